"""Plumbing of ``bench/ha.py``: the accounting of a rank fault's decisions and step rates. No
stack is started here: a row needs a stack, a 2-rank job and a server kill (tens of seconds on
2 cores); the servers' failovers themselves are tested in ``test_ha_e2e.py``."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from trainguard.schemas import Decision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def H():
    spec = importlib.util.spec_from_file_location("bench_ha", os.path.join(ROOT, "bench",
                                                                           "ha.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_ha"] = mod
    spec.loader.exec_module(mod)
    return mod


def _d(action: str, generation: int, execute: bool, key: str) -> Decision:
    return Decision(job="j", action=action, generation=generation, execute=execute,
                    ranks=[1], idempotency_key=key)


LAUNCHER = ("trainguard launch [vm]: rank 1 (pid 7) exited with signal 9\n"
            "trainguard launch [vm]: decision restart_workers (executing) generation 1 ranks [1] "
            "nodes ['vm']: crash/unknown: the rank's process is gone\n")


def test_one_acting_decision_carried_out_once_is_neither_lost_nor_duplicated(H):
    decisions = [_d("none", 0, False, "j:g0:none:checkpoint_save:1|"),  # a flag: not counted
                 _d("restart_workers", 1, True, "j:g0")]
    row = H.account(decisions, ["an anomaly"], LAUNCHER)
    assert (row["decisions"], row["carried_out"], row["detected"]) == (1, 1, True)
    assert (row["decisions_lost"], row["decisions_duplicated"]) == (0, 0)
    assert [d["action"] for d in row["decisions_seen"]] == ["none", "restart_workers"]


def test_two_acting_decisions_or_two_executions_count_as_a_duplicate(H):
    two = [_d("restart_workers", 1, True, "j:g0"), _d("restart_workers", 1, True, "j:g0b")]
    assert H.account(two, [1], LAUNCHER)["decisions_duplicated"] == 1
    once = [_d("restart_workers", 1, True, "j:g0")]
    assert H.account(once, [1], LAUNCHER * 2)["decisions_duplicated"] == 1


def test_without_a_bus_the_launcher_lines_count_and_none_is_a_lost_decision(H):
    row = H.account(None, None, "trainguard launch [vm]: rank 1 exited with signal 9\n")
    assert (row["decisions"], row["detected"], row["decisions_lost"]) == (0, None, 1)
    assert H.account(None, None, LAUNCHER)["decisions"] == 1


def test_step_rate_counts_generation_0_only(H, tmp_path: Path):
    s = H.Sampler(tmp_path)
    s.samples = [(0.0, 10, 0), (1.0, 30, 0), (2.0, 50, 0), (2.5, 0, 1), (3.0, 5, 1)]
    assert s.rate(0.0, 2.0) == 20.0
    assert s.rate(0.0, 3.0) == 20.0  # the restarted ranks' steps are not this rate
    assert s.rate(2.6, 3.0) is None

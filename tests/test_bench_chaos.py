"""Plumbing of the chaos benchmark (``bench/chaos.py``): the seeded schedule and the accounting
from records (duplicates, stalls, throughput during outages). No job is run here: the live
trials are the benchmark's (a trial needs a 4-rank job and server restarts, minutes on 2
cores)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture(scope="module")
def C():
    spec = importlib.util.spec_from_file_location("bench_chaos", os.path.join(ROOT, "bench",
                                                                              "chaos.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_chaos"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_schedule_is_seeded_spaced_and_covers_every_target(C):
    a, b = C.make_schedule(100, seed=3), C.make_schedule(100, seed=3)
    assert a == b and a != C.make_schedule(100, seed=4)
    assert [t["id"] for t in a] == list(range(1, 101))
    steps = [t["step"] for t in a]
    assert steps == sorted(steps) and min(y - x for x, y in zip(steps, steps[1:])) >= 60
    assert {t["target"] for t in a} == set(C.TARGETS)
    counts = [sum(t["target"] == x for t in a) for x in C.TARGETS]
    assert max(counts) - min(counts) <= 1  # cycled: every part killed about equally often
    assert {t["kind"] for t in a} == {"sigkill", "exception"}
    assert all(1 <= t["rank"] < 4 for t in a)  # rank 0 is the progress clock: never killed
    for t in a:
        if t["when"] == "steady":
            assert 0 < t["lead_steps"] < 60 and t["offset_s"] == 0
        else:
            assert t["lead_steps"] == 0 and 0 <= t["offset_s"] <= 1.5
        assert 0.3 <= t["down_s"] <= 2.5
    assert C.total_steps(a) > steps[-1]
    with pytest.raises(ValueError):
        C.make_schedule(0)


def test_duplicates_counted_from_results_audit_and_ranks(C):
    results = [{"idempotency_key": "k1", "executor": "launcher-node0", "ok": True},
               {"idempotency_key": "k1", "executor": "launcher-node1", "ok": True},
               {"idempotency_key": "k1", "executor": "launcher-node0", "ok": True,
                "skipped": True},  # refused by the idempotency claim: not an execution
               {"idempotency_key": "k2", "executor": "launcher-node0", "ok": True},
               {"idempotency_key": "k2", "executor": "launcher-node0", "ok": True}]
    audit = [{"type": "decision", "idempotency_key": "k1", "execute": True},
             {"type": "decision", "idempotency_key": "k3", "execute": True},
             {"type": "decision", "idempotency_key": "k3", "execute": True},
             {"type": "decision", "idempotency_key": "k4", "execute": False},
             {"type": "decision", "idempotency_key": "k4", "execute": False},
             {"type": "folded", "idempotency_key": "k1"}]
    resumed = [{"rank": 0, "decision_id": "d1"}, {"rank": 1, "decision_id": "d1"},
               {"rank": 1, "decision_id": "d1"}]
    d = C.duplicate_actions(results, audit, resumed)
    assert d["action_results"] == ["k2@launcher-node0"]
    assert d["audit_decisions"] == ["k3"]  # observe-mode records (k4) execute nothing
    assert d["rank_resumes"] == ["rank 1: d1"]
    assert d["count"] == 3
    assert C.duplicate_actions([], [], [])["count"] == 0


def _steps(start_s: float, end_s: float, dt: float) -> list[int]:
    out, t = [], start_s
    while t < end_s:
        out.append(T0 + int(t * S))
        t += dt
    return out


def test_account_splits_stalls_and_measures_throughput_in_outages(C):
    # 10 steps/s; a fault at 10 s recovered at 13 s (no steps between); steady outage 4–6 s at
    # half speed; another stall at 20–22 s with no fault (an outage that blocked training)
    rank0 = (_steps(0, 4, 0.1) + _steps(4, 6, 0.2) + _steps(6, 10, 0.1) + _steps(13, 20, 0.1)
             + _steps(22, 30, 0.1))
    trials = [{"injected_ns": T0 + 10 * S, "recovered_ns": T0 + 13 * S, "decided": True},
              {"injected_ns": T0 + 25 * S, "recovered_ns": None, "decided": False},
              {"injected_ns": None}]
    outages = [{"target": "nats", "when": "steady", "down_ns": T0 + 4 * S, "up_ns": T0 + 6 * S},
               {"target": "valkey", "when": "steady", "down_ns": T0 + 20 * S,
                "up_ns": T0 + 22 * S}]
    r = C.account(trials, outages, rank0)
    assert r["faults"] == 2 and r["recovered"] == 1 and r["decisions_lost"] == 1
    assert r["recovery_s"] == {"median": 3.0, "p95": 3.0, "max": 3.0}
    b = r["training_blocked_s"]
    assert b["total"] == pytest.approx(5.2, abs=0.3)
    assert b["in_fault_windows"] == pytest.approx(3.0, abs=0.2)
    assert b["outside"] == pytest.approx(2.1, abs=0.3)
    sp = r["steps_per_s"]
    assert sp["without"] == pytest.approx(10.0, rel=0.05)
    assert sp["during_outages"] == pytest.approx(2.5, rel=0.1)  # 10 steps in 4 s of outage
    assert r["throughput_ratio"] == pytest.approx(0.25, rel=0.15)


def _tl(fault_ns: int, detected_s: float, first_step_s: float) -> dict:
    from trainguard.core import timeline

    return timeline.Timeline({**dict.fromkeys(timeline.PHASES), "fault": fault_ns,
                              "detected": fault_ns + int(detected_s * S),
                              "first_step": fault_ns + int(first_step_s * S)}).to_dict()


def test_recovery_tails_group_by_kind_and_moment_and_name_the_slow_phase(C):
    trials = []
    for i in range(10):  # 10 SIGKILLs in steady outages, 0.3 s each; trial 7 waited 2 s to be seen
        det = 2.0 if i == 7 else 0.1
        trials.append({"id": i, "kind": "sigkill", "when": "steady", "target": "nats",
                       "recovery_s": det + 0.2, "timeline": _tl(T0 + i * 10 * S, det, det + 0.2)})
    trials.append({"id": 10, "kind": "exception", "when": "during", "target": "valkey",
                   "recovery_s": None, "timeline": None})  # never recovered
    t = C.recovery_tails(trials)
    assert set(t) == {"all", "sigkill/steady", "exception/during"}
    k = t["sigkill/steady"]
    assert (k["n"], k["recovered"], k["median_s"], k["max_s"]) == (10, 10, 0.3, 2.2)
    assert k["slow_runs"] == [{"run": 7, "seconds": 2.2, "slow_phase": "detected", "extra_s": 1.9,
                               "trial": 7, "target": "nats", "when": "steady"}]
    assert [sr["trial"] for sr in t["all"]["slow_runs"]] == [7, 10]
    assert t["exception/during"]["recovered"] == 0


def test_account_with_no_outage_or_no_records(C):
    r = C.account([], [], _steps(0, 5, 0.1))
    assert r["throughput_ratio"] is None and r["training_blocked_s"]["total"] == 0
    r = C.account([], [], [])
    assert r["faults"] == 0 and r["steps_per_s"]["without"] is None


def test_cli(C):
    a = C.parse_args(["--quick"])
    assert a.trials == 4 and a.json == ""
    assert C.parse_args([]).trials == 100
    with pytest.raises(SystemExit):
        C.parse_args(["--trials", "0"])

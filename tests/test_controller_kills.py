"""A short sample of ``bench/controller_kills.py``: the process carrying out Slurm actions is
SIGKILLed 4 times (random and aimed inside actions) against a real slurmctld, restarted each
time, and every scontrol/scancel mutation Slurm performed is counted against the decisions —
no duplicate, none missing. The counting itself is checked on a log with a duplicate in it.

The sample skips, saying why, without CAP_NET_ADMIN or without Slurm. About 15 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "bench", "controller_kills.py")


@pytest.fixture(scope="module")
def K():
    spec = importlib.util.spec_from_file_location("bench_controller_kills", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_controller_kills"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_counting_finds_duplicates_and_missing_actions(K):
    d = [{"id": "d0", "kind": "exclude", "node": "node1", "jid": "7", "posted_ns": 100},
         {"id": "d1", "kind": "stop", "node": "node0", "jid": "8", "posted_ns": 200}]
    log = ["0\t110\tscontrol update nodename=node1 state=drain reason=trainguard: x y\n",
           "0\t120\tscontrol requeue 7\n",
           "1\t125\tscontrol requeue 7\n",  # refused by Slurm: not performed
           "0\t130\tscontrol requeue 7\n",  # a second requeue: a duplicate
           "0\t210\tscontrol update jobid=8 admincomment=trainguard: budget spent\n",
           "0\t220\tscancel 8\n",
           "0\t230\tscontrol update nodename=node0 state=resume\n"]
    got = K.count(d, log)
    assert got["duplicates"] == 1 and got["duplicate_list"] == [["d0", "requeue", "7", 1]]
    assert got["missing"] == [["d0", "excnodelist", "7"]]
    assert got["unexpected"] == [["d1", "node_resume", "node0"]]
    assert (got["refused"], got["expected"], got["mutations"]) == (1, 5, 6)


@pytest.mark.skipif(cnet.unavailable_reason() is not None,
                    reason=f"no network namespaces: {cnet.unavailable_reason()}")
@pytest.mark.skipif(slurm_unavailable_reason() is not None, reason=str(slurm_unavailable_reason()))
def test_no_duplicate_slurm_action_over_controller_kills():
    p = subprocess.run([sys.executable, PATH, "--kills", "4", "--min-decisions", "3",
                        "--seed", "3", "--aim", "0.02", "--timeout", "90", "--json", "-"],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["kills"] == 4 and out["decisions"] >= 3, out
    assert out["kills_by_phase"].get("acting", 0) >= 1, out  # the aimed ones land in actions
    assert out["duplicates"] == 0 and out["missing"] == [] and out["unexpected"] == [], out
    assert out["mutations"] == out["expected"] + out["optional"] and out["refused"] == 0, out

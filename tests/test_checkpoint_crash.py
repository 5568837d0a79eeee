"""The crash harness with real SIGKILLs, flipped bytes, truncations, a full tmpfs and NaN:
zero corrupt and zero stale restores."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_crash_harness_24_trials(tmp_path):
    out = tmp_path / "crash.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "checkpoint_crash.py"),
                        "--trials", "24", "--seed", "7", "--json", str(out),
                        "--flip-trials", "0", "--clean-saves", "0"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["trials"] == 24
    assert res["corrupt_restores"] == 0 and res["stale_restores"] == 0, res["problems"]
    assert res["restore_failures"] == 0, res["problems"]
    # the faults really happened and restores really came from both places
    assert sum(1 for f, n in res["by_fault"].items() if n) >= 5, res["by_fault"]
    assert sum(res["restore_sources"].values()) == 24


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bit_flip_in_one_replica_is_caught_at_the_next_save(tmp_path):
    out = tmp_path / "replicas.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "checkpoint_crash.py"),
                        "--trials", "0", "--flip-trials", "8", "--clean-saves", "40",
                        "--seed", "5", "--json", str(out)],
                       capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())["replicas"]
    assert rep["rank_exit_codes"] == [0, 0, 0], r.stderr[-3000:]
    assert (rep["flip_trials"], rep["clean_saves"]) == (8, 40)
    # every flip caught at that save, its rank the one suspect, its checkpoint rejected
    assert rep["detected"] == rep["suspect_named"] == rep["rejected_by_verify"] == 8, rep
    assert rep["false_alarms"] == 0, rep

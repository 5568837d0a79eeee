"""A short sample of ``bench/scale.py`` (the figures themselves are the bench's to print): a
small layout over 2 replicas of each service gives every measurement, loses no fault, and the
killed replica's jobs are served again."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_scale_bench_sample(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "64", "--nodes", "8",
         "--replicas", "2", "--publishers", "1", "--seconds", "1", "--warmup", "1", "--json",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["jobs"] == 8 and res["replicas"] == 2
    hb, fd, tk = res["hb_to_anomaly_ms"], res["fault_to_decision_ms"], res["takeover_s"]
    assert hb["n"] == hb["sent"] > 0 and hb["p99"] is not None
    assert fd["n"] == fd["sent"] > 0 and fd["p99"] is not None
    assert tk["n"] > 0 and tk["lost"] == 0 and tk["max"] < 30
    assert isinstance(res["bytes_per_rank"], int)

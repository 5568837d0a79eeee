"""bench/checkpoint.py end to end on a tiny state: real ranks, real writer, real files; the JSON
carries what issue 4 asks for (the figures themselves are the benchmark's business)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(300)


def test_checkpoint_bench_reports_every_system(tmp_path):
    out = tmp_path / "ckpt.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "checkpoint.py"),
                        "--mb", "2", "--reps", "1", "--saves-per-window", "1",
                        "--max-window-steps", "12", "--matmuls", "1",
                        "--systems", "trainguard,write_only", "--dir", str(tmp_path / "d"),
                        "--json", str(out)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["memcpy_s"] > 0 and len(d["intervals"]) == 3
    by = {s["system"]: s for s in d["systems"]}
    assert set(by) == {"trainguard", "write_only"}
    tg = by["trainguard"]
    assert tg["durable_s"] >= tg["blocking_s"] > 0
    assert set(tg["efficiency"]) == {str(i) for i in d["intervals"]}
    assert all(0 < v < 2 for v in tg["efficiency"].values())
    assert tg["validation_gbps"] > 0 and tg["peak_rss_bytes"] > 0
    assert by["write_only"]["validation_gbps"] is None
    assert d["dcp_import_bytes"] >= 0
    assert set(d["trainguard_efficiency_vs_write_only"]) == set(tg["efficiency"])
    # trainguard wrote through a node writer: rank 0's share of it is counted
    assert tg["children_uss_bytes"] > 0
    mem = d["trainguard_memory"]
    assert mem["staging"] >= 2_000_000 and mem["writer_share"] == tg["children_uss_bytes"]
    assert set(d["efficiency_ceiling"]) == set(tg["efficiency"])
    assert all(0 < v < 1 for v in d["efficiency_ceiling"].values())

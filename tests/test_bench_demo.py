"""``bench/demo.py``'s summary of the demo's reports (no demo is run here)."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_demo", os.path.join(ROOT, "bench", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_demo"] = mod
    spec.loader.exec_module(mod)
    return mod


def _fault(kind, resumed_s, recovered=True, rolled=0):
    t = 1_700_000_000_000_000_000
    return {"kind": kind, "injected_ns": t, "detected_ns": t + 30_000_000,
            "decided_ns": t + 50_000_000,
            "resumed_ns": None if resumed_s is None else t + int(resumed_s * 1e9),
            "steps_rolled_back": rolled, "recovered": recovered}


def test_summary_keeps_every_run_per_fault_kind():
    b = _bench()
    reps = [{"faults": [_fault("sigkill", 0.2), _fault("hang", 2.3)]},
            {"faults": [_fault("sigkill", 0.4), _fault("hang", None, recovered=False)]}]
    s = b.summary(reps)
    assert s["sigkill"]["resumed_s"] == [0.2, 0.4]
    assert s["sigkill"]["detected_s"] == [0.03, 0.03] and s["sigkill"]["decided_s"] == [0.05, 0.05]
    assert s["hang"]["resumed_s"] == [2.3, None] and s["hang"]["recovered"] == [True, False]
    assert s["hang"]["rolled_back"] == [0, 0]

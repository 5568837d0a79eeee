"""The drop-in benchmark (``bench/dropin.py``): its pure parts on synthetic records, and the
quickest real sample — the plain job, one round, trainguard and torchrun, a short rate window,
a SIGKILL and an exception, no hang phase — checked for the JSON's shape and positive figures."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "bench", "dropin.py")
S = 1_000_000_000
T0 = 1_700_000_000 * S


@pytest.fixture(scope="module")
def D():
    spec = importlib.util.spec_from_file_location("bench_dropin", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_dropin"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_plan(D):
    a = D.parse_args(["--json", "x.json"])
    assert a.jobs == ["plain", "lightning", "hf"] and D.settings_from(a).rounds == 3
    q = D.settings_from(D.parse_args(["--quick", "--no-hang"]))
    assert q.rounds == 1 and not q.hang and q.window_s == D.QUICK["window_s"]
    with pytest.raises(SystemExit):
        D.parse_args(["--jobs", "keras"])
    with pytest.raises(SystemExit):
        D.parse_args(["--systems", "trainguard"])  # no ratio without torchrun
    p = D.plan(D.Settings(rounds=2), ["plain", "hf"], ["trainguard", "torchrun", "nvrx"])
    # each job's launchers alternate their order from round to round; ft_launcher in round 0
    assert p[:3] == [("plain", "trainguard", 0), ("plain", "torchrun", 0), ("plain", "nvrx", 0)]
    assert p[3:6] == [("hf", "torchrun", 0), ("hf", "trainguard", 0), ("hf", "nvrx", 0)]
    assert p[6:] == [("plain", "torchrun", 1), ("plain", "trainguard", 1),
                     ("hf", "trainguard", 1), ("hf", "torchrun", 1)]


def test_rate_and_recovery_from_records(D, tmp_path):
    f = tmp_path / "records.txt"
    lines = []
    for i in range(50):  # 2 ranks, 10 steps/s, pids 100/101
        lines += [f"0 {i} {T0 + i * S // 10} 100 0", f"1 {i} {T0 + i * S // 10 + 1000} 101 0"]
    t_f = T0 + 49 * S // 10 + 5000
    # restarted: rank 0 at +1.5 s, rank 1 at +2.0 s, from step 40 (the snapshot)
    lines += [f"0 40 {t_f + 15 * S // 10} 200 1", f"1 40 {t_f + 2 * S} 201 1",
              "1 41 torn"]
    f.write_text("\n".join(lines) + "\n")
    recs = D.read_records(str(f))
    assert len(recs) == 102
    assert D.step_rate(recs, T0, T0 + 5 * S) == pytest.approx(10.0, rel=1e-6)
    before = D.latest([r for r in recs if r.t <= t_f])
    back = D.back_after(recs, t_f, before)
    assert back == {"recovery_s": 2.0, "resumed_step": 40, "last_step": 49, "rolled_back": 10}
    assert D.back_after(recs[:-1], t_f, before) is None  # rank 1 not back yet
    # start-up: launch → every rank's first step (rank 1's first record, 1000 ns after rank 0's)
    assert D.startup(recs, T0 - 2 * S) == pytest.approx(2.0, abs=1e-3)
    assert D.startup([r for r in recs if r.rank == 0], T0) is None
    # the phases a launcher without bus events still shows: last progress, first step by rank
    tl = D.recovery_timeline(recs, t_f, before)
    assert tl["seconds"]["first_step"] == 2.0 and tl["first_step_by_rank"] == {"0": 1.5, "1": 2.0}
    assert tl["seconds"]["last_progress"] == pytest.approx(0.0, abs=1e-3)  # rank 1, step 49
    assert tl["seconds"]["decision"] is None  # torchrun publishes none


def test_summary_ratios_and_table(D):
    R = D.RunResult
    runs = [R("trainguard", "plain", 0, rate=40.0, startup_s=6.0, kill={"recovery_s": 1.0},
              hang={"detected": True, "by": "trainguard decision restart_workers ranks [1]",
                    "detected_s": 2.1, "training_again_s": 3.0, "waited_s": 30}),
            R("torchrun", "plain", 0, rate=40.4, kill={"recovery_s": 6.0},
              hang={"detected": False, "by": "nobody in 30 s", "waited_s": 30}),
            R("trainguard", "plain", 1, rate=41.0, kill={"recovery_s": 1.2}),
            R("torchrun", "plain", 1, rate=40.6, kill={"recovery_s": 5.0}),
            R("trainguard", "plain", 2, rate=40.5, kill={"recovery_s": 3.5}),
            R("torchrun", "plain", 2, rate=40.5, kill=None, notes=["never again"])]
    (row,) = D.summarize(runs, ["plain"], {"nvrx": "not installed"})
    assert row["rate_ratio"] == pytest.approx(40.5 / 40.5)
    assert row["startup_s"]["trainguard"] == 6.0 and row["startup_s"]["torchrun"] is None
    assert row["kill_trainguard_s"] == 1.2 and row["kill_torchrun_s"] == 5.5
    assert row["kill_ratio_torchrun_over_trainguard"] == round(5.5 / 1.2, 2)
    t = row["kill_trainguard_tails"]  # 3.5 s is over 2 x the 1.2 s median: listed as slow
    assert (t["median_s"], t["p95_s"], t["max_s"]) == (1.2, 3.5, 3.5)
    assert [x["run"] for x in t["slow_runs"]] == [2]
    # a launch that never trained again counts as not recovered and is listed
    assert row["kill_torchrun_tails"]["recovered"] == 2 and \
        row["kill_torchrun_tails"]["slow_runs"] == [{"run": 2, "seconds": None,
                                                     "slow_phase": None, "extra_s": 0.0}]
    assert row["hang_trainguard"]["detected"] == "1/1"
    assert row["hang_torchrun"]["detected"] == "0/1"
    assert row["hang_nvrx"]["by"].startswith("not run")
    md = D.markdown_table([row])
    assert "| plain |" in md and "never (0/1 in 30 s)" in md and "not run" in md


@pytest.mark.slow
def test_quickest_real_sample(tmp_path):
    out = tmp_path / "dropin.json"
    r = subprocess.run([sys.executable, PATH, "--quick", "--jobs", "plain", "--systems",
                        "trainguard,torchrun", "--window", "3", "--no-hang", "--json", str(out),
                        "--keep", str(tmp_path / "runs")],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) >= {"settings", "torchrun_args", "rows", "runs"}
    (row,) = data["rows"]
    assert row["job"] == "plain"
    for key in ("rate_trainguard", "rate_torchrun", "rate_ratio", "kill_trainguard_s",
                "kill_torchrun_s", "kill_ratio_torchrun_over_trainguard",
                "exception_trainguard_s", "exception_torchrun_s"):
        assert isinstance(row[key], (int, float)) and row[key] > 0, (key, row, r.stdout)
    assert row["kill_nvrx_s"] is None and row["hang_nvrx"]["by"].startswith("not run")
    assert {x["system"] for x in data["runs"]} == {"trainguard", "torchrun"}
    assert "steps/s tg" in r.stdout

"""Plumbing of the recovery benchmark (``bench/recovery.py``): CLI parsing, the fault schedule,
and the metric functions on synthetic progress timelines. No training is run here."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "bench", "recovery.py")


@pytest.fixture(scope="module")
def R():
    spec = importlib.util.spec_from_file_location("bench_recovery", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_recovery"] = mod
    spec.loader.exec_module(mod)
    return mod


S = 1_000_000_000  # ns per second
T0 = 1_700_000_000 * S


def line(rank, step, t, pid, inc, world=4, loss=1.0):
    return f"{rank} {step} {t} {pid} {loss:.6f} {inc} {world}"


def steady(world, steps, inc="0", t0=T0, dt=0.1, pid0=100, start=0):
    """Every rank completes every step, one step every ``dt`` s; returns (lines, end ns)."""
    out, t = [], t0
    for s in range(start, start + steps):
        t += int(dt * S)
        out += [line(r, s, t + r * 1000, pid0 + r, inc, world) for r in range(world)]
    return out, t


def test_help_and_arguments(R):
    r = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--json" in r.stdout and "--quick" in r.stdout
    a = R.parse_args(["--json", "x.json"])
    assert a.systems == list(R.SYSTEMS) and a.faults == list(R.FAULTS)
    assert R.settings_from(a).runs == 3
    q = R.parse_args(["--json", "x.json", "--quick", "--faults", "sigkill,hang", "--runs", "2"])
    assert q.faults == ["sigkill", "hang"] and "trainguard" in q.systems
    s = R.settings_from(q)
    assert s.runs == 2 and s.steps == R.QUICK["steps"]
    with pytest.raises(SystemExit):
        R.parse_args(["--json", "x.json", "--systems", "slurm"])
    assert R.parse_args(["--systems", "torchrun"]).json == ""  # the table alone (make bench)


def test_schedule(R):
    s = R.BenchSettings()
    faults, steps = R.schedule("sigkill", s)
    assert faults == [{"rank": 1, "kind": "sigkill", "step": s.fault_step}] and steps == s.steps
    assert R.schedule("node_loss", s)[0][0]["node"] == 1
    assert R.schedule("straggler", s)[0][0]["factor"] == 3
    five, steps5 = R.schedule("five_faults", s)
    assert [f["kind"] for f in five] == list(R.FIVE_KINDS)
    assert [f["step"] for f in five] == [s.fault_step + i * s.five_interval for i in range(5)]
    assert steps5 > five[-1]["step"]


def test_restart_timeline(R):
    """A SIGKILL at step 49, the last checkpoint at step 40: every rank restarts (new
    incarnation) and resumes at step 41, the last one 3.2 s after the fault."""
    before, t = steady(4, 50)
    t_f = t + int(0.05 * S)
    # a lagging survivor completes step 49 (its collective was done) after the fault: not new
    late = [line(0, 49, t_f + 1000, 100, "0")]
    resumed = t_f + int(3.2 * S)
    after, t_end = steady(4, 79, inc="1", t0=resumed - int(0.1 * S), pid0=200, start=41)
    lines = before + late + after + [f"#fault sigkill 1 49 {t_f}"]
    res = R.analyse_run(lines)
    (f,) = res["faults"]
    assert f["kind"] == "sigkill" and f["ranks"] == [1]
    assert f["recovery_s"] == pytest.approx(3.2, abs=1e-3)
    assert f["steps_rolled_back"] == 9  # steps 41..49 done again
    assert res["ref_step_s"] == pytest.approx(0.1, rel=1e-3)
    assert f["culprit_correct"] is None
    # productive: 120 distinct steps (119 intervals) × 0.1 s over wall = first→last record
    wall = (t_end + 3000 - (T0 + int(0.1 * S))) / S
    assert res["training_goodput"] == pytest.approx(119 * 0.1 / wall, abs=1e-3)
    assert res["infra_goodput"] == pytest.approx(1 - 3.2 / wall, abs=1e-3)


def test_in_process_and_shrink(R):
    """Same processes, new incarnation (in-process restart) into a smaller world of 2."""
    before, t = steady(4, 30)
    t_f = t + int(0.01 * S)
    after, _ = steady(2, 20, inc="g1", t0=t_f + int(0.3 * S), pid0=100, start=30)
    res = R.analyse_run(before + after + [f"#fault node_loss 2 29 {t_f}",
                                          f"#fault node_loss 3 29 {t_f}"])
    (f,) = res["faults"]
    assert f["ranks"] == [2, 3] and f["kind"] == "node_loss"
    assert f["recovery_s"] == pytest.approx(0.4, abs=1e-3)
    assert f["steps_rolled_back"] == 0


def test_a_lost_nodes_ranks_dying_late_are_not_a_recovery(R):
    """A node's launcher killed at ``t_f``: its ranks die a moment later (their parent-death
    signal), so the old world of 4 completes two more steps after the mark. Those steps are the
    old incarnation's, not a recovery: the figure is the new generation's first complete step,
    3 s after the fault (the bench once read 0.10 s here)."""
    before, t = steady(4, 30, inc="g0")
    t_f = t + int(0.01 * S)
    late, _ = steady(4, 2, inc="g0", t0=t_f, dt=0.05, start=30)
    after, _ = steady(4, 20, inc="g1", t0=t_f + int(2.9 * S), pid0=200, start=32)
    marks = [f"#fault node_loss 2 29 {t_f}", f"#fault node_loss 3 29 {t_f}"]
    (f,) = R.analyse_run(before + late + after + marks)["faults"]
    assert f["recovery_s"] == pytest.approx(3.0, abs=1e-3)
    assert f["steps_rolled_back"] == 0


def test_never_recovered_and_culprit(R):
    before, t = steady(4, 30)
    t_f = t + 1
    # only ranks 0..2 come back: not a complete world
    after = [line(r, 25, t_f + S, 300 + r, "1") for r in range(3)]
    res = R.analyse_run(before + after + [f"#fault hang 3 29 {t_f}"], culprits=[[3]])
    (f,) = res["faults"]
    assert f["recovery_s"] is None and f["culprit_correct"] is True
    wrong = R.analyse_run(before + after + [f"#fault hang 3 29 {t_f}"], culprits=[[2]])
    assert wrong["faults"][0]["culprit_correct"] is False
    nothing = R.analyse_run(before + after + [f"#fault hang 3 29 {t_f}"], culprits=[None])
    assert nothing["faults"][0]["culprit_correct"] is False


def test_straggler_back_to_normal(R):
    before, t = steady(4, 30, dt=0.1)
    t_f = t + 1
    slow, t2 = steady(4, 10, t0=t, dt=0.3, start=30)
    fast, _ = steady(4, 20, t0=t2, dt=0.1, start=40)
    res = R.analyse_run(before + slow + fast + [f"#fault straggler 2 30 {t_f}"])
    f = res["faults"][0]
    assert f["recovery_s"] == pytest.approx(3.0, abs=0.01)  # slow steps 30..39
    never = R.analyse_run(before + slow + [f"#fault straggler 2 30 {t_f}"])
    assert never["faults"][0]["recovery_s"] is None
    assert never["infra_goodput"] == pytest.approx(1.0)
    assert never["training_goodput"] < 0.7


def test_aggregate_ratio_json_and_table(R):
    def run(rs, rb, culprit_ok=None):
        return {"faults": [{"recovery_s": x, "steps_rolled_back": rb, "culprit_correct": culprit_ok}
                           for x in rs], "training_goodput": 0.5, "infra_goodput": 0.8}

    tg = R.aggregate("trainguard", "sigkill", [run([0.5], 1, True), run([0.7], 1, True),
                                               run([0.6], 1, True)], names_culprit=True)
    tr = R.aggregate("torchrun", "sigkill", [run([6.0], 9), run([None], None), run([5.0], 9)],
                     names_culprit=False)
    rows = [tg, tr]
    R.add_ratios(rows)
    assert tg["median_s"] == 0.6 and tg["max_s"] == 0.7 and tg["culprit_correct"] is True
    assert tg["culprit_correct_n"] == "3/3" and tg["ratio_to_trainguard"] == 1.0
    assert tr["median_s"] == 5.5 and tr["recovered"] == "2/3" and tr["culprit_correct"] is None
    assert tr["ratio_to_trainguard"] == pytest.approx(9.17, abs=0.01)
    # the tails: p95 beside the median; the run without a recovery listed as slow
    assert tg["p95_s"] == 0.7 and tg["slow_runs"] == [] and tr["p95_s"] == 6.0
    assert [x["run"] for x in tr["slow_runs"]] == [1]
    keys = {"system", "fault", "median_s", "max_s", "runs", "steps_rolled_back",
            "training_goodput", "infra_goodput", "culprit_correct"}
    for r in json.loads(json.dumps(rows)):
        assert keys <= set(r)
    md = R.markdown_table(rows)
    assert md.count("\n") == 3 and "| trainguard | sigkill | 0.60 |" in md


def test_plan_puts_trainguard_and_the_sigkill_ratio_first(R):
    a = R.parse_args(["--json", "x.json"])
    s = R.settings_from(a)
    p = R.plan(a, s, missing={"nvrx": "not installed"})
    # the first pass: trainguard on every fault, each available peer's SIGKILL beside it
    first = p[:len(R.FAULTS) + 3]
    assert [x for x in first if x[0] == "trainguard"] == [
        ("trainguard", f, 0, False) for f in R.FAULTS]
    assert {x[0] for x in first if x[0] != "trainguard"} == {"torchrun", "full_restart",
                                                              "torchft"}
    # trainguard's 3 runs are never budgeted; nvrx (missing) never planned
    assert sum(1 for x in p if x[0] == "trainguard") == 3 * len(R.FAULTS)
    assert not any(x[3] for x in p if x[0] == "trainguard")
    assert not any(x[0] == "nvrx" for x in p)
    assert all(x[3] for x in p[len(first) + 2 * len(R.FAULTS):])
    q = R.parse_args(["--json", "x.json", "--quick"])
    qp = R.plan(q, R.settings_from(q), missing={})
    assert [x for x in qp if x[0] == "torchrun"] == [("torchrun", "sigkill", 0, False)]


def test_spare_faults_are_trainguards_and_timed_by_its_harness(R):
    s = R.BenchSettings()
    (f,), steps = R.schedule("degrading_node", s)
    assert steps >= f["step"] + R.SPARE_STEPS_AFTER  # the job outlives the slow detection
    assert f["harness_kind"] == "ecc_degrading" and f["spare_nodes"] == 1 and f["node"] == 1
    a = R.parse_args(["--faults", ",".join(R.SPARE_FAULTS)])
    p = R.plan(a, R.settings_from(a), missing={})
    assert {x[0] for x in p} == {"trainguard"}  # the peers have no spare node to move to
    assert "degrading_node" not in R.parse_args(["--quick"]).faults

    class Out:  # what TrainguardRunner hands back: the harness's row per fault
        injected = [{"harness": {"injected_ns": T0, "detected_ns": T0 + 2 * S,
                                 "decided_ns": T0 + 3 * S, "resumed_ns": T0 + int(7.5 * S),
                                 "steps_rolled_back": 0, "path": "peer",
                                 "decision": {"action": "exclude_node_and_requeue",
                                              "nodes": ["node1"],
                                              "reason": "planned migration (ecc/hardware)"}}}]
    res = {"faults": [{"recovery_s": 0.01, "steps_rolled_back": 0}]}
    R._on_the_spare(res, Out, [f])
    (smp,) = res["faults"]
    assert smp["recovery_s"] == 7.5 and smp["steps_rolled_back"] == 0
    assert smp["decided_s"] == 3.0 and smp["detected_s"] == 2.0
    assert smp["culprit_correct"] is True and smp["planned"] is True

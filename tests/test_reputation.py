"""Node reputation: the readmit policy row by row (pure), the decaying score in a real Valkey
(one offence per job generation, atomic), the one ``NodeController.readmit`` carried out by the
local controller with canaries that pass and fail, and the canary program's checks (NVML at the
pynvml seam, fault injection). A few seconds; the Slurm side is tests/test_slurm_readmit.py."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from trainguard.core.reputation import (RULES, Canary, NodeView, ReputationConfig, decayed,
                                   offence_weight, plan)
from trainguard.schemas.reputation import NodeReputation, decode_reputation

DAY_NS = 86400 * 10**9
NOW = 1_800_000_000 * 10**9
CFG = ReputationConfig()


def rep(score=0.0, at=NOW, **kw):
    return NodeReputation("n1", score=score, score_ns=at, **kw)


def test_decay_halves_the_score_every_half_life():
    hl = CFG.half_life_s
    assert decayed(2.0, NOW, NOW + int(hl * 1e9), hl) == pytest.approx(1.0)
    assert decayed(1.0, NOW, NOW + 4 * int(hl * 1e9), hl) == pytest.approx(1 / 16)
    assert decayed(1.0, NOW, NOW - DAY_NS, hl) == 1.0  # a clock behind: no growth, no decay
    assert decayed(1.0, 0, NOW, hl) == 1.0  # no time recorded: as it is
    assert CFG.half_life_s == 7 * 86400 and CFG.threshold == 2.5


@pytest.mark.parametrize("view,score,canary,action,row,words", [
    (NodeView.UNKNOWN, 0, None, "leave", "unknown", "does not know"),
    (NodeView.IN_SERVICE, 5, None, "none", "in_service", "in service already"),
    (NodeView.OTHER, 0, None, "leave", "not_ours", "not by trainguard"),
    (NodeView.OURS_BUSY, 0, None, "wait", "busy", "still runs jobs"),
    (NodeView.OURS, 2.5, None, "hold", "repeat_offender", "score 2.50 >= 2.5"),
    (NodeView.CANARY, 3, Canary(True, "fine"), "hold", "repeat_offender", "repeat offender"),
    (NodeView.OURS, 1, None, "canary", "canary_first", "the canary decides"),
    (NodeView.CANARY, 1, None, "canary", "canary_first", "the canary decides"),
    (NodeView.OURS, 1, Canary(False, "compute: off by 1"), "keep", "canary_failed",
     "canary failed: compute: off by 1"),
    (NodeView.OURS, 1, Canary(False, "srun: error: Unable to allocate resources", ran=False),
     "untested", "canary_not_run", "no offence counted: srun: error: Unable"),
    (NodeView.OURS, 2.49, Canary(True, "all passed"), "readmit", "canary_passed",
     "on probation until"),
])
def test_plan_rows(view, score, canary, action, row, words):
    p = plan(view, rep(score, evidence=[{"job": "j", "reason": "xid 79"}], offences=2), NOW,
             CFG, canary, sched="State=IDLE+DRAIN")
    assert (p.action, p.row) == (action, row), p
    assert words in p.reason, p.reason
    assert p.ok == (action in ("none", "readmit"))


def test_every_rule_row_is_reached():
    reached = {plan(v, rep(s), NOW, CFG, c).row for v, s, c in [
        (NodeView.UNKNOWN, 0, None), (NodeView.IN_SERVICE, 0, None), (NodeView.OTHER, 0, None),
        (NodeView.OURS_BUSY, 0, None), (NodeView.OURS, 9, None), (NodeView.OURS, 0, None),
        (NodeView.OURS, 0, Canary(False, "x")), (NodeView.OURS, 0, Canary(True, "y")),
        (NodeView.OURS, 0, Canary(False, "z", ran=False))]}
    assert reached == {r[0] for r in RULES}


def test_the_score_that_decayed_below_the_threshold_lets_the_canary_decide():
    r = rep(3.0, at=NOW)
    assert plan(NodeView.OURS, r, NOW, CFG).action == "hold"
    assert plan(NodeView.OURS, r, NOW + 7 * DAY_NS, CFG).action == "canary"  # 1.5 < 2.5


def test_offence_weight_doubles_on_probation():
    on = rep(1.0, status="probation", probation_until_ns=NOW + DAY_NS)
    assert offence_weight(on, NOW, CFG) == (2.0, "excluded again while on probation")
    assert offence_weight(on, NOW + 2 * DAY_NS, CFG)[0] == 1.0  # probation over
    assert offence_weight(rep(1.0, status="drained"), NOW, CFG)[0] == 1.0


def test_config_checks_and_env(monkeypatch):
    with pytest.raises(ValueError, match="must be > 0"):
        ReputationConfig(half_life_s=0)
    monkeypatch.setenv("TG_REP_HALF_LIFE_S", "3600")
    monkeypatch.setenv("TG_REP_THRESHOLD", "4")
    assert (ReputationConfig.from_env().half_life_s, ReputationConfig.from_env().threshold) == (
        3600.0, 4.0)
    monkeypatch.setenv("TG_REP_THRESHOLD", "high")
    with pytest.raises(ValueError, match="TG_REP_THRESHOLD"):
        ReputationConfig.from_env()


def test_decode_refuses_what_it_cannot_read():
    assert decode_reputation("n", {}) == NodeReputation("n")
    with pytest.raises(ValueError, match="score"):
        decode_reputation("n", {"score": "lots"})
    with pytest.raises(ValueError, match="status"):
        decode_reputation("n", {"status": "sick"})


async def test_offences_count_once_per_key_and_decay_in_the_store(redis_db):
    from trainguard.clients.store import StateStore

    st = StateStore(redis_db)
    hl = 7 * 86400.0
    assert await st.add_offence("n1", "j:g0", 1.0, hl, {"job": "j", "reason": "xid 79"},
                                now_ns=NOW) == (True, 1.0)
    # the same exclusion carried out again (a restarted controller): not counted again
    assert await st.add_offence("n1", "j:g0", 1.0, hl, {"job": "j"}, now_ns=NOW + 1) == (
        False, pytest.approx(1.0))
    counted, score = await st.add_offence("n1", "k:g3", 1.0, hl, {"job": "k", "reason": "ecc"},
                                          now_ns=NOW + 7 * DAY_NS)
    assert counted and score == pytest.approx(1.5)  # 1 halved over a week, plus 1
    r = await st.reputation("n1")
    assert (r.offences, r.status, r.score_ns) == (2, "drained", NOW + 7 * DAY_NS)
    assert [e["job"] for e in r.evidence] == ["j", "k"] and r.evidence[0]["reason"] == "xid 79"
    assert r.evidence[1]["ts_ns"] == NOW + 7 * DAY_NS  # Unix ns kept exactly
    await st.set_probation("n1", "probation", "canary passed", NOW + 8 * DAY_NS,
                           {"ok": True, "detail": "fine"})
    r = await st.reputation("n1")
    assert (r.status, r.probation_until_ns, r.canary["ok"], r.score) == (
        "probation", NOW + 8 * DAY_NS, True, pytest.approx(1.5))
    for i in range(12):  # evidence is bounded, the count is not
        await st.add_offence("n1", f"x:g{i}", 0.0, hl, {"job": f"x{i}"}, now_ns=NOW + 8 * DAY_NS)
    r = await st.reputation("n1")
    assert len(r.evidence) == 10 and r.offences == 14 and r.evidence[-1]["job"] == "x11"
    assert [x.node for x in await st.reputations()] == ["n1"]
    await st.forget_reputation("n1")
    assert await st.reputation("n1") == NodeReputation("n1") and await st.reputations() == []
    await st.close()


async def test_readmit_through_the_one_implementation(redis_db):
    """Local controller: exclusion → offence; failing canary → kept out, offence, evidence;
    a second failure makes a repeat offender held without a canary; two weeks later the decayed
    score lets a passing canary readmit it, on probation; excluded again then, it weighs 2."""
    from trainguard.scheduler.local import LocalController
    from trainguard.schemas import JobSettings
    from trainguard.clients.store import StateStore

    import time

    st = StateStore(redis_db)
    t0 = time.time_ns() + 10**9  # just after the exclusions below
    await st.register_settings("tj", JobSettings(mode="action"))
    ctl = LocalController(st)
    calls: list[str] = []

    def canary(ok, detail):
        async def run(node):
            calls.append(node)
            return ok, detail
        return run

    await ctl.exclude("n1", "tj", "xid 79 on n1")
    await ctl.exclude("n1", "tj", "xid 79 on n1 (carried out again)")
    assert (await st.reputation("n1")).offences == 1
    res = await ctl.readmit("n1", canary(False, "compute: relative error 1.0"), now_ns=t0)
    assert not res.ok and "canary failed: compute: relative error 1.0" in res.detail
    assert "score 2.00" in res.detail
    assert (await st.node("n1"))["status"] == "excluded"
    assert "canary failed" in (await st.node("n1"))["reason"]
    r = await st.reputation("n1")
    assert (r.status, r.canary["ok"], r.evidence[-1]["job"]) == ("drained", False, "canary")
    await ctl.readmit("n1", canary(False, "allreduce hung"), now_ns=t0 + 1)
    calls.clear()
    held = await ctl.readmit("n1", canary(True, "fine"), now_ns=t0 + 2)
    assert not held.ok and "repeat offender" in held.detail and calls == []  # no canary
    assert (await st.reputation("n1")).status == "held"
    later = t0 + 14 * DAY_NS  # 3 → 0.75
    ok = await ctl.readmit("n1", canary(True, "all passed"), now_ns=later)
    assert ok.ok and "canary passed (all passed)" in ok.detail and calls == ["n1"]
    r = await st.reputation("n1")
    assert r.status == "probation" and r.probation_until_ns == later + 7 * DAY_NS
    assert (await st.node("n1"))["status"] == "healthy"
    again = await ctl.readmit("n1", canary(True, "x"), now_ns=later)
    assert again.ok and "in service already" in again.detail
    await st.update_job("tj", generation=1)  # a later generation: a new offence
    await ctl.exclude("n1", "tj", "xid 79 again")
    r = await st.reputation("n1")
    assert r.evidence[-1]["weight"] == 2.0 and "while on probation" in r.evidence[-1]["why"]
    await st.close()


async def test_a_canary_that_could_not_run_keeps_the_node_out_without_an_offence(redis_db):
    """The scheduler could not start the canary (``CanaryNotRun``): nothing was learnt of the
    node, so it stays out of service, its score unchanged, the reason saying so."""
    from trainguard.scheduler.base import CanaryNotRun
    from trainguard.scheduler.local import LocalController
    from trainguard.schemas import JobSettings
    from trainguard.clients.store import StateStore

    st = StateStore(redis_db)
    await st.register_settings("tj", JobSettings(mode="action"))
    ctl = LocalController(st)
    await ctl.exclude("n1", "tj", "xid 79 on n1")
    before = await st.reputation("n1")

    async def refused(node):
        raise CanaryNotRun("srun did not start the canary: exit 1: srun: error: Unable to "
                           "allocate resources: Requested node configuration is not available")

    res = await ctl.readmit("n1", refused)
    assert not res.ok and "canary could not run" in res.detail and "Unable to allocate" in \
        res.detail, res.detail
    after = await st.reputation("n1")
    assert (after.offences, after.score) == (before.offences, before.score), after
    assert after.status == "drained" and after.canary["ok"] is False
    assert (await st.node("n1"))["status"] == "excluded"
    await st.close()


async def test_one_readmit_of_a_node_at_a_time(redis_db):
    """Two readmits of one node at once (two operators, a controller and an operator): one
    runs the canary, the other does nothing and says so; after the first, the lock is free."""
    import asyncio

    from trainguard.scheduler.local import LocalController
    from trainguard.schemas import JobSettings
    from trainguard.clients.store import StateStore

    st = StateStore(redis_db)
    await st.register_settings("tj", JobSettings(mode="action"))
    ctl, other = LocalController(st), LocalController(StateStore(redis_db))
    await ctl.exclude("n1", "tj", "xid 79 on n1")
    runs: list[str] = []

    async def slow(node):
        runs.append(node)
        await asyncio.sleep(0.5)
        return True, "all passed"

    a, b = await asyncio.gather(ctl.readmit("n1", slow), other.readmit("n1", slow))
    assert runs == ["n1"], (a, b)
    assert sorted([a.ok, b.ok]) == [False, True], (a, b)
    lost = a if not a.ok else b
    assert "another readmit of n1 is under way" in lost.detail, lost.detail
    assert await st.r.get("tg:rep:n1:readmit") is None  # released
    assert [r.node for r in await st.reputations()] == ["n1"]
    assert (await ctl.readmit("n1", slow)).detail.startswith("in_service")
    await st.close()
    await other.state.close()


sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "agent"))


def test_nvml_rules_at_the_pynvml_seam():
    import fake_pynvml as fk

    from trainguard.agents.nvml import NvmlConfig, NvmlSampler
    from trainguard.agents.canary import nvml_problems

    good = fk.healthy_h100(0)
    bad = fk.healthy_h100(1)
    bad.remapped = (0, 2, 0, 1)  # correctable, uncorrectable, pending, failure
    s = NvmlSampler(NvmlConfig(xid_events=False), module=fk.FakePynvml([good, bad]))
    assert s.open()
    problems = nvml_problems(s.sample())
    s.close()
    assert problems == ["GPU 1 remapped_rows_failure=True: a row remap failed: RMA"], problems
    s = NvmlSampler(NvmlConfig(xid_events=False), module=fk.FakePynvml([good]))
    assert s.open() and nvml_problems(s.sample()) == []


@pytest.mark.parametrize("spec,check,node,want", [
    ("compute", "compute", "n1", True), ("compute@n2,n3", "compute", "n1", False),
    ("compute,allreduce@n1", "allreduce", "n1", True), ("", "compute", "n1", False),
    ("nvml@n1", "compute", "n1", False),
])
def test_fault_injection_names_checks_and_nodes(spec, check, node, want):
    from trainguard.agents.canary import injected

    assert injected(check, node, spec) is want


def test_the_canary_program_fails_an_injected_compute_fault(monkeypatch, capsys):
    import json

    from trainguard.agents.canary import main

    monkeypatch.setenv("TG_NODE", "n7")
    monkeypatch.setenv("TG_CANARY_FAIL", "compute@n7")
    assert main(["--json", "--skip", "allreduce"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["node"] == "n7" and not out["ok"]
    assert [c["name"] for c in out["checks"] if not c["ok"]] == ["compute"]
    assert "relative error 1.00e+00 > 0.0001" in out["summary"]
    monkeypatch.setenv("TG_CANARY_FAIL", "compute@n8")
    assert main(["--skip", "allreduce"]) == 0


def test_canary_summary_reads_the_last_json_line():
    from trainguard.scheduler.base import canary_summary

    assert canary_summary('noise\n{"summary": "compute: off"}\n') == "compute: off"
    assert canary_summary("srun: error: Unable to allocate") == "srun: error: Unable to allocate"
    assert dataclasses.is_dataclass(NodeReputation)


async def test_the_node_command_shows_forgives_and_readmits(redis_db, monkeypatch, capsys):
    """``trainguard node``: a node in service needs no canary (exit 0), ``show`` prints the
    score now, ``forgive`` removes the reputation; no state store: exit 2, saying why."""
    import asyncio
    import json

    from trainguard.tools.node import main
    from trainguard.clients.store import StateStore

    st = StateStore(redis_db)
    await st.add_offence("n9", "j:g0", 1.0, 7 * 86400.0, {"job": "j", "reason": "xid 79"})
    await st.close()
    monkeypatch.setenv("REDIS_URL", redis_db)
    run = asyncio.to_thread
    assert await run(main, ["readmit", "n9", "--controller", "local"]) == 0
    assert "in service already" in capsys.readouterr().out
    assert await run(main, ["show", "n9", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["status"] == "drained" and row["score_now"] == pytest.approx(1.0, abs=1e-3)
    assert row["fault_history"]["records"] == [] and not row["fault_history"]["repeat_offender"]
    assert await run(main, ["forgive", "n9"]) == 0
    capsys.readouterr()
    assert await run(main, ["show"]) == 0 and capsys.readouterr().out == ""
    # the cross-job history the attributor counts: a node fault in two jobs makes a repeat
    # offender, an application fault or an unexplained crash there counts against no node
    st = StateStore(redis_db)
    now = time.time_ns()
    await st.record_fault("n7", "ja", "gpu_xid:79", {"layer": "hardware"}, now - 2_000_000_000)
    await st.record_fault("n7", "jb", "crash:-9", {"layer": "unknown"}, now - 1_000_000_000)
    await st.record_fault("n8", "ja", "app:exc", {"layer": "application"}, now)
    await st.record_fault("n7", "old", "gpu_xid:79", {"layer": "hardware"}, now - 2 * 86400 * 10**9)
    await st.close()
    assert await run(main, ["show"]) == 0
    out = capsys.readouterr().out
    assert "n7: 2 fault(s) in the last 24 h; the node's own in 1 job(s) (ja): not a repeat" in out
    assert "job jb: unknown (crash:-9)" in out and "job old" not in out  # past the window
    assert "n8: 1 fault(s)" in out and "(none)" in out
    st = StateStore(redis_db)
    await st.record_fault("n7", "jc", "node_lost", {"layer": "infrastructure"}, now)
    await st.close()
    assert await run(main, ["show", "n7", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    h = row["fault_history"]
    assert row["offences"] == 0 and h["fault_jobs"] == ["ja", "jc"] and h["repeat_offender"]
    assert [r["job"] for r in h["records"]] == ["ja", "jb", "jc"]
    monkeypatch.delenv("REDIS_URL")
    assert await run(main, ["show"]) == 2
    assert "REDIS_URL is not set" in capsys.readouterr().err

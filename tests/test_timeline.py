"""trainguard.core.timeline: the phases of one recovery from events, audit records and step records,
and the slow phase of a run against its path's median. Pure: no servers."""
from __future__ import annotations

import pytest

from trainguard import schemas

from trainguard.core import timeline

S = 1_000_000_000  # ns per second
F = 1_000 * S      # the fault


def _events(shift: dict[str, float] | None = None) -> list[schemas.Event]:
    """A node loss on node1 (ranks 2, 3) recovered on node2; ``shift`` delays a phase (s)."""
    sh = shift or {}
    t = {"anomaly": 3.0, "verdict": 3.01, "decision": 3.02, "acted": 3.05, "rdzv": 3.2,
         "resumed": 3.3}
    for k, v in sh.items():
        for later in list(t)[list(t).index(k):]:
            t[later] += v
    ns = {k: F + int(v * S) for k, v in t.items()}
    v = schemas.Verdict(job="j", fault_class="node_lost", layer="hardware", ts=ns["verdict"])
    return [
        schemas.Anomaly(job="j", kind="rank_silent", fault_class="hang", ts=F - 5 * S),  # before
        schemas.Anomaly(job="j", kind="node_lost", fault_class="node_lost", ts=ns["anomaly"]),
        v,
        schemas.Decision(job="j", action="none", idempotency_key="flag", generation=1,
                         ts=ns["decision"] - 1000),
        schemas.Decision(job="j", event_id="d2", action="exclude_node_and_requeue",
                         execute=True, generation=2, idempotency_key="k", verdict_id=v.event_id,
                         ts=ns["decision"]),
        schemas.ActionResult(job="j", node="node0", decision_id="d2", idempotency_key="k",
                             executor="launcher-node0", action="x", ok=True,
                             ts=ns["acted"] - 20_000_000),
        schemas.ActionResult(job="j", node="node2", decision_id="d2", idempotency_key="k",
                             executor="launcher-node2", action="x", ok=True, ts=ns["acted"]),
        *[schemas.TrainingResumed(job="j", rank=r, generation=2, world_size=4,
                                  restored_step=15, resumed_step=16, ts=ns["resumed"],
                                  rendezvous_ts=ns["rdzv"] - (3 - r) * 1000)
          for r in range(4)]]


def _steps(first_after: float = 3.4) -> list[dict]:
    old = [{"t": (F - 2 * S + k * S // 10) / 1e9, "rank": r, "gen": 1, "step": k}
           for k in range(15) for r in range(4)]
    old.append({"t": (F + S // 2) / 1e9, "rank": 0, "gen": 1, "step": 15})  # after the fault
    new = [{"t": (F + int((first_after + r / 100) * S)) / 1e9, "rank": r, "gen": 2, "step": 16}
           for r in range(4)]
    return old + new


def test_phases_of_a_node_loss():
    tl = timeline.build(F, _events(), steps=_steps())
    sec = tl.seconds()
    assert tl.generation == 2 and tl.decision_id == "d2"
    assert tl.action == "exclude_node_and_requeue"
    assert sec == {"fault": 0.0, "last_progress": 0.5, "detected": 3.0, "verdict": 3.01,
                   "decision": 3.02, "acted": 3.05, "rendezvous": 3.2, "first_step": 3.43}
    assert tl.to_dict()["acted_by_node"] == {"node0": 3.03, "node2": 3.05}
    assert tl.to_dict()["first_step_by_rank"]["3"] == 3.43
    d = tl.durations()
    assert d["detected"] == 2.5 and d["rendezvous"] == pytest.approx(0.15)


@pytest.mark.parametrize("missing, expect", [
    # no step records: the first steps come from recovery.resumed
    ("steps", {"first_step": 3.3, "last_progress": None}),
    # decisions only in the audit trail (a report without the decision events)
    ("decision_events", {"decision": 3.02}),
    # no anomaly on the job's subjects (a node's): the decision's detected_ts
    ("anomaly", {"detected": 2.9}),
])
def test_missing_sources(missing, expect):
    evs = _events()
    audit = []
    steps = _steps()
    if missing == "steps":
        steps = []
    if missing == "decision_events":
        decs = [e for e in evs if isinstance(e, schemas.Decision)]
        evs = [e for e in evs if not isinstance(e, schemas.Decision)]
        audit = [{"type": "decision", "decision_id": d.event_id, "ts": d.ts, "action": d.action,
                  "generation": d.generation, "execute": d.execute, "verdict_id": d.verdict_id}
                 for d in decs]
    if missing == "anomaly":
        evs = [e for e in evs if not isinstance(e, schemas.Anomaly)]
        evs = [e.model_copy(update={"detected_ts": F + int(2.9 * S)})
               if isinstance(e, schemas.Decision) else e for e in evs]
    sec = timeline.build(F, evs, audit, steps).seconds()
    for k, v in expect.items():
        assert sec[k] == v, k


def test_scheduler_alone_from_step_records():
    """No decision at all (Slurm alone): the new generation is read from the step records."""
    tl = timeline.build(F, steps=_steps(first_after=120.0))
    assert tl.generation == 2 and tl.seconds()["first_step"] == 120.03
    assert tl.seconds()["last_progress"] == 0.5 and tl.seconds()["decision"] is None


def test_slow_run_names_the_phase_that_waited():
    """Ten runs like the first; one whose rendezvous waited 17 s more: the tails list it with
    that phase, not the first step that merely came after it."""
    runs = [timeline.build(F, _events(), steps=_steps()).to_dict() for _ in range(9)]
    slow = timeline.build(F, _events({"rdzv": 17.0}), steps=_steps(first_after=20.4)).to_dict()
    runs.insert(4, slow)
    secs = [r["seconds"]["first_step"] for r in runs]
    out = timeline.tails(secs, runs)
    assert out["median_s"] == 3.43 and out["max_s"] == 20.43 and out["p95_s"] == 20.43
    assert out["slow_runs"] == [{"run": 4, "seconds": 20.43, "slow_phase": "rendezvous",
                                 "extra_s": 17.0}]


def test_run_without_recovery_is_listed():
    runs = [timeline.build(F, _events(), steps=_steps()).to_dict() for _ in range(3)]
    out = timeline.tails([3.43, None, 3.43], [runs[0], None, runs[2]])
    assert out["recovered"] == 2 and out["slow_runs"][0]["run"] == 1
    assert out["slow_runs"][0]["slow_phase"] is None


def test_p95_nearest_rank():
    assert timeline.tails(list(range(1, 21)), [None] * 20)["p95_s"] == 19
    assert timeline.tails([1.0], [None])["p95_s"] == 1.0


def test_format_lists_every_phase():
    lines = timeline.format_timeline(timeline.build(F, _events(), steps=_steps()).to_dict())
    assert sum(1 for x in lines if x.startswith("| ") and not x.startswith("| phase")) \
        == len(timeline.PHASES)
    assert any("node2 3.050" in x for x in lines)


def test_with_mark_recomputes_durations():
    tl = timeline.build(F, _events()).to_dict()
    assert tl["seconds"]["last_progress"] is None
    tl2 = timeline.with_mark(tl, "last_progress", F + S // 2)
    assert tl2["seconds"]["last_progress"] == 0.5 and tl2["durations"]["detected"] == 2.5
    assert tl2["acted_by_node"] == tl["acted_by_node"]
    with pytest.raises(KeyError):
        timeline.with_mark(tl, "lunch", F)

"""The remediator reducer's watchdog: a pending decision cleared by ``recovery.resumed``,
escalated by a failing ``action.result`` or its deadline along ``policy.escalate``'s ladder, and
re-armed from the job records after a restart (``remediator.reducer``). Pure."""
from __future__ import annotations

import logging
from dataclasses import replace

from trainguard import schemas
from trainguard.core.reducer import Effect, Log, Reply, store
from trainguard.schemas import ActionResult, Decision, JobRecord, TrainingResumed

from trainguard.remediator import gate
from trainguard.remediator import plan
from trainguard.remediator.decisions import claim_call, commit
from trainguard.remediator.model import (Out, Pending, RemediatorState, Work, count, done, stamp, start, update,
                    without_pending)


# ---- watchdog -------------------------------------------------------------------------------------
def on_resumed(state: RemediatorState, ev: TrainingResumed) -> Out:
    p = state.pending.get(ev.job or "")
    if not ev.job or p is None or ev.generation < p.decision.generation:
        return state, []
    return without_pending(state, ev.job), [store("clear_pending", ev.job)]


def on_action(state: RemediatorState, ev: ActionResult, wall_ns: int) -> Out:
    if not ev.job or ev.ok or ev.skipped:
        return state, []
    if ev.executor.startswith("controller:"):
        # the scheduler could not drain the node; the job itself re-ranks without it, so only
        # training not resuming (the deadline) escalates
        return state, []
    p = state.pending.get(ev.job)
    if p and (ev.decision_id == p.decision.event_id
              or ev.idempotency_key == p.decision.idempotency_key):
        return _escalate(state, ev.job, f"failed ({ev.executor}: {ev.detail or 'no detail'})")
    return state, []


def on_tick(state: RemediatorState, now: float, wall_ns: int) -> Out:
    if not state.armed:
        return replace(state, armed=True), [store("jobs", reply=("rearm_jobs",))]
    effects: list[Effect] = []
    for job, p in list(state.pending.items()):
        if now >= p.deadline:
            state, more = _escalate(state, job, f"not followed by training again within "
                                                f"{state.config.decision_timeout_s:g} s")
            effects += more
    return state, effects


def _escalate(state: RemediatorState, job: str, why: str) -> Out:
    p = state.pending.get(job)
    if p is None:
        return state, []
    state, seq = start(without_pending(state, job), Work(job, prev=p.decision, why=why))
    return state, [store("job", job, reply=("wd_job", seq))]


def on_wd_job(state, seq, w: Work, inp: Reply, now) -> Out:
    rec: JobRecord = inp.value
    prev = w.prev
    assert prev is not None
    if rec.generation > prev.generation:
        return done(state, seq), []  # a later decision superseded it
    dec = plan.escalate(prev, rec, w.why, state.config.policy)
    if dec is None:
        return done(state, seq), [store("clear_pending", w.job)]
    state, w = update(state, seq, record=rec, decision=stamp(dec, inp.wall_ns),
                      fault_gen=prev.generation)
    if gate.needs_gate(state, w.decision):  # node-taking: the fleet breaker first
        return gate.ask(state, seq, "wd_claim")
    return state, [claim_call(w.decision, ("wd_claim", seq))]


def on_wd_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return done(state, seq), []
    return commit(count(state, "escalations"), seq, now, inp.wall_ns)


# ---- re-arm after a restart -----------------------------------------------------------------------
def on_rearm(state: RemediatorState, inp: Reply, now: float) -> Out:
    """Re-arm the watchdog for pending decisions a previous instance left in the job records:
    the deadline left is ``deadline_ns - wall_ns`` (at least 0) from ``now``."""
    if inp.error and inp.tag[0] == "rearm_jobs":  # tried again at the next tick
        return replace(state, armed=False), [Log(logging.WARNING, (
            f"job list unreadable ({inp.error}): pending decisions not re-armed yet"))]
    if inp.error:
        return state, [Log(logging.WARNING, f"{inp.tag[1]}: record unreadable, its pending "
                                            f"decision is not re-armed ({inp.error})")]
    if inp.tag[0] == "rearm_jobs":
        return state, [store("job", j, reply=("rearm_job", j)) for j in inp.value or ()]
    job = inp.tag[1]
    try:
        pd = dict(inp.value.pending_decision or {})
        if not pd:
            return state, []
        deadline_ns = int(pd.pop("deadline_ns", 0))
        dec = schemas.from_dict(pd)
    except Exception as exc:  # noqa: BLE001 - a bad record is skipped, not fatal
        return state, [Log(logging.WARNING, f"{job}: unreadable pending decision, not "
                                            f"re-armed ({exc})")]
    if not isinstance(dec, Decision):
        return state, []
    left = max(0.0, (deadline_ns - inp.wall_ns) / 1e9)
    return replace(state, pending={**state.pending, job: Pending(dec, now + left)}), []


"""The remediator as a reducer: verdict → decision, idempotency, audit, exclusion, watchdog. Pure.

``step(state, input, now) -> (state, effects)`` (``trainguard.reducer``). ``now`` is the service
clock in seconds (watchdog deadlines); wall-clock fields (a decision's ``ts``, audit ``ts``,
``pending_decision.deadline_ns``) are the inputs' ``wall_ns`` (Unix ns). Call targets:
``"state"`` (the ``StateStore``) and ``"controller"`` (the node controller).

A verdict goes through these stages; each is a ``Call`` whose ``Reply`` tag is ``(stage, seq,
…)``, ``seq`` numbering the work in flight (``RemediatorState.work``):

1. ``verdict_claim`` — claim ``<job>:verdict:<verdict id>``; held → fold (the same verdict
   delivered twice is decided once);
2. ``job`` — read the job record; an ended job (stopped, finished, failed) → fold; else the pure
   ``policy.decide``;
3. ``flag_owner`` — a flag (action ``none``) for a generation that already has its decision
   (``claimed_by("<job>:g<fault generation>")``) → fold;
4. ``claim`` — claim the decision's idempotency key; held by an action that is not weaker than
   the table's action for this verdict → fold; else ``escalation_claim`` claims
   ``<key>:<action>`` (held → fold);
5. commit (action mode, action other than ``none``): ``bump`` the generation (when another
   decision moved it, bump from the generation in force, up to 5 tries), ``commit`` the record
   (``commit_decision``: retries, last fault/decision, the new world, stop, the
   ``pending_decision`` the watchdog waits on); then in every mode: audit, publish on
   ``tg.job.<job>.decision``, and watch an executed recovery decision;
6. exclusion of an executed ``exclude_node_and_requeue``, per node: ``exclude_claim`` claims
   ``<key>:exclude:<node>`` (held: already carried out), ``exclude`` asks the controller and
   publishes its ``action.result`` (the controller call runs in the background:
   ``wait=False``); a failed drain is audited (``controller_failed``) and does
   not escalate: the job re-ranks without the node anyway;
7. pod restart of an executed decision for which ``policy.pod_restart`` names nodes (a lost
   launcher on a healthy node, under a controller that recreates pods), per node:
   ``pod_claim`` claims ``<key>:restart_pod:<node>`` (held: already done), ``pod_restart``
   asks the controller (``restart_pod(node, job, before_ns)``, in the background) and
   publishes its ``action.result``; a failure is audited (``controller_failed``) and left to
   the watchdog.

A stage whose call failed (Valkey gone) ends that work with a ``Log``: nothing is published
for a decision whose record was not written.

Outbox: a decision is written to the job's outbox (``tg:job:<job>:outbox``) in the same step
as its record — inside ``commit_decision`` in action mode, ``outbox_put`` otherwise — and only
then published, with a JetStream ack (``Publish(stored=True)``, the decision id as
``Nats-Msg-Id``); the reply ``("published", job, id)`` drops it from the outbox
(``outbox_done``). Every ``outbox_sweep_s`` a ``Tick`` reads the outbox (``("outbox",)``) and
publishes again what is still there and not in flight, for the jobs this replica serves: a
remediator killed between storing and publishing, or a bus that was away, still gets every
decision into the stream, once (the stream drops a second copy of an id; executors act once per
idempotency key).

A ``BusUp`` after an outage moves every watchdog deadline on by the outage's length.

Replicas: ``Gained(job)`` re-arms the job's pending decision from its record and sweeps the
outbox at the next tick; ``Released(job)`` drops its pending decision here (the new owner
re-arms it).

Watchdog: ``pending`` holds one executed recovery decision per job with its deadline
(``decision_timeout_s`` later). ``recovery.resumed`` with ``generation >=`` the decision's
clears it; a failing ``action.result`` of an executor (not the controller) or a ``Tick`` past
the deadline escalates: ``wd_job`` reads the record (a later generation in force: superseded,
nothing), ``policy.escalate`` gives the next rung of the ladder (none: clear the pending
record), ``wd_claim`` claims its key, then the commit above. The first ``Tick`` re-arms the
pending decisions a previous instance left in the job records (``rearm_jobs``, ``rearm_job``;
an unreadable job list is tried again at the next ``Tick``).
"""
from __future__ import annotations

import logging

from dataclasses import replace

from trainguard import schemas
from trainguard.reducer import (BusUp, Effect, Gained, Input, Log, Received, Released, Reply,
                                Tick, store)
from trainguard.schemas import ActionResult, Decision, TrainingResumed, Verdict

from . import decisions as d
from . import watchdog as wd
from .model import (Out, Pending, RemediatorConfig, RemediatorState, Work, count_outbox,
                    done, without_pending)

__all__ = ["RemediatorConfig", "RemediatorState", "Pending", "Work", "step"]


def step(state: RemediatorState, inp: Input, now: float) -> Out:
    """One input: a verdict, action result or resume (``Received``), a ``Tick``, a ``Reply``."""
    if isinstance(inp, Received):
        ev = inp.event
        if isinstance(ev, Verdict):
            return d.on_verdict(state, inp.subject, ev, inp.wall_ns)
        if isinstance(ev, ActionResult):
            return wd.on_action(state, ev, inp.wall_ns)
        if isinstance(ev, TrainingResumed):
            return wd.on_resumed(state, ev)
        return state, []
    if isinstance(inp, Tick):
        state, effects = wd.on_tick(state, now, inp.wall_ns)
        if now - state.last_sweep >= state.config.outbox_sweep_s:
            state = replace(state, last_sweep=now)
            effects = effects + [store("outbox", reply=("outbox",))]
        return state, effects
    if isinstance(inp, Gained):
        return replace(state, last_sweep=float("-inf")), [
            store("job", inp.key, reply=("rearm_job", inp.key))]
    if isinstance(inp, Released):
        return without_pending(state, inp.key), []
    if isinstance(inp, BusUp):  # training could not report back meanwhile: give it the time
        return replace(state, pending={j: Pending(p.decision, p.deadline + inp.gap_s)
                                       for j, p in state.pending.items()}), []
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple) and inp.tag:
        if inp.tag[0] in ("rearm_jobs", "rearm_job"):
            return wd.on_rearm(state, inp, now)
        if inp.tag[0] == "published":
            return d.on_published(state, inp)
        if inp.tag[0] == "outbox":
            return _on_outbox(state, inp)
        seq = inp.tag[1] if len(inp.tag) > 1 else None
        w = state.work.get(seq)  # type: ignore[arg-type]
        handler = _STAGES.get(inp.tag[0])
        if w is None or handler is None:
            return state, []
        if inp.error and inp.tag[0] not in ("exclude", "pod_restart"):
            return done(state, seq), [Log(logging.WARNING, (
                f"{w.job}: {inp.tag[0]} failed ({inp.error}); "
                + (f"verdict {w.verdict.event_id}" if w.verdict else "watchdog escalation")
                + " not carried further"))]
        return handler(state, seq, w, inp, now)
    return state, []


def _on_outbox(state: RemediatorState, inp: Reply) -> Out:
    """Publish again the outbox entries of the jobs this replica serves, unless in flight."""
    if inp.error:
        return state, [Log(logging.WARNING, f"outbox unreadable ({inp.error}); next sweep")]
    effects: list[Effect] = []
    for job, entries in sorted((inp.value or {}).items()):
        if not state.serves(job):
            continue
        for raw in entries:
            try:
                dec = schemas.from_dict(raw)
            except Exception as exc:  # noqa: BLE001 - a bad entry is logged, not fatal
                effects.append(Log(logging.WARNING, f"{job}: unreadable outbox entry ({exc})"))
                continue
            if not isinstance(dec, Decision) or dec.event_id in state.publishing:
                continue
            state, more = d.publish_decision(count_outbox(state, "republished"), dec)
            effects += more
    return state, effects


#: Reply tag → the stage it completes (``tag = (stage, seq, …)``).
_STAGES = {
    "verdict_claim": d.on_verdict_claim, "job": d.on_job, "flag_owner": d.on_flag_owner,
    "claim": d.on_claim, "escalation_claim": d.on_escalation_claim, "bump": d.on_bump,
    "commit": d.on_commit, "outbox_put": d.on_outbox_put,
    "exclude_claim": d.on_exclude_claim, "exclude": d.on_exclude,
    "pod_claim": d.on_pod_claim, "pod_restart": d.on_pod_restart,
    "wd_job": wd.on_wd_job, "wd_claim": wd.on_wd_claim,
}


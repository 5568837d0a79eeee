"""The remediator as a reducer: verdict → decision, idempotency, audit, exclusion, watchdog. Pure.

``step(state, input, now) -> (state, effects)`` (``trainguard.core.reducer``). ``now`` is the service
clock in seconds (watchdog deadlines); wall-clock fields (a decision's ``ts``, audit ``ts``,
``pending_decision.deadline_ns``) are the inputs' ``wall_ns`` (Unix ns). Call targets:
``"state"`` (the ``StateStore``) and ``"controller"`` (the node controller).

A verdict goes through these stages; each is a ``Call`` whose ``Reply`` tag is ``(stage, seq,
…)``, ``seq`` numbering the work in flight (``RemediatorState.work``):

1. ``verdict_claim`` — claim ``<job>:verdict:<verdict id>`` for ``verdict_token`` (this
   replica and the verdict); held by another owner, or settled (``decided:<decision id>``,
   written with the decision) → fold (the same verdict delivered twice is decided once); held
   by its own token → carry on (its first try landed: a lost reply, or the verdict delivered
   again to this replica after a restart). A verdict already in flight here is stepped as
   nothing;
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
6. the node controller's part (``decisions.NODE_STEPS``), per node: the exclusion of an
   executed ``exclude_node_and_requeue`` (``exclude(node, job, reason)``), or the pod restart
   of an executed decision for which ``policy.pod_restart`` names nodes (a lost launcher on a
   healthy node, under a controller that recreates pods: ``restart_pod(node, job,
   before_ns)``), or, once for the job, the scheduler's stop of an executed
   ``stop_job_notify_user`` under a controller that ``cancels_jobs`` (Slurm: ``stop(job,
   reason, generation)``, claim key ``<key>:stop``; observe mode leaves the scheduler alone).
   ``node_claim`` claims ``<key>:<step>:<node>`` (held by another decision or settled
   ``done:<id>``: already carried out; held by this decision's id: begun by a process that
   died, asked again), settled ``done:<id>`` once the controller answered;
   ``node_step`` gets the controller's result (the call runs in the background:
   ``wait=False``) and publishes its ``action.result``; a failure is audited
   (``controller_failed``) and does not escalate here (an excluded node's job re-ranks
   without it anyway; a pod not restarted is the watchdog's).

A stage whose state-store call failed (Valkey gone) is issued again at a later ``Tick``
(``RemediatorConfig.store_retry_s``; given up after ``store_retries``, with a ``Log``): nothing
is published for a decision whose record was not written. The verdict stays ``in_flight``
meanwhile, and the service acks its message only once it left (decided, folded, ignored, given
up): a remediator killed while it waits gets the verdict again after its restart. The decision
of a verdict has an id derived from the verdict (``model.decision_id``), so the retried chain
claims, stores and publishes the first try's decision; the commit (or the observe-mode outbox
put) settles the verdict's claim in the same transaction, so a delivery after that folds.

Outbox: a decision is written to the job's outbox (``tg:outbox:<job>``) in the same step
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
from trainguard.core.reducer import (BusUp, Call, Effect, Gained, Input, Log, Received, Released,
                                Reply, Tick, store)
from trainguard.schemas import ActionResult, Decision, TrainingResumed, Verdict

from trainguard.remediator import decisions as d
from trainguard.remediator import gate
from trainguard.remediator import watchdog as wd
from trainguard.remediator.model import (Out, Pending, RemediatorConfig, RemediatorState, Work, count_outbox,
                    done, in_flight, update, without_pending)

__all__ = ["RemediatorConfig", "RemediatorState", "Pending", "Work", "step", "in_flight"]


def step(state: RemediatorState, inp: Input, now: float) -> Out:
    """One input: a verdict, action result or resume (``Received``), a ``Tick``, a ``Reply``.

    Every state-store ``Call`` of a chain in flight is remembered in its ``Work``; when it
    fails, the chain waits and the same call is issued again at a later ``Tick``
    (``RemediatorConfig.store_retries``), so a verdict that arrives while Valkey restarts is
    decided once Valkey is back instead of dropped."""
    state, effects = _step(state, inp, now)
    for e in effects:
        tag = getattr(e, "reply", None)
        if (isinstance(e, Call) and e.target == "state" and isinstance(tag, tuple)
                and len(tag) > 1 and _retried(tag[0]) and tag[1] in state.work):
            state, _ = update(state, tag[1], last_call=e, retry_at=None)
    return state, effects


#: the stage whose reply is the node controller's, not the state store's: its failure is the
#: controller's to report (``decisions.on_node_step``), never issued again here
_CONTROLLER_STAGE = "node_step"


def _retried(stage: str) -> bool:
    """Whether a failed call of chain stage ``stage`` is issued again (every state-store stage)."""
    return stage in _STAGES and stage != _CONTROLLER_STAGE


def _retry_due(state: RemediatorState, now: float) -> Out:
    effects: list[Effect] = []
    for seq, w in sorted(state.work.items()):
        if w.retry_at is not None and w.retry_at <= now and w.last_call is not None:
            state, _ = update(state, seq, retry_at=None)
            effects.append(w.last_call)
    return state, effects


def _store_failed(state: RemediatorState, seq: int, w: Work, inp: Reply, now: float) -> Out:
    what = f"verdict {w.verdict.event_id}" if w.verdict else "watchdog escalation"
    cfg = state.config
    if w.last_call is None or w.store_tries >= cfg.store_retries:
        return done(state, seq), [Log(logging.WARNING, (
            f"{w.job}: {inp.tag[0]} failed ({inp.error}); {what} not carried further"
            + (f" after {w.store_tries} tries" if w.store_tries else "")))]
    delay = min(cfg.store_retry_max_s, cfg.store_retry_s * 2 ** w.store_tries)
    state, _ = update(state, seq, retry_at=now + delay, store_tries=w.store_tries + 1)
    return state, [Log(logging.WARNING if w.store_tries == 0 else logging.DEBUG, (
        f"{w.job}: {inp.tag[0]} failed ({inp.error}); {what}: trying again in {delay:.2f} s"))]


def _step(state: RemediatorState, inp: Input, now: float) -> Out:
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
        state, retried = _retry_due(state, now)
        state, effects = wd.on_tick(state, now, inp.wall_ns)
        effects = retried + effects
        if now - state.last_sweep >= state.config.outbox_sweep_s:
            state = replace(state, last_sweep=now)
            effects = effects + [store("outbox", reply=("outbox",))]
        if now - state.last_breaker_poll >= state.config.breaker_poll_s:
            state = replace(state, last_breaker_poll=now)
            effects = effects + [store("breaker_view", reply=("breaker_seen",))]
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
        if inp.tag[0] == "breaker_seen":  # the periodic read for /metrics and health
            return (state if inp.error else replace(state, breaker_seen=tuple(inp.value))), []
        seq = inp.tag[1] if len(inp.tag) > 1 else None
        w = state.work.get(seq)  # type: ignore[arg-type]
        handler = _STAGES.get(inp.tag[0])
        if w is None or handler is None:
            return state, []
        if inp.error and _retried(inp.tag[0]):
            return _store_failed(state, seq, w, inp, now)
        if w.store_tries:
            state, w = update(state, seq, store_tries=0)
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
    "verdict_claim": d.on_verdict_claim, "job": d.on_job, "decided_job": d.on_decided_job,
    "flag_owner": d.on_flag_owner,
    "claim": d.on_claim, "escalation_claim": d.on_escalation_claim, "bump": d.on_bump,
    "commit": d.on_commit, "outbox_put": d.on_outbox_put,
    "node_claim": d.on_node_claim, "node_step": d.on_node_step,
    "wd_job": wd.on_wd_job, "wd_claim": wd.on_wd_claim,
    "breaker": gate.on_breaker, "breaker_put": gate.on_breaker_put,
}


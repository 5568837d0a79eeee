"""The remediator reducer's verdict chain: claims, fold or escalate, the commit (generation,
job record, audit, publish), the exclusion, the pod restart and the stop through the
controller. Stages 1–7 of
``remediator.reducer``; every function is pure and returns ``(state, effects)``."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from trainguard.core.reducer import Call, Effect, Log, Publish, Reply, store
from trainguard.schemas import ActionResult, Decision, JobRecord, Verdict, subjects
from trainguard.schemas.vocabulary import stronger

from trainguard.remediator import gate
from trainguard.remediator import policy as pol
from trainguard.remediator import plan
from trainguard.remediator import policy_table
from trainguard.remediator import progress
from trainguard.remediator.model import (ENDED, Out, Pending, RemediatorState, Work, brief, count, count_outbox,
                    FOLDED, decision_id, done, fold, in_flight, owner_action, owner_of, stamp, start,
                    token_replica, update, verdict_key, verdict_token, without_pending)

#: what a verdict's claim holds once its decision is stored (``StateStore.commit_decision``'s
#: ``settles``): ``decided:<decision id>``
DECIDED = "decided:"


# ---- verdicts -----------------------------------------------------------------------------------
def on_verdict(state: RemediatorState, subject: str, ev: Verdict, wall_ns: int) -> Out:
    try:
        job = ev.job or subjects.parse(subject)["name"]
    except ValueError:
        return state, []
    if ev.event_id in in_flight(state):  # delivered again while its chain runs here
        return state, [Log(logging.DEBUG, f"{job}: verdict {ev.event_id} already in flight")]
    v = ev if ev.job == job else ev.model_copy(update={"job": job})
    token = verdict_token(state.replica, v.event_id)
    state, seq = start(state, Work(job, verdict=v, token=token))
    return state, [store("claim", verdict_key(job, v.event_id), token,
                         reply=("verdict_claim", seq))]


def on_verdict_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    # the chain's own token: its first try landed (a retried claim whose reply was lost, or the
    # verdict delivered again after a restart of this replica): carry on from there
    if inp.value is not None and inp.value != w.token:
        other = token_replica(str(inp.value))
        if other is not None and other != state.replica and not state.alive(other):
            # claimed by a replica that died mid-chain (its lease ran out) and was not settled:
            # this replica, which took the job over, takes the claim over (compare-and-set: of
            # two that try, one wins) and resumes from the claims the dead one left
            return state, [store("take_claim", verdict_key(w.job, w.verdict.event_id),
                                 inp.value, w.token, reply=("verdict_claim", seq))]
        if str(inp.value).startswith(DECIDED):
            # decided and committed: a chain killed while its controller steps ran (the
            # verdict's message is held until they end) resumes those steps from the record
            return state, [store("job", w.job, reply=("decided_job", seq,
                                                      str(inp.value)[len(DECIDED):]))]
        return fold(state, seq, w, None, "this verdict was already handled", inp.wall_ns,
                    claimed=False)
    return state, [store("job", w.job, reply=("job", seq))]


def on_decided_job(state, seq, w: Work, inp: Reply, now) -> Out:
    """The record of a job whose verdict was decided already (``decided:<id>``): when that
    decision is still the job's pending one and needs the node controller (an exclusion, a pod
    restart), its steps run again: each step's claim tells whether it was carried out (settled
    ``done:<id>``) or only begun by a process that died (held by the decision's own id); the
    controllers re-read the scheduler first, so a step that landed anyway is "already …".
    Otherwise the verdict folds, as before."""
    did = inp.tag[2]
    rec: JobRecord = inp.value
    pend = rec.pending_decision or {}
    why = "this verdict was already decided"
    if pend.get("event_id") != did:
        return fold(state, seq, w, None, why, inp.wall_ns, claimed=False)
    try:
        dec = Decision.model_validate({k: v for k, v in pend.items() if k != "deadline_ns"})
    except Exception:  # noqa: BLE001 - a record written by another version: fold
        return fold(state, seq, w, None, why, inp.wall_ns, claimed=False)
    steps = _node_steps(state, dec, w.verdict)
    if steps is None:
        return fold(state, seq, w, None, why, inp.wall_ns, claimed=False)
    step, nodes = steps
    state, w = update(state, seq, record=rec, decision=dec, resumed=True)
    return _start_node_steps(state, seq, step, nodes, [store("audit", w.job, {
        "type": "resumed", "decision_id": did, "step": step, "nodes": list(nodes),
        "reason": "the verdict came again with its decision's controller steps maybe "
                  "unfinished (the remediator was restarted): each runs unless done",
        "ts": inp.wall_ns})])


def _node_steps(state: RemediatorState, dec: Decision, verdict: Verdict | None
                ) -> tuple[str, tuple[str, ...]] | None:
    """What the node controller does for executed decision ``dec``: ``(step, nodes)`` or
    None (``NODE_STEPS``)."""
    if not dec.execute:
        return None
    if dec.action == "exclude_node_and_requeue" and dec.nodes:
        return "exclude", tuple(dec.nodes)
    if dec.action == "stop_job_notify_user" and state.cancels_jobs:
        return "stop", JOB_TARGET
    pods, _ = plan.pod_restart(dec, verdict, state.restarts_pods, state.config.policy)
    if pods:
        return "restart_pod", tuple(pods)
    return None


def _settles(w: Work) -> str | None:
    """The verdict claim the stored decision of ``w`` settles (None: a watchdog escalation)."""
    return None if w.verdict is None else verdict_key(w.job, w.verdict.event_id)


def on_job(state, seq, w: Work, inp: Reply, now) -> Out:
    rec: JobRecord = inp.value
    v = w.verdict
    assert v is not None
    if rec.status in ENDED:
        # an ended job's lingering anomalies (silence of its dead ranks…) decide nothing
        return fold(state, seq, w, None, f"job is {rec.status}: no further decisions",
                    inp.wall_ns)
    policy = state.config.policy
    dec = pol.decide(v, rec, policy, restarts_pods=state.restarts_pods,
                     requeues=state.requeues_jobs)
    if dec is None:
        return count(done(state, seq), "ignored"), [store("audit", w.job, {
            "type": "ignored", "verdict_id": v.event_id, "fault_class": v.fault_class,
            "reason": "verdict names no job"}),
            store("settle", verdict_key(w.job, v.event_id), FOLDED, wait=False)]
    fault_gen = plan.fault_generation(v, plan.with_defaults(rec, policy))
    # the verdict's own decision id: decided again after a restart, it is the same decision
    dec = stamp(dec, inp.wall_ns).model_copy(update={"event_id": decision_id(v.event_id)})
    state, w = update(state, seq, record=rec, decision=dec, fault_gen=fault_gen)
    if dec.action == "none":
        # a flag for an incident that already has its decision adds nothing
        return state, [store("claimed_by", f"{w.job}:g{fault_gen}", reply=("flag_owner", seq))]
    if gate.needs_gate(state, w.decision):  # node-taking: the fleet breaker first
        return gate.ask(state, seq, "claim")
    return state, [claim_call(w.decision, ("claim", seq))]


def claim_call(dec: Decision | None, tag: tuple) -> Call:
    assert dec is not None
    return store("claim", dec.idempotency_key, owner_of(dec), reply=tag)


def on_flag_owner(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return fold(state, seq, w, inp.value,
                    f"generation already decided ({owner_action(inp.value)})", inp.wall_ns)
    return state, [claim_call(w.decision, ("claim", seq))]


def on_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    owner = inp.value
    if owner is None or (w.decision is not None and owner == owner_of(w.decision)):
        # claimed now, or by this chain's own try whose reply was lost (a retried claim)
        return commit(state, seq, now, inp.wall_ns)
    assert w.verdict is not None and w.record is not None and w.decision is not None
    held = owner_action(owner)
    # compare the table's action, not the escalated one: a budget or loop stop computed for an
    # incident that already has its decision is not a new incident
    policy = state.config.policy
    table_action, _ = plan.table_action(w.verdict, plan.with_defaults(w.record, policy), policy)
    if not stronger(table_action, held):
        why = f"generation already decided ({held})"
        pods, _ = plan.pod_restart(w.decision, w.verdict, state.restarts_pods, policy)
        if pods and w.decision.execute and held == w.decision.action:
            return _fold_then_pods(state, seq, w, owner, why, inp.wall_ns, pods)
        return fold(state, seq, w, owner, why, inp.wall_ns)
    dec = w.decision
    dec = dec.model_copy(update={
        "idempotency_key": f"{dec.idempotency_key}:{dec.action}",
        "reason": f"{dec.reason}; stronger than the {held} already decided for this generation"})
    state, w = update(state, seq, decision=dec)
    return state, [claim_call(dec, ("escalation_claim", seq))]


def _fold_then_pods(state: RemediatorState, seq: int, w: Work, owner: str, why: str,
                    wall_ns: int, pods: list[str]) -> Out:
    """A lost launcher found after its ranks' silence was decided (a ``restart_workers`` of
    the same generation, e.g. a job with a short hang timeout): the verdict is folded, and the
    pod restart that decision lacked is carried out for it (same key: once)."""
    _, audit = fold(state, seq, w, owner, why + f"; its pod restart on {', '.join(pods)} is "
                                                "carried out for it", wall_ns)
    assert w.decision is not None
    held = w.decision.model_copy(update={"event_id": owner.rsplit("/", 1)[0]})
    return _start_node_steps(count(state, "folded"), seq, "restart_pod", pods, audit,
                             decision=held)


def on_escalation_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return fold(state, seq, w, inp.value,
                    f"escalation already decided ({owner_action(inp.value)})", inp.wall_ns)
    return commit(state, seq, now, inp.wall_ns)


# ---- commit: generation, record, audit, publish, watchdog ------------------------------------------
def commit(state: RemediatorState, seq: int, now: float, wall_ns: int) -> Out:
    """Apply the claimed decision of work ``seq``: job record (action mode), audit, publish."""
    w = state.work[seq]
    dec = w.decision
    assert dec is not None and dec.job
    if dec.mode == "action" and dec.action != "none":
        rec = w.record
        if rec is not None and rec.generation_by and rec.generation_by == dec.event_id:
            # this decision's own bump landed in a first try that died before its commit (a
            # resumed chain): the generation in force is the one it made; no second bump
            state, w = update(state, seq, expected=rec.generation - 1, tries=0)
            return on_bump(state, seq, w, Reply(("bump", seq), rec.generation,
                                                wall_ns=wall_ns), now)
        state, w = update(state, seq, expected=dec.generation - 1, tries=0)
        return state, [store("bump_generation", dec.job, w.expected, dec.event_id,
                             reply=("bump", seq))]
    return _finish(state, seq, now, wall_ns)


def on_bump(state, seq, w: Work, inp: Reply, now) -> Out:
    """Bump from ``expected``; when another decision moved the generation meanwhile, bump from
    the generation in force (5 tries, then the generation in force is taken)."""
    got, tries = int(inp.value), w.tries + 1
    if got != w.expected + 1 and tries < 5:
        state, w = update(state, seq, expected=got, tries=tries)
        return state, [store("bump_generation", w.job, got, w.decision.event_id
                             if w.decision is not None else "", reply=("bump", seq))]
    assert w.decision is not None and w.record is not None
    dec = w.decision.model_copy(update={"generation": got})
    state, w = update(state, seq, decision=dec, tries=tries)
    v = w.verdict
    policy = state.config.policy
    last_fault = None if v is None else progress.next_last_fault(
        v, plan.with_defaults(w.record, policy), w.fault_gen, policy.progress_s)
    world: dict[str, Any] = {}
    if dec.members:
        new_nodes = {m.node for m in dec.members}
        world = dict(members=[m.model_dump() for m in dec.members], world_size=dec.world_size,
                     spare_nodes=[s for s in w.record.spare_nodes if s not in new_nodes])
    pending = None
    if dec.execute and dec.action in policy_table.RECOVERY_ACTIONS:
        pending = {**dec.to_dict(), "deadline_ns": inp.wall_ns
                   + int(state.config.decision_timeout_s * 1e9)}
    return state, [store("commit_decision", w.job, retries_used=dec.retries_used,
                         last_decision=brief(dec, w.fault_gen), last_fault=last_fault,
                         stopped=dec.action == "stop_job_notify_user",
                         pending_decision=pending, outbox=dec.to_dict(), **world,
                         settles=_settles(w), reply=("commit", seq))]


def on_commit(state, seq, w: Work, inp: Reply, now) -> Out:
    return _finish(state, seq, now, inp.wall_ns, in_outbox=True)


def on_outbox_put(state, seq, w: Work, inp: Reply, now) -> Out:
    return _finish(state, seq, now, inp.wall_ns, in_outbox=True)


def publish_decision(state: RemediatorState, dec: Decision) -> Out:
    """Publish ``dec`` until a stream stored it (``Publish(stored=True)``); its reply
    ``("published", job, decision id)`` drops it from the outbox (``on_published``)."""
    assert dec.job
    state = replace(state, publishing=state.publishing | {dec.event_id})
    return state, [Publish(subjects.job(dec.job, "decision"), dec, stored=True,
                           reply=("published", dec.job, dec.event_id))]


def on_published(state: RemediatorState, inp: Reply) -> Out:
    """A stored publish of a decision came back: stored → out of the outbox; not stored → it
    stays there, and the next outbox sweep publishes it again."""
    _, job, did = inp.tag
    state = replace(state, publishing=state.publishing - {did})
    if inp.error:
        return state, [Log(logging.WARNING, f"{job}: decision {did} not stored yet "
                                            f"({inp.error}); publishing it again")]
    return count_outbox(state, "stored"), [store("outbox_done", job, did,
                                                 reply=("outbox_done", job))]


def _finish(state: RemediatorState, seq: int, now: float, wall_ns: int,
            in_outbox: bool = False) -> Out:
    """Audit and publish the decision of work ``seq``; first into the outbox when the commit
    did not put it there (observe mode, a flag): a decision is published only from there."""
    w = state.work[seq]
    dec = w.decision
    assert dec is not None
    job = w.job
    if not in_outbox:
        return state, [store("outbox_put", job, dec.to_dict(), settles=_settles(w),
                             reply=("outbox_put", seq))]
    state = count(state, "decisions")
    state, publish = publish_decision(state, dec)
    effects: list[Effect] = [
        store("audit", job, {"type": "decision", "decision_id": dec.event_id,
                             "action": dec.action, "generation": dec.generation,
                             "execute": dec.execute, "mode": dec.mode,
                             "idempotency_key": dec.idempotency_key, "reason": dec.reason,
                             "verdict_id": dec.verdict_id, "fault_class": dec.fault_class,
                             "ranks": dec.ranks, "nodes": dec.nodes,
                             "world_size": dec.world_size, "ts": dec.ts,
                             "decision": dec.to_dict()}),
        *publish,
        Log(logging.INFO, f"{job}: {dec.action} (generation {dec.generation}, "
                          f"execute={dec.execute}): {dec.reason}")]
    if dec.execute and dec.action in policy_table.RECOVERY_ACTIONS:
        state = replace(state, pending={**state.pending, job: Pending(
            dec, now + state.config.decision_timeout_s)})
    elif dec.execute:  # a stop supersedes a pending recovery; a flag (none) does not
        state = without_pending(state, job)
    steps = _node_steps(state, dec, w.verdict)
    if steps is not None:
        return _start_node_steps(state, seq, steps[0], steps[1], effects)
    return done(state, seq), effects


# ---- the node controller's part of a decision: exclusion or pod restart node by node; a stop ----
#: ``Work.node_step`` → the action its ``action.result`` reports (None: the decision's own) and
#: the prefix of that result's detail (None: the controller's detail alone). The step is also the
#: controller method called and the middle of the claim key ``<key>:<step>:<node>``; ``stop``
#: (an executed stop decision, under a controller that ``cancels_jobs``: Slurm's ``scancel``)
#: is done once for the job, target ``JOB_TARGET``, claim key ``<key>:stop``.
NODE_STEPS: dict[str, tuple[str | None, str | None]] = {
    "exclude": ("exclude_node_and_requeue", None),
    "restart_pod": (None, "restart_pod"),
    "stop": (None, None),
}
#: the one target of a job-wide step (``stop``): the job's allocation, no node of it
JOB_TARGET = ("",)


#: what a node step's claim holds once the controller answered (``done:<decision id>``)
DONE = "done:"


def _node_key(w: Work, node: str) -> str:
    assert w.decision is not None
    return f"{w.decision.idempotency_key}:{w.node_step}" + (f":{node}" if node else "")


def _node_claim(w: Work, seq: int) -> Call:
    assert w.decision is not None
    node = w.nodes[0]
    return store("claim", _node_key(w, node), w.decision.event_id,
                 reply=("node_claim", seq, node))


def _start_node_steps(state: RemediatorState, seq: int, step: str, nodes, effects: list[Effect],
                      **changes) -> Out:
    state, w = update(state, seq, node_step=step, nodes=tuple(nodes), **changes)
    return state, effects + [_node_claim(w, seq)]


def _next_node(state: RemediatorState, seq: int, effects: list[Effect]) -> Out:
    state, w = update(state, seq, nodes=state.work[seq].nodes[1:])
    if not w.nodes:
        return done(state, seq), effects
    return state, effects + [_node_claim(w, seq)]


def on_node_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    """Claimed: ask the controller in the background (``wait=False``: a scheduler's drain can
    take seconds, and the decision is committed and published already, so other jobs'
    inputs need not wait for it). Held by this decision's own id in a resumed chain
    (``Work.resumed``): begun by a process that died before the controller answered, so asked
    again (every controller re-reads the scheduler first); held otherwise (``done:…``, another
    decision, this decision in a live chain): already carried out."""
    dec, node = w.decision, inp.tag[2]
    assert dec is not None
    if inp.value is not None and not (w.resumed and inp.value == dec.event_id):
        return _next_node(state, seq, [])
    if w.node_step == "exclude":
        args: tuple = (node, w.job, dec.reason)
    elif w.node_step == "stop":  # scoped to its generation: a later one is a new run
        args = (w.job, dec.reason, dec.generation)
    else:
        # only a pod older than the fault is the failed one: a replacement made since is left
        onset = w.verdict.detail.get("last_beat_ns") if w.verdict is not None else None
        before_ns = (onset if isinstance(onset, int) and onset > 0
                     else dec.fault_ts or dec.detected_ts)
        args = (node, w.job, before_ns)
    return state, [Call("controller", w.node_step, args, reply=("node_step", seq, node),
                        wait=False)]


def on_node_step(state, seq, w: Work, inp: Reply, now) -> Out:
    """The controller's ``ControllerResult`` (or its error: a failed drain or pod restart) →
    ``action.result``; a failure is audited (``controller_failed``) and does not escalate here:
    an excluded node's job re-ranks without it anyway, a pod not restarted is the watchdog's."""
    assert w.decision is not None
    action, prefix = NODE_STEPS[w.node_step]
    effects = _controller_result(state, w, inp, action or w.decision.action, prefix)
    # carried out (or failed and audited): a resumed chain does not ask again
    effects.append(store("settle", _node_key(w, inp.tag[2]), DONE + w.decision.event_id,
                         wait=False))
    return _next_node(state, seq, effects)


def _controller_result(state: RemediatorState, w: Work, inp: Reply, action: str,
                       step: str | None = None) -> list[Effect]:
    """The effects of a controller call's reply (``ControllerResult`` or an error) on node
    ``inp.tag[2]``: an ``action.result`` of ``action`` (executor ``controller:<name>``; its
    detail prefixed with ``step`` when given) and, when it failed, a ``controller_failed``
    audit record (left to the watchdog: training does not resume)."""
    node, dec = inp.tag[2], w.decision
    assert dec is not None
    if inp.error:
        ok, detail = False, inp.error
    else:
        ok, detail = bool(inp.value.ok), str(inp.value.detail)
    effects: list[Effect] = [Log(logging.INFO if ok else logging.WARNING,
                                 f"{w.job}: {action} on {node or '-'} by controller:"
                                 f"{state.controller}: {'ok' if ok else 'FAILED'}: "
                                 f"{step + ' ' if step else ''}{detail}"[:1000])]
    if not ok:
        effects.append(store("audit", w.job, {
            "type": "controller_failed", "decision_id": dec.event_id, "node": node,
            "controller": state.controller, **({"step": step} if step else {}),
            "reason": detail, "ts": inp.wall_ns}))
    effects.append(Publish(subjects.job(w.job, "action"), ActionResult(
        job=w.job, node=node or None, trace=dec.child_trace(), decision_id=dec.event_id,
        idempotency_key=dec.idempotency_key, executor=f"controller:{state.controller}",
        action=action, ok=ok, detail=f"{step} {node}: {detail}" if step else detail,
        **({"ts": inp.wall_ns} if inp.wall_ns else {}))))
    return effects

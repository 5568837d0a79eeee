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
   not escalate: the job re-ranks without the node anyway.

A stage whose call failed (Valkey gone) ends that work with a ``Log``: nothing is published
for a decision whose record was not written.

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
import os
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard import schemas
from trainguard.reducer import Call, Effect, Input, Log, Publish, Received, Reply, Tick, store
from trainguard.schemas import ActionResult, Decision, JobRecord, TrainingResumed, Verdict, subjects
from trainguard.schemas.vocabulary import signature, stronger

from . import policy as pol

ENDED = ("stopped", "finished", "failed")


@dataclass
class RemediatorConfig:
    """Remediator settings.

    * ``decision_timeout_s`` — seconds an executed recovery decision may wait for
      ``recovery.resumed`` before the watchdog escalates (env ``TG_DECISION_TIMEOUT_S``,
      default 60 s: well above the worst measured full restart on CPU, ≈ 11 s to spawn 4 gloo
      ranks, as measured with gloo);
    * ``controller`` — node controller for exclusions: ``local`` (state store only), ``slurm``
      or ``kubernetes`` (env ``TG_NODE_CONTROLLER``, default ``local``);
    * ``policy`` — the ``remediator.policy.Policy`` (default ``DEFAULT_POLICY``).
    """

    decision_timeout_s: float = field(
        default_factory=lambda: float(os.environ.get("TG_DECISION_TIMEOUT_S", "60")))
    controller: str = field(
        default_factory=lambda: os.environ.get("TG_NODE_CONTROLLER", "local"))
    policy: pol.Policy = field(default_factory=lambda: pol.DEFAULT_POLICY)


@dataclass(frozen=True)
class Pending:
    """An executed recovery decision the watchdog waits on; ``deadline``: service clock, s."""

    decision: Decision
    deadline: float


@dataclass(frozen=True)
class Work:
    """One verdict's (or one escalation's) chain in flight.

    ``verdict`` — None for a watchdog escalation; ``prev``/``why`` — the escalated decision and
    why; ``record`` — the job record read; ``decision`` — as claimed so far; ``fault_gen`` — the
    generation the fault happened in; ``expected``/``tries`` — the generation bump;
    ``nodes`` — nodes still to exclude."""

    job: str
    verdict: Verdict | None = None
    prev: Decision | None = None
    why: str = ""
    record: JobRecord | None = None
    decision: Decision | None = None
    fault_gen: int = 0
    expected: int = 0
    tries: int = 0
    nodes: tuple[str, ...] = ()


def _zero_counts() -> dict[str, int]:
    return {"decisions": 0, "folded": 0, "escalations": 0, "ignored": 0}


@dataclass(frozen=True)
class RemediatorState:
    """``config`` — the live ``RemediatorConfig`` (read at each step); ``controller`` — the node
    controller's name (``action.result.executor = controller:<name>``); ``pending`` — job →
    ``Pending``; ``work`` — chains in flight by sequence number; ``armed`` — the pending
    decisions of the job records were re-armed (first ``Tick``)."""

    config: RemediatorConfig = field(default_factory=RemediatorConfig)
    controller: str = "local"
    pending: dict[str, Pending] = field(default_factory=dict)
    work: dict[int, Work] = field(default_factory=dict)
    seq: int = 0
    counts: dict[str, int] = field(default_factory=_zero_counts)
    armed: bool = False


Out = tuple[RemediatorState, list[Effect]]


def step(state: RemediatorState, inp: Input, now: float) -> Out:
    """One input: a verdict, action result or resume (``Received``), a ``Tick``, a ``Reply``."""
    if isinstance(inp, Received):
        ev = inp.event
        if isinstance(ev, Verdict):
            return _on_verdict(state, inp.subject, ev, inp.wall_ns)
        if isinstance(ev, ActionResult):
            return _on_action(state, ev, inp.wall_ns)
        if isinstance(ev, TrainingResumed):
            return _on_resumed(state, ev)
        return state, []
    if isinstance(inp, Tick):
        return _on_tick(state, now, inp.wall_ns)
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple) and inp.tag:
        if inp.tag[0] in ("rearm_jobs", "rearm_job"):
            return _on_rearm(state, inp, now)
        seq = inp.tag[1] if len(inp.tag) > 1 else None
        w = state.work.get(seq)  # type: ignore[arg-type]
        handler = _STAGES.get(inp.tag[0])
        if w is None or handler is None:
            return state, []
        if inp.error and inp.tag[0] != "exclude":
            return _done(state, seq), [Log(logging.WARNING, (
                f"{w.job}: {inp.tag[0]} failed ({inp.error}); "
                + (f"verdict {w.verdict.event_id}" if w.verdict else "watchdog escalation")
                + " not carried further"))]
        return handler(state, seq, w, inp, now)
    return state, []


# ---- helpers ------------------------------------------------------------------------------------
def _start(state: RemediatorState, w: Work) -> tuple[RemediatorState, int]:
    seq = state.seq + 1
    return replace(state, seq=seq, work={**state.work, seq: w}), seq


def _set(state: RemediatorState, seq: int, **changes: Any) -> tuple[RemediatorState, Work]:
    w = replace(state.work[seq], **changes)
    return replace(state, work={**state.work, seq: w}), w


def _done(state: RemediatorState, seq: int) -> RemediatorState:
    return replace(state, work={k: v for k, v in state.work.items() if k != seq})


def _count(state: RemediatorState, what: str) -> RemediatorState:
    return replace(state, counts={**state.counts, what: state.counts.get(what, 0) + 1})


def _without_pending(state: RemediatorState, job: str) -> RemediatorState:
    return replace(state, pending={k: v for k, v in state.pending.items() if k != job})


def _stamp(dec: Decision, wall_ns: int) -> Decision:
    """The decision with ``ts`` = the input's Unix ns (kept when the input gave none)."""
    return dec.model_copy(update={"ts": wall_ns}) if wall_ns else dec


def _owner(dec: Decision) -> str:
    """Claim owner string: ``<decision id>/<action>`` (the action is read back when folding)."""
    return f"{dec.event_id}/{dec.action}"


def _owner_action(owner: str) -> str:
    return owner.rsplit("/", 1)[-1] if "/" in owner else "restart_workers"


def _brief(dec: Decision, fault_gen: int) -> dict[str, Any]:
    return {"id": dec.event_id, "action": dec.action, "generation": dec.generation,
            "fault_generation": fault_gen, "key": dec.idempotency_key, "execute": dec.execute,
            "ts": dec.ts}


def _fold(state: RemediatorState, seq: int, w: Work, owner: str | None, why: str,
          wall_ns: int) -> Out:
    v = w.verdict
    assert v is not None
    return _count(_done(state, seq), "folded"), [store("audit", w.job, {
        "type": "folded", "verdict_id": v.event_id, "fault_class": v.fault_class,
        "culprit": v.culprit.model_dump(), "into": owner or "", "reason": why, "ts": wall_ns})]


# ---- verdicts -----------------------------------------------------------------------------------
def _on_verdict(state: RemediatorState, subject: str, ev: Verdict, wall_ns: int) -> Out:
    try:
        job = ev.job or subjects.parse(subject)["name"]
    except ValueError:
        return state, []
    v = ev if ev.job == job else ev.model_copy(update={"job": job})
    state, seq = _start(state, Work(job, verdict=v))
    return state, [store("claim", f"{job}:verdict:{v.event_id}", "remediator",
                         reply=("verdict_claim", seq))]


def _on_verdict_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return _fold(state, seq, w, None, "this verdict was already handled", inp.wall_ns)
    return state, [store("job", w.job, reply=("job", seq))]


def _on_job(state, seq, w: Work, inp: Reply, now) -> Out:
    rec: JobRecord = inp.value
    v = w.verdict
    assert v is not None
    if rec.status in ENDED:
        # an ended job's lingering anomalies (silence of its dead ranks…) decide nothing
        return _fold(state, seq, w, None, f"job is {rec.status}: no further decisions",
                     inp.wall_ns)
    policy = state.config.policy
    dec = pol.decide(v, rec, policy)
    if dec is None:
        return _count(_done(state, seq), "ignored"), [store("audit", w.job, {
            "type": "ignored", "verdict_id": v.event_id, "fault_class": v.fault_class,
            "reason": "verdict names no job"})]
    fault_gen = pol.fault_generation(v, pol.with_defaults(rec, policy))
    state, w = _set(state, seq, record=rec, decision=_stamp(dec, inp.wall_ns),
                    fault_gen=fault_gen)
    if dec.action == "none":
        # a flag for an incident that already has its decision adds nothing
        return state, [store("claimed_by", f"{w.job}:g{fault_gen}", reply=("flag_owner", seq))]
    return state, [_claim(w.decision, ("claim", seq))]


def _claim(dec: Decision | None, tag: tuple) -> Call:
    assert dec is not None
    return store("claim", dec.idempotency_key, _owner(dec), reply=tag)


def _on_flag_owner(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return _fold(state, seq, w, inp.value,
                     f"generation already decided ({_owner_action(inp.value)})", inp.wall_ns)
    return state, [_claim(w.decision, ("claim", seq))]


def _on_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    owner = inp.value
    if owner is None:
        return _commit(state, seq, now, inp.wall_ns)
    assert w.verdict is not None and w.record is not None and w.decision is not None
    held = _owner_action(owner)
    # compare the table's action, not the escalated one: a budget or loop stop computed for an
    # incident that already has its decision is not a new incident
    policy = state.config.policy
    table_action, _ = pol.table_action(w.verdict, pol.with_defaults(w.record, policy), policy)
    if not stronger(table_action, held):
        return _fold(state, seq, w, owner, f"generation already decided ({held})", inp.wall_ns)
    dec = w.decision
    dec = dec.model_copy(update={
        "idempotency_key": f"{dec.idempotency_key}:{dec.action}",
        "reason": f"{dec.reason}; stronger than the {held} already decided for this generation"})
    state, w = _set(state, seq, decision=dec)
    return state, [_claim(dec, ("escalation_claim", seq))]


def _on_escalation_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return _fold(state, seq, w, inp.value,
                     f"escalation already decided ({_owner_action(inp.value)})", inp.wall_ns)
    return _commit(state, seq, now, inp.wall_ns)


# ---- commit: generation, record, audit, publish, watchdog ------------------------------------------
def _commit(state: RemediatorState, seq: int, now: float, wall_ns: int) -> Out:
    """Apply the claimed decision of work ``seq``: job record (action mode), audit, publish."""
    dec = state.work[seq].decision
    assert dec is not None and dec.job
    if dec.mode == "action" and dec.action != "none":
        state, w = _set(state, seq, expected=dec.generation - 1, tries=0)
        return state, [store("bump_generation", dec.job, w.expected, reply=("bump", seq))]
    return _finish(state, seq, now, wall_ns)


def _on_bump(state, seq, w: Work, inp: Reply, now) -> Out:
    """Bump from ``expected``; when another decision moved the generation meanwhile, bump from
    the generation in force (5 tries, then the generation in force is taken)."""
    got, tries = int(inp.value), w.tries + 1
    if got != w.expected + 1 and tries < 5:
        state, w = _set(state, seq, expected=got, tries=tries)
        return state, [store("bump_generation", w.job, got, reply=("bump", seq))]
    assert w.decision is not None and w.record is not None
    dec = w.decision.model_copy(update={"generation": got})
    state, w = _set(state, seq, decision=dec, tries=tries)
    v = w.verdict
    last_fault = None if v is None else {
        "fault_class": v.fault_class, "step": pol.fault_step(v), "signature": signature(v),
        "generation": w.fault_gen, "ts": v.first_ts or v.ts}
    world: dict[str, Any] = {}
    if dec.members:
        new_nodes = {m.node for m in dec.members}
        world = dict(members=[m.model_dump() for m in dec.members], world_size=dec.world_size,
                     spare_nodes=[s for s in w.record.spare_nodes if s not in new_nodes])
    pending = None
    if dec.execute and dec.action in pol.RECOVERY_ACTIONS:
        pending = {**dec.to_dict(), "deadline_ns": inp.wall_ns
                   + int(state.config.decision_timeout_s * 1e9)}
    return state, [store("commit_decision", w.job, retries_used=dec.retries_used,
                         last_decision=_brief(dec, w.fault_gen), last_fault=last_fault,
                         stopped=dec.action == "stop_job_notify_user",
                         pending_decision=pending, **world, reply=("commit", seq))]


def _on_commit(state, seq, w: Work, inp: Reply, now) -> Out:
    return _finish(state, seq, now, inp.wall_ns)


def _finish(state: RemediatorState, seq: int, now: float, wall_ns: int) -> Out:
    w = state.work[seq]
    dec = w.decision
    assert dec is not None
    job = w.job
    state = _count(state, "decisions")
    effects: list[Effect] = [
        store("audit", job, {"type": "decision", "decision_id": dec.event_id,
                             "action": dec.action, "generation": dec.generation,
                             "execute": dec.execute, "mode": dec.mode,
                             "idempotency_key": dec.idempotency_key, "reason": dec.reason,
                             "verdict_id": dec.verdict_id, "fault_class": dec.fault_class,
                             "ranks": dec.ranks, "nodes": dec.nodes,
                             "world_size": dec.world_size, "ts": dec.ts,
                             "decision": dec.to_dict()}),
        Publish(subjects.job(job, "decision"), dec),
        Log(logging.INFO, f"{job}: {dec.action} (generation {dec.generation}, "
                          f"execute={dec.execute}): {dec.reason}")]
    if dec.execute and dec.action in pol.RECOVERY_ACTIONS:
        state = replace(state, pending={**state.pending, job: Pending(
            dec, now + state.config.decision_timeout_s)})
    elif dec.execute:  # a stop supersedes a pending recovery; a flag (none) does not
        state = _without_pending(state, job)
    if dec.execute and dec.action == "exclude_node_and_requeue" and dec.nodes:
        state, w = _set(state, seq, nodes=tuple(dec.nodes))
        return state, effects + [_exclude_claim(w, seq)]
    return _done(state, seq), effects


# ---- exclusion through the controller ----------------------------------------------------------
def _exclude_claim(w: Work, seq: int) -> Call:
    assert w.decision is not None
    node = w.nodes[0]
    return store("claim", f"{w.decision.idempotency_key}:exclude:{node}", w.decision.event_id,
                 reply=("exclude_claim", seq, node))


def _next_node(state: RemediatorState, seq: int, effects: list[Effect]) -> Out:
    state, w = _set(state, seq, nodes=state.work[seq].nodes[1:])
    if not w.nodes:
        return _done(state, seq), effects
    return state, effects + [_exclude_claim(w, seq)]


def _on_exclude_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:  # this exclusion was already carried out
        return _next_node(state, seq, [])
    dec = w.decision
    assert dec is not None
    # in the background (wait=False): a scheduler's drain can take seconds, and the decision
    # is committed and published already, so other jobs' inputs need not wait for it
    return state, [Call("controller", "exclude", (inp.tag[2], w.job, dec.reason),
                        reply=("exclude", seq, inp.tag[2]), wait=False)]


def _on_exclude(state, seq, w: Work, inp: Reply, now) -> Out:
    """The controller's ``ControllerResult`` (or its error: a failed drain) → action.result."""
    node, dec = inp.tag[2], w.decision
    assert dec is not None
    if inp.error:
        ok, detail = False, inp.error
    else:
        ok, detail = bool(inp.value.ok), str(inp.value.detail)
    effects: list[Effect] = []
    if not ok:
        effects.append(store("audit", w.job, {
            "type": "controller_failed", "decision_id": dec.event_id, "node": node,
            "controller": state.controller, "reason": detail, "ts": inp.wall_ns}))
    effects.append(Publish(subjects.job(w.job, "action"), ActionResult(
        job=w.job, node=node, trace=dec.child_trace(), decision_id=dec.event_id,
        idempotency_key=dec.idempotency_key, executor=f"controller:{state.controller}",
        action="exclude_node_and_requeue", ok=ok, detail=detail,
        **({"ts": inp.wall_ns} if inp.wall_ns else {}))))
    return _next_node(state, seq, effects)


# ---- watchdog -------------------------------------------------------------------------------------
def _on_resumed(state: RemediatorState, ev: TrainingResumed) -> Out:
    p = state.pending.get(ev.job or "")
    if not ev.job or p is None or ev.generation < p.decision.generation:
        return state, []
    return _without_pending(state, ev.job), [store("clear_pending", ev.job)]


def _on_action(state: RemediatorState, ev: ActionResult, wall_ns: int) -> Out:
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


def _on_tick(state: RemediatorState, now: float, wall_ns: int) -> Out:
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
    state, seq = _start(_without_pending(state, job), Work(job, prev=p.decision, why=why))
    return state, [store("job", job, reply=("wd_job", seq))]


def _on_wd_job(state, seq, w: Work, inp: Reply, now) -> Out:
    rec: JobRecord = inp.value
    prev = w.prev
    assert prev is not None
    if rec.generation > prev.generation:
        return _done(state, seq), []  # a later decision superseded it
    dec = pol.escalate(prev, rec, w.why, state.config.policy)
    if dec is None:
        return _done(state, seq), [store("clear_pending", w.job)]
    state, w = _set(state, seq, record=rec, decision=_stamp(dec, inp.wall_ns),
                    fault_gen=prev.generation)
    return state, [_claim(w.decision, ("wd_claim", seq))]


def _on_wd_claim(state, seq, w: Work, inp: Reply, now) -> Out:
    if inp.value is not None:
        return _done(state, seq), []
    return _commit(_count(state, "escalations"), seq, now, inp.wall_ns)


# ---- re-arm after a restart -----------------------------------------------------------------------
def _on_rearm(state: RemediatorState, inp: Reply, now: float) -> Out:
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


_STAGES = {
    "verdict_claim": _on_verdict_claim, "job": _on_job, "flag_owner": _on_flag_owner,
    "claim": _on_claim, "escalation_claim": _on_escalation_claim, "bump": _on_bump,
    "commit": _on_commit, "exclude_claim": _on_exclude_claim, "exclude": _on_exclude,
    "wd_job": _on_wd_job, "wd_claim": _on_wd_claim,
}

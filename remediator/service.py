"""The remediator service: verdict → decision, with idempotency, audit, and a watchdog.

``python -m trainguard.remediator --nats-url … --redis-url …`` (or env ``NATS_URL``/``REDIS_URL``).

Subscribes ``tg.job.*.verdict``, ``tg.job.*.action`` and ``tg.job.*.recovery``. For each verdict:
reads the job record (``StateStore.job``), calls the pure ``policy.decide``, then

1. claims ``<job>:verdict:<verdict id>`` (the same verdict delivered twice is decided once);
2. claims the decision's idempotency key ``<job>:g<fault generation>`` in the state store; if
   another decision holds it, the verdict is *folded* (audit record, nothing published) unless
   the table gives a strictly stronger action (a node lost after a rank crash of the same
   generation): that one claims ``<job>:g<gen>:<action>`` and joins the next generation;
3. in action mode bumps the job's generation, records ``retries_used``, ``last_fault``,
   ``members``/``world_size``/``spare_nodes`` for an exclusion, ``status=stopped`` for a stop,
   and ``pending_decision`` for the watchdog; in observe mode changes no job field;
4. appends the decision and its reason to the job's audit trail, publishes it on
   ``tg.job.<job>.decision``;
5. for an executed exclusion, drains the node(s) through the configured node controller
   (``trainguard.controllers``) and publishes its ``action.result``; a failed drain is audited
   (``controller_failed``) but does not escalate: the job re-ranks without the node anyway.

Watchdog: an executed recovery decision not followed by ``recovery.resumed`` with
``generation >= decision.generation`` within ``decision_timeout_s``, or answered by a failing
``action.result``, escalates along ``policy.WATCHDOG_LADDER`` (restart → exclude → stop), so no
job waits forever. Pending decisions live in the job record (``pending_decision``), so a
restarted remediator re-arms them and, because every claim is in Redis, never repeats one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard import schemas
from trainguard.schemas import (
    ActionResult,
    Decision,
    Event,
    JobRecord,
    TrainingResumed,
    Verdict,
    subjects,
)
from trainguard.schemas.vocabulary import signature, stronger
from trainguard.controllers import NodeController, make_controller
from trainguard.service import Service, ServiceConfig

from . import policy as pol

log = logging.getLogger("remediator")


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


class Remediator(Service):
    """Turns verdicts into decisions (see the module docstring)."""

    name = "remediator"

    def __init__(self, config: ServiceConfig | None = None,
                 rconfig: RemediatorConfig | None = None,
                 controller: NodeController | None = None):
        super().__init__(config)
        self.rconfig = rconfig or RemediatorConfig()
        self._controller = controller
        self._locks: dict[str, asyncio.Lock] = {}
        #: job → (pending decision, deadline in monotonic seconds)
        self.pending: dict[str, tuple[Decision, float]] = {}
        self.counts = {"decisions": 0, "folded": 0, "escalations": 0, "ignored": 0}

    # ---- wiring -------------------------------------------------------------------------------
    def subscriptions(self):
        return [("tg.job.*.verdict", self.on_verdict),
                ("tg.job.*.action", self.on_action),
                ("tg.job.*.recovery", self.on_recovery)]

    async def setup(self) -> None:
        assert self.state is not None
        if self._controller is None:
            self._controller = make_controller(self.rconfig.controller, self.state)
        await self._rearm()

    def health(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "pending": sorted(self.pending),
                "controller": self.rconfig.controller}

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    # ---- verdicts -----------------------------------------------------------------------------
    async def on_verdict(self, subject: str, ev: Event) -> None:
        if not isinstance(ev, Verdict):
            return
        job = ev.job or subjects.parse(subject)["name"]
        ev.job = job
        async with self._lock(job):
            await self._handle_verdict(ev)

    async def _handle_verdict(self, v: Verdict) -> None:
        st = self.state
        assert st is not None
        job = v.job or ""
        first = await st.claim(f"{job}:verdict:{v.event_id}", "remediator")
        if first is not None:
            await self._fold(v, None, "this verdict was already handled")
            return
        state = await st.job(job)
        if state.status in ("stopped", "finished", "failed"):
            # an ended job's lingering anomalies (silence of its dead ranks…) decide nothing
            await self._fold(v, None, f"job is {state.status}: no further decisions")
            return
        dec = pol.decide(v, state, self.rconfig.policy)
        if dec is None:
            self.counts["ignored"] += 1
            await st.audit(job, {"type": "ignored", "verdict_id": v.event_id,
                                 "fault_class": v.fault_class, "reason": "verdict names no job"})
            return
        view = pol.with_defaults(state, self.rconfig.policy)
        fault_gen = pol.fault_generation(v, view)
        if dec.action == "none":
            # a flag for an incident that already has its decision adds nothing
            owner = await st.claimed_by(f"{job}:g{fault_gen}")
            if owner is not None:
                await self._fold(v, owner, f"generation already decided ({_owner_action(owner)})")
                return
        owner = await st.claim(dec.idempotency_key, _owner(dec))
        if owner is not None:
            held = _owner_action(owner)
            # compare the table's action, not the escalated one: a budget or loop stop computed
            # for an incident that already has its decision is not a new incident
            table_action, _ = pol.table_action(v, view, self.rconfig.policy)
            if not stronger(table_action, held):
                await self._fold(v, owner, f"generation already decided ({held})")
                return
            dec.idempotency_key = f"{dec.idempotency_key}:{dec.action}"
            dec.reason += f"; stronger than the {held} already decided for this generation"
            owner = await st.claim(dec.idempotency_key, _owner(dec))
            if owner is not None:
                await self._fold(v, owner, f"escalation already decided ({_owner_action(owner)})")
                return
        await self._commit(dec, v, state, fault_gen)

    async def _fold(self, v: Verdict, owner: str | None, why: str) -> None:
        self.counts["folded"] += 1
        assert self.state is not None
        await self.state.audit(v.job or "", {
            "type": "folded", "verdict_id": v.event_id, "fault_class": v.fault_class,
            "culprit": v.culprit.model_dump(), "into": owner or "", "reason": why,
            "ts": time.time_ns()})

    async def _commit(self, dec: Decision, v: Verdict | None, state: JobRecord,
                      fault_gen: int) -> None:
        """Apply a claimed decision: job state (action mode), audit, publish, controller."""
        st = self.state
        assert st is not None and dec.job
        job = dec.job
        if dec.mode == "action" and dec.action != "none":
            dec.generation = await self._bump(job, dec.generation - 1)
            last_fault = None if v is None else {
                "fault_class": v.fault_class, "step": pol.fault_step(v),
                "signature": signature(v), "generation": fault_gen, "ts": v.first_ts or v.ts}
            world: dict[str, Any] = {}
            if dec.members:
                new_nodes = {m.node for m in dec.members}
                world = dict(members=[m.model_dump() for m in dec.members],
                             world_size=dec.world_size,
                             spare_nodes=[s for s in state.spare_nodes if s not in new_nodes])
            pending = None
            if dec.execute and dec.action in pol.RECOVERY_ACTIONS:
                pending = {**dec.to_dict(), "deadline_ns": time.time_ns()
                           + int(self.rconfig.decision_timeout_s * 1e9)}
            await st.commit_decision(
                job, retries_used=dec.retries_used, last_decision=_brief(dec, fault_gen),
                last_fault=last_fault, stopped=dec.action == "stop_job_notify_user",
                pending_decision=pending, **world)
        self.counts["decisions"] += 1
        await st.audit(job, {"type": "decision", "decision_id": dec.event_id,
                             "action": dec.action, "generation": dec.generation,
                             "execute": dec.execute, "mode": dec.mode,
                             "idempotency_key": dec.idempotency_key, "reason": dec.reason,
                             "verdict_id": dec.verdict_id, "fault_class": dec.fault_class,
                             "ranks": dec.ranks, "nodes": dec.nodes,
                             "world_size": dec.world_size, "ts": dec.ts,
                             "decision": dec.to_dict()})
        await self.bus.publish(subjects.job(job, "decision"), dec)
        log.info("%s: %s (generation %d, execute=%s): %s", job, dec.action, dec.generation,
                 dec.execute, dec.reason)
        if dec.execute and dec.action in pol.RECOVERY_ACTIONS:
            self.pending[job] = (dec, time.monotonic() + self.rconfig.decision_timeout_s)
        elif dec.execute:  # a stop supersedes a pending recovery; a flag (none) does not
            self.pending.pop(job, None)
        if dec.execute and dec.action == "exclude_node_and_requeue":
            await self._exclude(dec)

    async def _bump(self, job: str, expected: int) -> int:
        """Bump the generation from ``expected``; when another decision moved it meanwhile,
        bump from the generation in force (a few tries)."""
        assert self.state is not None
        for _ in range(5):
            got = await self.state.bump_generation(job, expected)
            if got == expected + 1:
                return got
            expected = got
        return got + 0

    async def _exclude(self, dec: Decision) -> None:
        assert self.state is not None and self._controller is not None and dec.job
        for node in dec.nodes:
            if await self.state.claim(f"{dec.idempotency_key}:exclude:{node}", dec.event_id):
                continue  # this exclusion was already carried out
            try:
                res = await self._controller.exclude(node, dec.job, dec.reason)
                ok, detail = res.ok, res.detail
            except Exception as exc:  # noqa: BLE001 - a controller failure is reported
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            if not ok:
                await self.state.audit(dec.job, {
                    "type": "controller_failed", "decision_id": dec.event_id, "node": node,
                    "controller": self._controller.name, "reason": detail, "ts": time.time_ns()})
            await self.bus.publish(subjects.job(dec.job, "action"), ActionResult(
                job=dec.job, node=node, trace=dec.child_trace(), decision_id=dec.event_id,
                idempotency_key=dec.idempotency_key,
                executor=f"controller:{self._controller.name}",
                action="exclude_node_and_requeue", ok=ok, detail=detail))

    # ---- watchdog -----------------------------------------------------------------------------
    async def on_recovery(self, subject: str, ev: Event) -> None:
        if not isinstance(ev, TrainingResumed) or not ev.job:
            return
        p = self.pending.get(ev.job)
        if p and ev.generation >= p[0].generation:
            async with self._lock(ev.job):
                p = self.pending.get(ev.job)
                if p and ev.generation >= p[0].generation:
                    self.pending.pop(ev.job, None)
                    assert self.state is not None
                    await self.state.clear_pending(ev.job)

    async def on_action(self, subject: str, ev: Event) -> None:
        if not isinstance(ev, ActionResult) or not ev.job or ev.ok or ev.skipped:
            return
        if ev.executor.startswith("controller:"):
            # the scheduler could not drain the node; the job itself re-ranks without it, so
            # only training not resuming (the deadline) escalates
            return
        p = self.pending.get(ev.job)
        if p and (ev.decision_id == p[0].event_id or ev.idempotency_key == p[0].idempotency_key):
            await self._escalate(ev.job, f"failed ({ev.executor}: {ev.detail or 'no detail'})")

    async def tick(self) -> None:
        now = time.monotonic()
        for job, (dec, deadline) in list(self.pending.items()):
            if now >= deadline:
                await self._escalate(job, f"not followed by training again within "
                                          f"{self.rconfig.decision_timeout_s:g} s")

    async def _escalate(self, job: str, why: str) -> None:
        assert self.state is not None
        async with self._lock(job):
            p = self.pending.pop(job, None)
            if p is None:
                return
            prev = p[0]
            state = await self.state.job(job)
            if state.generation > prev.generation:
                return  # a later decision superseded it
            dec = pol.escalate(prev, state, why, self.rconfig.policy)
            if dec is None:
                await self.state.clear_pending(job)
                return
            owner = await self.state.claim(dec.idempotency_key, _owner(dec))
            if owner is not None:
                return
            self.counts["escalations"] += 1
            await self._commit(dec, None, state, prev.generation)

    async def _rearm(self) -> None:
        """Re-arm the watchdog for pending decisions left by a previous instance."""
        assert self.state is not None
        for job in await self.state.jobs():
            try:
                pd = dict((await self.state.job(job)).pending_decision or {})
                if not pd:
                    continue
                deadline_ns = int(pd.pop("deadline_ns", 0))
                dec = schemas.from_dict(pd)
            except Exception as exc:  # noqa: BLE001 - a bad record is skipped, not fatal
                log.warning("%s: unreadable pending decision, not re-armed (%s)", job, exc)
                continue
            if isinstance(dec, Decision):
                left = max(0.0, (deadline_ns - time.time_ns()) / 1e9)
                self.pending[job] = (dec, time.monotonic() + left)


def _owner(dec: Decision) -> str:
    """Claim owner string: ``<decision id>/<action>`` (the action is read back when folding)."""
    return f"{dec.event_id}/{dec.action}"


def _owner_action(owner: str) -> str:
    return owner.rsplit("/", 1)[-1] if "/" in owner else "restart_workers"


def _brief(dec: Decision, fault_gen: int) -> dict[str, Any]:
    return {"id": dec.event_id, "action": dec.action, "generation": dec.generation,
            "fault_generation": fault_gen, "key": dec.idempotency_key, "execute": dec.execute,
            "ts": dec.ts}

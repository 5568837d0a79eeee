"""The remediator service: verdict → decision, with idempotency, audit, and a watchdog.

``python -m trainguard.remediator --nats-url … --redis-url …`` (or env ``NATS_URL``/``REDIS_URL``).

Subscribes ``tg.job.*.verdict``, ``tg.job.*.action`` and ``tg.job.*.recovery``; publishes
decisions on ``tg.job.<job>.decision`` and the controller's exclusions on
``tg.job.<job>.action``. What it decides (claims, fold or escalate, the commit, the exclusion,
the watchdog, the re-arm after a restart) is the reducer ``remediator.reducer.step``; this
module wires it to the bus (``trainguard.services.live_reducer.ReducerService``) with two call targets:
``"state"`` (the ``StateStore``) and ``"controller"`` (the node controller of
``RemediatorConfig.controller``, ``trainguard.scheduler.local``, unless one is passed in).

Pending decisions live in the job record (``pending_decision``), so a restarted remediator
re-arms them (the first tick, fed in ``setup`` before any subscription) and, because every
claim is in Redis, never repeats one. A verdict's message is acked only once its chain has
completed (``holding_topics``, ``reducer.in_flight``): a verdict that waited on Valkey when the
process died is delivered to the restarted replica again and decided then, once.
"""
from __future__ import annotations

import time
import os
from dataclasses import replace
from typing import Any

from trainguard.scheduler.local import NodeController, make_controller
from trainguard.core.reducer import Tick
from trainguard.services.live_reducer import ReducerService
from trainguard.schemas import Decision
from trainguard.services.base import ServiceConfig

from trainguard.remediator import breaker, reducer
from trainguard.remediator.reducer import RemediatorConfig, RemediatorState

__all__ = ["Remediator", "RemediatorConfig"]


class _CrashBeforePublish:
    """Test hook (``TG_TEST_CRASH_AFTER_OUTBOX=1``, set by tests only): the process dies at the
    first decision publish, after the decision was stored in the outbox and before any of it
    reached the bus — the window the outbox exists for."""

    async def publish_stored(self, subject: str, event: Any, timeout: float = 2.0) -> int:
        os._exit(70)


class Remediator(ReducerService[RemediatorState]):
    """Turns verdicts into decisions (see ``remediator.reducer``)."""

    name = "remediator"
    topics = ("tg.job.*.verdict", "tg.job.*.action", "tg.job.*.recovery")
    #: a verdict's message is acked once its chain completed (``reducer.in_flight``), so a
    #: verdict waiting on Valkey when this process dies is decided by its restart
    holding_topics = ("tg.job.*.verdict",)

    def __init__(self, config: ServiceConfig | None = None,
                 rconfig: RemediatorConfig | None = None,
                 controller: NodeController | None = None):
        self.rconfig = rconfig or RemediatorConfig()
        self._controller = controller
        super().__init__(config)

    def _controller_fields(self) -> dict[str, Any]:
        """The state's view of the node controller: its name and what it can do."""
        c = self._controller
        return {"controller": c.name if c else self.rconfig.controller,
                "restarts_pods": bool(getattr(c, "restarts_pods", False)),
                "cancels_jobs": bool(getattr(c, "cancels_jobs", False)),
                "requeues_jobs": bool(getattr(c, "requeues_jobs", False))}

    def initial_state(self) -> RemediatorState:
        return RemediatorState(config=self.rconfig, serves=self.membership.owns,
                               alive=lambda r: r in self.membership.members,
                               replica=self.config.replica, **self._controller_fields())

    def step(self, state, inp, now):
        return reducer.step(state, inp, now)

    def in_flight(self, state):
        return reducer.in_flight(state)

    def targets(self) -> dict[str, Any]:
        bus: Any = self.bus
        if os.environ.get("TG_TEST_CRASH_AFTER_OUTBOX") == "1":
            bus = _CrashBeforePublish()  # tests only: die with the decision stored, unpublished
        return {"state": self.state, "controller": self._controller, "bus": bus}

    async def setup(self) -> None:
        assert self.state is not None
        if self._controller is None:
            self._controller = make_controller(self.rconfig.controller, self.state)
        self.model = replace(self.model, **self._controller_fields())
        await self.feed(Tick(time.time_ns()))  # re-arms the pending decisions of the records

    @property
    def pending(self) -> dict[str, tuple[Decision, float]]:
        """job → (pending decision, deadline in service-clock seconds)."""
        return {job: (p.decision, p.deadline) for job, p in self.model.pending.items()}

    @property
    def counts(self) -> dict[str, int]:
        """decisions, folded, escalations, ignored: verdicts and escalations so far."""
        return self.model.counts

    def breaker(self) -> dict[str, Any]:
        """The fleet breaker as this replica last read it (``RemediatorConfig.breaker_poll_s``):
        status, nodes taken in the window, the limit, known nodes, decisions held, mode."""
        cfg = self.rconfig.breaker
        seen = self.model.breaker_seen
        if seen is None:
            return {"status": "unknown", "mode": cfg.mode}
        st, known = seen
        return {"status": st.status, "mode": cfg.mode,
                "taken": len(breaker.window(st, cfg, time.time_ns())),
                "limit": breaker.limit(cfg, known), "known_nodes": max(known, cfg.fleet_nodes),
                "held": st.held, "tripped_ts": st.tripped_ts, "trip_reason": st.trip_reason,
                "would_trip_ts": st.would_trip_ts, "window_s": cfg.window_s}

    def metric_families(self):
        """``/metrics`` gauges of the fleet breaker (``trainguard.services.metrics.mount``)."""
        from prometheus_client.core import GaugeMetricFamily
        b = self.breaker()
        rows = (("tg_breaker_tripped", "1 while the fleet breaker holds node-taking actions",
                 1 if b.get("status") == "tripped" else 0),
                ("tg_breaker_nodes_taken", "nodes taken out within the breaker's window",
                 b.get("taken", 0)),
                ("tg_breaker_limit", "most nodes the breaker lets out within its window",
                 b.get("limit", 0)),
                ("tg_breaker_known_nodes", "nodes of the fleet the breaker knows",
                 b.get("known_nodes", 0)),
                ("tg_breaker_held", "node-taking decisions held since the breaker tripped",
                 b.get("held", 0)))
        for name, doc, value in rows:
            fam = GaugeMetricFamily(name, doc)
            fam.add_metric([], float(value))
            yield fam

    def health(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "pending": sorted(self.model.pending),
                "controller": self.rconfig.controller, "breaker": self.breaker()}

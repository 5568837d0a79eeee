"""The detector service: raw signals in, ``schemas.Anomaly`` out.

Subscribes ``tg.job.*.rank.*.hb``, ``tg.job.*.worker``, ``tg.job.*.log``, ``tg.job.*.ckpt``,
``tg.node.*.heartbeat`` (node agents), ``tg.node.*.launcher.*`` (launchers), ``tg.node.*.xid``,
``tg.node.*.telemetry`` and the rest of ``detector.reducer.TOPICS``, and ticks every
``ServiceConfig.tick_s`` (50 ms). The service is wiring only: a ``ReducerService`` whose
``step`` is ``detector.reducer.step``, which keeps the per-job and per-node windows, runs the
pure rules (``detector.rules``), deduplicates — one anomaly per (job, subject, kind,
generation) incident on ``tg.job.<job>.anomaly`` — fans node findings (node lost, XID,
thermal, ECC counters) out to ``tg.node.<node>.anomaly`` and to every job with members on that
node, and asks for the job records (membership, per-job timeouts, generation) every
``job_refresh_s``. The base class publishes, reads the records from Valkey and feeds the
replies back (``trainguard.core.reducer``).
"""
from __future__ import annotations

from typing import Any

from trainguard.services.live_reducer import ReducerService
from trainguard.schemas import JobRecord
from trainguard.services.base import ServiceConfig

from trainguard.detector import reducer
from trainguard.detector.core import DetectorConfig
from trainguard.detector.progress import JobState
from trainguard.detector.state import DetectorServiceConfig, DetectorState
from trainguard.detector.signals import NodeState

__all__ = ["Detector", "DetectorServiceConfig", "DetectorConfig", "factory"]


class Detector(ReducerService[DetectorState]):
    """The detector: ``detector.reducer.step`` behind the bus and the state store."""

    name = "detector"
    topics = reducer.TOPICS

    def __init__(self, config: ServiceConfig | None = None,
                 detector_config: DetectorServiceConfig | None = None):
        self.dc = detector_config or DetectorServiceConfig()
        self.cfg = self.dc.rules
        super().__init__(config)  # calls initial_state, which needs self.dc

    def initial_state(self) -> DetectorState:
        return DetectorState(config=self.dc, serves=self.membership.owns)

    def accepts(self, subject: str) -> bool:
        """Node events are stepped by every replica (see ``detector.reducer``); job events by
        the replica that serves the job."""
        return subject.startswith("tg.node.") or super().accepts(subject)

    def step(self, state: DetectorState, event, now: float):
        return reducer.step(state, event, now)

    def health(self) -> dict[str, Any]:
        m = self.model
        return {"jobs": len(m.jobs), "ranks": sum(len(j.ranks) for j in m.jobs.values()),
                "nodes": len(m.nodes), "anomalies": m.anomalies, "refused": dict(m.refused)}

    async def refresh_now(self) -> None:
        """Re-read every known job record at once and wait for the replies (tests and
        tools)."""
        async with self._lock:
            for call in reducer.refresh_calls(self.model, self.clock(), wait=True, force=True):
                await self._perform(call)

    # ---- read-only views of the reducer's state (tests, tools) --------------------------------
    @property
    def jobs(self) -> dict[str, JobState]:
        return self.model.jobs

    @property
    def job_cfg(self) -> dict[str, JobRecord]:
        return self.model.records

    @property
    def nodes(self) -> dict[str, NodeState]:
        return self.model.nodes

    @property
    def node_jobs(self) -> dict[str, set[str]]:
        return self.model.node_jobs

    @property
    def anomalies(self) -> int:
        return self.model.anomalies


def factory(cfg: ServiceConfig) -> Detector:
    return Detector(cfg)

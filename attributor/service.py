"""The attributor service: anomalies in, one ``schemas.Verdict`` per incident out.

Subscribes ``tg.job.*.anomaly``; publishes on ``tg.job.<job>.verdict``. The logic (incident
grouping, symptom hold, fold or republish, cross-job history) is the reducer
``attributor.incidents.step``; this module wires it to the bus and the state store
(``trainguard.services.live_reducer.ReducerService``: the ``"state"`` call target is the ``StateStore``).
"""
from __future__ import annotations

from typing import Any

from trainguard.services.live_reducer import ReducerService
from trainguard.services.base import ServiceConfig

from trainguard.attributor import incidents as _incidents
from trainguard.attributor.decide import AttributorConfig
from trainguard.attributor.incidents import AttributorState, Incident

__all__ = ["Attributor", "AttributorConfig", "Incident", "factory"]


class Attributor(ReducerService[AttributorState]):
    """The attributor (see ``attributor.incidents`` for what it decides)."""

    name = "attributor"
    #: node telemetry for the nodes' attributes (driver, image, rack …: ``attributor.shared``)
    topics = ("tg.job.*.anomaly", "tg.node.*.telemetry")

    def __init__(self, config: ServiceConfig | None = None,
                 attributor_config: AttributorConfig | None = None):
        self.ac = attributor_config or AttributorConfig()
        super().__init__(config)

    def initial_state(self) -> AttributorState:
        return AttributorState(config=self.ac)

    def step(self, state, inp, now):
        return _incidents.step(state, inp, now)

    @property
    def incidents(self) -> dict[tuple[str, int], Incident]:
        """Open incidents by (job, generation)."""
        return self.model.incidents

    @property
    def published(self) -> int:
        """Verdicts published so far."""
        return self.model.published

    def health(self) -> dict[str, Any]:
        return {"incidents": len(self.model.incidents), "verdicts": self.model.published}


def factory(cfg: ServiceConfig) -> Attributor:
    return Attributor(cfg)

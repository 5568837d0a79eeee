"""The attributor service: anomalies in, one ``schemas.Verdict`` per incident out.

Subscribes ``tg.job.*.anomaly``; publishes on ``tg.job.<job>.verdict``.

* An incident is (job, generation) — a new one starts when the first anomaly of the current one
  is older than ``incident_window_s``.
* A root-cause anomaly (``symptom=False``) is attributed at once (the decide function is pure
  and takes microseconds; the cross-job history read is one Redis round trip per culprit node).
* A symptom is held for ``symptom_hold_s`` waiting for a root cause; when one comes the symptom
  is folded into its verdict, otherwise the held symptoms are attributed on their own.
* After a verdict, later anomalies of the same incident are folded in; a new verdict is
  published only when they change its conclusion (``decide.conclusion``: a root that outranks
  the first, e.g. node lost after a rank crash, or a new fact such as a repeat-offender node).
  Whether that changes the action is the remediator's call.
* A verdict whose root is a warning (a straggler, thermal throttling, a failed checkpoint save)
  is a flag: it does not settle the incident, so symptoms that follow still wait for their root
  cause.
* Each verdict is written to the cross-job history (``StateStore.record_fault``): per culprit
  node, with the failure signature, layer, and for GPU faults the XID, GPU and pid.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard import schemas
from trainguard.schemas import subjects
from trainguard.service import Service, ServiceConfig

from .decide import (APP_XIDS, AttributorConfig, VerdictSpec, choose_root, conclusion, decide,
                     history_from_records, signature)

log = logging.getLogger("trainguard.attributor")


@dataclass
class Incident:
    job: str
    generation: int
    started: float
    anomalies: list[schemas.Anomaly] = field(default_factory=list)
    hold_until: float | None = None
    concluded: tuple | None = None  # conclusion of the last verdict published, None = none yet
    settled: bool = False  # a verdict with a root-cause fault (not a warning) was published
    verdicts: int = 0


class Attributor(Service):
    name = "attributor"

    def __init__(self, config: ServiceConfig | None = None,
                 attributor_config: AttributorConfig | None = None):
        super().__init__(config)
        self.ac = attributor_config or AttributorConfig()
        self.incidents: dict[tuple[str, int], Incident] = {}
        self.latest_gen: dict[str, int] = {}
        self.published = 0

    def subscriptions(self):
        return [("tg.job.*.anomaly", self.on_anomaly)]

    def health(self) -> dict[str, Any]:
        return {"incidents": len(self.incidents), "verdicts": self.published}

    async def on_anomaly(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.Anomaly):
            return
        job = ev.job or subject.split(".")[2]
        gen = ev.generation if ev.generation is not None else self.latest_gen.get(job, 0)
        self.latest_gen[job] = max(gen, self.latest_gen.get(job, 0))
        now = time.monotonic()
        key = (job, gen)
        inc = self.incidents.get(key)
        if inc is None or now - inc.started > self.ac.incident_window_s:
            inc = self.incidents[key] = Incident(job, gen, now)
        inc.anomalies.append(ev)
        if ev.symptom:
            # a flag (a warning, e.g. a straggler) does not settle an incident: symptoms that
            # follow still wait for their root cause
            if not inc.settled and inc.hold_until is None:
                inc.hold_until = now + self.ac.symptom_hold_s
            return
        await self._attribute(inc)

    async def tick(self) -> None:
        now = time.monotonic()
        for key, inc in list(self.incidents.items()):
            if not inc.settled and inc.hold_until is not None and now >= inc.hold_until:
                await self._attribute(inc)
            elif now - inc.started > 2 * self.ac.incident_window_s:
                del self.incidents[key]

    async def _history(self, inc: Incident, root: schemas.Anomaly):
        nodes = sorted({n for a in inc.anomalies for n in a.culprit.nodes})
        since = time.time_ns() - int(self.ac.history_window_s * 1e9)
        recs: dict[str, list[dict]] = {}
        pairs: list[tuple[str, str]] = []
        if self.state is None:
            return history_from_records(inc.job, recs, pairs, since_ns=since)
        try:
            for n in nodes:
                recs[n] = await self.state.node_history(n, since)
            pairs = await self.state.signature_history(signature(root), since)
        except Exception as exc:  # noqa: BLE001 - attribute without history rather than not
            log.warning("cross-job history unavailable (%s): attributing without it", exc)
        current = {}
        for a in inc.anomalies:
            xid, pid = a.detail.get("xid"), a.detail.get("pid")
            if xid in APP_XIDS and pid is not None and a.culprit.gpus:
                current.setdefault(a.culprit.gpus[0], set()).add(int(pid))
        return history_from_records(inc.job, recs, pairs, current, since)

    async def _attribute(self, inc: Incident) -> None:
        root = choose_root(inc.anomalies)
        hist = await self._history(inc, root)
        spec = decide(inc.anomalies, hist, self.ac)
        if inc.concluded is not None and conclusion(spec) == inc.concluded:
            return  # folded into the verdict already published
        await self._publish(inc, spec, root)

    async def _publish(self, inc: Incident, spec: VerdictSpec, root: schemas.Anomaly) -> None:
        v = schemas.Verdict(
            job=inc.job, node=spec.nodes[0] if spec.nodes else None,
            rank=spec.ranks[0] if len(spec.ranks) == 1 else None,
            fault_class=spec.fault_class, layer=spec.layer,
            culprit=schemas.Culprit(ranks=spec.ranks, nodes=spec.nodes, gpus=spec.gpus),
            confidence=spec.confidence, score=round(spec.score, 3),
            evidence=spec.evidence, anomaly_ids=spec.anomaly_ids, first_ts=spec.first_ts,
            generation=inc.generation, detail={**spec.detail, "signature": spec.signature,
                                               "revision": inc.verdicts},
            trace=root.child_trace())
        await self.bus.publish(subjects.job(inc.job, "verdict"), v)
        inc.concluded = conclusion(spec)
        inc.settled = inc.settled or root.severity == "error"
        inc.hold_until = None
        inc.verdicts += 1
        self.published += 1
        await self._record(inc, spec)

    async def _record(self, inc: Incident, spec: VerdictSpec) -> None:
        if self.state is None:
            return
        try:
            for n in spec.nodes:
                await self.state.record_fault(n, inc.job, spec.signature, {
                    "fault_class": spec.fault_class, "layer": spec.layer,
                    "generation": inc.generation})
            for a in inc.anomalies:
                xid = a.detail.get("xid")
                if xid is not None and a.culprit.nodes:
                    await self.state.record_fault(a.culprit.nodes[0], inc.job, f"xid|{xid}", {
                        "fault_class": a.fault_class, "layer": a.detail.get("layer"),
                        "xid": xid, "pid": a.detail.get("pid"),
                        "gpu": a.culprit.gpus[0] if a.culprit.gpus else ""})
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot record fault history (%s); the verdict stands", exc)


def factory(cfg: ServiceConfig) -> Attributor:
    return Attributor(cfg)

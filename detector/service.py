"""The detector service: raw signals in, ``schemas.Anomaly`` out.

Subscribes ``tg.job.*.rank.*.hb``, ``tg.job.*.worker``, ``tg.job.*.log``, ``tg.job.*.ckpt``,
``tg.node.*.heartbeat``, ``tg.node.*.xid``, ``tg.node.*.telemetry``. Keeps per-job windows in
memory (``detector.rules`` state objects), runs the pure rules of ``detector.rules`` on each
event and on a 50 ms tick, and publishes each new incident once — one anomaly per (job,
subject, kind, generation) — on ``tg.job.<job>.anomaly``. Node-only signals (node lost, XID,
thermal, ECC counters) go to ``tg.node.<node>.anomaly`` and to every job with members on that
node (membership and per-job timeouts from the job record, refreshed every
``job_refresh_s``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard import schemas
from trainguard.schemas import JobRecord, subjects
from trainguard.service import Service, ServiceConfig

from . import rules
from .rules import DetectorConfig, Finding, JobState, NodeState

log = logging.getLogger("trainguard.detector")


@dataclass
class DetectorServiceConfig:
    """``rules`` — rule parameters (``DetectorConfig``). ``job_refresh_s`` — how often the
    job records (members, timeouts, generation) are re-read (2 s). ``eval_s`` — period of the
    per-job stall / straggler / throughput evaluation (0.25 s; silence and node-lost run on
    every 50 ms tick). ``forget_after_s`` — a rank or node silent this long is dropped from
    memory (600 s). ``dedup_ttl_s`` — how long an incident key is remembered (3600 s)."""

    rules: DetectorConfig = field(default_factory=DetectorConfig)
    job_refresh_s: float = 2.0
    eval_s: float = 0.25
    forget_after_s: float = 600.0
    dedup_ttl_s: float = 3600.0


class Detector(Service):
    name = "detector"

    def __init__(self, config: ServiceConfig | None = None,
                 detector_config: DetectorServiceConfig | None = None):
        super().__init__(config)
        self.dc = detector_config or DetectorServiceConfig()
        self.cfg = self.dc.rules
        self.jobs: dict[str, JobState] = {}
        self.job_cfg: dict[str, JobRecord] = {}
        self.job_seen: dict[str, float] = {}
        self.nodes: dict[str, NodeState] = {}
        self.node_jobs: dict[str, set[str]] = {}
        self.emitted: dict[tuple, float] = {}
        self.anomalies = 0
        self._last_eval = 0.0
        self._last_refresh = 0.0
        self._last_gc = 0.0
        self._refreshing: asyncio.Task | None = None

    # ---- wiring -----------------------------------------------------------------------------
    def subscriptions(self):
        return [
            ("tg.job.*.rank.*.hb", self.on_heartbeat),
            ("tg.job.*.worker", self.on_worker),
            ("tg.job.*.log", self.on_log),
            ("tg.job.*.ckpt", self.on_ckpt),
            ("tg.node.*.heartbeat", self.on_node_heartbeat),
            ("tg.node.*.xid", self.on_xid),
            ("tg.node.*.telemetry", self.on_telemetry),
        ]

    def health(self) -> dict[str, Any]:
        return {"jobs": len(self.jobs), "ranks": sum(len(j.ranks) for j in self.jobs.values()),
                "nodes": len(self.nodes), "anomalies": self.anomalies}

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _job_of(subject: str, ev: schemas.Event) -> str:
        return ev.job or subject.split(".")[2]

    def _job(self, name: str) -> JobState:
        js = self.jobs.get(name)
        if js is None:
            js = self.jobs[name] = JobState(name, self.cfg.step_window)
            self.job_seen[name] = time.monotonic()
            self._last_refresh = 0.0  # learn its config soon
        return js

    def _node(self, name: str) -> NodeState:
        ns = self.nodes.get(name)
        if ns is None:
            ns = self.nodes[name] = NodeState(name)
        return ns

    async def emit(self, job: str | None, f: Finding, source: schemas.Event | None = None,
                   node_scope: str | None = None) -> bool:
        """Publish ``f`` once per incident key; returns False when deduplicated."""
        key = f.dedup_key(job or f"node:{node_scope}")
        if key in self.emitted:
            return False
        self.emitted[key] = time.monotonic()
        a = schemas.Anomaly(
            job=job, node=(f.nodes[0] if f.nodes else node_scope),
            rank=f.ranks[0] if len(f.ranks) == 1 else None, kind=f.kind,
            fault_class=f.fault_class,
            culprit=schemas.Culprit(ranks=f.ranks, nodes=f.nodes, gpus=f.gpus),
            symptom=f.symptom, severity=f.severity, first_ts=f.ts or time.time_ns(),
            evidence=f.evidence, detail=f.detail,
            source_event_ids=[source.event_id] if source is not None else [],
            generation=f.generation,
            trace=source.child_trace() if source is not None else {})
        subject = subjects.job(job, "anomaly") if job else subjects.node(node_scope or "unknown",
                                                                        "anomaly")
        await self.bus.publish(subject, a)
        self.anomalies += 1
        return True

    async def emit_node(self, node: str, f: Finding, source: schemas.Event | None = None) -> None:
        """A node-level finding: on the node's subject and on every job with members there
        (culprit ranks: the members on that node — for a GPU finding, those whose local rank
        is the GPU's index when it is known)."""
        await self.emit(None, f, source, node_scope=node)
        gpu_index = f.detail.get("gpu_index")
        for job in sorted(self.node_jobs.get(node, ())):
            jc = self.job_cfg.get(job) or JobRecord()
            on_node = [m for m in jc.members if m.get("node") == node]
            if gpu_index is not None and any(m.get("local_rank") == gpu_index for m in on_node):
                on_node = [m for m in on_node if m.get("local_rank") == gpu_index]
            jf = Finding(f.kind, f.fault_class, ranks=sorted(int(m["rank"]) for m in on_node
                                                             if "rank" in m),
                         nodes=f.nodes, gpus=f.gpus, symptom=f.symptom, severity=f.severity,
                         evidence=f.evidence, detail=f.detail, ts=f.ts,
                         generation=jc.generation)
            await self.emit(job, jf, source)

    # ---- handlers -----------------------------------------------------------------------------
    async def on_heartbeat(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.RankHeartbeat):
            return
        job = ev.job or subject.split(".")[2]
        rank = ev.rank if ev.rank is not None else int(subject.split(".")[4])
        js = self.jobs.get(job) or self._job(job)
        rules.observe_heartbeat(js, rank, ev.node, ev.local_rank, ev.generation, ev.step,
                                ev.collective_seq, ev.phase, ev.step_time_s, time.monotonic(),
                                self.cfg, ev.interval_s, ev.compute_s)
        if ev.loss is not None and not math.isfinite(ev.loss):
            f = rules.nan_loss_rule(ev.loss, rank, ev.node, ev.step, ev.generation, ev.ts)
            if f:
                await self.emit(job, f, ev)

    async def on_worker(self, subject: str, ev: schemas.Event) -> None:
        job = self._job_of(subject, ev)
        js = self._job(job)
        if isinstance(ev, schemas.WorkerExited):
            if ev.rank is not None and ev.rank in js.ranks:
                js.ranks[ev.rank].exited = True
            f = rules.crash_rule(ev.rank, ev.node, ev.exit_code, ev.signal, ev.oom_killed,
                                 ev.expected, ev.generation, ev.ts, ev.pid)
            if f:
                await self.emit(job, f, ev)
        elif isinstance(ev, schemas.WorkerStarted) and ev.rank is not None:
            rs = js.ranks.get(ev.rank)
            if rs is not None:
                rs.exited = False
                rs.last_hb = rs.last_advance = time.monotonic()
                rs.phase = "startup"

    async def on_log(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.LogLine):
            return
        job = self._job_of(subject, ev)
        self._job(job)
        f = rules.log_rule(ev.line, ev.stream, ev.rank, ev.node, ev.generation, ev.ts, ev.step)
        if f and f.symptom and ev.source == "launcher":
            # a rank's stderr as the launcher relays it carries no reliable generation: a
            # peer's collective error printed during a recovery would open a new incident.
            # The shim reports those itself, with its generation; relayed lines count for
            # root causes only (a CUDA error or segfault printed as a process dies)
            return
        if f:
            f.detail["stream"] = ev.stream
            await self.emit(job, f, ev)

    async def on_ckpt(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.CheckpointSaveFailed):
            return
        job = self._job_of(subject, ev)
        if ev.error.startswith("skipped:"):
            return  # overlap_policy="skip" did what it was asked to: nothing failed
        await self.emit(job, rules.save_failed_finding(
            ev.rank, ev.node, ev.step, ev.error, ev.errno, ev.generation, ev.ts), ev)

    async def on_node_heartbeat(self, subject: str, ev: schemas.Event) -> None:
        if isinstance(ev, schemas.NodeHeartbeat):
            node = ev.node or subject.split(".")[2]
            rules.observe_node_heartbeat(self._node(node), ev.role, time.monotonic())

    async def on_xid(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.XidEvent):
            return
        node = ev.node or subject.split(".")[2]
        f = rules.xid_rule(ev.xid, node, ev.pci, ev.gpu_index, ev.pid, ev.raw, ev.ts,
                           ev.message)
        if f is not None:
            if ev.gpu_uuid:
                f.gpus.append(ev.gpu_uuid)
            await self.emit_node(node, f, ev)

    async def on_telemetry(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.NodeTelemetry) or not ev.gpus:
            return
        node = ev.node or subject.split(".")[2]
        for f in rules.telemetry_rule(self._node(node), [g.model_dump() for g in ev.gpus],
                                      self.cfg, ev.ts):
            await self.emit_node(node, f, ev)

    # ---- periodic rules -----------------------------------------------------------------------
    async def tick(self) -> None:
        now = time.monotonic()
        for name, js in list(self.jobs.items()):
            jc = self.job_cfg.get(name)
            for f in rules.silence_rule(js, now, self.cfg, jc):
                f.ts = time.time_ns()
                await self.emit(name, f)
        for ns in list(self.nodes.values()):
            timeout = self._node_timeout(ns.name)
            f = rules.node_lost_rule(ns, now, timeout)
            if f is not None:
                f.ts = time.time_ns()
                await self.emit_node(ns.name, f)
        if now - self._last_eval >= self.dc.eval_s:
            self._last_eval = now
            await self._evaluate(now)
        if now - self._last_refresh >= self.dc.job_refresh_s and self.state is not None and (
                self._refreshing is None or self._refreshing.done()):
            self._last_refresh = now
            self._refreshing = asyncio.create_task(self._refresh_jobs())
        if now - self._last_gc >= 30.0:
            self._last_gc = now
            self._gc(now)

    def _node_timeout(self, node: str) -> float:
        t = [self.job_cfg[j].node_timeout_s for j in self.node_jobs.get(node, ())
             if j in self.job_cfg and self.job_cfg[j].node_timeout_s]
        return min(t) if t else self.cfg.node_timeout_s

    async def _evaluate(self, now: float) -> None:
        for name, js in list(self.jobs.items()):
            jc = self.job_cfg.get(name)
            for f in rules.stall_rule(js, now, self.cfg, jc):
                f.ts = time.time_ns()
                await self.emit(name, f)
            if jc is not None:
                for f in rules.missing_member_rule(js, jc, self.job_seen.get(name, now), now,
                                                   self.cfg):
                    f.ts = time.time_ns()
                    await self.emit(name, f)
            if js.dirty:
                js.dirty = False
                for f in rules.straggler_rule(js, self.cfg):
                    f.ts = time.time_ns()
                    await self.emit(name, f)
            f = rules.throughput_rule(js, now, self.cfg)
            if f is not None:
                f.ts = time.time_ns()
                await self.emit(name, f)

    async def _refresh_jobs(self) -> None:
        assert self.state is not None
        node_jobs: dict[str, set[str]] = {}
        for name in list(self.jobs):
            try:
                jc = await self.state.job(name)
            except Exception as exc:  # noqa: BLE001 - keep the last known config
                log.warning("job %s: cannot read its config (%s); keeping the last one", name, exc)
                jc = self.job_cfg.get(name) or JobRecord()
            old = self.job_cfg.get(name)
            if old is not None and jc.runs > old.runs:
                # the job was launched again: the old run's ranks, progress and step times
                # are not this run's (a finished rank would otherwise be judged stalled)
                self.jobs[name] = JobState(name, self.cfg.step_window)
                self.job_seen[name] = time.monotonic()
            self.job_cfg[name] = jc
            for m in jc.members:
                if m.get("node"):
                    node_jobs.setdefault(str(m["node"]), set()).add(name)
        self.node_jobs = node_jobs

    async def refresh_now(self) -> None:
        """Re-read every known job record at once (tests and tools)."""
        await self._refresh_jobs()

    def _gc(self, now: float) -> None:
        horizon = now - self.dc.forget_after_s
        for name, js in list(self.jobs.items()):
            for r, rs in list(js.ranks.items()):
                if rs.last_hb and rs.last_hb < horizon:
                    del js.ranks[r]
            if not js.ranks and self.job_seen.get(name, now) < horizon:
                del self.jobs[name]
                self.job_cfg.pop(name, None)
        for n, ns in list(self.nodes.items()):
            if ns.last and max(ns.last.values()) < horizon:
                del self.nodes[n]
        old = now - self.dc.dedup_ttl_s
        for k, t in list(self.emitted.items()):
            if t < old:
                del self.emitted[k]


def factory(cfg: ServiceConfig) -> Detector:
    return Detector(cfg)

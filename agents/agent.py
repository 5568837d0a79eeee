"""The node agent: one per node, publishing what the node itself can tell about its health.

Publishes (subjects from ``schemas.subjects.node``):

* ``tg.node.<node>.heartbeat`` — ``NodeHeartbeat(role="agent", seq, pid, interval_s)`` every
  ``heartbeat_interval_s`` (default 0.5 s; the detector declares the node lost when beats stop);
  ``seq`` counts up by one per beat from 0. Beats run in their own task, so slow telemetry or a
  hung NVML call never delays them.
* ``tg.node.<node>.telemetry`` — ``NodeTelemetry`` every ``interval_s`` (default 1 s): host
  metrics (psutil), TCP connect RTT in seconds to each peer (key ``"host:port"``) and to the NATS
  server (key ``"bus"``; ``inf`` when unreachable), and one ``GpuSample`` per GPU when NVML is
  there (``nvml=True``). Without NVML the agent says so once in its log and publishes host
  metrics with ``nvml=False``.
* ``tg.node.<node>.xid`` — ``XidEvent`` for every XID: from the kernel log (``source`` =
  ``kmsg`` | ``journal`` | ``file``; parsed by ``trainguard.core.xid.parse_xid_line``) and from the
  NVML event set (``source="nvml"``). The PCI address is mapped to ``gpu_index``/``gpu_uuid``
  through NVML, or to the UUID alone from the driver's ``NVRM: GPU at PCI:…: GPU-…`` line when
  NVML is absent. One fault may arrive from both sources.
* ``tg.node.<node>.kernel`` — ``LogLine(stream="kernel", source="agent", job=None)`` for the
  non-XID kernel lines of ``agents.kernel_log.KERNEL_LINE_PATTERNS`` (host OOM kills, segfaults,
  hung tasks …), for the detector to match against worker exits.

Health (``tg.svc.agent-<node>.health``) adds ``node``, ``nvml``, ``nvml_reason``, ``gpus``,
``kernel_log``, ``heartbeat_seq`` and event counts to the base service fields.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from trainguard.schemas import LogLine, NodeHeartbeat, NodeTelemetry, XidEvent, subjects
from trainguard.schemas.base import Event
from trainguard.services.base import Service, ServiceConfig
from trainguard.core.xid import parse_gpu_uuid_line, parse_xid_line

from trainguard.agents.host import HostSampler, NodeMemory, nats_target, parse_peer, probe_latencies
from trainguard.agents.kernel_log import Follower, KernelLogConfig, classify_kernel_line, open_follower
from trainguard.agents.nvml import NvmlConfig, NvmlSampler, NvmlXid, load_module, normalise_pci

log = logging.getLogger("trainguard.agent")

#: Subject kind of forwarded kernel lines: ``tg.node.<node>.kernel``.
KERNEL_KIND = "kernel"


def node_attributes(env: str | None = None) -> dict[str, str]:
    """The node's attributes from ``TG_NODE_ATTRS`` (``driver=550.54,rack=r3,switch=s1,…``):
    what the attributor compares when one fault comes from many nodes at once. A malformed
    entry (no ``=``) is skipped."""
    text = os.environ.get("TG_NODE_ATTRS", "") if env is None else env
    out: dict[str, str] = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if sep and k.strip() and v.strip():
            out[k.strip()[:64]] = v.strip()[:128]
    return out


@dataclass
class AgentConfig:
    """Settings of the node agent (all durations in seconds).

    ``interval_s`` — telemetry period (default 1.0).
    ``heartbeat_interval_s`` — node heartbeat period (default 0.5: node loss must be noticed
    within a few beats, well inside the design's "node-heartbeat timeout + 2 s" budget).
    ``peers`` — ``"host:port"`` endpoints whose TCP connect RTT is measured every telemetry
    period (e.g. the other nodes' rendezvous ports).
    ``probe_timeout_s`` — connect timeout of one latency probe (default 0.5).
    ``probe_bus`` — also measure the RTT to the NATS server (key ``"bus"``).
    ``kernel`` — kernel log follower settings; ``nvml`` — NVML sampler settings.
    ``memory_budget_file`` — when set, this node is a share of its host (``host.NodeMemory``):
    its memory in use is its own processes', its total the budget this file holds; ``{node}``
    in the path is replaced by the node's name (one setting for every simulated node).
    """

    interval_s: float = 1.0
    heartbeat_interval_s: float = 0.5
    peers: tuple[str, ...] = ()
    probe_timeout_s: float = 0.5
    probe_bus: bool = True
    kernel: KernelLogConfig = field(default_factory=KernelLogConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    memory_budget_file: str = ""

    def validate(self) -> None:
        """Raise ValueError naming the bad setting."""
        for name in ("interval_s", "heartbeat_interval_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"agent setting {name} must be > 0 seconds, "
                                 f"got {getattr(self, name)!r}")
        for p in self.peers:
            parse_peer(p)


class NodeAgent(Service):
    """Node agent service; its ``name`` is ``agent-<node>``. No state store is used.

    ``nvml_module`` replaces ``pynvml`` (tests stand in for the NVIDIA library there); without
    it, ``agent_config.nvml.module`` names one to load (``nvml.load_module``).
    Raises SystemExit when the node name cannot be a subject token or a setting is invalid.
    """

    uses_state = False

    def __init__(self, config: ServiceConfig | None = None,
                 agent_config: AgentConfig | None = None, *, nvml_module: Any = None):
        cfg = config or ServiceConfig()
        try:
            subjects.token(cfg.node)
        except ValueError as exc:
            raise SystemExit(f"agent: bad node name: {exc}; pass --node NAME") from None
        self.name = f"agent-{cfg.node}"
        super().__init__(cfg)
        self.agent_config = agent_config or AgentConfig()
        try:
            self.agent_config.validate()
        except ValueError as exc:
            raise SystemExit(f"{self.name}: {exc}") from None
        self.node = cfg.node
        budget = self.agent_config.memory_budget_file
        self.host = HostSampler(NodeMemory(self.node, budget.replace("{node}", self.node))
                                if budget else None)
        if nvml_module is None and self.agent_config.nvml.module and self.agent_config.nvml.enabled:
            try:
                nvml_module = load_module(self.agent_config.nvml.module, self.node)
            except ValueError as exc:
                raise SystemExit(f"{self.name}: {exc}") from None
        self.nvml = NvmlSampler(self.agent_config.nvml, module=nvml_module)
        self.follower: Follower | None = None
        self.heartbeat_seq = -1
        self.counts: collections.Counter[str] = collections.Counter()
        self._targets = {p: parse_peer(p) for p in self.agent_config.peers}
        if self.agent_config.probe_bus:
            try:
                self._targets["bus"] = nats_target(cfg.nats_url)
            except ValueError:
                pass
        self._kernel_uuids: dict[str, str] = {}
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._gpu_future: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stuck_logged = False
        self._failed_rounds: set[str] = set()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="agent-heartbeat"))
        if await asyncio.to_thread(self.nvml.open):
            names = ", ".join(f"{d.index}:{d.name or '?'}@{d.pci or '?'}"
                              for d in self.nvml.devices)
            log.info("%s: NVML sees %d GPU(s): %s", self.name, len(self.nvml.devices), names)
            self.nvml.start_xid_watch(self._on_nvml_xid)
        else:
            log.info("%s: %s", self.name, self.nvml.reason)
        self.follower = open_follower(self._on_kernel_line, self.agent_config.kernel)
        if self.follower is not None:
            self.follower.start()
            log.info("%s: following the kernel log at %s", self.name, self.follower.describe())
        self._tasks.append(asyncio.create_task(self._telemetry_loop(), name="agent-telemetry"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.follower is not None:
            await asyncio.to_thread(self.follower.stop)
        await asyncio.to_thread(self.nvml.close)
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        await super().close()

    def health(self) -> dict[str, Any]:
        f = self.follower
        return {"node": self.node, "nvml": self.nvml.available, "nvml_reason": self.nvml.reason,
                "gpus": len(self.nvml.devices) if self.nvml.available else 0,
                "kernel_log": f.describe() if f else None,
                "kernel_lines": f.lines if f else 0, "kernel_lines_lost": f.lost if f else 0,
                "heartbeat_seq": self.heartbeat_seq, "nvml_errors": dict(self.nvml.errors),
                **{f"sent_{k}": v for k, v in self.counts.items()}}

    # ---- periodic publishers ------------------------------------------------------------------
    async def _every(self, period: float, fn: Any) -> None:
        """Call ``await fn()`` every ``period`` seconds on a fixed schedule (no drift; after a
        stall the schedule restarts instead of bursting)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one failed round never ends the loop
                key = f"{getattr(fn, '__name__', fn)}:{type(exc).__name__}"
                self.counts["round_errors"] += 1
                if key not in self._failed_rounds:  # once per kind, not once per second
                    self._failed_rounds.add(key)
                    log.exception("%s: %s failed (reported once; the loop goes on)",
                                  self.name, key)
            due += period
            delay = due - loop.time()
            if delay < 0:
                due, delay = loop.time(), 0.0
            await asyncio.sleep(delay)

    async def _heartbeat_loop(self) -> None:
        await self._every(self.agent_config.heartbeat_interval_s, self.publish_heartbeat)

    async def _telemetry_loop(self) -> None:
        await self._every(self.agent_config.interval_s, self.publish_telemetry)

    async def publish_heartbeat(self) -> None:
        self.heartbeat_seq += 1
        await self._publish("heartbeat", NodeHeartbeat(
            node=self.node, role="agent", seq=self.heartbeat_seq, pid=os.getpid(),
            interval_s=self.agent_config.heartbeat_interval_s))

    async def publish_telemetry(self) -> None:
        """Sample host, GPUs (in a worker thread) and latencies concurrently; publish one
        ``NodeTelemetry``. A GPU read that takes longer than ``interval_s`` is left running and
        this round carries no GPU samples (logged once); no second read is started meanwhile."""
        h = self.host.sample()
        probes = asyncio.create_task(
            probe_latencies(self._targets, self.agent_config.probe_timeout_s))
        gpus = []
        if self.nvml.available:
            if self._gpu_future is None or self._gpu_future.done():
                self._gpu_future = asyncio.ensure_future(asyncio.to_thread(self.nvml.sample))
            try:
                gpus = await asyncio.wait_for(asyncio.shield(self._gpu_future),
                                              self.agent_config.interval_s)
            except asyncio.TimeoutError:
                if not self._stuck_logged:
                    self._stuck_logged = True
                    log.warning("%s: NVML did not answer within %.1f s; telemetry goes out "
                                "without GPU samples until it does", self.name,
                                self.agent_config.interval_s)
            except Exception as exc:  # noqa: BLE001 - a sampler defect: host metrics still go
                key = f"gpu-sample:{type(exc).__name__}"
                if key not in self._failed_rounds:
                    self._failed_rounds.add(key)
                    log.error("%s: GPU sampling failed (%s); telemetry goes out without GPU "
                              "samples", self.name, exc)
        latency = await probes
        await self._publish("telemetry", NodeTelemetry(
            node=self.node, cpu_percent=h.cpu_percent, mem_used_bytes=h.mem_used_bytes,
            mem_total_bytes=h.mem_total_bytes, load1=h.load1, net_latency_s=latency,
            nvml=self.nvml.available, gpus=gpus, attributes=node_attributes()))

    async def _publish(self, kind: str, event: Event) -> None:
        await self.bus.publish(subjects.node(self.node, kind), event)
        self.counts[kind] += 1

    # ---- events from threads (kernel log follower, NVML watcher) ------------------------------
    def _from_thread(self, kind: str, event: Event) -> None:
        """Publish from a non-loop thread; dropped (counted) once the loop is gone."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self.counts["dropped_after_close"] += 1
            return
        try:
            loop.call_soon_threadsafe(self._spawn_publish, kind, event)
        except RuntimeError:  # loop closed between the check and the call
            self.counts["dropped_after_close"] += 1

    def _spawn_publish(self, kind: str, event: Event) -> None:
        t = asyncio.ensure_future(self._publish(kind, event))
        self._inflight.add(t)
        t.add_done_callback(self._inflight.discard)

    def _gpu_of(self, pci: str) -> tuple[int | None, str]:
        if pci:
            hit = self.nvml.lookup_pci(pci) if self.nvml.available else None
            if hit:
                return hit
            return None, self._kernel_uuids.get(normalise_pci(pci), "")
        return None, ""

    def _on_kernel_line(self, message: str) -> None:
        """Follower thread: a kernel message → XidEvent, a forwarded LogLine, or nothing."""
        try:
            m = parse_xid_line(message)
        except Exception:  # noqa: BLE001 - a parser defect must not stop the follower
            log.exception("XID parser failed on %r", message[:200])
            m = None
        source = self.follower.source if self.follower else "file"
        if m is not None:
            index, uuid = self._gpu_of(m.pci)
            self._from_thread("xid", XidEvent(
                node=self.node, xid=m.xid, pci=m.pci, gpu_index=index, gpu_uuid=uuid,
                pid=m.pid, process_name=m.process_name, message=m.message, raw=m.raw,
                source=source))
            return
        announced = parse_gpu_uuid_line(message)
        if announced:
            self._kernel_uuids[normalise_pci(announced[0])] = announced[1]
            return
        if classify_kernel_line(message):
            self._from_thread(KERNEL_KIND, LogLine(node=self.node, job=None, stream="kernel",
                                                   source="agent", line=message))

    def _on_nvml_xid(self, x: NvmlXid) -> None:
        """NVML watcher thread: an XID critical-error event → XidEvent(source="nvml")."""
        where = f" (MIG GPU instance {x.gpu_instance})" if x.gpu_instance is not None else ""
        self._from_thread("xid", XidEvent(
            node=self.node, xid=x.xid, pci=x.pci, gpu_index=x.gpu_index, gpu_uuid=x.gpu_uuid,
            message=f"NVML XID critical error event{where}", source="nvml"))

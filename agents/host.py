"""Host metrics (psutil) and network latency probes of the node agent.

* ``HostSampler.sample()`` → ``HostSample``: CPU percent since the previous call, memory in
  bytes, 1-minute load average. Memory is the host's (psutil ``virtual_memory``), or, for a node
  that is a share of the host (``NodeMemory``), that of the node's own processes against the
  node's budget.
* ``probe_latencies(targets, timeout_s)`` → ``{name: seconds}``: TCP connect round-trip time
  (SYN → SYN-ACK, as seen by ``connect()``) to each ``(host, port)``; ``math.inf`` when the
  connection failed or did not complete within ``timeout_s``. A TCP connect needs no privileges
  (ICMP ping would need a raw socket) and measures the path the training traffic and the bus
  actually use.
"""
from __future__ import annotations

import asyncio
import math
import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

#: NATS client port when a URL names none (NATS documentation, "Client port").
NATS_DEFAULT_PORT = 4222


@dataclass
class HostSample:
    """``cpu_percent`` (0–100, all CPUs, since the previous sample), ``mem_used_bytes``
    (total − available, i.e. memory that cannot be handed to a new process without swapping
    or reclaiming), ``mem_total_bytes``, ``load1`` (1-minute load average)."""

    cpu_percent: float
    mem_used_bytes: int
    mem_total_bytes: int
    load1: float


#: The environment variable that says which node a process was started for (set by the
#: launcher for every rank and warm spare of a node: ``trainguard.launch.pool``).
NODE_ENV = "TG_NODE"


class NodeMemory:
    """Memory of a node that is a share of its host: several simulated nodes on one machine
    (the embedded stack), or a node confined to part of a host.

    ``used_bytes()`` — the summed anonymous resident memory (RssAnon, proc(5): resident minus
    file-backed and shared pages; memory the kernel cannot reclaim without swap, so what runs a
    host out of memory) of every process whose environment says it was started for ``node``
    (``TG_NODE=<node>``: the node's launcher's ranks and warm spares, and anything else started
    for it). A process's tag is read once (``/proc/<pid>/environ``) and kept for its lifetime;
    processes that cannot be read (another user's, gone meanwhile) are not the node's.
    ``budget_bytes()`` — the node's memory budget, read from ``budget_file`` (bytes, one
    integer) on every call, as a container's limit may change while it runs; None while the file
    is absent or holds no positive integer.
    """

    def __init__(self, node: str, budget_file: str):
        self.node = node
        self.budget_file = budget_file
        self._tags: dict[int, tuple[float, bool]] = {}

    def _is_node(self, p: psutil.Process) -> bool:
        created = p.create_time()
        known = self._tags.get(p.pid)
        if known is None or known[0] != created:
            try:
                mine = p.environ().get(NODE_ENV) == self.node
            except (psutil.Error, OSError):
                mine = False
            known = self._tags[p.pid] = (created, mine)
        return known[1]

    def used_bytes(self) -> int:
        total, alive = 0, set()
        for p in psutil.process_iter():
            try:
                alive.add(p.pid)
                if self._is_node(p):
                    m = p.memory_info()
                    total += max(0, int(m.rss) - int(getattr(m, "shared", 0)))
            except (psutil.Error, OSError):
                continue
        for pid in set(self._tags) - alive:
            del self._tags[pid]
        return total

    def budget_bytes(self) -> int | None:
        try:
            with open(self.budget_file) as fh:
                n = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            return None
        return n if n > 0 else None


class HostSampler:
    """psutil readings of this host. The first ``sample()`` covers the time since construction
    (psutil's ``cpu_percent(interval=None)`` is primed in ``__init__``). With ``node_memory``
    the memory fields are the node's (``NodeMemory``): in use, its processes'; the total, its
    budget (the host's total while it has none)."""

    def __init__(self, node_memory: NodeMemory | None = None) -> None:
        psutil.cpu_percent(interval=None)
        self.node_memory = node_memory

    def sample(self) -> HostSample:
        vm = psutil.virtual_memory()
        try:
            load1 = os.getloadavg()[0]
        except OSError:  # platforms without a load average
            load1 = 0.0
        used, total = int(vm.total - vm.available), int(vm.total)
        if self.node_memory is not None:
            used = self.node_memory.used_bytes()
            total = self.node_memory.budget_bytes() or total
        return HostSample(cpu_percent=float(psutil.cpu_percent(interval=None)),
                          mem_used_bytes=used, mem_total_bytes=total, load1=float(load1))


def parse_peer(spec: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` → ``(host, port)``.

    Raises ValueError saying the expected form when ``spec`` has no valid port.
    """
    s = spec.strip()
    host, sep, port = s.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {spec!r} must be host:port (e.g. node-2:29500 or "
                         f"[fd00::2]:29500)")
    return host, int(port)


def nats_target(url: str) -> tuple[str, int]:
    """``(host, port)`` of the first server in a NATS URL list
    (``nats://h:4222,nats://h2:4222``); the port defaults to 4222.

    Raises ValueError for a URL without a host.
    """
    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    if not parts.hostname:
        raise ValueError(f"NATS URL {url!r} has no host")
    return parts.hostname, parts.port or NATS_DEFAULT_PORT


async def tcp_rtt(host: str, port: int, timeout_s: float) -> float:
    """Seconds a TCP connect to ``host:port`` took (name resolution excluded when ``host`` is
    an address); ``math.inf`` when it failed or exceeded ``timeout_s``."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return math.inf
    if not infos:
        return math.inf
    family, _, _, _, addr = infos[0]
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(addr[0], addr[1], family=family), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return math.inf
    rtt = time.perf_counter() - t0
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout_s)
    except (OSError, asyncio.TimeoutError):
        pass
    return rtt


async def probe_latencies(targets: dict[str, tuple[str, int]],
                          timeout_s: float) -> dict[str, float]:
    """TCP connect RTT (seconds, ``math.inf`` when unreachable) to every target, probed
    concurrently; returns within about ``2 * timeout_s`` (name resolution and connect are each
    bounded by ``timeout_s``)."""
    names = list(targets)
    rtts = await asyncio.gather(*(tcp_rtt(*targets[n], timeout_s) for n in names))
    return dict(zip(names, rtts))

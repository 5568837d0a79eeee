"""The child processes of the embedded stack: a free port, a start that waits for the port to
answer, a stop that leaves no zombie.

Every server child gets ``PR_SET_PDEATHSIG`` (``die_with_parent``) so that it dies with the
process that started it, even when that process is SIGKILLed: nothing is left behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


class ServerStartError(RuntimeError):
    """An embedded server did not become ready; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """True when ``port`` can be bound on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """``preexec_fn`` of a child: SIGTERM when its parent dies (``PR_SET_PDEATHSIG``; skipped
    where libc has no ``prctl``) and a process group of its own, so that a Ctrl-C in a terminal
    reaches the stack, not its servers."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()


def wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until ``host:port`` accepts a TCP connection (``timeout`` seconds). Raises
    ServerStartError with the tail of ``log`` when ``proc`` exited first or time ran out (it is
    then killed)."""
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


def stop_process(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """End a server process this package started: SIGTERM, then SIGKILL after ``timeout``
    seconds; waits for it (no zombie). None or an ended process: nothing to do."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

"""The stack's child processes (rendezvous store, services, console): each in a process group
of its own, dying with the stack (``PR_SET_PDEATHSIG``), its output appended to
``<log dir>/<name>.log``; stopped by group, SIGTERM first.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

from trainguard.stack.process import die_with_parent


class StackError(RuntimeError):
    """The stack could not start; the message names the process and has the tail of its log."""


def tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` characters of the log at ``path`` (``"(no log)"`` when it cannot be
    read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` with ``env``, stdin closed, stdout and stderr appended to ``log`` (its
    folder created); the child dies with this process and has its own process group."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
    """Send ``sig`` to the process group of ``proc`` and wait until it exited (SIGKILL to the
    group after ``timeout`` seconds). An ended process: nothing to do."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the process group of each of ``procs`` in the order given, SIGKILL what is left
    after ``grace_s`` seconds in all; waits for every one (no zombie)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()

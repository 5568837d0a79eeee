"""Shared pieces of the benchmark's peer training scripts (``bench/peers/*.py``).

Every rank of every system appends one progress record per completed training step to the run's
progress file, so the benchmark computes "fault → every rank completed a new step" from the file
alone, the same way for every system. A record is one text line (one ``write`` on an
``O_APPEND`` descriptor, well under ``PIPE_BUF``, so lines from concurrent ranks never interleave):

    <rank> <step> <unix_ns> <pid> <loss> <incarnation> <world_size>

``incarnation`` names the process lifetime / restart generation that computed the step (it changes
on every restart, in process or not), ``world_size`` the size of the group that computed it.
Fault markers written by a rank (injected exception, start of a straggler) are lines of the same
file starting with ``#fault``: ``#fault <kind> <rank> <step> <unix_ns>``.
"""
from __future__ import annotations

import json
import os
import time


class Progress:
    """Appends progress records to ``path`` (from ``$BENCH_PROGRESS``; a no-op when unset)."""

    def __init__(self, path: str | None = None):
        path = path if path is not None else os.environ.get("BENCH_PROGRESS", "")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.pid = os.getpid()

    def step(self, rank: int, step: int, loss: float, incarnation: str, world_size: int) -> None:
        if self.fd is not None:
            os.write(self.fd, f"{rank} {step} {time.time_ns()} {self.pid} {loss:.6f} "
                              f"{incarnation} {world_size}\n".encode())

    def fault(self, kind: str, rank: int, step: int) -> int:
        ts = time.time_ns()
        if self.fd is not None:
            os.write(self.fd, f"#fault {kind} {rank} {step} {ts}\n".encode())
        return ts


class InjectedFault(RuntimeError):
    """The benchmark's injected Python exception."""


class Faults:
    """The faults a rank injects into itself: ``exception`` (raised once, in the step's backward →
    optimizer gap, like the trainguard demo) and ``straggler`` (from its step on, this rank sleeps
    ``(factor - 1) × step_sleep`` more per step). ``spec`` is the JSON list of the schedule;
    ``once_dir`` holds the markers that make an exception fire once across restarts."""

    def __init__(self, spec: str, once_dir: str, progress: Progress):
        self.faults = json.loads(spec or "[]")
        self.once_dir = once_dir
        self.progress = progress
        self.slow_since: dict[int, int] = {}

    def before_optimizer(self, rank: int, step: int) -> None:
        for i, f in enumerate(self.faults):
            if f["kind"] != "exception" or f.get("rank") != rank or f["step"] != step:
                continue
            marker = os.path.join(self.once_dir, f"exception-{i}.fired")
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.close(fd)
            self.progress.fault("exception", rank, step)
            raise InjectedFault(f"injected exception in rank {rank} at step {step}")

    def extra_sleep(self, rank: int, step: int, step_sleep: float) -> float:
        for i, f in enumerate(self.faults):
            if f["kind"] == "straggler" and f.get("rank") == rank and step >= f["step"]:
                marker = os.path.join(self.once_dir, f"straggler-{i}.started")
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.close(fd)
                    self.progress.fault("straggler", rank, step)
                except FileExistsError:
                    pass
                return (float(f.get("factor", 3)) - 1.0) * step_sleep
        return 0.0


def save_checkpoint(path: str, model, opt, step: int) -> None:
    """``torch.save`` of model, optimizer and step to ``path`` (written to a temporary file and
    renamed, so a kill during the save never leaves a torn checkpoint)."""
    import torch

    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, model, opt) -> int:
    """Restore from ``path`` if it exists; returns the first step to run (0 without one)."""
    import torch

    if not os.path.exists(path):
        return 0
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    return int(sd["step"]) + 1


def parse_line(line: str):
    """One line of a progress file → ``("step", rank, step, t_ns, pid, loss, incarnation, world)``
    or ``("fault", kind, rank, step, t_ns)``; None for a torn or foreign line."""
    parts = line.split()
    try:
        if parts and parts[0] == "#fault" and len(parts) == 5:
            return ("fault", parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
        if len(parts) == 7:
            return ("step", int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]),
                    float(parts[4]), parts[5], int(parts[6]))
    except ValueError:
        return None
    return None

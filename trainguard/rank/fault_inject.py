"""The rank side of ``trainguard launch --faults``: fire the schedule's rank faults at their step.

The launcher passes the rank faults of the schedule (``trainguard.core.fault_schedule``) to every
rank in ``TG_FAULTS`` (JSON), the directory of the markers that make each fault fire once in
``TG_FAULTS_DIR`` and its own start time in ``TG_FAULTS_T0`` (Unix seconds). ``at_step(rank,
step)`` is called by the shim each time a rank completes a step (``Context.progress`` and the
hooks of an unmodified script): a fault of that rank whose trigger is met, and whose marker
``<dir>/fault-<id>.fired`` does not exist yet, writes the marker (``O_EXCL``: once, even across
restarts, rollbacks and nodes sharing the directory; it holds the Unix ns of injection, the rank
and the step) and then fires: ``sigkill`` (SIGKILL of this process), ``hang`` (SIGSTOP of this
process), ``exception`` (raises ``InjectedFault``).
"""
from __future__ import annotations

import json
import os
import signal
import time

__all__ = ["InjectedFault", "at_step", "reset"]


class InjectedFault(RuntimeError):
    """The exception a scheduled ``exception`` fault raises in a rank's step."""


_faults: list[dict] | None = None


def reset() -> None:
    """Forget the schedule read from the environment (tests)."""
    global _faults
    _faults = None


def _load() -> list[dict]:
    global _faults
    if _faults is None:
        try:
            data = json.loads(os.environ.get("TG_FAULTS") or "{}")
        except ValueError:
            data = {}
        _faults = [f for f in data.get("faults", []) if f.get("rank") is not None]
    return _faults


def _claim(f: dict, rank: int, step: int) -> bool:
    """Write the fault's marker; False when it fired before."""
    d = os.environ.get("TG_FAULTS_DIR", "")
    if not d:
        return True
    os.makedirs(d, exist_ok=True)
    try:
        fd = os.open(os.path.join(d, f"fault-{f['id']}.fired"), os.O_WRONLY | os.O_CREAT |
                     os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps({"ts": time.time_ns(), "rank": rank, "step": step,
                             "kind": f["kind"]}))
    return True


def at_step(rank: int, step: int) -> None:
    """Fire the scheduled faults of ``rank`` due at completed ``step`` (see module docstring).
    Raises ``InjectedFault`` for an ``exception`` fault; a no-op without a schedule."""
    faults = _load()
    if not faults:
        return
    t0 = float(os.environ.get("TG_FAULTS_T0") or 0.0)
    for f in faults:
        if f["rank"] != rank:
            continue
        if "step" in f:
            if f["step"] != step:
                continue
        elif time.time() - t0 < float(f["at_s"]):
            continue
        if not _claim(f, rank, step):
            continue
        if f["kind"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["kind"] == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f["kind"] == "exception":
            raise InjectedFault(f"scheduled fault {f['id']}: exception in rank {rank} at step "
                                f"{step}")

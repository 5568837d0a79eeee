"""Restarts count progress, not attempts. Pure.

A restart is *stalled* when the job made no real progress after it: the next fault came at no
step past the highest step any fault of the run reached (the high-water mark), or — when no
report named a step — sooner than ``progress_s`` after the last fault. The job record's
``last_fault`` carries the bookkeeping (``next_last_fault``):

* ``high_water`` — the highest step at which a fault of this run came (None: none named one);
* ``stalled`` — restarts in a row after which the job made no progress;
* ``steps`` — the failing steps of those stalled restarts (the last 8), for the reason.

Progress resets ``stalled`` to 0. The retry budget (``Policy.default_retry_budget``, 10)
counts stalled restarts: a week-long job with eleven unrelated faults, each after real training,
is not stopped. A restart loop stops sooner, whatever the signature: ``Policy.loop_restarts``
(3) stalled restarts in a row whose faults all named a step (a loop that fails soon after each
load at a step that drifts: Megatron-LM issue 5281, 44 identical 90-second cycles from a corrupt
local checkpoint, NaN three steps after each load). The same signature at the same step stops at
once (``plan._would_loop``), as before.

What does not end a restart loop here: faults that named no step and come further apart than
``progress_s`` (each counts as progress, since a job that trained that long between restarts is
not looping); a loop that reaches a new highest step each time (that is progress).

A record without this bookkeeping (``last_fault`` without ``stalled``, written by an older
version, or none at all) counts every recovery action, as before: ``retries_used``.
"""
from __future__ import annotations

from typing import Any

from trainguard.schemas import JobRecord, Verdict
from trainguard.schemas.vocabulary import signature

__all__ = ["progress", "stalled_restarts", "next_last_fault", "STEPS_KEPT"]

#: failing steps kept in ``last_fault["steps"]`` (for the reason of a stop)
STEPS_KEPT = 8


def _step(v: Verdict) -> int | None:
    s = v.detail.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else None


def _high_water(last: dict[str, Any]) -> int | None:
    hw = last.get("high_water", last.get("step"))
    return hw if isinstance(hw, int) and not isinstance(hw, bool) else None


def _same_incident(last: dict[str, Any], fault_gen: int) -> bool:
    g = last.get("generation")
    return isinstance(g, int) and g >= fault_gen


def progress(v: Verdict, last: dict[str, Any], progress_s: float) -> bool:
    """Whether the job made progress between fault ``last`` (its ``last_fault``) and ``v``:
    a step past the high-water mark when both name steps, else ``progress_s`` seconds or more
    between them (Unix ns ``ts``; False when either time is unknown)."""
    step, hw = _step(v), _high_water(last)
    if step is not None and hw is not None:
        return step > hw
    now, then = v.first_ts or v.ts, last.get("ts")
    if not isinstance(then, int) or not now or not then:
        return False
    return now - then >= progress_s * 1e9


def stalled_restarts(v: Verdict, job: JobRecord, fault_gen: int, progress_s: float) -> int:
    """Restarts in a row after which the job made no progress, ``v`` included as the fault
    that ends the last one. The same incident as the last fault (its generation): unchanged."""
    last = job.last_fault
    if not last or "stalled" not in last:
        return job.retries_used
    before = int(last.get("stalled") or 0)
    if _same_incident(last, fault_gen):
        return before
    return 0 if progress(v, last, progress_s) else before + 1


def loop_facts(v: Verdict, job: JobRecord, fault_gen: int, progress_s: float,
               loop_restarts: int) -> dict[str, Any] | None:
    """The facts of a restart loop (``loop_restarts`` stalled restarts in a row, every fault
    naming a step), or None."""
    last = job.last_fault
    step = _step(v)
    if not last or "stalled" not in last or step is None or _high_water(last) is None:
        return None
    n = stalled_restarts(v, job, fault_gen, progress_s)
    if n < loop_restarts:
        return None
    steps = [*list(last.get("steps") or [])[-(STEPS_KEPT - 1):], step]
    return {"stalled": n, "high_water": _high_water(last),
            "steps": ", ".join(map(str, steps))}


def next_last_fault(v: Verdict, job: JobRecord, fault_gen: int, progress_s: float
                    ) -> dict[str, Any]:
    """The ``last_fault`` the commit of a decision for ``v`` writes: ``{fault_class, step,
    signature, generation, ts}`` (the loop check) and ``{high_water, stalled, steps}`` (this
    module)."""
    last = job.last_fault or {}
    step = _step(v)
    stalled = stalled_restarts(v, job, fault_gen, progress_s) if last else 0
    hw = _high_water(last) if last else None
    if step is not None:
        hw = step if hw is None else max(hw, step)
    steps = list(last.get("steps") or []) if stalled else []
    if stalled and step is not None and not _same_incident(last, fault_gen):
        steps = [*steps, step][-STEPS_KEPT:]
    return {"fault_class": v.fault_class, "step": step, "signature": signature(v),
            "generation": fault_gen, "ts": v.first_ts or v.ts, "high_water": hw,
            "stalled": stalled, "steps": steps}

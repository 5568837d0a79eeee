"""Checkpoint requests inside a rank: every rank saves the same step, at a step boundary, when
someone outside the job asks for a checkpoint (``schemas.CheckpointRequest`` on
``tg.job.<job>.control``; the Kubernetes drain handshake sends one before a node is drained).

A save is a collective (``Checkpointer.save``): every rank must call it with the same step, and
a rank that waits in it while a peer trains on would hold that peer in its next gradient
collective. The ranks hear of the request at slightly different times, so they first agree,
through the job's rendezvous store (outside the ranks), on the step and on whether every rank
heard of it in time. Keys live under ``tg/ckptreq/<job>/<generation>/<request_id>/``:

1. At its first step boundary after the request (step ``s``, step time ``t`` seconds), a rank
   proposes ``target = s + max(2, ceil(lookahead_s / t))`` with ``compare_set(target, "",
   proposal)``: the first proposal wins and every rank reads the same target.
2. A rank still before ``target`` adds itself to ``acks``; a rank already at or past it sets the
   outcome to ``skip`` (``compare_set(outcome, "", "skip")``: the first outcome set wins).
3. At the boundary of step ``target`` a rank that acknowledged waits (at most ``agree_s``
   seconds) until ``acks`` equals the world size, then sets the outcome to ``save``; past
   ``agree_s`` it sets ``skip``. It then reads the outcome, which is the same for every rank.
   ``save`` is only ever set when every rank acknowledged before ``target``, so every rank saves
   it; a rank that never heard of the request in time can only make the others skip.
4. On ``save`` every rank calls ``Checkpointer.save(target)``; rank 0 waits until it is
   committed and answers ``CheckpointRequestDone`` on ``tg.job.<job>.action``. Every rank then
   holds at that step for ``hold_s`` seconds (phase ``checkpoint``, whose hang allowance is
   600 s: ``detector.core.DetectorConfig.phase_timeout_s``) unless a decision ends the
   generation: a node drained meanwhile loses no step.

Store operations run on the training thread only, at step boundaries (two or three round trips
per request, none per step otherwise). Without a store (one rank) the next boundary is the
target. A job without a trainguard ``Checkpointer`` answers ``ok=False``.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("trainguard.rank.checkpoint_requests")

#: Seconds a rank at the target step waits for every rank's acknowledgement (a peer that heard
#: of the request late is blocked in the next gradient collective and can never acknowledge).
AGREE_S = 5.0
#: Seconds rank 0 waits for the requested save to be committed before answering.
COMMIT_WAIT_S = 120.0
#: Fewest steps between the proposing rank's step and the target.
MIN_LOOKAHEAD_STEPS = 2


def target_step(step: int, step_time_s: float | None, lookahead_s: float) -> int:
    """The step a rank at ``step`` proposes: ``step + max(2, ceil(lookahead_s / step_time_s))``
    (2 steps ahead when the step time is unknown)."""
    ahead = MIN_LOOKAHEAD_STEPS
    if step_time_s and step_time_s > 0 and lookahead_s > 0:
        ahead = max(ahead, math.ceil(lookahead_s / step_time_s))
    return int(step) + ahead


@dataclass
class _Pending:
    request_id: str
    hold_s: float
    lookahead_s: float
    target: int | None = None
    acked: bool = False


class CheckpointRequests:
    """One rank's side of the checkpoint requests of its job.

    ``offer(request)`` is called from the bus thread; ``at_boundary(step, step_time_s,
    checkpointer)`` from the training thread after each completed step (``Context.progress``).
    ``publish(subject, event)`` sends the answer; ``interrupted()`` returns True when a decision
    ends the generation (the hold stops then)."""

    def __init__(self, job: str, rank: int, world_size: int, generation: int, store: Any,
                 publish: Callable[[str, Any], None], interrupted: Callable[[], bool],
                 set_phase: Callable[[str], None], agree_s: float = AGREE_S):
        self.job, self.rank, self.world_size, self.generation = job, rank, world_size, generation
        self.store, self.publish, self.interrupted = store, publish, interrupted
        self.set_phase, self.agree_s = set_phase, agree_s
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._seen: set[str] = set()
        self.current: _Pending | None = None
        self.saved: list[int] = []

    def offer(self, ev: Any) -> None:
        """Queue a ``CheckpointRequest`` (a repeated ``request_id`` is ignored)."""
        with self._lock:
            if ev.request_id in self._seen:
                return
            self._seen.add(ev.request_id)
            self._queue.append(_Pending(ev.request_id, max(0.0, float(ev.hold_s)),
                                        max(0.0, float(ev.lookahead_s))))

    def _key(self, p: _Pending, name: str) -> str:
        return f"tg/ckptreq/{self.job}/{self.generation}/{p.request_id}/{name}"

    def _set_first(self, key: str, value: str) -> str:
        """Set ``key`` unless set; returns the value it holds (the first one set)."""
        return self.store.compare_set(key, "", value).decode()

    def at_boundary(self, step: int, step_time_s: float | None, ckpt: Any) -> None:
        """Advance the current request at the boundary after ``step``. Never raises for a
        store problem: the request is then answered as failed and training goes on."""
        if self.current is None:
            with self._lock:
                if not self._queue:
                    return
                self.current = self._queue.pop(0)
        p = self.current
        try:
            if p.target is None:
                self._propose(p, step, step_time_s)
                if p.target is None:
                    return
            if step < p.target:
                return
            outcome = self._outcome(p, step)
        except Exception as exc:  # noqa: BLE001 - a store problem never stops training
            self._answer(p, False, -1, "", f"rendezvous store: {exc}")
            self.current = None
            return
        self.current = None
        if outcome != "save":
            self._answer(p, False, -1, "", "not every rank heard of the request before step "
                         f"{p.target}: nothing saved; ask again (a longer lookahead_s)")
            return
        self._save_and_hold(p, step, ckpt)

    def _propose(self, p: _Pending, step: int, step_time_s: float | None) -> None:
        proposal = target_step(step, step_time_s, p.lookahead_s)
        if self.store is None or self.world_size <= 1:
            p.target, p.acked = step, True  # alone: this boundary is the target
            return
        p.target = int(self._set_first(self._key(p, "target"), str(proposal)))
        if step < p.target:
            self.store.add(self._key(p, "acks"), 1)
            p.acked = True
        else:
            self._set_first(self._key(p, "outcome"), "skip")

    def _outcome(self, p: _Pending, step: int) -> str:
        if self.store is None or self.world_size <= 1:
            return "save" if step == p.target else "skip"
        if not p.acked or step != p.target:
            return self._set_first(self._key(p, "outcome"), "skip")
        deadline = time.monotonic() + self.agree_s
        okey = self._key(p, "outcome")
        while True:
            if self.store.check([okey]):
                return self.store.get(okey).decode()
            if int(self.store.add(self._key(p, "acks"), 0)) >= self.world_size:
                return self._set_first(okey, "save")
            if time.monotonic() >= deadline:
                return self._set_first(okey, "skip")
            time.sleep(0.005)

    def _save_and_hold(self, p: _Pending, step: int, ckpt: Any) -> None:
        if ckpt is None:
            self._answer(p, False, -1, "", "this job makes no trainguard checkpoints "
                         "(ctx.checkpointer): nothing to save")
            return
        self.set_phase("checkpoint")
        started = ckpt.save(step)
        self.saved.append(step)
        if self.rank == 0:
            from trainguard.checkpoint import format as fmt

            path = os.path.join(ckpt.root, fmt.checkpoint_name(step, self.generation))
            done = started and ckpt.wait(COMMIT_WAIT_S)
            err = (ckpt.stats.get("last_error") or "") if hasattr(ckpt, "stats") else ""
            committed = done and os.path.isdir(path)
            self._answer(p, committed, step if committed else -1, path if committed else "",
                         "" if committed else (err or "the save was not committed in "
                                               f"{COMMIT_WAIT_S:.0f} s"))
        deadline = time.monotonic() + p.hold_s
        while time.monotonic() < deadline and not self.interrupted():
            time.sleep(0.02)
        self.set_phase("train")

    def _answer(self, p: _Pending, ok: bool, step: int, path: str, detail: str) -> None:
        if self.rank != 0:
            return
        from trainguard import schemas
        from trainguard.schemas import subjects

        if not ok:
            log.warning("checkpoint request %s: %s", p.request_id, detail)
        self.publish(subjects.job(self.job, "action"), schemas.CheckpointRequestDone(
            job=self.job, rank=self.rank, request_id=p.request_id, ok=ok, step=step, path=path,
            detail=detail, generation=self.generation))

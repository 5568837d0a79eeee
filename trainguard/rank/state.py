"""What a rank knows about itself, shared by the shim (``trainguard.rank.shim``) and the hooks of
an unmodified script (``trainguard.rank.hooks``): its settings (``WorkerConfig``), its progress
(``_Progress``, read by the heartbeat thread), the executed decisions that reached it
(``DecisionInbox``; what each one means for this rank is ``trainguard.core.recovery_plan.plan_rank``) and
the two ways a decision ends a generation inside ``train_fn`` (``RestartRequested``,
``JobStopped``). Torch-free. ``trainguard.rank.shim`` re-exports all of it.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from trainguard import schemas
from trainguard.schemas import subjects

from trainguard.core.recovery_plan import RankAction, RankPlan, ThisRank, plan_rank

__all__ = ["COLLECTIVE_ERROR_MARKERS", "RestartRequested", "JobStopped", "WorkerConfig",
           "DecisionInbox"]

#: Substrings of exceptions raised by a collective whose peer failed or was aborted: the rank
#: that sees them is a symptom, not the culprit. Sources: gloo transport/tcp/pair.cc messages,
#: torch.distributed timeouts; NCCL's "remote process exited / ncclRemoteError".
COLLECTIVE_ERROR_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "gloo/transport", "Timed out waiting", "ncclRemoteError", "NCCL communicator was aborted",
    "Socket Timeout", "Application timeout caused pair closure",
)


class RestartRequested(RuntimeError):
    """Raised inside ``train_fn`` (from ``ctx.progress``) when a decision asks this healthy rank
    to leave its current generation (a peer is being restarted or excluded)."""


class JobStopped(SystemExit):
    """The remediator decided to stop the job; carries the reason. Exit status 3."""

    def __init__(self, reason: str):
        super().__init__(3)
        self.reason = reason


@dataclass
class WorkerConfig:
    """Settings of the shim, read from the environment by ``from_env``.

    ``heartbeat_interval_s`` (0.1): rank heartbeat period — hang detection resolution.
    ``decision_timeout_s`` (60): how long a faulted rank waits for a decision before acting on
    its own (restart in process at the next generation) — the bus may be gone.
    ``rendezvous_timeout_s`` (120): barrier timeout of a generation.
    ``pg_timeout_s`` (300): collective timeout of the process groups (last resort only).
    """

    job: str = "default"
    node: str = field(default_factory=subjects.default_node)
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    generation: int = 0
    mode: str = "action"
    nats_url: str = ""
    redis_url: str = ""
    rdzv_endpoint: str = ""
    ckpt_dir: str = ""
    backend: str = "gloo"
    heartbeat_interval_s: float = 0.1
    decision_timeout_s: float = 60.0
    rendezvous_timeout_s: float = 120.0
    pg_timeout_s: float = 300.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "WorkerConfig":
        e = os.environ if env is None else env
        rdzv = e.get("TG_RDZV_ENDPOINT") or (
            f"{e['MASTER_ADDR']}:{e['MASTER_PORT']}" if "MASTER_ADDR" in e and "MASTER_PORT" in e
            else "")
        return cls(
            job=e.get("TG_JOB", "default"), node=e.get("TG_NODE") or subjects.default_node(),
            rank=int(e.get("RANK", 0)), local_rank=int(e.get("LOCAL_RANK", 0)),
            world_size=int(e.get("WORLD_SIZE", 1)),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", 1)),
            generation=int(e.get("TG_GENERATION", 0)), mode=e.get("TG_MODE", "action"),
            nats_url=e.get("NATS_URL", ""), redis_url=e.get("REDIS_URL", ""),
            rdzv_endpoint=rdzv, ckpt_dir=e.get("TG_CKPT_DIR", ""),
            backend=e.get("TG_BACKEND", "gloo"),
            heartbeat_interval_s=float(e.get("TG_HEARTBEAT_INTERVAL_S", 0.1)),
            decision_timeout_s=float(e.get("TG_DECISION_TIMEOUT_S", 60.0)),
        )


class _Progress:
    """Progress shared with the heartbeat thread (plain attributes; the GIL makes each
    assignment atomic)."""

    __slots__ = ("step", "loss", "step_time_s", "progress_ts", "phase", "collective_seq",
                 "collectives_completed", "compute_s", "arrived", "_last_mono")

    def __init__(self) -> None:
        self.step = -1
        self.loss: float | None = None
        self.step_time_s: float | None = None
        self.progress_ts = 0
        self.phase = "startup"
        self.collective_seq = 0
        self.collectives_completed: int | None = None  # counted by trainguard.rank.hooks only
        self.compute_s: float | None = None
        self.arrived = False
        self._last_mono = 0.0

    def advance(self, step: int, loss: float | None) -> None:
        """Record that ``step`` completed with ``loss`` (None: no loss reported); the step time
        is the wall time since the previous step while training."""
        now = time.monotonic()
        if self._last_mono and self.phase == "train":
            self.step_time_s = now - self._last_mono
        self._last_mono = now
        self.step = step
        self.loss = None if loss is None else float(loss)
        self.progress_ts = time.time_ns()
        self.phase = "train"



class DecisionInbox:
    """The executed decisions that reached this rank and are still ahead of it, for the shim.

    ``offer`` is called on the bus thread, the rest on the rank's threads (a condition guards the
    list). Which decisions count, and what they mean for this rank, is ``plan_rank`` with the
    rank's seat and generation as they are in ``cfg`` at that moment (``cfg`` changes when the
    rank rejoins). Each idempotency key is taken once.
    """

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.decisions: list[schemas.Decision] = []
        self._cond = threading.Condition()
        self._seen_keys: set[str] = set()

    def me(self) -> ThisRank:
        """This rank, as ``plan_rank`` sees it (the shim rejoins in process)."""
        c = self.cfg
        return ThisRank(node=c.node, local_rank=c.local_rank, rank=c.rank,
                        world_size=c.world_size, in_process=True)

    def plan(self, d: schemas.Decision) -> RankPlan:
        """What ``d`` means for this rank now."""
        return plan_rank(d, self.me(), self.cfg.generation)

    def offer(self, d: schemas.Decision) -> bool:
        """Take ``d`` when it is for this rank and new (its key not seen); True when taken."""
        if self.plan(d).action is RankAction.IGNORE or d.idempotency_key in self._seen_keys:
            return False
        self._seen_keys.add(d.idempotency_key)
        with self._cond:
            self.decisions.append(d)
            self._cond.notify_all()
        return True

    def newer(self) -> schemas.Decision | None:
        """The executed decision of the newest generation still ahead of this rank, if any."""
        with self._cond:
            return self._newer_locked()

    def wait(self, timeout_s: float) -> schemas.Decision | None:
        """``newer()``, waiting up to ``timeout_s`` seconds for one; None when none came."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                d = self._newer_locked()
                if d is not None:
                    return d
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.05))

    def _newer_locked(self) -> schemas.Decision | None:
        live = [d for d in self.decisions if self.plan(d).action is not RankAction.IGNORE]
        return max(live, key=lambda d: d.generation) if live else None

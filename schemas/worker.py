"""Events from the worker side: the shim inside each rank and the launcher on each node."""
from __future__ import annotations

from pydantic import field_validator

from trainguard.schemas.base import Event

#: Phases a rank reports; each has its own hang allowance in the detector.
PHASES = ("startup", "train", "checkpoint", "recovery", "compile", "eval", "done")
#: Characters of a phase name a heartbeat keeps: the detector holds each rank's last phase, and a
#: hostile 200 KB one (seen in bench/fuzz.py) would be held that long; ``Context.phase`` refuses a
#: longer name at the source.
MAX_PHASE_CHARS = 64


class RankHeartbeat(Event):
    """Liveness and progress of one rank. Subject ``tg.job.<job>.rank.<rank>.hb``.

    Sent by a background thread of the shim every ``interval_s`` seconds, so a rank blocked in a
    collective keeps beating while a stopped (SIGSTOP) or dead rank falls silent.

    * ``step`` — last completed training step (-1 before the first);
    * ``step_time_s`` — wall seconds of that step; ``loss`` — its loss (None if not reported);
    * ``progress_ts`` — Unix ns when ``step`` last advanced;
    * ``phase`` — one of ``PHASES``;
    * ``generation`` — restart generation of the process group the rank is in;
    * ``collective_seq`` — under ``trainguard.run``: number of training steps whose collectives
      were entered; under the hooks of an unmodified script (``trainguard.rank.hooks``): number of
      collectives entered (the script's ``torch.distributed`` calls and DDP's gradient buckets);
    * ``collectives_completed`` — how many of those collectives completed (the hooks only; None
      from the shim and from older senders): a rank with ``collective_seq`` above it waits
      inside a collective, a rank level with it computes;
    * ``compute_s`` — seconds of the last step spent before its first gradient collective (set
      when the model is wrapped with ``ctx.ddp``). In synchronous data parallelism every rank's
      step wall time is the same (all wait in the allreduce), so this is what tells the
      straggler: it is large on the slow rank and small on the ranks waiting for it.
    """

    SCHEMA = "rank.heartbeat"
    local_rank: int = 0
    world_size: int = 1
    generation: int = 0
    pid: int = 0
    step: int = -1
    loss: float | None = None
    step_time_s: float | None = None
    progress_ts: int = 0
    phase: str = "train"
    collective_seq: int = 0
    collectives_completed: int | None = None
    compute_s: float | None = None
    interval_s: float = 0.1

    @field_validator("phase")
    @classmethod
    def _phase_length(cls, v: str) -> str:
        """A phase name is cut to ``MAX_PHASE_CHARS``: one label the detector keeps per rank
        (a heartbeat with a long one still counts as a beat)."""
        return v[:MAX_PHASE_CHARS]


class WorkerStarted(Event):
    """A rank process started (or a warm spare was promoted). Subject ``tg.job.<job>.worker``."""

    SCHEMA = "worker.started"
    local_rank: int = 0
    pid: int = 0
    generation: int = 0
    world_size: int = 1
    spare: bool = False


class WorkerExited(Event):
    """A rank process exited. Subject ``tg.job.<job>.worker``.

    ``exit_code`` is the process exit status (None when killed by a signal); ``signal`` the
    signal number that killed it (e.g. 9 for SIGKILL), else None. ``oom_killed`` is True when
    the kernel log attributes the kill to the OOM killer.
    """

    SCHEMA = "worker.exited"
    local_rank: int = 0
    pid: int = 0
    generation: int = 0
    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    expected: bool = False


class LogLine(Event):
    """A line from a rank's output or a caught exception. Subject ``tg.job.<job>.log``.

    ``stream`` is ``stdout``, ``stderr`` or ``exception`` (a traceback caught by the shim, in
    ``line``); ``step`` is the step the rank was in, when known.
    """

    SCHEMA = "log.line"
    stream: str = "stderr"
    line: str
    step: int | None = None
    generation: int = 0
    source: str = "shim"


class TrainingResumed(Event):
    """A rank completed its first step after a restart. Subject ``tg.job.<job>.recovery``.

    ``restored_step`` is the checkpoint step loaded; ``resumed_step`` the first step completed in
    the new generation; ``steps_rolled_back`` = last step completed before the fault minus
    ``restored_step``; ``fault_ts`` the Unix ns of the fault the rank saw (0 if unknown).
    ``path``: how the state came back — ``"peer"`` (from healthy data-parallel peers: the step
    they all held) or ``"checkpoint"`` (the newest valid checkpoint); ``reason``: why that path
    (on ``"checkpoint"``: why no peer could give the state). ``restore_source`` is ``"peer"``,
    ``"disk"``, ``"shm"``, ``"script"`` or ``"none"``. ``path`` and ``reason`` were added to
    version 1 with defaults (``"checkpoint"``, ``""``): older events decode unchanged.
    ``rendezvous_ts``: Unix ns when this rank had passed the generation's barrier and formed
    its process groups (0: unknown, e.g. an unmodified script's own rendezvous); added to
    version 1 with that default.
    """

    SCHEMA = "recovery.resumed"
    generation: int
    world_size: int
    restored_step: int
    resumed_step: int
    steps_rolled_back: int = 0
    fault_ts: int = 0
    restore_source: str = "disk"
    decision_id: str = ""
    path: str = "checkpoint"
    reason: str = ""
    rendezvous_ts: int = 0


class RecoveryVerified(Event):
    """Post-recovery check: the loss of the first steps after a restore compared with the loss
    recorded at save time. Subject ``tg.job.<job>.recovery``.

    ``ok`` is True when ``|loss_after - loss_at_save| <= tolerance * max(1, |loss_at_save|)``.
    """

    SCHEMA = "recovery.verified"
    generation: int
    restored_step: int
    loss_at_save: float | None = None
    loss_after: float | None = None
    tolerance: float = 0.5
    ok: bool = True

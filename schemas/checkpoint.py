"""Checkpoint events. Subject ``tg.job.<job>.ckpt``."""
from __future__ import annotations

from pydantic import Field

from trainguard.schemas.base import Event, Items


class CheckpointSaved(Event):
    """A checkpoint directory was committed (manifest written last, then renamed into place).

    ``path`` is the committed directory; ``step`` the training step; ``bytes`` its total size;
    ``loss`` the loss recorded at save time (for post-recovery verification);
    ``blocking_s`` seconds the training loop was blocked; ``durable_s`` seconds until fsynced.
    """

    SCHEMA = "ckpt.saved"
    path: str
    step: int
    world_size: int
    generation: int = 0
    bytes: int = 0
    loss: float | None = None
    blocking_s: float | None = None
    durable_s: float | None = None


class CheckpointValidated(Event):
    """The validator checked a checkpoint and found it valid."""

    SCHEMA = "ckpt.validated"
    path: str
    step: int
    bytes: int = 0
    duration_s: float = 0.0
    gbps: float = 0.0


class CheckpointInvalid(Event):
    """The validator found a checkpoint invalid; ``reasons`` says each problem found."""

    SCHEMA = "ckpt.invalid"
    path: str
    step: int
    reasons: Items[str] = Field(default_factory=list)
    duration_s: float = 0.0


class CheckpointSaveFailed(Event):
    """A save failed (disk full, permission denied …); training goes on, the last valid
    checkpoint stays. ``error`` is the message, ``errno`` the OS error number when there is one,
    ``generation`` the restart generation of the rank that reports it."""

    SCHEMA = "ckpt.save_failed"
    step: int
    path: str = ""
    error: str
    errno: int | None = None
    generation: int = 0


class CheckpointRequest(Event):
    """Ask every rank of a job for a checkpoint at the next step boundary they can agree on
    (``trainguard.rank.checkpoint_requests``). Subject ``tg.job.<job>.control``; published by the
    remediator role (the Kubernetes drain handshake, ``trainguard.scheduler.k8s.drain``).

    ``request_id`` — names the request (the ranks meet under it in the rendezvous store);
    ``reason`` — why, for logs and the audit trail; ``hold_s`` — seconds every rank waits at the
    saved step before training on (0: train on at once), so that a node drained right after
    the save loses no step; ``lookahead_s`` — how far ahead, in seconds of steps, the ranks
    place the step they save, so that every rank hears of the request before it gets there.
    """

    SCHEMA = "ckpt.request"
    request_id: str
    reason: str = ""
    hold_s: float = 0.0
    lookahead_s: float = 1.0


class CheckpointRequestDone(Event):
    """Rank 0's answer to a ``CheckpointRequest``, sent once the requested checkpoint is
    committed (``ok``) or could not be made (``ok`` False, ``detail`` says why). Subject
    ``tg.job.<job>.action``. ``step`` — the step saved (-1 when none); ``path`` — the committed
    checkpoint directory; ``generation`` — the rank's restart generation."""

    SCHEMA = "ckpt.request_done"
    request_id: str
    ok: bool
    step: int = -1
    path: str = ""
    detail: str = ""
    generation: int = 0

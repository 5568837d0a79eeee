"""Configuration of the Checkpointer (torch-free)."""
from __future__ import annotations

import os
from dataclasses import dataclass


def staging_path(shm_dir: str, job: str, rank: int) -> str:
    """The staging buffer of one rank: ``<shm_dir>/trainguard-<job>-r<rank>.stage`` (plus a
    ``.meta`` file beside it). Torch-free, so the launcher can clean up without importing torch."""
    return os.path.join(shm_dir, f"trainguard-{job}-r{rank}.stage")


OVERLAP_POLICIES = ("wait", "skip")
CHECKSUMS = ("xxh3_64",)

#: Relative tolerance of the post-recovery loss check (``CheckpointConfig.loss_tolerance``;
#: ``recovery.verified`` carries it, and its schema default is the same number). The loss
#: compared after a restore is that of the next step — another batch, one more update — so the
#: check must pass the ordinary spread of a minibatch loss between neighbouring steps; it is
#: meant to catch a restore that did not take (a model left at its initialisation, whose loss
#: is usually a multiple of the trained one) or a non-finite loss, not small drifts. ±50 % of
#: the saved loss (±0.5 absolute below 1) is that band; it is a judgement, not a measurement:
#: set ``loss_tolerance`` tighter for a smooth loss, looser for a noisy one.
DEFAULT_LOSS_TOLERANCE = 0.5


@dataclass
class CheckpointConfig:
    """Settings of one job's checkpoints. Every field has a default; ``root`` usually is set.

    ``root`` — directory of this job's checkpoints (one sub-directory per checkpoint; created if
    missing). Default ``"checkpoints"`` (relative to the working directory).
    ``keep`` — retention K: the newest K *valid* checkpoints are kept, and everything newer than
    the K-th newest valid one; older ones are deleted. The newest valid one is never deleted.
    Default 3.
    ``overlap_policy`` — what ``save()`` does when this rank's previous save is still being
    written: ``"wait"`` (default) blocks until it is durable, then saves; ``"skip"`` drops the new
    save on every rank (all ranks agree), counts it in ``stats["skipped"]`` and publishes
    ``ckpt.save_failed`` whose error starts with ``"skipped:"``.
    ``checksum`` — per-file checksum algorithm: ``"xxh3_64"`` (xxhash package; 9 GB/s per core
    measured here against 0.84 GB/s for sha256, ../shared/findings.md).
    ``shm_dir`` — node-local shared memory for the staging buffers (default ``/dev/shm``); the
    staged state survives the death of the training process there.
    ``fsync`` — fsync every file and directory before the commit rename (default True; turning
    it off trades durability after a power loss for speed).
    ``commit_timeout_s`` — seconds the coordinator waits for every rank's shard before it
    abandons the checkpoint (default 120).
    ``writer_nice`` — niceness of a writer process this Checkpointer starts (default 10, so that
    checksumming and writing yield to the training on shared cores).
    ``reverify_valid`` — at restore, re-check sizes and checksums of a checkpoint the validator
    marked valid (catches damage after validation; ≈ 0.1 s per GB). Default True.
    ``restore_from_shm`` — restore from this node's staged copy when it is byte-identical to the
    chosen checkpoint and the world is unchanged (default True).
    ``state_timeout_s`` — seconds to wait for the state store at restore before verifying
    manifests locally (default 2).
    ``loss_tolerance`` — relative tolerance of the post-recovery loss check that
    ``trainguard.run`` publishes as ``recovery.verified`` (``Checkpointer.recovery_check``): ok
    when ``|loss_after - loss_at_save| <= tol * max(1, |loss_at_save|)``. Default
    ``DEFAULT_LOSS_TOLERANCE`` (0.5; its reason is there). Must be ≥ 0.
    ``peer_recovery`` — at restore, take the state from healthy data-parallel peers when a
    complete replica survived the fault (``checkpoint.live``), before any checkpoint: no step is
    lost. Default True; False always loads the newest valid checkpoint.
    ``certify`` — at each save, compare the replicas' state digests (one tiny all-gather) and
    mark a checkpoint whose replicas disagree, or whose state did not change although the step
    advanced, not certified (invalid). Default True.
    """

    root: str = "checkpoints"
    keep: int = 3
    overlap_policy: str = "wait"
    checksum: str = "xxh3_64"
    shm_dir: str = "/dev/shm"
    fsync: bool = True
    commit_timeout_s: float = 120.0
    writer_nice: int = 10
    reverify_valid: bool = True
    restore_from_shm: bool = True
    state_timeout_s: float = 2.0
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE
    peer_recovery: bool = True
    certify: bool = True

    def __post_init__(self) -> None:
        if self.overlap_policy not in OVERLAP_POLICIES:
            raise ValueError(f"overlap_policy must be one of {OVERLAP_POLICIES}, "
                             f"got {self.overlap_policy!r}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {CHECKSUMS}, got {self.checksum!r}")
        if not self.loss_tolerance >= 0:
            raise ValueError(f"loss_tolerance must be ≥ 0 (a relative band around the saved "
                             f"loss), got {self.loss_tolerance!r}")
        if int(self.keep) < 1:
            raise ValueError(f"keep must be ≥ 1 (the newest valid checkpoint is always kept), "
                             f"got {self.keep}")

"""One save in flight: staged into shared memory by the training thread, written (and, on the
coordinator, committed) by the writer process in the background, finished by the writer's
reply — or abandoned.

Lifecycle::

    SaveSession(...)  ─ stage(staging)            copy every local tensor into the buffer  ← blocks
                      ─ start(writer, request)    hand the request to the writer          ─ returns
    writer's reply    ─ complete(reply)           "done" (durable; committed on rank 0) | "failed"
    or a fault        ─ abandon(writer)           the coordinator drops the commit → "failed"

``done`` turns True (and ``wait`` returns) once the reply came — the writer's, or the one the
connection makes up when the writer dies.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from trainguard.checkpoint import format as fmt
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.plan import SavePlan

log = logging.getLogger("trainguard.checkpoint")


@dataclass(frozen=True)
class RankIdentity:
    """Who saves: ``job``, ``rank`` in a world of ``world_size``, ``generation``."""

    job: str
    rank: int
    world_size: int
    generation: int

    @property
    def coordinator(self) -> bool:
        """Rank 0 commits the checkpoint."""
        return self.rank == 0


class SaveSession:
    """The save of ``step`` (``loss``: recorded in the manifest) with ``plan``, id ``save_id``;
    ``t0``: ``time.perf_counter()`` when ``save`` was called. ``on_done(session, reply)`` runs
    on the writer connection's reader thread when the reply comes (its errors are logged,
    never raised). ``blocking_s``: seconds ``save`` blocked, set by the caller."""

    def __init__(self, save_id: int, step: int, loss: float | None, plan: SavePlan,
                 identity: RankIdentity, nonce: int, t0: float,
                 on_done: Callable[["SaveSession", dict], None]):
        self.id, self.step, self.loss, self.plan = save_id, int(step), loss, plan
        self.identity, self.nonce, self.t0 = identity, nonce, t0
        self.on_done = on_done
        self.event = threading.Event()
        self.reply: dict | None = None
        self.blocking_s: float | None = None

    @property
    def name(self) -> str:
        """The checkpoint directory's name."""
        return fmt.checkpoint_name(self.step, self.identity.generation)

    @property
    def done(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the reply; False on timeout."""
        return self.event.wait(timeout)

    # ---- the steps ---------------------------------------------------------------------------
    def stage(self, staging: Any, copied: bool = False) -> None:
        """Copy every local tensor into ``staging`` (``staging.Staging``; the only blocking
        part; ``copied``: ``copy_state`` already did, with this plan), then describe the buffer
        in its sidecar."""
        ident = self.identity
        if not copied:
            copy_state(self.plan, staging)
        staging.write_meta({"job": ident.job, "rank": ident.rank,
                            "world_size": ident.world_size, "step": self.step,
                            "generation": ident.generation, "nonce": self.nonce,
                            "items": self.plan.staging_index()})

    def request(self, root: str, shm_path: str, byte_blobs: list[bytes],
                metadata: bytes | None, config: CheckpointConfig) -> dict:
        """The writer's ``save`` request (``protocol``)."""
        ident = self.identity
        return {"op": "save", "id": self.id, "plan_id": self.plan.plan_id,
                "shm_path": shm_path,
                "tmp_dir": os.path.join(root, f"{fmt.TMP_PREFIX}{self.name}-{self.nonce:x}"),
                "final_dir": os.path.join(root, self.name), "rank": ident.rank,
                "world_size": ident.world_size, "bytes_data": byte_blobs,
                "coordinator": ident.coordinator, "metadata": metadata,
                "manifest": {"job": ident.job, "step": self.step,
                             "generation": ident.generation,
                             "loss": None if self.loss is None else float(self.loss),
                             "keys": self.plan.keys},
                "commit_timeout_s": config.commit_timeout_s, "fsync": config.fsync}

    def start(self, writer: Any, request: dict) -> None:
        """Hand ``request`` to ``writer`` (``client.WriterClient``); the reply completes this
        session. Raises OSError when the writer is gone (the session is then done, with no
        reply and no callback)."""
        writer.pending[self.id] = self
        try:
            writer.send(request)
        except OSError:
            writer.pending.pop(self.id, None)
            self.event.set()
            raise

    def complete(self, reply: dict) -> None:
        """The writer's reply (``protocol``): run ``on_done``, then wake ``wait``."""
        self.reply = reply
        try:
            self.on_done(self, reply)
        except Exception:  # noqa: BLE001 - a callback error never kills the reader
            log.exception("checkpoint completion callback failed")
        self.event.set()

    def abandon(self, writer: Any) -> None:
        """Ask ``writer`` to give this save up (a coordinator waiting for shards stops at once
        and replies "failed"; elsewhere the request is ignored). Never raises."""
        if writer is None or writer.dead or self.done:
            return
        try:
            writer.send({"op": "cancel", "id": self.id})
        except OSError:
            pass

    def durable_s(self) -> float:
        """Seconds since ``save`` was called."""
        return time.perf_counter() - self.t0


def copy_state(plan: SavePlan, staging: Any) -> None:
    """Copy every local tensor of ``plan`` into ``staging`` (``staging.Staging``, at least
    ``plan.staging_size`` bytes) at its planned offset. The sidecar is removed first: until
    ``SaveSession.stage`` describes the buffer again, nothing restores from it."""
    from torch.distributed.checkpoint.planner import WriteItemType

    from trainguard.checkpoint.plan import item_key

    planner = plan.planner
    staging.clear_meta()
    for wi in plan.local_items:
        if wi.type == WriteItemType.BYTE_IO:
            continue
        s = plan.staged[item_key(wi)]
        src = planner.resolve_data(wi)
        if hasattr(src, "to_local"):
            src = src.to_local()
        staging.view(s.offset, s.nbytes, s.dtype, s.shape).copy_(src.detach().reshape(s.shape))

"""What a rank's checkpointing holds between saves and across Checkpointers: the connection to
its writer, its staging buffer and the save in flight. One ``CheckpointResources`` object per
training process and job, owned by whoever makes the Checkpointers: a Checkpointer makes its
own when given none; ``trainguard.run`` keeps one for the whole process and passes it to the
Checkpointer of every generation, so that an in-process restart reuses the writer and the
staging buffer, and so that the shim can abandon the save in flight when a fault ends the
generation (``abandon_inflight``). Nothing here is global to the module.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from trainguard.checkpoint.client import WriterClient

if TYPE_CHECKING:  # staging imports torch; this module does not need it
    from trainguard.checkpoint.plan import SavePlan
    from trainguard.checkpoint.session import SaveSession
    from trainguard.checkpoint.staging import Staging


class CheckpointResources:
    """The per-process resources of one job's checkpointing.

    ``writer``: the ``WriterClient`` (None until the first save; a new one replaces a dead
    one). ``staging``: the staging buffer (None until the first plan). ``inflight``: the last
    save started (``SaveSession``; finished or not). ``unreported_failure``: a save failed
    since the last agreement (the next save tells the other ranks). ``live``: the
    ``live.LiveState`` of the newest Checkpointer that restored (its model and optimizer, kept
    across an in-process restart for the peer path of the next restore). ``last_certified``:
    (step, state digest) of the newest save the replicas certified (stale detection). Thread-safe where the
    reader thread of the writer meets the training thread (``inflight``, ``seq``).
    """

    def __init__(self) -> None:
        self.writer: WriterClient | None = None
        self.staging: Staging | None = None
        self.inflight: SaveSession | None = None
        self.unreported_failure = False
        self.live = None
        self.last_certified: tuple[int, str] | None = None
        self._seq = 0
        self._lock = threading.Lock()

    def next_seq(self) -> int:
        """A number not given out before by these resources (plan and save ids)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def busy(self) -> bool:
        """True while a save is in flight (started and not yet durable or failed)."""
        p = self.inflight
        return p is not None and not p.done

    def writer_client(self, nice: int) -> WriterClient:
        """The live writer connection, started (``nice``: of a private writer) when there is
        none or the last one died."""
        w = self.writer
        if w is None or w.dead:
            if w is not None:
                w.close()
            self.writer = w = WriterClient(nice)
        return w

    def fitting_staging(self, path: str, plan: SavePlan) -> Staging | None:
        """The current staging buffer when it is at ``path`` and holds ``plan``'s staged
        tensors (``plan.staging_size`` bytes), else None."""
        st = self.staging
        return st if st is not None and st.path == path and st.size >= plan.staging_size \
            else None

    def ensure_staging(self, path: str, size: int) -> Staging:
        """The staging buffer at ``path`` of at least ``size`` bytes: the current one when it
        fits, else a new mapping (the old one is unmapped; unlinked when the path changed)."""
        from trainguard.checkpoint.staging import Staging

        st = self.staging
        if st is None or st.path != path or st.size < size:
            if st is not None:
                st.close(unlink=st.path != path)
            self.staging = st = Staging(path, size)
        return st

    def abandon_inflight(self) -> bool:
        """Cancel the save in flight, if any. Returns True when one was. Never raises.

        Called when a fault ends the generation (``trainguard.run`` does, through the resources
        it passed to its Checkpointers): a save of the old generation may wait for a shard a
        dead rank will never write, and the coordinator would hold it until the commit timeout,
        blocking the next save of the new generation for that long (seen here: rank 0 stuck in
        ``save`` for 120 s after a SIGKILL during a save, the job escalated by the watchdog).
        The coordinator's writer drops the temporary directory; a shard already written by
        another rank is swept with it.
        """
        p = self.inflight
        if p is None or p.done:
            return False
        p.abandon(self.writer)
        return True

    def release(self, timeout: float = 5.0) -> None:
        """Stop the writer (a private one is waited for up to ``timeout`` s) and remove the
        staging buffer from shared memory. The resources stay usable: the next save starts a
        writer and maps a buffer again. Never raises."""
        w, st = self.writer, self.staging
        self.writer = self.staging = None
        if w is not None:
            w.stop(timeout)
        if st is not None:
            st.close(unlink=True)

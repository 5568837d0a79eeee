"""``Checkpointer``: async checkpoints that block training only while staging, written by a
background process, validated before anyone resumes from them, restorable on another world size.

Save path (every rank calls ``save`` collectively)::

    save(step) ─ copy every local tensor into the reused /dev/shm staging buffer   ← blocks here
                 while one all_gather agrees on step, overlap, plan, nonce (after it: a new plan)
               ─ hand the request to the writer process                            ─ returns
    writer     ─ writes __<rank>_0.distcp (torch.save blobs DCP can read), xxh3_64 and NaN/Inf
                 count in the same pass, fsync
    rank 0's   ─ waits for every rank's shard, writes .metadata, manifest.json (last), fsyncs,
    writer       renames .tmp-… → step_…_g…  (the commit), fsyncs the root
    rank 0     ─ publishes ckpt.saved; retention; the validator marks it valid / invalid

Restore (collective): first from healthy peers (``live``: when a complete replica of the state
survived the fault, the ranks agree on the newest step they hold and the holders send it to the
others; no step is lost), else the newest valid checkpoint. Rank 0 picks the newest checkpoint
that is valid — marked valid by the validator (sizes and checksums re-checked), or, when
pending or the state store is unreachable, verified here with the validator's own function —
and not written after its generation ended, and broadcasts it; every rank loads it with DCP
(any world size: resharding) or, when the world is unchanged and this node's staged copy is
byte-identical to it, from shared memory.

The parts: ``plan`` (the ``SavePlan``: where every item goes), ``session`` (one save in flight),
``restorer`` (choosing, loading, the post-restore check), ``resources`` (what the process holds
between saves: writer connection, staging buffer, the save in flight), ``collectives``, ``index``
(verdicts and retention), ``live`` (recovery from peers), ``replicas`` (the digest, the recovery
plan, the certificate of a save). This class runs them in order and keeps the counters.

Certified saves: every save all-gathers each replica's state digest with the save agreement; a
disagreement, or a state identical to the previous certified save's while the step advanced,
writes the checkpoint with ``"certified": false`` in its manifest (``verify`` rejects it) and
names the disagreeing ranks as suspects of silent data corruption (``anomaly``,
``detail.sdc_suspect``).
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

import torch

from trainguard.checkpoint import collectives, statedict
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.index import doomed, fetch_generation_ends, fetch_index
from trainguard.checkpoint.live import LiveState, peer_restore
from trainguard.checkpoint.plan import SavePlan, make_plan, new_plan_id, signature, trim_heap
from trainguard.checkpoint.replicas import Certificate, certify, manifest_fields, state_digest
from trainguard.checkpoint.resources import CheckpointResources
from trainguard.checkpoint.restorer import Restorer, RestoreResult, loss_matches, recovery_check
from trainguard.checkpoint.session import RankIdentity, SaveSession, copy_state
from trainguard.checkpoint.staging import staging_path

__all__ = ["Checkpointer", "loss_matches"]

log = logging.getLogger("trainguard.checkpoint")


class Checkpointer:
    """Async, validated, resharding checkpoints of ``model`` (and ``optimizer``) for one rank.

    ``model``: ``nn.Module``, DDP-wrapped or FSDP2 (``fully_shard``); state keys are those of
    the unwrapped module, so checkpoints are portable. ``config``: ``CheckpointConfig``.
    ``job``/``rank``/``world_size``/``generation``: identity of this rank in the current
    generation. ``group``: a gloo process group for checkpoint collectives, separate from the
    training group (DCP-style collectives on the training group deadlock, findings.md); None
    when not distributed. ``bus``: ``ThreadedBus`` for ``ckpt.saved``/``ckpt.save_failed`` on
    ``tg.job.<job>.ckpt`` (None: no events). ``redis_url``: the state store with the validator's
    verdicts (None or unreachable: restore verifies manifests itself). ``resources``: the
    ``CheckpointResources`` to use (writer connection, staging buffer, save in flight); pass
    the same object to the Checkpointers of successive generations of one job in a process to
    reuse them (``trainguard.run`` does); None: this Checkpointer makes its own.

    Construction is cheap (no I/O): the writer process and the staging buffer are created on
    first use.

    ``data``: an object with ``state_dict()``/``load_state_dict()`` holding the data position
    (kept and sent with the state on the peer path), or None when the step says it.

    Attributes after ``restore()``: ``restored_step`` (int | None), ``restored_loss``
    (float | None), ``restore_source`` ("peer" | "disk" | "shm" | "none"), ``restore_reason``
    (why newer checkpoints were passed over, "" if none were), ``restored_path``,
    ``recovery_path`` ("peer" | "checkpoint") and ``recovery_reason`` (why that path).
    ``certificate``: the ``replicas.Certificate`` of the last save.
    ``stats``: counters (saves, skipped, failed, committed) and the last ``blocking_s`` /
    ``durable_s`` in seconds. ``interrupt``: optional callable, called every 50 ms while a
    save waits for the previous one; it may raise to abandon the wait.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, config: CheckpointConfig, job: str, rank: int, world_size: int,
                 generation: int = 0, group: Any = None, bus: Any = None,
                 redis_url: str | None = None, interrupt: Any = None,
                 resources: CheckpointResources | None = None, data: Any = None):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.job, self.rank, self.world_size = job, int(rank), int(world_size)
        self.generation, self.group, self.bus = int(generation), group, bus
        self.redis_url = redis_url
        self.root = os.path.abspath(config.root)
        self.restored_step = self.restored_loss = self.restored_path = None  # int, float, str
        self.restore_source, self.restore_reason = "none", ""
        self.recovery_path, self.recovery_reason = "checkpoint", ""
        self.certificate: Certificate | None = None
        self.live = LiveState(model, optimizer, data)
        self.stats: dict[str, Any] = dict(saves=0, skipped=0, failed=0, committed=0, uncertified=0,
                                          blocking_s=None, durable_s=None, last_error="")
        self.resources = resources if resources is not None else CheckpointResources()
        self._interrupt, self._plan = interrupt, None  # the SavePlan in use
        self._verdicts: dict[str, str] = {}  # path → the writers' verdict, for retention

    # ---- helpers -----------------------------------------------------------------------------
    @property
    def identity(self) -> RankIdentity:
        """This rank now (the attributes may change between saves)."""
        return RankIdentity(self.job, self.rank, self.world_size, self.generation)

    def _gather(self, obj: Any) -> list[Any]:  # collectives.all_gather
        return collectives.all_gather(obj, self.group, self.world_size)

    def _index(self) -> dict[str, dict] | None:
        """``{path: {"status", "reasons"}}`` from the state store, None when unreachable."""
        return fetch_index(self.redis_url, self.job, self.config.state_timeout_s)

    def _ended(self) -> dict[int, int] | None:  # index.fetch_generation_ends
        return fetch_generation_ends(self.redis_url, self.job, self.config.state_timeout_s)

    def _staging_path(self) -> str:
        return staging_path(self.config.shm_dir, self.job, self.rank)

    def _publish(self, cls: str, /, subject: str = "ckpt", **fields: Any) -> None:
        """Publish ``schemas.<cls>(**fields)`` on ``tg.job.<job>.<subject>`` with a bus.
        The event schemas (pydantic, ≈ 6 MB) are imported only then: a Checkpointer without a
        bus does not load them into the training process. Never raises."""
        if self.bus is None:
            return
        try:
            from trainguard import schemas
            from trainguard.schemas import subjects

            self.bus.publish(subjects.job(self.job, subject), getattr(schemas, cls)(**fields))
        except Exception:  # noqa: BLE001 - a bus problem never stops checkpointing
            log.warning("could not publish %s", cls, exc_info=True)

    def _make_plan(self, sd: dict[str, Any]) -> SavePlan:
        """Collective: the ``SavePlan`` of ``sd``, and a staging buffer it fits in."""
        res = self.resources
        self._plan = plan = make_plan(sd, self.rank, new_plan_id(res.next_seq()), self._gather)
        trim_heap()  # before the staging buffer is faulted in: the peak stays low
        res.ensure_staging(self._staging_path(), plan.staging_size)
        return plan

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, loss: float | None = None) -> bool:
        """Checkpoint the current state as ``step`` (collective: every rank calls it).

        Blocks only while the state is copied into the staging buffer (and, when the previous
        save is not finished and ``overlap_policy == "wait"``, until it is). Returns True when a
        save was started, False when it was skipped (policy ``"skip"``). Never raises for a
        storage problem: that is reported by ``ckpt.save_failed`` and ``stats["last_error"]``,
        and training goes on; the last valid checkpoint stays.
        """
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        t0 = time.perf_counter()
        res, step = self.resources, int(step)
        sd = statedict.get_state(self.model, self.optimizer)
        flat, _ = flatten_state_dict(sd)
        digest = state_digest(flat) if self.config.certify else None
        plan = self._plan
        changed = plan is None or signature(flat) != plan.signature
        busy = res.busy()
        failed, res.unreported_failure = res.unreported_failure, False
        byte_blobs = None if changed else plan.byte_blobs(sd)
        info = {"busy": busy, "changed": changed, "failed": failed, "step": step,
                "nonce": random.getrandbits(40), "digest": digest,
                "byte_lens": [len(b) for b in byte_blobs] if byte_blobs is not None else None}
        # stage during the agreement when this rank's writer is done with the buffer and its plan
        # fits (a new plan: staged again below; a skip leaves no sidecar, so no shm restore)
        st = None if changed or busy else res.fitting_staging(self._staging_path(), plan)
        pending = collectives.start_all_gather_small(info, self.group, self.world_size)
        if st is not None:
            copy_state(plan, st)
        infos = pending.wait()
        nonce = int(infos[0]["nonce"])
        steps = {i["step"] for i in infos}
        if len(steps) != 1:
            self._fail(step, f"ranks disagree on the step to save ({sorted(steps)}): call "
                       f"save() with the same step on every rank", None)
            return False
        cert = self.certificate = certify([i["digest"] for i in infos], step, res.last_certified)
        if not cert.ok:
            self._uncertified(step, cert)
        elif cert.digest:
            res.last_certified = (step, cert.digest)
        if any(i["failed"] for i in infos) and busy and self.rank == 0:
            res.inflight.abandon(res.writer)  # a rank's shard will never come: give up now
        if any(i["busy"] for i in infos):
            if self.config.overlap_policy == "skip":
                self.stats["skipped"] += 1
                self._publish(
                    "CheckpointSaveFailed", job=self.job, rank=self.rank, step=step,
                    generation=self.generation,
                    error=f"skipped: the previous save (step {res.inflight.step if busy else '?'}"
                          f") is still being written (overlap_policy='skip'); save less often "
                          f"or use overlap_policy='wait'")
                return False
            if busy:
                self._wait_inflight()
        if any(i["changed"] for i in infos):
            plan = self._make_plan(sd)
            st = None  # the layout may have moved: stage again
            byte_blobs = plan.byte_blobs(sd)
            infos = self._gather({"byte_lens": [len(b) for b in byte_blobs]})
        try:
            writer = res.writer_client(self.config.writer_nice)
            if plan.plan_id not in writer.plans:
                writer.send({"op": "plan", "plan_id": plan.plan_id,
                             "items": list(plan.writer_items)})
                writer.plans.add(plan.plan_id)
        except (OSError, ConnectionError) as exc:
            self._fail(step, f"cannot reach the checkpoint writer: {exc}", None)
            return False
        meta = plan.metadata_bytes([i["byte_lens"] for i in infos]) if self.rank == 0 else None
        staging = res.ensure_staging(self._staging_path(), plan.staging_size)
        session = SaveSession(res.next_seq(), step, loss, plan, self.identity, nonce, t0,
                              self._on_done)
        session.certified = cert.ok
        session.stage(staging, copied=st is not None)
        res.inflight = session
        request = session.request(self.root, staging.path, byte_blobs, meta, self.config)
        request["manifest"].update(manifest_fields(cert))
        try:
            session.start(writer, request)
        except OSError as exc:
            self._fail(step, f"cannot start the save: {exc}", getattr(exc, "errno", None))
            return False
        self.stats["saves"] += 1
        self.stats["blocking_s"] = session.blocking_s = time.perf_counter() - t0
        return True

    def _wait_inflight(self) -> None:
        """Wait for the previous save (policy ``"wait"``), calling ``interrupt`` every 50 ms: it
        may raise to leave (``trainguard.run`` passes one that reports the ``checkpoint`` phase
        and raises ``RestartRequested`` when a decision ends this generation)."""
        p = self.resources.inflight
        while p is not None and not p.wait(0.05):
            if self._interrupt is not None:
                self._interrupt()

    def _uncertified(self, step: int, cert: Certificate) -> None:
        """Tell training (``stats["uncertified"]``, ``certificate``, a warning) and, from rank
        0, the bus: an ``anomaly`` naming the suspects of silent data corruption (fault class
        ``ecc``, the vocabulary's hardware memory-corruption class, with ``detail.sdc_suspect``;
        severity warning: evidence for the attributor, not a crash)."""
        self.stats["uncertified"] += 1
        log.warning("checkpoint of step %s is not certified: %s", step, "; ".join(cert.reasons))
        if self.rank == 0 and cert.suspects:
            self._publish("Anomaly", subject="anomaly", job=self.job, rank=self.rank,
                          kind="replica_divergence", fault_class="ecc", severity="warning",
                          culprit={"ranks": list(cert.suspects)}, evidence=list(cert.reasons),
                          generation=self.generation,
                          detail={"sdc_suspect": True, "layer": "hardware", "step": step,
                                  "rule": "replica_digest_mismatch"})

    def mark(self, step: int, loss: float | None = None) -> None:
        """``step`` completed (``trainguard.run``'s ``ctx.progress`` calls it): the model,
        optimizer, random generators and data position now are that step's, for the peer path
        of the next restore. Cheap (≈ 0.2 ms here, no I/O)."""
        self.live.mark(step, loss)

    def _fail(self, step: int, error: str, errno: int | None, path: str = "") -> None:
        self.stats["failed"] += 1
        self.stats["last_error"] = error
        log.warning("checkpoint of step %s failed: %s", step, error)
        self._publish("CheckpointSaveFailed", job=self.job, rank=self.rank, step=step,
                      path=path, error=error, errno=errno, generation=self.generation)

    def _on_done(self, session: SaveSession, msg: dict) -> None:
        """The writer's reply to ``session`` (on the connection's reader thread)."""
        durable, step = session.durable_s(), session.step
        if msg.get("op") != "done":
            self.resources.unreported_failure = True
            self._fail(step, msg.get("error", "unknown error"), msg.get("errno"),
                       msg.get("path", ""))
            return
        self.stats["durable_s"] = durable
        if not msg.get("committed"):
            return
        self.stats["committed"] += 1
        bad = msg.get("nonfinite") or []
        # the writers' own verdict, for retention when no validator's verdict is at hand
        self._verdicts[msg["path"]] = "invalid" if bad or not getattr(
            session, "certified", True) else "valid"
        if bad:
            log.warning("checkpoint of step %s holds NaN/Inf (%s): the validator will mark "
                        "it invalid and restore will pass it over; check the loss and the "
                        "learning rate", step, ", ".join(
                            f"{b['key']}: {b['count']}" for b in bad[:5]))
        ident = session.identity
        self._publish("CheckpointSaved", job=ident.job, rank=ident.rank, path=msg["path"],
                      step=step, world_size=ident.world_size, generation=ident.generation,
                      bytes=int(msg.get("bytes", 0)), loss=session.loss,
                      blocking_s=session.blocking_s, durable_s=durable)
        try:
            self._retention()
        except Exception:  # noqa: BLE001 - retention problems never stop training
            log.warning("checkpoint retention failed", exc_info=True)

    def _retention(self) -> None:
        """Delete what retention dooms (``index.doomed``), by the writer, off the process."""
        paths = doomed(self.root, self.config.keep, self._index, self._verdicts,
                       store=bool(self.redis_url))
        if paths:
            self.resources.writer.send({"op": "prune", "paths": paths})
            for p in paths:
                self._verdicts.pop(p, None)

    # ---- wait / abandon / finalize ---------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this rank's in-flight save is durable (rank 0: committed) or failed.
        Returns True when nothing is in flight any more, False on timeout."""
        p = self.resources.inflight
        return True if p is None else p.wait(timeout)

    def abandon_inflight(self) -> bool:
        """Cancel the save in flight (``CheckpointResources.abandon_inflight``). Returns True
        when one was. Never raises."""
        return self.resources.abandon_inflight()

    def finalize(self, release: bool = True, timeout: float | None = None) -> None:
        """Flush on shutdown: wait for the in-flight save (at most ``timeout`` s, default the
        commit timeout). ``release=True`` (end of training) also stops the writer of this
        Checkpointer's resources and removes the staging buffer from shared memory; use
        ``release=False`` when the process goes on (e.g. before an in-process restart) to keep
        them for the next Checkpointer given the same ``resources``."""
        self.wait(self.config.commit_timeout_s + 5.0 if timeout is None else timeout)
        if release:
            self.resources.release()

    # ---- restore ---------------------------------------------------------------------------------
    def restore(self) -> int:
        """Restore the newest state into the model (and optimizer); collective.

        First from healthy peers (``config.peer_recovery``): when a complete replica of the
        state survived in this job's processes (``trainguard.run``'s in-process restart), the
        ranks agree on the newest step held and the others receive it (``live.peer_restore``);
        ``recovery_path`` is then "peer". Else the newest valid checkpoint ("checkpoint";
        ``recovery_reason`` says why no peer could give it).

        Returns the step to run next: the restored step + 1, or 0 when there is nothing to
        restore. Never loads a partial, corrupt, stale or NaN checkpoint: every newer one that
        was passed over is named with its reason in ``restore_reason``. Raises RuntimeError
        (with the DCP error) only when a checkpoint that verified fine fails to load into this
        model — e.g. a model whose state keys differ from the saved ones.
        """
        res = self.resources
        prev, res.live = res.live, self.live
        if prev is not None and prev is not self.live:
            prev.close()
        peer = None
        if self.config.peer_recovery:
            peer = peer_restore(self.live, prev, self.rank, self.world_size, self.group)
        del prev
        self.recovery_path = peer.path if peer is not None else "checkpoint"
        self.recovery_reason = peer.reason if peer is not None else "peer recovery off"
        if peer is not None and peer.path == "peer":
            self.restored_step, self.restored_loss = peer.step, None
            self.restore_source, self.restore_reason, self.restored_path = "peer", "", None
            self._plan_now()
            return peer.next_step
        r: RestoreResult = Restorer(
            self.model, self.optimizer, config=self.config, root=self.root, job=self.job,
            rank=self.rank, world_size=self.world_size, group=self.group,
            index=self._index, ended=self._ended).restore()
        self.restored_step, self.restored_loss = r.step, r.loss
        self.restore_source, self.restore_reason, self.restored_path = r.source, r.reason, \
            r.path
        if r.step is None:
            return 0
        self.live.mark(r.step)  # the restored state is that step's (generators: the script's)
        self._plan_now()
        return r.next_step

    def _plan_now(self) -> None:
        """Plan and map the staging buffer now, so that the first save does not pay for it."""
        try:
            self._make_plan(statedict.get_state(self.model, self.optimizer))
        except Exception:  # noqa: BLE001 - the first save plans again
            log.debug("planning after restore failed", exc_info=True)
            self._plan = None

    def recovery_check(self, loss_after: float | None) -> dict[str, Any]:
        """What ``recovery.verified`` needs after the first step(s) following a restore:
        ``{"restored_step", "loss_at_save", "loss_after", "tolerance", "ok"}`` (``ok`` None when
        a loss is unknown); the tolerance is ``config.loss_tolerance``."""
        return recovery_check(self.restored_step, self.restored_loss, loss_after,
                              self.config.loss_tolerance)

"""The checkpoint validator service: ``ckpt.saved`` → verify → mark in the state store →
``ckpt.validated`` | ``ckpt.invalid`` on ``tg.job.<job>.ckpt``; ``recovery.verified`` with
``ok`` False (a restored state whose loss is off the saved one) → that checkpoint marked invalid.

Thin: the verdict is ``trainguard.checkpoint.verify.validate_checkpoint`` (pure, unit-tested,
shared with the rank-side restore); the check runs in a worker thread so that the service keeps
answering health requests while it reads a large checkpoint. A failure on one message is logged and counted by the bus; the service goes on.

Replicas partition the jobs (``trainguard.services.base``); a replica that takes a job over validates
the checkpoints of the job saved within ``consume.RELEVANCE`` that are still ``pending`` in the
state store (saved while their replica was gone).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from trainguard import schemas

from trainguard.services import durable as consume
from trainguard.core import partitions as P  # noqa: N812 - the module is 'partitions' here too
from trainguard.checkpoint.verify import validate_checkpoint
from trainguard.schemas import subjects
from trainguard.services.base import Service, ServiceConfig
from trainguard.services.entry import main

log = logging.getLogger("checkpoint_validator")


class CheckpointValidator(Service):
    """Subscribes ``tg.job.*.ckpt``; for each ``ckpt.saved`` indexes the checkpoint as pending
    (``StateStore.add_checkpoint``), validates it, marks it (``mark_checkpoint``) and publishes
    the verdict. ``stats``: validated, invalid, bytes, seconds."""

    name = "checkpoint_validator"
    partitioned = True

    def __init__(self, config: ServiceConfig | None = None):
        super().__init__(config)
        self.counts = {"validated": 0, "invalid": 0, "bytes": 0, "seconds": 0.0}
        self._lock = asyncio.Lock()

    #: the subjects it consumes: saved checkpoints, and recoveries (for a failed loss check)
    topics = (f"{subjects.PREFIX}.job.*.ckpt", f"{subjects.PREFIX}.job.*.recovery")

    def subscriptions(self):
        return list(zip(self.topics, (self.on_ckpt, self.on_recovery)))

    async def on_recovery(self, subject: str, ev: schemas.Event) -> None:
        """A restore whose loss check failed (``recovery.verified``, ``ok`` False): the
        checkpoint it restored read back whole but holds a state that is not the one saved
        with its loss. Mark that checkpoint (the job's indexed one at ``restored_step``)
        invalid with the losses as the reason, so that no restore takes it again: the next
        one resumes from an older valid checkpoint."""
        if not isinstance(ev, schemas.RecoveryVerified) or ev.ok or ev.restored_step < 0:
            return
        assert self.state is not None
        job = ev.job or subject.split(".")[2]
        reason = (f"restored at generation {ev.generation}, the loss check failed on rank "
                  f"{ev.rank}: loss {ev.loss_after!r} after the restore, {ev.loss_at_save!r} "
                  f"at save time (tolerance {ev.tolerance:g})")
        for c in await self.state.checkpoints(job):
            if c["step"] == ev.restored_step and c["status"] != "invalid":
                await self.state.mark_checkpoint(job, c["path"], c["step"], valid=False,
                                                 reasons=[reason])
                self.counts["invalid"] += 1
                log.warning("%s: checkpoint %s marked invalid: %s", job, c["path"], reason)
                await self.bus.publish(subjects.job(job, "ckpt"), schemas.CheckpointInvalid(
                    job=job, path=c["path"], step=c["step"], reasons=[reason],
                    trace=ev.child_trace()))

    async def setup(self) -> None:
        # the NaN/Inf scan needs torch; import it now, beside the start-up, not inside the
        # first validation: on a node busy with training that import took tens of seconds
        # (seen in CI: the first verdict came 45 s after the first save)
        import threading

        threading.Thread(target=__import__, args=("torch",), name="tg-import-torch",
                         daemon=True).start()

    async def members_changed(self, gained: set[str], lost: set[str],
                              partitions: frozenset[int] = frozenset()) -> None:
        """Validate what the gained jobs, and the jobs of the gained stream partitions, saved
        while nobody served them (what the state store does not say is settled)."""
        assert self.bus.nc is not None and self.state is not None
        topic = f"{subjects.PREFIX}.job.*.ckpt"
        since = time.time_ns() - int(consume.max_age_s(topic) * 1e9)
        n = self.membership.partitions if partitions else 0
        jobs = sorted(k for k in gained if not k.startswith("node:"))
        try:  # a partitioned stream: one read of the gained partitions
            reads = ([(topic, [f]) for f in P.stored_filters(topic, partitions, n)] if n else
                     [(subjects.job(job, "ckpt"), None) for job in jobs])
            msgs = [m for subject, filters in reads for m, _st in
                    await consume.replay(self.bus.nc, subject, since, filters=filters)]
        except Exception as exc:  # noqa: BLE001 - the next save is validated anyway
            log.warning("%s: cannot replay the checkpoints of %s: %s", self.name,
                        ",".join(jobs) or f"partitions {sorted(partitions)}", exc)
            return
        known: dict[str, dict[str, str]] = {}
        for m in msgs:
            try:
                ev = schemas.decode(m.data)
            except schemas.DecodeError:
                continue
            if not isinstance(ev, schemas.CheckpointSaved):
                continue
            job = subjects.parse(m.subject)["name"]
            if job not in known:
                try:
                    known[job] = {c["path"]: c["status"]
                                  for c in await self.state.checkpoints(job)}
                except Exception as exc:  # noqa: BLE001 - the next save is validated anyway
                    log.warning("%s: cannot read the checkpoints of %s: %s", self.name, job,
                                exc)
                    known[job] = {ev.path: "unknown"}
            if known[job].get(ev.path, "pending") == "pending":
                known[job][ev.path] = "replayed"
                await self.bus.handle(m.subject, m.data, self.on_ckpt)

    def health(self) -> dict[str, Any]:
        c = self.counts
        return {"checkpoints": dict(c),
                "gbps": c["bytes"] / c["seconds"] / 1e9 if c["seconds"] else None}

    async def on_ckpt(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.CheckpointSaved):
            return  # our own verdicts and save failures come by on the same subject
        job = ev.job or subjects.parse(subject)["name"]
        assert self.state is not None
        await self.state.add_checkpoint(job, ev.path, ev.step)
        async with self._lock:  # one at a time: validation is I/O and CPU bound
            rep = await asyncio.to_thread(validate_checkpoint, ev.path, expected_step=ev.step,
                                          expected_world_size=ev.world_size)
        await self.state.mark_checkpoint(job, ev.path, ev.step, rep.ok, rep.reasons)
        self.counts["bytes"] += rep.bytes
        self.counts["seconds"] += rep.duration_s
        if rep.ok:
            self.counts["validated"] += 1
            out: schemas.Event = schemas.CheckpointValidated(
                job=job, path=ev.path, step=ev.step, bytes=rep.bytes,
                duration_s=rep.duration_s, gbps=rep.gbps, trace=ev.child_trace())
        else:
            self.counts["invalid"] += 1
            log.warning("checkpoint %s invalid: %s", ev.path, "; ".join(rep.reasons))
            out = schemas.CheckpointInvalid(job=job, path=ev.path, step=ev.step,
                                            reasons=rep.reasons, duration_s=rep.duration_s,
                                            trace=ev.child_trace())
        await self.bus.publish(subjects.job(job, "ckpt"), out)


def run(argv: list[str] | None = None) -> None:
    main(CheckpointValidator, argv)

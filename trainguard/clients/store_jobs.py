"""The job record's key family in the state store (``StateStore`` inherits it).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:jobs``                     set    job names
``tg:job:<job>``                hash   the job record: ``schemas.job.JobRecord`` (every field, its
                                       type, default, unit and encoding)
==============================  =====  ============================================================

One reader (``job``, ``job_records`` for many), and writers by purpose: a launcher's first
registration (``register_settings``), the Slurm watcher's part (``register_slurm_job``), the
generation compare-and-set (``bump_generation``); ``register_job`` and ``update_job`` are the
general paths of tests and tools. A run's launchers and members are in
``trainguard.clients.store_runs``, a decision's commit in ``trainguard.clients.store_decisions``.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from trainguard.clients.store_scripts import BUMP_GENERATION, job_key, settings_fields
from trainguard.schemas.job import (
    JobRecord,
    JobRecordError,
    JobSettings,
    decode_record,
    encode_fields,
    encode_value,
)


class JobKeys:
    """``StateStore``'s methods for job records (``self.r``: the redis-py client;
    ``self._records``: ``job_records``' cache, a dict the store makes)."""

    r: Any
    _records: dict[str, tuple[dict[str, str], JobRecord]]

    async def job(self, job: str) -> JobRecord:
        """The job's record; every field at its default when the job is unknown. Raises
        ``JobRecordError`` for a value its field's codec cannot read."""
        return decode_record(await self.r.hgetall(job_key(job)))

    #: records ``job_records`` keeps with the hash they were decoded from (past it, emptied)
    RECORD_CACHE_MAX = 20_000

    async def job_records(self, jobs: Sequence[str]) -> dict[str, JobRecord | str]:
        """The records of ``jobs`` in one round trip (a pipeline of HGETALL, no transaction):
        job → its record, or for one whose hash a codec cannot read, the error as text
        (``"JobRecordError: …"``). A hash equal to the one a record was last decoded from here
        gives that record object again (readers treat records as read-only; a job with no hash
        gets a new default record, and nothing is kept for it): a detector
        replica re-reads each of its jobs every 2 s (``DetectorServiceConfig.job_refresh_s``),
        and one HGETALL round trip and decode per job was 11 % of its CPU at 10,000 ranks
        (``bench/scale.py``, sampled). Raises the client's errors (the store unreachable)."""
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.hgetall(job_key(job))
        raws = await pipe.execute()
        cache = self._records
        if len(cache) > self.RECORD_CACHE_MAX:
            cache.clear()
        out: dict[str, JobRecord | str] = {}
        for job, raw in zip(jobs, raws):
            if not raw:  # no such job (a hostile name, a record not written yet): not kept
                cache.pop(job, None)
                out[job] = JobRecord()
                continue
            hit = cache.get(job)
            if hit is not None and hit[0] == raw:
                out[job] = hit[1]
                continue
            try:
                rec = decode_record(raw)
            except JobRecordError as exc:
                cache.pop(job, None)
                out[job] = f"JobRecordError: {exc}"
                continue
            cache[job] = (raw, rec)
            out[job] = rec
        return out

    async def jobs(self) -> list[str]:
        return sorted(await self.r.smembers("tg:jobs"))

    async def register_settings(self, job: str, settings: JobSettings) -> None:
        """A launcher's first registration of ``job``: the launch ``settings``, generation 0,
        no retries used, status ``running``. Fields already set are kept (HSETNX): the
        launchers of one run race, and a new run's settings are ``begin_run``'s."""
        await self.register_job(job, **settings_fields(settings), generation=0,
                                retries_used=0, status="running")

    async def register_slurm_job(self, job: str, slurm_job_id: str, *, state: str,
                                 nodes: list[str], partition: str = "", restarts: int = 0,
                                 directive: dict[str, Any] | None = None,
                                 directive_error: str = "") -> None:
        """The Slurm watcher's record of ``job`` (``trainguard.scheduler.slurm.watch``), in one
        transaction: the scheduler part (``slurm_state``, ``slurm_nodes``,
        ``slurm_partition``, ``slurm_restarts``, ``slurm_directive``,
        ``slurm_directive_error``) overwritten, ``slurm_job_id`` set only where no launcher
        set it yet (HSETNX: the launchers' settings are theirs), the job in ``tg:jobs``."""
        put, drop = encode_fields(slurm_state=state, slurm_nodes=sorted(nodes),
                                  slurm_partition=partition, slurm_restarts=restarts,
                                  slurm_directive=directive,
                                  slurm_directive_error=directive_error)
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd("tg:jobs", job)
        pipe.hset(job_key(job), mapping=put)
        if drop:
            pipe.hdel(job_key(job), *drop)
        pipe.hsetnx(job_key(job), "slurm_job_id", encode_value("slurm_job_id", slurm_job_id))
        await pipe.execute()

    async def register_job(self, job: str, **fields: Any) -> None:
        """Write the given record ``fields`` where not yet set (HSETNX), each in its codec; a
        field set to None is skipped. The general path for tests and tools; the launchers use
        ``register_settings``. Raises ``KeyError`` for a name the record does not have."""
        put, _ = encode_fields(**fields)
        pipe = self.r.pipeline()
        pipe.sadd("tg:jobs", job)
        for k, v in put.items():
            pipe.hsetnx(job_key(job), k, v)
        await pipe.execute()

    async def set_group_attempt(self, job: str, generation: int, attempt: int) -> None:
        """Observe mode: this node restarted its group for the ``attempt``-th time in
        ``generation`` (``group_attempt = "<generation>:<attempt>"``)."""
        await self.r.hset(job_key(job), "group_attempt", f"{int(generation)}:{int(attempt)}")

    async def clear_pending(self, job: str) -> None:
        """No decision of ``job`` is pending for the watchdog any more."""
        await self.r.hdel(job_key(job), "pending_decision")

    async def update_job(self, job: str, **fields: Any) -> None:
        """Overwrite the given record ``fields`` (each in its codec; None deletes the field), in
        one transaction. For tests and tools: the services use the narrow mutators.
        Raises ``KeyError`` for a name the record does not have."""
        put, drop = encode_fields(**fields)
        pipe = self.r.pipeline(transaction=True)
        if put:
            pipe.hset(job_key(job), mapping=put)
        if drop:
            pipe.hdel(job_key(job), *drop)
        await pipe.execute()

    async def bump_generation(self, job: str, expected: int, by: str = "") -> int:
        """Atomically set generation to ``expected + 1`` if it is still ``expected``, recording
        ``by`` (the decision id) as ``generation_by`` and now (Unix ns) as the end of
        ``expected`` (``JobRecord.generation_ends``); returns the generation now in force (a
        caller that lost the race learns the winner's)."""
        return int(await self.r.eval(BUMP_GENERATION, 1, job_key(job), expected, by,
                                     str(time.time_ns())))

    async def generation_ends(self, job: str) -> dict[int, int]:
        """``JobRecord.generation_ends`` of ``job``: generation → Unix ns it ended ({} for
        none, or an unreadable field)."""
        raw = await self.r.hget(job_key(job), "generation_ends")
        try:  # the record's own codec for the field
            ends = decode_record({"generation_ends": raw} if raw else {}).generation_ends
            return {int(g): int(ns) for g, ns in (ends or {}).items()}
        except (ValueError, TypeError, AttributeError):  # JobRecordError is a ValueError
            return {}

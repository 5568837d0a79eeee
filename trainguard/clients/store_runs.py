"""A run's key family in the state store: the launchers' leases and the members they register
(``StateStore`` inherits it).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:job:<job>:launchers``      zset   node of each live launcher, score = lease expiry (Unix ms)
``tg:job:<job>``                hash   (the job record, ``trainguard.clients.store_jobs``) its
                                       run fields: generation, runs, status, members, spares
==============================  =====  ============================================================

A run is live while one of its launchers holds a lease: ``begin_run`` joins it or starts a new
one, atomically (one Lua script, ``store_scripts.BEGIN_RUN``); ``add_members`` and
``add_spare`` merge what launchers register at once; ``end_run`` records how it ended.
"""
from __future__ import annotations

import json
import time
from typing import Any

from trainguard.clients.store_scripts import (ADD_MEMBERS, ADD_SPARE, BEGIN_RUN, END_RUN, job_key,
                                              settings_fields)
from trainguard.schemas.job import JobSettings, encode_fields, encode_value


class LauncherConflict(RuntimeError):
    """A launcher of the same job already holds a live lease on this node
    (``StateStore.begin_run``). ``remaining_s``: seconds until that lease runs out."""

    def __init__(self, job: str, node: str, remaining_s: float, message: str = ""):
        self.job, self.node, self.remaining_s = job, node, remaining_s
        super().__init__(message or (
            f"job {job!r} already has a live launcher on node {node!r} (its lease runs out in "
            f"{remaining_s:.0f} s): stop that launcher first, give this launch another --job "
            f"(or, for another node of a multi-node job, that node's --node and --node-rank), "
            f"or, if that launcher died, launch again once its lease ran out"))


class RankConflict(LauncherConflict):
    """The ranks a launch registers are held by another node whose launcher holds a live lease
    (``StateStore.add_members``): ``rank`` is the first such, ``node`` its node."""

    def __init__(self, job: str, node: str, remaining_s: float, rank: int):
        self.rank = rank
        super().__init__(
            job, node, remaining_s,
            f"rank {rank} of job {job!r} is already run by node {node!r}, whose launcher "
            f"is live (its lease runs out in {remaining_s:.0f} s): this launch would start a "
            f"second copy of it. For another node of a multi-node job give its --node-rank; "
            f"for a node that waits to replace one, --spare-node; else another --job")


class RunKeys:
    """``StateStore``'s methods for a run's launchers and members (``self.r``: the redis-py
    client)."""

    r: Any

    async def begin_run(self, job: str, node: str, lease_s: float,
                        settings: JobSettings | None = None,
                        run_id: str = "") -> tuple[int, bool]:
        """A launcher of ``node`` joins the job's current run, or starts a new one.

        A run is live while any of its launchers holds a lease (renewed by ``renew_launcher``,
        dropped by ``end_launcher``). When none does and the job ran before, this launch is a
        new run of it (a resume): its generation moves past every generation used so far — the
        rendezvous keys of the old run's generations stay in the store, and ranks meeting under
        them would connect to dead peers — the status becomes ``running``, the retry budget
        starts afresh, the members are registered anew and ``settings`` replace the old run's.
        Atomic, so the launchers of one new run agree. ``run_id`` (the scheduler's name of the
        run: Slurm's ``<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>``; "" = none) other than the one the
        record holds also makes this launch a new run, and drops the old run's leases first: a
        requeued Slurm job starts while a launcher of its old allocation that is cut off still
        holds its lease (up to ``lease_s``), and must neither join that run nor wait it out on a
        node it shares with it. A new run records the end of the old run's generation
        (``JobRecord.generation_ends``). Returns ``(generation, new_run)``.
        Raises ``LauncherConflict`` when a launcher of ``node`` already holds a live lease on
        the job (a second launch of a running job on one node would start a second set of the
        same ranks and break the first run).
        """
        put, drop = encode_fields(**(settings_fields(settings) if settings else {}))
        now_ms = int(time.time() * 1000)
        gen, new_run, left_ms = await self.r.eval(
            BEGIN_RUN, 2, job_key(job), f"tg:job:{job}:launchers", node, now_ms,
            int(lease_s * 1000), json.dumps(put), json.dumps(drop), run_id, str(time.time_ns()))
        if int(new_run) < 0:
            raise LauncherConflict(job, node, int(left_ms) / 1000.0)
        return int(gen), bool(new_run)

    async def renew_launcher(self, job: str, node: str, lease_s: float) -> None:
        """Extend the lease of ``node``'s launcher in the job's live run."""
        await self.r.zadd(f"tg:job:{job}:launchers",
                          {node: int(time.time() * 1000 + lease_s * 1000)})

    async def end_launcher(self, job: str, node: str) -> None:
        """``node``'s launcher is gone: a launch after the last one is a new run."""
        await self.r.zrem(f"tg:job:{job}:launchers", node)

    async def add_members(self, job: str, members: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Merge ``members`` (``{"rank", "node", "local_rank"}``) into the job's ``members``
        list atomically (several launchers register at once); a rank given again replaces its
        entry. Returns the merged list sorted by rank. Raises ``RankConflict`` (nothing merged)
        when one of the ranks is held by another node whose launcher holds a live lease: a
        second launch of a running job under another ``--node`` with the same node rank would
        otherwise take the running ranks' entries and start a second copy of them."""
        await self.r.sadd("tg:jobs", job)
        out = json.loads(await self.r.eval(ADD_MEMBERS, 2, job_key(job), f"tg:job:{job}:launchers",
                                           json.dumps(members), int(time.time() * 1000)))
        if isinstance(out, dict):
            raise RankConflict(job, out["node"], out["left_ms"] / 1000.0, int(out["held_rank"]))
        return out

    async def add_spare(self, job: str, node: str) -> list[str]:
        """Register ``node`` as a spare of ``job`` (atomic: spares register at once). Returns
        the spare nodes, sorted."""
        await self.r.sadd("tg:jobs", job)
        return json.loads(await self.r.eval(ADD_SPARE, 1, job_key(job), node))

    async def end_run(self, job: str, status: str) -> None:
        """Record how the run ended on a node (``finished`` | ``failed``), or for the job
        (``requeued``: the Slurm controller requeued it), unless a decision already
        ``stopped`` the job (atomic)."""
        await self.r.eval(END_RUN, 1, job_key(job), encode_value("status", status))


def mark_stopped(r: Any, job: str) -> bool:
    """Mark ``job``'s record ``stopped`` through ``r``, a *synchronous* redis client (tools that
    run no event loop: ``trainguard credentials revoke``), the way ``StateStore.end_run`` ends a
    run; a job with no record is left alone. True when it had one."""
    if not r.exists(job_key(job)):
        return False
    r.eval(END_RUN, 1, job_key(job), encode_value("status", "stopped"))
    return True

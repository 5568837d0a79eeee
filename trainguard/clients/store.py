"""The one state store of trainguard: job state, node state, checkpoint index, audit trail,
idempotency keys and cross-job fault history, in Redis/Valkey (redis-py asyncio).

Key layout (all keys under ``tg:``):

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:jobs``                     set    job names
``tg:job:<job>``                hash   the job record: ``schemas.job.JobRecord`` (every field, its
                                       type, default, unit and encoding); ``StateStore.job``
``tg:job:<job>:launchers``      zset   node of each live launcher, score = lease expiry (Unix ms)
``tg:audit:<job>``              stream one entry per decision (fields: the decision as JSON)
``tg:idem:<key>``               string owner that claimed the key (SET NX, 7 days); a verdict's
                                       claim once its decision is stored: ``decided:<id>``
``tg:node:<node>``              hash   status (healthy | excluded | lost), reason, updated_ns
``tg:ckpt:<job>``               zset   checkpoint path, score = step
``tg:ckpt:<job>:<path>``        hash   status (pending | valid | invalid), step, reasons (JSON)
``tg:hist:node:<node>``         zset   fault records on that node (JSON), score = Unix ns
``tg:hist:sig:<signature>``     zset   ``<job>|<node>`` pairs that saw that fault signature
``tg:outbox:<job>``             hash   decision id → decision (JSON) stored, not yet seen stored
                                       in JetStream (the remediator's outbox)
``tg:members:<service>``        zset   live replicas of a service, score = lease expiry (Unix ms)
``tg:rep:<node>``               hash   the node's reputation across jobs:
                                       ``schemas.reputation.NodeReputation``; ``reputation``
``tg:rep:<node>:evidence``      list   its last offences (JSON), newest last
``tg:rep:<node>:keys``          set    offence keys counted already (30 days)
``tg:rep:<node>:readmit``       string the lock of a readmit under way (its token; expires)
``tg:nodeattrs:<node>``         hash   the node's attributes (driver, image, rack, switch, mount …)
``tg:breaker``, ``…:audit``     hash,  the fleet breaker and its trail (``trainguard.clients.store_breaker``)
                                stream
==============================  =====  ============================================================
"""
from __future__ import annotations

import dataclasses
import json
import ssl
import time
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trainguard.schemas.job import (
    JobRecord,
    JobRecordError,
    JobSettings,
    decode_record,
    encode_fields,
    encode_value,
)

from trainguard.schemas.reputation import EVIDENCE_KEPT, NodeReputation, decode_reputation

from trainguard.security.credentials import redact
from trainguard.clients.store_breaker import BreakerKeys
from trainguard.clients.errors import ServerUnreachable
from trainguard.clients.store_scripts import (ADD_MEMBERS, ADD_OFFENCE, ADD_SPARE, BEGIN_RUN, BUMP_GENERATION,
                            END_RUN, OUTBOX_DONE, OUTBOX_INDEX, TAKE_CLAIM, idem_key, job_key,
                            members_key, outbox_key, audit_key, rep_key, settings_fields)
from trainguard.clients.store_sentinel import close_client, is_sentinel_url, sentinel_client
from trainguard.security.tls import ca_file

IDEMPOTENCY_TTL_S = 7 * 86400
#: how long an offence key is remembered (an exclusion carried out again later counts again)
OFFENCE_KEY_TTL_S = 30 * 86400


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


def tls_options(url: str, ca: str | None = None) -> dict[str, Any]:
    """redis-py options for ``url``: for ``rediss://``, verify the server's certificate and
    name against ``ca_file(ca)`` (``ca``, else env ``TG_TLS_CA``, else the system's trust
    store); nothing for ``redis://``."""
    if not url.startswith("rediss://"):
        return {}
    opts: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
                            "ssl_min_version": ssl.TLSVersion.TLSv1_2}
    if ca_file(ca):
        opts["ssl_ca_certs"] = ca_file(ca)
    return opts


class StateStore(BreakerKeys):
    """Async access to trainguard state in Redis/Valkey at ``url`` (``redis://host:port/db``, or
    ``redis://<role>:<password>@host:port/db`` for a role of ``trainguard.security.roles``; ``rediss://``
    for TLS, verified as ``tls_options`` says; ``redis+sentinel://…/<master name>/<db>`` for a
    replicated Valkey, whose failovers its commands outlive: ``trainguard.clients.store_sentinel``)."""

    def __init__(self, url: str, tls_ca: str | None = None):
        self.url = url
        if is_sentinel_url(url):  # a replicated Valkey: the primary its sentinels name
            self.r = sentinel_client(url, tls_options(url.replace("+sentinel", "", 1), tls_ca),
                                     decode_responses=True, socket_connect_timeout=2.0,
                                     socket_timeout=5.0, health_check_interval=10)
        else:
            self.r = aioredis.Redis.from_url(url, decode_responses=True,
                                             socket_connect_timeout=2.0, socket_timeout=5.0,
                                             health_check_interval=10,
                                             **tls_options(url, tls_ca))
        self._records: dict[str, tuple[dict[str, str], JobRecord]] = {}
        self._outbox_scanned = False  # ``outbox``'s one full scan done

    async def ping(self) -> None:
        """Raises ``ServerUnreachable`` (a ConnectionError) with what to do when Redis/Valkey
        cannot be reached."""
        try:
            await self.r.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServerUnreachable("Redis/Valkey", redact(self.url), str(exc),
                                    "REDIS_URL") from None

    async def close(self) -> None:
        await close_client(self.r)

    # ---- jobs: the record is schemas.job.JobRecord, one encoding per field -------------------
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

    async def set_group_attempt(self, job: str, generation: int, attempt: int) -> None:
        """Observe mode: this node restarted its group for the ``attempt``-th time in
        ``generation`` (``group_attempt = "<generation>:<attempt>"``)."""
        await self.r.hset(job_key(job), "group_attempt", f"{int(generation)}:{int(attempt)}")

    async def end_run(self, job: str, status: str) -> None:
        """Record how the run ended on a node (``finished`` | ``failed``), or for the job
        (``requeued``: the Slurm controller requeued it), unless a decision already
        ``stopped`` the job (atomic)."""
        await self.r.eval(END_RUN, 1, job_key(job), encode_value("status", status))

    async def commit_decision(self, job: str, *, retries_used: int,
                              last_decision: dict[str, Any],
                              last_fault: dict[str, Any] | None = None,
                              members: list[dict[str, Any]] | None = None,
                              world_size: int | None = None,
                              spare_nodes: list[str] | None = None, stopped: bool = False,
                              pending_decision: dict[str, Any] | None = None,
                              outbox: dict[str, Any] | None = None,
                              settles: str | None = None) -> None:
        """The remediator's record of an executed decision, in one transaction: retries used,
        the decision (``last_decision``), the fault it acted on (``last_fault``, kept when
        None), the new world of an exclusion (``members``/``world_size``/``spare_nodes``,
        kept when None), ``status=stopped`` for a stop, and the decision the watchdog waits on
        (``pending_decision``; None clears it), and ``outbox`` (the decision's ``to_dict()``)
        into the job's outbox, so a decision is never published without its record nor its
        record written without the decision kept for publishing. ``settles`` — the claim key
        of the input the decision answers (``<job>:verdict:<verdict id>``): set to
        ``decided:<decision id>`` in the same transaction (``settle_value``), so that input
        delivered again after its decision was stored is not decided a second time."""
        fields: dict[str, Any] = {"retries_used": retries_used, "last_decision": last_decision}
        optional = {"last_fault": last_fault, "members": members, "world_size": world_size,
                    "spare_nodes": spare_nodes, "status": "stopped" if stopped else None}
        fields.update({k: v for k, v in optional.items() if v is not None})
        put, _ = encode_fields(**fields)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(job_key(job), mapping=put)
        if pending_decision is None:
            pipe.hdel(job_key(job), "pending_decision")
        else:
            pipe.hset(job_key(job), "pending_decision",
                      encode_value("pending_decision", pending_decision))
        if outbox is not None:
            pipe.hset(outbox_key(job), str(outbox["event_id"]), json.dumps(outbox))
            pipe.sadd(OUTBOX_INDEX, job)
            if settles is not None:
                pipe.set(idem_key(settles), settle_value(str(outbox["event_id"])),
                         ex=IDEMPOTENCY_TTL_S)
        await pipe.execute()

    # ---- the decision outbox ------------------------------------------------------------------
    async def outbox_put(self, job: str, decision: dict[str, Any],
                         settles: str | None = None) -> None:
        """Keep ``decision`` (a ``Decision.to_dict()``) in the job's outbox until
        ``outbox_done``; the observe-mode path, where no record is committed. ``settles``: as
        ``commit_decision``'s, in the same transaction."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(outbox_key(job), str(decision["event_id"]), json.dumps(decision))
        pipe.sadd(OUTBOX_INDEX, job)
        if settles is not None:
            pipe.set(idem_key(settles), settle_value(str(decision["event_id"])),
                     ex=IDEMPOTENCY_TTL_S)
        await pipe.execute()

    async def outbox_done(self, job: str, decision_id: str) -> None:
        """The decision ``decision_id`` is stored in JetStream: drop it from the outbox (and the
        job from ``OUTBOX_INDEX`` with its last decision, in one script)."""
        await self.r.eval(OUTBOX_DONE, 2, outbox_key(job), OUTBOX_INDEX, decision_id, job)

    async def outbox(self, jobs: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
        """job → the decisions waiting in its outbox (``to_dict()`` form, oldest ``ts``
        first), for ``jobs`` (default: the jobs of ``OUTBOX_INDEX``; the first default call of
        this store reads every job of ``tg:jobs`` and indexes what it finds, so decisions an
        earlier release kept without the index are swept too); jobs with none are left out."""
        if jobs is not None:
            names = list(jobs)
        elif self._outbox_scanned:
            names = sorted(await self.r.smembers(OUTBOX_INDEX))
        else:
            names = await self.jobs()
        pipe = self.r.pipeline(transaction=False)
        for j in names:
            pipe.hvals(outbox_key(j))
        rows = await pipe.execute() if names else []
        out: dict[str, list[dict[str, Any]]] = {}
        for j, vals in zip(names, rows):
            if vals:
                out[j] = sorted((json.loads(v) for v in vals), key=lambda d: d.get("ts", 0))
        if jobs is None and not self._outbox_scanned:
            if out:
                await self.r.sadd(OUTBOX_INDEX, *out)
            self._outbox_scanned = True
        return out

    # ---- service replicas ----------------------------------------------------------------------
    async def renew_member(self, service: str, replica: str, lease_s: float) -> list[str]:
        """Hold (or renew) ``replica``'s lease among ``service``'s replicas for ``lease_s``
        seconds, drop expired leases, and return the live replicas, sorted (one round trip)."""
        now_ms = int(time.time() * 1000)
        key = members_key(service)
        pipe = self.r.pipeline(transaction=True)
        pipe.zremrangebyscore(key, "-inf", now_ms)
        pipe.zadd(key, {replica: now_ms + int(lease_s * 1000)})
        pipe.zrange(key, 0, -1)
        return sorted((await pipe.execute())[-1])

    async def members(self, service: str) -> list[str]:
        """The replicas of ``service`` whose lease has not run out, sorted."""
        now_ms = int(time.time() * 1000)
        return sorted(await self.r.zrangebyscore(members_key(service), now_ms, "+inf"))

    async def leave_member(self, service: str, replica: str) -> None:
        """``replica`` stops serving: its jobs move at once, not when its lease runs out."""
        await self.r.zrem(members_key(service), replica)

    async def clear_pending(self, job: str) -> None:
        """No decision of ``job`` is pending for the watchdog any more."""
        await self.r.hdel(job_key(job), "pending_decision")

    async def update_job(self, job: str, **fields: Any) -> None:
        """Overwrite the given record ``fields`` (each in its codec; None deletes the field), in
        one transaction. For tests and tools: the services use the narrow mutators above.
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

    # ---- idempotency and audit ------------------------------------------------------------------
    async def claim(self, key: str, owner: str, ttl_s: int = IDEMPOTENCY_TTL_S) -> str | None:
        """Claim idempotency ``key`` for ``owner``. Returns None when this call claimed it, else
        the owner that claimed it first (the caller must then not act)."""
        ok = await self.r.set(idem_key(key), owner, nx=True, ex=ttl_s)
        if ok:
            return None
        return await self.r.get(idem_key(key))

    async def take_claim(self, key: str, old: str, owner: str) -> str | None:
        """Idempotency ``key`` passes from ``old`` to ``owner`` only while ``old`` still holds
        it (compare-and-set, one Lua call; its expiry is kept). Returns None when it passed,
        else the owner holding it now (the caller must then not act)."""
        got = await self.r.eval(TAKE_CLAIM, 1, idem_key(key), old, owner)
        return None if got == 1 else await self.r.get(idem_key(key))

    async def settle(self, key: str, outcome: str, ttl_s: int = IDEMPOTENCY_TTL_S) -> None:
        """Idempotency ``key``, claimed by the caller, is settled: it holds ``outcome`` from now
        on (e.g. ``folded``), so whoever claims it later learns it was handled and how."""
        await self.r.set(idem_key(key), outcome, ex=ttl_s)

    async def claimed_by(self, key: str) -> str | None:
        """The owner holding idempotency ``key``, or None when nobody claimed it (read only)."""
        return await self.r.get(idem_key(key))

    async def audit(self, job: str, record: dict[str, Any], maxlen: int = 10000) -> str:
        """Append a record to the job's audit stream; returns the stream entry id."""
        return await self.r.xadd(audit_key(job), {"record": json.dumps(record, default=str)},
                                 maxlen=maxlen, approximate=True)

    async def audit_trail(self, job: str, count: int = 1000) -> list[dict[str, Any]]:
        rows = await self.r.xrange(audit_key(job), count=count)
        return [json.loads(f["record"]) for _, f in rows]

    # ---- nodes --------------------------------------------------------------------------------
    async def set_node(self, node: str, status: str, reason: str = "") -> None:
        await self.r.hset(f"tg:node:{node}", mapping={"status": status, "reason": reason,
                                                      "updated_ns": time.time_ns()})

    async def node(self, node: str) -> dict[str, str]:
        return await self.r.hgetall(f"tg:node:{node}")

    async def nodes(self) -> dict[str, dict[str, str]]:
        """Every node with a ``tg:node:<node>`` record: node → ``{status, reason, updated_ns}``
        (SCAN, so a large store is read in batches, never blocked)."""
        out: dict[str, dict[str, str]] = {}
        async for key in self.r.scan_iter(match="tg:node:*", count=500):
            node = key[len("tg:node:"):]
            out[node] = await self.r.hgetall(key)
        return out

    async def set_node_attrs(self, node: str, attrs: dict[str, str]) -> None:
        """The node's attributes (``NodeTelemetry.attributes``) as ``tg:nodeattrs:<node>``,
        replacing the last ones."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(f"tg:nodeattrs:{node}")
        if attrs:
            pipe.hset(f"tg:nodeattrs:{node}", mapping=dict(attrs))
        await pipe.execute()

    async def node_attrs(self) -> dict[str, dict[str, str]]:
        """Every node's attributes: node → ``{key: value}`` (SCAN)."""
        out: dict[str, dict[str, str]] = {}
        async for key in self.r.scan_iter(match="tg:nodeattrs:*", count=500):
            out[key[len("tg:nodeattrs:"):]] = await self.r.hgetall(key)
        return out

    # ---- node reputation: schemas.reputation; the policy is trainguard.core.reputation's ------------
    async def reputation(self, node: str) -> NodeReputation:
        """``node``'s reputation (defaults when it has none). Raises ValueError for a field
        that cannot be read."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(rep_key(node))
        pipe.lrange(rep_key(node) + ":evidence", 0, -1)
        raw, ev = await pipe.execute()
        rep = decode_reputation(node, raw)
        return dataclasses.replace(rep, evidence=[json.loads(e) for e in ev])

    async def reputations(self) -> list[NodeReputation]:
        """Every node with a reputation, by name (SCAN)."""
        names = sorted({k[len("tg:rep:"):] async for k in self.r.scan_iter(match="tg:rep:*",
                                                                            count=500)
                        if not k.endswith((":evidence", ":keys", ":readmit"))})
        return [await self.reputation(n) for n in names]

    def readmit_lock(self, node: str, ttl_s: float) -> Any:
        """The lock that lets one readmit of ``node`` run at a time: redis-py's ``Lock`` on
        ``tg:rep:<node>:readmit`` (SET NX PX with a random token; released by a compare-and-
        delete script), non-blocking, expiring after ``ttl_s`` seconds. ``await
        lock.acquire()`` is False while another readmit holds it."""
        return self.r.lock(rep_key(node) + ":readmit", timeout=ttl_s, blocking=False)

    async def add_offence(self, node: str, key: str, weight: float, half_life_s: float,
                          evidence: dict[str, Any], status: str = "drained", detail: str = "",
                          now_ns: int | None = None) -> tuple[bool, float]:
        """Count one offence of ``node`` under ``key`` (e.g. ``<job>:g<generation>``): the
        score decays to ``now_ns`` (Unix ns; default now) with ``half_life_s`` (seconds) and
        ``weight`` is added; ``evidence`` (JSON-able) joins the last ``EVIDENCE_KEPT``;
        ``status``/``detail`` are set. Atomic; a ``key`` counted already changes nothing.
        Returns ``(counted, score now)``."""
        now = now_ns or time.time_ns()
        ev = json.dumps({**evidence, "key": key, "weight": weight, "ts_ns": now}, default=str)
        counted, score = await self.r.eval(
            ADD_OFFENCE, 3, rep_key(node), rep_key(node) + ":keys",
            rep_key(node) + ":evidence", key, repr(float(weight)), str(now),
            repr(float(half_life_s)), ev, EVIDENCE_KEPT, status, detail[:500],
            OFFENCE_KEY_TTL_S)
        return bool(int(counted)), float(score)

    async def set_probation(self, node: str, status: str, detail: str = "",
                            until_ns: int | None = None,
                            canary: dict[str, Any] | None = None) -> None:
        """Set ``node``'s reputation ``status`` (``schemas.reputation.STATUSES``) with
        ``detail``; ``until_ns``: the end of its probation (Unix ns; None: kept); ``canary``:
        the last canary's result (None: kept). The score is left as it is."""
        fields: dict[str, Any] = {"status": status, "detail": detail[:500],
                                  "updated_ns": time.time_ns()}
        if until_ns is not None:
            fields["probation_until_ns"] = int(until_ns)
        if canary is not None:
            fields["canary"] = json.dumps(canary, default=str)
        await self.r.hset(rep_key(node), mapping=fields)

    async def forget_reputation(self, node: str) -> None:
        """An operator forgives ``node`` (repaired, replaced): its reputation is removed."""
        await self.r.delete(rep_key(node), rep_key(node) + ":keys",
                            rep_key(node) + ":evidence")

    # ---- checkpoints --------------------------------------------------------------------------
    async def add_checkpoint(self, job: str, path: str, step: int) -> None:
        """Index a committed checkpoint as ``pending`` (until the validator marks it)."""
        pipe = self.r.pipeline()
        pipe.zadd(f"tg:ckpt:{job}", {path: step})
        pipe.hsetnx(f"tg:ckpt:{job}:{path}", "status", "pending")
        pipe.hset(f"tg:ckpt:{job}:{path}", "step", step)
        await pipe.execute()

    async def mark_checkpoint(self, job: str, path: str, step: int, valid: bool,
                              reasons: list[str] | None = None) -> None:
        pipe = self.r.pipeline()
        pipe.zadd(f"tg:ckpt:{job}", {path: step})
        pipe.hset(f"tg:ckpt:{job}:{path}", mapping={
            "status": "valid" if valid else "invalid", "step": step,
            "reasons": json.dumps(reasons or []), "updated_ns": time.time_ns()})
        await pipe.execute()

    async def generation_ends(self, job: str) -> dict[int, int]:
        """``JobRecord.generation_ends`` of ``job``: generation → Unix ns it ended ({} for
        none, or an unreadable field)."""
        raw = await self.r.hget(job_key(job), "generation_ends")
        try:  # the record's own codec for the field
            ends = decode_record({"generation_ends": raw} if raw else {}).generation_ends
            return {int(g): int(ns) for g, ns in (ends or {}).items()}
        except (ValueError, TypeError, AttributeError):  # JobRecordError is a ValueError
            return {}

    async def checkpoints(self, job: str) -> list[dict[str, Any]]:
        """All indexed checkpoints of ``job``, newest step first:
        ``[{"path", "step", "status", "reasons"}]``."""
        paths = await self.r.zrevrange(f"tg:ckpt:{job}", 0, -1, withscores=True)
        pipe = self.r.pipeline(transaction=False)  # one round trip, not one per checkpoint
        for path, _ in paths:
            pipe.hgetall(f"tg:ckpt:{job}:{path}")
        hashes = await pipe.execute() if paths else []
        return [{"path": path, "step": int(step), "status": h.get("status", "pending"),
                 "reasons": json.loads(h.get("reasons", "[]"))}
                for (path, step), h in zip(paths, hashes)]

    async def forget_checkpoint(self, job: str, path: str) -> None:
        pipe = self.r.pipeline()
        pipe.zrem(f"tg:ckpt:{job}", path)
        pipe.delete(f"tg:ckpt:{job}:{path}")
        await pipe.execute()

    # ---- cross-job history ------------------------------------------------------------------------
    async def record_fault(self, node: str, job: str, signature: str, record: dict[str, Any],
                           ts_ns: int | None = None) -> None:
        """Remember a fault on ``node`` in ``job`` with a ``signature`` (e.g. fault class +
        normalised message) for cross-job attribution."""
        ts = ts_ns or time.time_ns()
        pipe = self.r.pipeline()
        pipe.zadd(f"tg:hist:node:{node}", {json.dumps({**record, "job": job,
                                                         "signature": signature, "ts": ts}): ts})
        pipe.zadd(f"tg:hist:sig:{signature}", {f"{job}|{node}": ts})
        await pipe.execute()

    async def node_history(self, node: str, since_ns: int = 0) -> list[dict[str, Any]]:
        rows = await self.r.zrangebyscore(f"tg:hist:node:{node}", since_ns, "+inf")
        return [json.loads(r) for r in rows]

    async def fault_history(self, nodes: Sequence[str], signature: str, since_ns: int = 0,
                            recent_since_ns: int | None = None, attrs_at: int = 0) -> tuple:
        """``node_history`` of each of ``nodes`` and ``signature_history`` of ``signature``
        since ``since_ns`` (Unix ns), in one round trip (a pipeline, no transaction): what the
        attributor reads before it decides. Returns (node → records, ``[(job, node)]``).
        With ``recent_since_ns``: a third item, the ``[(job, node)]`` that saw the signature
        since then (a shared cause's nodes), and a fourth, every node's attributes
        (``node_attrs``) when those pairs name ``attrs_at`` nodes or more (else ``{}``)."""
        pipe = self.r.pipeline(transaction=False)
        for node in nodes:
            pipe.zrangebyscore(f"tg:hist:node:{node}", since_ns, "+inf")
        pipe.zrangebyscore(f"tg:hist:sig:{signature}", since_ns, "+inf")
        if recent_since_ns is not None:
            pipe.zrangebyscore(f"tg:hist:sig:{signature}", recent_since_ns, "+inf")
        results = await pipe.execute()
        per_node, sig = results[:len(nodes)], results[len(nodes)]
        recent = results[len(nodes) + 1] if recent_since_ns is not None else None
        out = ({n: [json.loads(r) for r in rows] for n, rows in zip(nodes, per_node)},
               [tuple(r.split("|", 1)) for r in sig])
        if recent is None:
            return out
        pairs = [tuple(r.split("|", 1)) for r in recent]
        attrs = (await self.node_attrs()
                 if attrs_at and len({p[-1] for p in pairs}) >= attrs_at else {})
        return (*out, pairs, attrs)

    async def history_nodes(self) -> list[str]:
        """Every node with a cross-job fault history (``tg:hist:node:<node>``), by name (SCAN)."""
        return sorted({k[len("tg:hist:node:"):] async for k in
                       self.r.scan_iter(match="tg:hist:node:*", count=500)})

    async def signature_history(self, signature: str, since_ns: int = 0) -> list[tuple[str, str]]:
        """``[(job, node)]`` that saw ``signature`` since ``since_ns``."""
        rows = await self.r.zrangebyscore(f"tg:hist:sig:{signature}", since_ns, "+inf")
        return [tuple(r.split("|", 1)) for r in rows]  # type: ignore[misc]


def mark_stopped(r: Any, job: str) -> bool:
    """Mark ``job``'s record ``stopped`` through ``r``, a *synchronous* redis client (tools that
    run no event loop: ``trainguard credentials revoke``), the way ``StateStore.end_run`` ends a
    run; a job with no record is left alone. True when it had one."""
    if not r.exists(job_key(job)):
        return False
    r.eval(END_RUN, 1, job_key(job), encode_value("status", "stopped"))
    return True


def settle_value(decision_id: str) -> str:
    """What a settled claim holds (``commit_decision``'s ``settles``): ``decided:<id>``."""
    return f"decided:{decision_id}"

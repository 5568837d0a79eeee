"""The one state store of trainguard: job state, node state, checkpoint index, audit trail,
idempotency keys and cross-job fault history, in Redis/Valkey (redis-py asyncio).

Key layout (all keys under ``tg:``):

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:jobs``                     set    job names
``tg:job:<job>``                hash   mode, generation, world_size, min_world_size, retry_budget,
                                       retries_used, status, members (JSON), last_fault (JSON)
``tg:job:<job>:audit``          stream one entry per decision (fields: the decision as JSON)
``tg:idem:<key>``               string decision id that claimed the key (SET NX, 7 days)
``tg:node:<node>``              hash   status (healthy | excluded | lost), reason, updated_ns
``tg:ckpt:<job>``               zset   checkpoint path, score = step
``tg:ckpt:<job>:<path>``        hash   status (pending | valid | invalid), step, reasons (JSON)
``tg:hist:node:<node>``         zset   fault records on that node (JSON), score = Unix ns
``tg:hist:sig:<signature>``     zset   ``<job>|<node>`` pairs that saw that fault signature
==============================  =====  ============================================================
"""
from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from .errors import ServerUnreachable

IDEMPOTENCY_TTL_S = 7 * 86400


class LauncherConflict(RuntimeError):
    """A launcher of the same job already holds a live lease on this node
    (``StateStore.begin_run``). ``remaining_s``: seconds until that lease runs out."""

    def __init__(self, job: str, node: str, remaining_s: float):
        self.job, self.node, self.remaining_s = job, node, remaining_s
        super().__init__(
            f"job {job!r} already has a live launcher on node {node!r} (its lease runs out in "
            f"{remaining_s:.0f} s): stop that launcher first, give this launch another --job "
            f"(or --node), or, if that launcher died, launch again once its lease ran out")


class StateStore:
    """Async access to trainguard state in Redis/Valkey at ``url`` (``redis://host:port/db``)."""

    def __init__(self, url: str):
        self.url = url
        self.r = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2.0,
                                         socket_timeout=5.0, health_check_interval=10)

    async def ping(self) -> None:
        """Raises ``ServerUnreachable`` (a ConnectionError) with what to do when Redis/Valkey
        cannot be reached."""
        try:
            await self.r.ping()
        except (RedisConnectionError, OSError) as exc:
            raise ServerUnreachable("Redis/Valkey", self.url, str(exc), "REDIS_URL") from None

    async def close(self) -> None:
        await self.r.aclose()

    # ---- jobs ---------------------------------------------------------------------------------
    async def register_job(self, job: str, **fields: Any) -> None:
        """Create or update the job's hash; only fields not yet set are written (HSETNX), except
        those passed in ``fields`` with ``overwrite=True`` semantics via ``update_job``."""
        pipe = self.r.pipeline()
        pipe.sadd("tg:jobs", job)
        for k, v in fields.items():
            pipe.hsetnx(f"tg:job:{job}", k, _enc(v))
        await pipe.execute()

    async def begin_run(self, job: str, node: str, lease_s: float, **fields: Any
                        ) -> tuple[int, bool]:
        """A launcher of ``node`` joins the job's current run, or starts a new one.

        A run is live while any of its launchers holds a lease (renewed by ``renew_launcher``,
        dropped by ``end_launcher``). When none does and the job ran before, this launch is a
        new run of it (a resume): its generation moves past every generation used so far — the
        rendezvous keys of the old run's generations stay in the store, and ranks meeting under
        them would connect to dead peers — the status becomes ``running``, the retry budget
        starts afresh, the members are registered anew and ``fields`` (the launch settings)
        replace the old run's. Atomic, so the launchers of one new run agree. Returns
        ``(generation, new_run)``. Raises ``LauncherConflict`` when a launcher of ``node``
        already holds a live lease on the job (a second launch of a running job on one node
        would start a second set of the same ranks and break the first run).
        """
        script = """
        local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
        redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
        local mine = redis.call('ZSCORE', KEYS[2], ARGV[1])
        if mine then
            return {-1, -1, tonumber(mine) - now}
        end
        local live = redis.call('ZCARD', KEYS[2])
        local runs = tonumber(redis.call('HGET', KEYS[1], 'runs') or '0')
        local gen = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
        local new_run = 0
        if live == 0 then
            if runs > 0 then
                gen = gen + 1
                new_run = 1
                local f = cjson.decode(ARGV[4])
                for k, v in pairs(f) do redis.call('HSET', KEYS[1], k, v) end
                redis.call('HSET', KEYS[1], 'generation', cjson.encode(gen), 'status',
                           cjson.encode('running'), 'retries_used', '0')
                redis.call('HDEL', KEYS[1], 'members', 'spare_nodes')
            end
            redis.call('HSET', KEYS[1], 'runs', tostring(runs + 1))
        end
        redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
        return {gen, new_run, 0}"""
        now_ms = int(time.time() * 1000)
        gen, new_run, left_ms = await self.r.eval(
            script, 2, f"tg:job:{job}", f"tg:job:{job}:launchers", node, now_ms,
            int(lease_s * 1000), json.dumps({k: _enc(v) for k, v in fields.items()}))
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

    async def update_job(self, job: str, **fields: Any) -> None:
        await self.r.hset(f"tg:job:{job}", mapping={k: _enc(v) for k, v in fields.items()})

    async def add_members(self, job: str, members: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Merge ``members`` (``{"rank", "node", "local_rank"}``) into the job's ``members``
        list atomically (several launchers register at once); a rank given again replaces its
        entry. Returns the merged list sorted by rank."""
        script = """
        local cur = redis.call('HGET', KEYS[1], 'members')
        local list = cur and cjson.decode(cur) or {}
        local byrank = {}
        for _, m in ipairs(list) do byrank[tostring(m.rank)] = m end
        for _, m in ipairs(cjson.decode(ARGV[1])) do byrank[tostring(m.rank)] = m end
        local out = {}
        for _, m in pairs(byrank) do table.insert(out, m) end
        table.sort(out, function(a, b) return a.rank < b.rank end)
        local enc = cjson.encode(out)
        redis.call('HSET', KEYS[1], 'members', enc)
        return enc"""
        await self.r.sadd("tg:jobs", job)
        return json.loads(await self.r.eval(script, 1, f"tg:job:{job}", json.dumps(members)))

    async def job(self, job: str) -> dict[str, Any]:
        """The job's hash, values decoded from JSON where they are JSON; {} when unknown."""
        raw = await self.r.hgetall(f"tg:job:{job}")
        return {k: _dec(v) for k, v in raw.items()}

    async def jobs(self) -> list[str]:
        return sorted(await self.r.smembers("tg:jobs"))

    async def bump_generation(self, job: str, expected: int) -> int:
        """Atomically set generation to ``expected + 1`` if it is still ``expected``; returns
        the generation now in force (a caller that lost the race learns the winner's)."""
        script = """
        local cur = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
        if cur == tonumber(ARGV[1]) then
          redis.call('HSET', KEYS[1], 'generation', cur + 1)
          return cur + 1
        end
        return cur"""
        return int(await self.r.eval(script, 1, f"tg:job:{job}", expected))

    # ---- idempotency and audit ------------------------------------------------------------------
    async def claim(self, key: str, owner: str, ttl_s: int = IDEMPOTENCY_TTL_S) -> str | None:
        """Claim idempotency ``key`` for ``owner``. Returns None when this call claimed it, else
        the owner that claimed it first (the caller must then not act)."""
        ok = await self.r.set(f"tg:idem:{key}", owner, nx=True, ex=ttl_s)
        if ok:
            return None
        return await self.r.get(f"tg:idem:{key}")

    async def claimed_by(self, key: str) -> str | None:
        """The owner holding idempotency ``key``, or None when nobody claimed it (read only)."""
        return await self.r.get(f"tg:idem:{key}")

    async def audit(self, job: str, record: dict[str, Any], maxlen: int = 10000) -> str:
        """Append a record to the job's audit stream; returns the stream entry id."""
        return await self.r.xadd(f"tg:job:{job}:audit", {"record": json.dumps(record, default=str)},
                                 maxlen=maxlen, approximate=True)

    async def audit_trail(self, job: str, count: int = 1000) -> list[dict[str, Any]]:
        rows = await self.r.xrange(f"tg:job:{job}:audit", count=count)
        return [json.loads(f["record"]) for _, f in rows]

    # ---- nodes --------------------------------------------------------------------------------
    async def set_node(self, node: str, status: str, reason: str = "") -> None:
        await self.r.hset(f"tg:node:{node}", mapping={"status": status, "reason": reason,
                                                      "updated_ns": time.time_ns()})

    async def node(self, node: str) -> dict[str, str]:
        return await self.r.hgetall(f"tg:node:{node}")

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

    async def signature_history(self, signature: str, since_ns: int = 0) -> list[tuple[str, str]]:
        """``[(job, node)]`` that saw ``signature`` since ``since_ns``."""
        rows = await self.r.zrangebyscore(f"tg:hist:sig:{signature}", since_ns, "+inf")
        return [tuple(r.split("|", 1)) for r in rows]  # type: ignore[misc]


def _enc(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _dec(v: str) -> Any:
    try:
        return json.loads(v)
    except (ValueError, TypeError):
        return v

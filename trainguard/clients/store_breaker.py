"""The fleet breaker's key family in the state store (``StateStore`` inherits it).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:breaker``                  hash   ``schemas.breaker.BreakerState`` (``encode_breaker``)
``tg:breaker:observe``          hash   the same for the decisions of observe-mode jobs (never
                                       executed: it holds nothing, it shows when it would trip)
``tg:breaker:audit``            stream trips, holds, resets (who, when, why): one JSON record each
==============================  =====  ============================================================

One reader (``breaker``), one writer (``put_breaker``: compare-and-set on ``version``, so two
remediator replicas, or a replica and a person's reset, never overwrite each other's
transition: the loser reads again and applies its step to what won).
"""
from __future__ import annotations

import json
from typing import Any

from trainguard.schemas.breaker import BreakerState, decode_breaker, encode_breaker

BREAKER_KEY = "tg:breaker"
#: ``which`` → the hash: ``""`` the breaker, ``"observe"`` its shadow over observe-mode jobs
BREAKER_KEYS = {"": BREAKER_KEY, "observe": f"{BREAKER_KEY}:observe"}
BREAKER_AUDIT_KEY = "tg:breaker:audit"

#: KEYS[1] the hash; ARGV[1] the version expected; ARGV[2..] field, value pairs. Writes them
#: with ``version`` = expected + 1 when the hash's version is the expected one (absent = 0);
#: returns the new version, or -1 - the version in force when another write came first
PUT_BREAKER = """
local v = tonumber(redis.call('hget', KEYS[1], 'version') or '0')
if v ~= tonumber(ARGV[1]) then return -1 - v end
for i = 2, #ARGV, 2 do redis.call('hset', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('hset', KEYS[1], 'version', v + 1)
return v + 1
"""


class BreakerKeys:
    """``StateStore``'s methods for the fleet breaker (``self.r``: the redis-py client)."""

    r: Any

    async def breaker(self, which: str = "") -> BreakerState:
        """The breaker's state (closed, version 0, when never written); ``which``:
        ``BREAKER_KEYS``. Raises ``ValueError`` for a field it cannot read (the message says how
        to start over) and ``KeyError`` for an unknown ``which``."""
        return decode_breaker(await self.r.hgetall(BREAKER_KEYS[which]))

    async def put_breaker(self, state: BreakerState, expected: int,
                          which: str = "") -> int | None:
        """Write ``state`` if the stored version is ``expected``: the new version, or None when
        another write came first (read again, step again)."""
        fields = {k: v for k, v in encode_breaker(state).items() if k != "version"}
        args: list[Any] = [expected]
        for k, v in fields.items():
            args += [k, v]
        got = int(await self.r.eval(PUT_BREAKER, 1, BREAKER_KEYS[which], *args))
        return got if got >= 0 else None

    async def fleet_nodes(self) -> list[str]:
        """The nodes this control plane knows, sorted: every job's members, spare nodes and
        scheduler allocation, and every node with a status record (``tg:node:<node>``)."""
        nodes: set[str] = set()
        jobs = sorted(await self.r.smembers("tg:jobs"))
        if jobs:
            recs = await self.job_records(jobs)  # type: ignore[attr-defined]
            for rec in recs.values():
                if isinstance(rec, str):
                    continue
                nodes |= {str(m.get("node")) for m in rec.members if m.get("node")}
                nodes |= set(rec.spare_nodes) | set(rec.slurm_nodes)
        async for key in self.r.scan_iter(match="tg:node:*", count=500):
            nodes.add(key[len("tg:node:"):])
        return sorted(nodes)

    async def breaker_view(self, which: str = "") -> tuple[BreakerState, int]:
        """``(breaker state, number of known nodes)``: what ``remediator.breaker.admit`` needs."""
        return await self.breaker(which), len(await self.fleet_nodes())

    async def breaker_audit(self, record: dict[str, Any], maxlen: int = 10000) -> str:
        """Append a record (a trip, a hold, a reset: who, when, why) to the breaker's trail."""
        return await self.r.xadd(BREAKER_AUDIT_KEY,
                                 {"record": json.dumps(record, default=str)},
                                 maxlen=maxlen, approximate=True)

    async def breaker_trail(self, count: int = 1000) -> list[dict[str, Any]]:
        """The breaker's audit records, oldest first."""
        rows = await self.r.xrange(BREAKER_AUDIT_KEY, count=count)
        return [json.loads(f["record"]) for _, f in rows]

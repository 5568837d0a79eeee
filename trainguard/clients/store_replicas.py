"""The services' replica leases in the state store (``StateStore`` inherits them;
``trainguard.services.membership`` shares the jobs among the live replicas).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:members:<service>``        zset   live replicas of a service, score = lease expiry (Unix ms)
==============================  =====  ============================================================
"""
from __future__ import annotations

import time
from typing import Any

from trainguard.clients.store_scripts import members_key


class ReplicaKeys:
    """``StateStore``'s methods for service replicas (``self.r``: the redis-py client)."""

    r: Any

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

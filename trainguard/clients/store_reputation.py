"""A node's reputation across jobs in the state store (``StateStore`` inherits it): the record
is ``schemas.reputation.NodeReputation``; the policy is ``trainguard.core.reputation``'s.

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:rep:<node>``               hash   the node's reputation: ``schemas.reputation.NodeReputation``
``tg:rep:<node>:evidence``      list   its last offences (JSON), newest last
``tg:rep:<node>:keys``          set    offence keys counted already (30 days)
``tg:rep:<node>:readmit``       string the lock of a readmit under way (its token; expires)
==============================  =====  ============================================================
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from trainguard.clients.store_scripts import ADD_OFFENCE, rep_key
from trainguard.schemas.reputation import EVIDENCE_KEPT, NodeReputation, decode_reputation

#: how long an offence key is remembered (an exclusion carried out again later counts again)
OFFENCE_KEY_TTL_S = 30 * 86400


class ReputationKeys:
    """``StateStore``'s methods for node reputation (``self.r``: the redis-py client)."""

    r: Any

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

"""The remediator's decision keys in the state store: idempotency claims, the decision outbox
and the audit trail (``StateStore`` inherits them).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:idem:<key>``               string owner that claimed the key (SET NX, 7 days); a verdict's
                                       claim once its decision is stored: ``decided:<id>``
``tg:outbox:<job>``             hash   decision id → decision (JSON) stored, not yet seen stored
                                       in JetStream (the remediator's outbox)
``tg:outboxes``                 set    the jobs whose outbox holds a decision (``OUTBOX_INDEX``)
``tg:audit:<job>``              stream one entry per decision (fields: the decision as JSON)
==============================  =====  ============================================================

``commit_decision`` writes a decision's record (``tg:job:<job>``), its outbox entry and the
settling of its input's claim in one transaction.
"""
from __future__ import annotations

import json
from typing import Any

from trainguard.clients.store_scripts import (OUTBOX_DONE, OUTBOX_INDEX, TAKE_CLAIM, audit_key,
                                              idem_key, job_key, outbox_key)
from trainguard.schemas.job import encode_fields, encode_value

#: how long an idempotency claim is kept (seconds)
IDEMPOTENCY_TTL_S = 7 * 86400


def settle_value(decision_id: str) -> str:
    """What a settled claim holds (``commit_decision``'s ``settles``): ``decided:<id>``."""
    return f"decided:{decision_id}"


class DecisionKeys:
    """``StateStore``'s methods for claims, the decision outbox and the audit trail
    (``self.r``: the redis-py client)."""

    r: Any

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
        first), for ``jobs`` (default: the jobs of ``OUTBOX_INDEX``); jobs with none are left
        out."""
        names = list(jobs) if jobs is not None else sorted(await self.r.smembers(OUTBOX_INDEX))
        pipe = self.r.pipeline(transaction=False)
        for j in names:
            pipe.hvals(outbox_key(j))
        rows = await pipe.execute() if names else []
        out: dict[str, list[dict[str, Any]]] = {}
        for j, vals in zip(names, rows):
            if vals:
                out[j] = sorted((json.loads(v) for v in vals), key=lambda d: d.get("ts", 0))
        return out

"""A node's key families in the state store: its status, its attributes and the cross-job fault
history (``StateStore`` inherits them; its reputation is ``trainguard.clients.store_reputation``).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:node:<node>``              hash   status (healthy | excluded | lost), reason, updated_ns
``tg:nodeattrs:<node>``         hash   the node's attributes (driver, image, rack, switch, mount …)
``tg:hist:node:<node>``         zset   fault records on that node (JSON), score = Unix ns
``tg:hist:sig:<signature>``     zset   ``<job>|<node>`` pairs that saw that fault signature
==============================  =====  ============================================================
"""
from __future__ import annotations

import json
import time
from typing import Any, Sequence


class NodeKeys:
    """``StateStore``'s methods for node status, attributes and fault history (``self.r``: the
    redis-py client)."""

    r: Any

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

    # ---- cross-job history --------------------------------------------------------------------
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

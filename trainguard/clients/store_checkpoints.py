"""The checkpoint index in the state store (``StateStore`` inherits it): what restore trusts.
Only the ``checkpoint_validator`` role writes it (``trainguard.security.roles``).

==============================  =====  ============================================================
key                             type   content
==============================  =====  ============================================================
``tg:ckpt:<job>``               zset   checkpoint path, score = step
``tg:ckpt:<job>:<path>``        hash   status (pending | valid | invalid), step, reasons (JSON)
==============================  =====  ============================================================
"""
from __future__ import annotations

import json
import time
from typing import Any


class CheckpointKeys:
    """``StateStore``'s methods for the checkpoint index (``self.r``: the redis-py client)."""

    r: Any

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

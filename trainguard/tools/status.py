"""``trainguard status``: the control plane at a glance — the fleet breaker (closed or tripped,
the nodes taken out within its window, the decisions it held) and every job (mode, status,
generation, world size, restarts without progress of the budget).

``--json`` prints one object ``{"breaker": …, "jobs": […]}``. Exit status 0, 3 while the
breaker is tripped (as ``trainguard breaker status``). The state store is ``REDIS_URL``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from redis.exceptions import NoPermissionError

from trainguard.tools import breaker as breaker_cli
from trainguard.clients.store import StateStore

__all__ = ["main"]


async def _jobs(store: StateStore) -> list[dict[str, Any]]:
    names = await store.jobs()
    recs = await store.job_records(names) if names else {}
    out = []
    for name in names:
        r = recs[name]
        if isinstance(r, str):
            out.append({"job": name, "error": r})
            continue
        stalled = (r.last_fault or {}).get("stalled", r.retries_used)
        out.append({"job": name, "mode": r.mode or "observe", "status": r.status,
                    "generation": r.generation, "world_size": r.world_size,
                    "retries_used": r.retries_used, "stalled_restarts": stalled,
                    "retry_budget": r.retry_budget})
    return out


async def _run(a: argparse.Namespace) -> int:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        print("trainguard status: REDIS_URL is not set", file=sys.stderr)
        return 2
    store = StateStore(url)
    try:
        await store.ping()
        b = await breaker_cli.status(store, trail=3)
        jobs = await _jobs(store)
    except NoPermissionError as exc:
        print(breaker_cli.refused_words("trainguard status", exc), file=sys.stderr)
        return 1
    finally:
        await store.close()
    if a.json:
        print(json.dumps({"breaker": b, "jobs": jobs}, default=str))
    else:
        breaker_cli._print_status(b)
        print(f"jobs: {len(jobs)}")
        for j in jobs:
            if "error" in j:
                print(f"  {j['job']}: {j['error']}")
                continue
            print(f"  {j['job']}: {j['mode']}, {j['status'] or 'never launched'}, generation "
                  f"{j['generation']}, world {j['world_size']}, restarts without progress "
                  f"{j['stalled_restarts']} of {j['retry_budget'] if j['retry_budget'] is not None else 'the default'}")
    return breaker_cli.TRIPPED_EXIT if b["status"] == "tripped" else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainguard status")
    p.add_argument("--json", action="store_true")
    return asyncio.run(_run(p.parse_args(argv)))

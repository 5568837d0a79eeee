"""``trainguard breaker``: the fleet breaker over node-taking actions (``remediator.breaker``).

* ``trainguard breaker status [--json]`` — closed or tripped, since when and why, the nodes
  taken out within the window (node, job, action, time), the limit and the known nodes, the
  decisions held, when it would have tripped (observe: the breaker's own ``observe`` mode, or
  the decisions of observe-mode jobs, which it counts apart and never holds), the last reset, and the last entries of the breaker's audit trail. Exit
  status 0 closed, 3 tripped (scripts and health checks can test it).
* ``trainguard breaker reset --reason TEXT [--by NAME]`` — close it: a person's act, after
  investigating (``docs/fleet-guard.md``). ``--reason`` is required; ``--by`` defaults to
  ``$USER@host``. Who, when and why go to the breaker's audit trail; the ``reset`` transition is
  published on ``tg.fleet.breaker`` when ``NATS_URL`` is set. The breaker never resets itself.

The state store is ``REDIS_URL`` (required). The window, fraction and counts the status shows
are this process's ``BreakerConfig`` (env ``TG_BREAKER_…``): give it the remediator's settings.
"""
from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket
import sys
import time
from typing import Any

from redis.exceptions import NoPermissionError

from trainguard.remediator import breaker as br
from trainguard.schemas import BreakerChanged, BreakerState, subjects

from trainguard.clients.store import StateStore

__all__ = ["main", "reset", "status"]

#: exit status of ``status`` while the breaker is tripped
TRIPPED_EXIT = 3


def default_by() -> str:
    """``$USER@host``: who resets when ``--by`` is not given."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def status(store: StateStore, cfg: br.BreakerConfig | None = None,
                 trail: int = 10) -> dict[str, Any]:
    """The breaker as a JSON-ready dict (see the module docstring)."""
    cfg = cfg or br.BreakerConfig()
    st, known = await store.breaker_view()
    shadow = await store.breaker("observe")
    now = time.time_ns()
    win = br.window(st, cfg, now)
    return {"status": st.status, "mode": cfg.mode, "tripped_ts": st.tripped_ts,
            "trip_reason": st.trip_reason, "held": st.held, "taken": len(win),
            "window": [dict(t) for t in win], "limit": br.limit(cfg, known),
            "known_nodes": max(known, cfg.fleet_nodes), "window_s": cfg.window_s,
            "fraction": cfg.fraction, "min_nodes": cfg.min_nodes, "max_nodes": cfg.max_nodes,
            "would_trip_ts": st.would_trip_ts or shadow.would_trip_ts,
            "would_trip_reason": st.would_trip_reason or shadow.would_trip_reason,
            "observe_jobs_taken": len(br.window(shadow, cfg, now)),
            "last_reset": st.last_reset, "version": st.version,
            "trail": (await store.breaker_trail())[-trail:] if trail > 0 else []}


async def reset(store: StateStore, by: str, reason: str, bus: Any = None,
                now_ns: int | None = None) -> BreakerState:
    """Close the breaker (compare-and-set: a remediator's write meanwhile is read again), write
    who, when and why to its trail, publish the ``reset`` on ``bus`` when given. Returns the
    state written. Raises ``breaker.BreakerError`` without a reason or a name."""
    ts = now_ns or time.time_ns()
    for which in ("observe", ""):  # its shadow over observe-mode jobs too; the breaker last
        for _ in range(20):
            before = await store.breaker(which)
            after = br.reset(before, by, reason, ts)
            version = await store.put_breaker(after, before.version, which)
            if version is not None:
                break
        else:
            raise br.BreakerError("the breaker's state kept changing: try the reset again")
    await store.breaker_audit({"type": "reset", "by": by, "reason": reason, "ts": ts,
                               "was": before.status, "held": before.held,
                               "taken": len(before.taken)})
    if bus is not None:
        await bus.publish(subjects.FLEET_BREAKER, BreakerChanged(
            transition="reset", status=after.status, by=by, reason=reason, ts=ts,
            detail={"was": before.status, "held": before.held}))
    return after


def _print_status(s: dict[str, Any]) -> None:
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s["tripped_ts"] / 1e9)) + " UTC"
            if s["tripped_ts"] else "")
    print(f"fleet breaker: {s['status'].upper()} (mode {s['mode']})"
          + (f" since {when}: {s['trip_reason']}" if when else ""))
    print(f"  window: {s['taken']} of at most {s['limit']} node(s) taken out within "
          f"{s['window_s']:g} s (max({s['min_nodes']}, {s['fraction']:g} x "
          f"{s['known_nodes']} known nodes)"
          + (f", at most {s['max_nodes']}" if s["max_nodes"] is not None else "") + ")")
    for t in s["window"]:
        print(f"    {t.get('node')}  {t.get('action')}  job {t.get('job')}  "
              f"decision {t.get('decision_id')}")
    if s["held"]:
        print(f"  held: {s['held']} decision(s) since it tripped")
    if s["would_trip_ts"]:
        print(f"  would have tripped (observe): {s['would_trip_reason']}")
    if s["last_reset"]:
        r = s["last_reset"]
        print(f"  last reset by {r.get('by')}: {r.get('reason')}")
    if s["status"] == "tripped":
        print("  investigate (docs/fleet-guard.md), then: trainguard breaker reset "
              "--reason '…'")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard breaker")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status")
    s.add_argument("--json", action="store_true")
    r = sub.add_parser("reset")
    r.add_argument("--reason", required=True, help="what was found and fixed")
    r.add_argument("--by", default=None, help="who resets it (default $USER@host)")
    return p


def refused_words(prog: str, exc: Exception) -> str:
    """What to say when the state store refuses this user a key (``redis``'s
    ``NoPermissionError``): the breaker and the job records are read with the ``reader`` role's
    credentials (``trainguard up`` writes them to ``<data dir>/env/reader.env``; the line it
    prints is the worker's, which may not read them)."""
    return (f"{prog}: the state store refused this user ({exc}): reading the fleet breaker and "
            f"the jobs needs the reader role's credentials: `. <data dir>/env/reader.env` "
            f"(trainguard up writes it; the export line it prints is the workers'); a reset "
            f"needs the remediator's or the console's")


async def _run(a: argparse.Namespace) -> int:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        print("trainguard breaker: REDIS_URL is not set: the breaker lives in the state "
              "store", file=sys.stderr)
        return 2
    store = StateStore(url)
    try:
        await store.ping()
        if a.cmd == "status":
            s = await status(store)
            if a.json:
                print(json.dumps(s, default=str))
            else:
                _print_status(s)
            return TRIPPED_EXIT if s["status"] == "tripped" else 0
        bus = None
        if os.environ.get("NATS_URL"):
            from trainguard.clients.bus import Bus
            try:
                bus = await Bus(os.environ["NATS_URL"], "breaker-cli").connect()
            except Exception as exc:  # noqa: BLE001 - the reset is the store's; say it
                print(f"trainguard breaker: NATS unreachable ({exc}); the reset is written "
                      f"to the store, not announced", file=sys.stderr)
        try:
            after = await reset(store, a.by or default_by(), a.reason, bus)
        finally:
            if bus is not None:
                await bus.close()
        print(f"fleet breaker: {after.status} (reset by {after.last_reset['by']}: "
              f"{after.last_reset['reason']})")
        return 0
    except br.BreakerError as exc:
        print(f"trainguard breaker: {exc}", file=sys.stderr)
        return 2
    except NoPermissionError as exc:
        print(refused_words("trainguard breaker", exc), file=sys.stderr)
        return 1
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_run(_parser().parse_args(argv)))

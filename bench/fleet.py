"""Fleet guard benchmark: the real services against a simulated fleet, with and without the
fleet breaker and the shared-cause rule, in the same run.

    python bench/fleet.py [--nodes 64] [--jobs 8] [--rollout-s 30] [--json PATH]

Each arm starts its own embedded NATS and Valkey and the real ``python -m trainguard.detector |
attributor | remediator`` processes (roles' users, plain subscriptions), registers ``--jobs``
jobs of ``--nodes / --jobs`` nodes (one rank a node, action mode; ``min_world_size`` a quarter of
the nodes: elastic jobs) and simulated node agents and ranks publishing real events: rank heartbeats, node
heartbeats and telemetry (with each node's attributes: driver version, rack, image) every
second, and XID events on ``tg.node.<node>.xid``. Arms:

* ``off`` — no fleet guard (``TG_BREAKER=off``, ``TG_SHARED_CAUSE_NODES=0``): as before;
* ``breaker`` — the breaker alone (defaults: 50 % of the known nodes in 300 s, floor 4);
* ``guard`` — the breaker and the shared-cause rule (defaults).

Schedules:

* ``rollout`` (a) — a bad driver rollout: XID 79 on 60 % of the nodes (those with the new
  driver) within ``--rollout-s`` seconds;
* ``after_reset`` (c) — on the same services right after (a): the breaker is reset by a
  person (``trainguard breaker reset``), then independent faults on 3 healthy nodes;
* ``independent`` (b) — fresh services: six different hardware XIDs (48, 62, 64, 74, 79, 119)
  on six nodes of different jobs, ``--gap-s`` apart.

Reported per arm and schedule: nodes taken out (executed exclusions), jobs stopped, jobs that
kept training (not stopped), decisions held (by the breaker, by a shared cause), whether the
breaker tripped and at how many nodes, the shared cause a verdict named. ``--json PATH`` writes
it all with the run's conditions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard import schemas  # noqa: E402

from trainguard.tools import breaker as breaker_cli
from trainguard.clients.bus import Bus  # noqa: E402
from trainguard.stack.embedded import EmbeddedServers  # noqa: E402
from trainguard.schemas import subjects  # noqa: E402
from trainguard.services.base import health_subject  # noqa: E402
from trainguard.clients.store import StateStore  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

SERVICES = ("detector", "attributor", "remediator")
ARMS: dict[str, dict[str, str]] = {
    "off": {"TG_BREAKER": "off", "TG_SHARED_CAUSE_NODES": "0"},
    "breaker": {"TG_BREAKER": "action", "TG_SHARED_CAUSE_NODES": "0"},
    "guard": {"TG_BREAKER": "action", "TG_SHARED_CAUSE_NODES": "4"},
}
INDEPENDENT_XIDS = (48, 62, 64, 74, 79, 119)
NEW_DRIVER, OLD_DRIVER = "550.54.15", "535.104.05"


def fleet(nodes: int, jobs: int, seed: int) -> tuple[dict[str, list[dict]], dict[str, dict],
                                                     list[str]]:
    """(job → members, node → attributes, the rollout's nodes: 60 %, spread over the jobs)."""
    per = nodes // jobs
    layout = {f"job{j}": [{"rank": r, "node": f"node{j * per + r:03d}", "local_rank": 0}
                          for r in range(per)] for j in range(jobs)}
    names = [m["node"] for ms in layout.values() for m in ms]
    rng = random.Random(seed)
    bad = sorted(rng.sample(names, round(0.6 * len(names))))
    attrs = {n: {"driver": NEW_DRIVER if n in bad else OLD_DRIVER, "rack": f"r{i // 8}",
                 "image": "ubuntu-22.04-gpu-7"} for i, n in enumerate(names)}
    rng.shuffle(bad)  # the order the rollout reaches them
    return layout, attrs, bad


def min_world(job: str, size: int) -> int:
    """Every job is elastic: it trains on down to a quarter of its nodes (a job that stops
    takes no more of its nodes out, which would hide what the breaker bounds)."""
    return max(1, size // 4)


class Sim:
    """Simulated agents and ranks: heartbeats and telemetry every second; XIDs on demand."""

    def __init__(self, ranks: Bus, agents: Bus, layout: dict[str, list[dict]],
                 attrs: dict[str, dict]):
        self.bus, self.agents, self.layout, self.attrs = ranks, agents, layout, attrs
        self.step = 0
        self.task: asyncio.Task | None = None

    async def beat(self) -> None:
        while True:
            self.step += 1
            for job, members in self.layout.items():
                for m in members:
                    await self.bus.publish(subjects.rank_hb(job, m["rank"]), schemas.RankHeartbeat(
                        job=job, rank=m["rank"], node=m["node"], local_rank=0,
                        world_size=len(members), step=self.step, collective_seq=self.step,
                        phase="train", step_time_s=1.0, interval_s=1.0))
            for node, a in self.attrs.items():
                await self.agents.publish(subjects.node(node, "heartbeat"),
                                       schemas.NodeHeartbeat(node=node, role="agent"))
                await self.agents.publish(subjects.node(node, "telemetry"), schemas.NodeTelemetry(
                    node=node, cpu_percent=20.0, mem_used_bytes=8 << 30,
                    mem_total_bytes=64 << 30, attributes=a))
            await asyncio.sleep(1.0)

    async def xid(self, node: str, xid: int) -> None:
        line = (f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=4242, name=python, "
                f"{'GPU has fallen off the bus' if xid == 79 else 'fault'}.")
        await self.agents.publish(subjects.node(node, "xid"), schemas.XidEvent(
            node=node, xid=xid, pci="0000:3b:00.0", gpu_index=0, pid=4242, message=line,
            raw=line, source="kmsg"))


async def _healthy(bus: Bus, service: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(await bus.request(health_subject(service), timeout=0.5)).get("ok"):
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{service} not healthy within {timeout} s")


async def _quiet(count, settle_s: float, limit_s: float) -> None:
    """Wait until ``count()`` stays the same for ``settle_s`` (at most ``limit_s``)."""
    last, since, t0 = count(), time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        await asyncio.sleep(0.25)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return


def _summary(decisions: list, store_jobs: dict[str, Any], layout: dict, breaker: dict,
             verdicts: list, breaker_events: list) -> dict[str, Any]:
    executed = [d for d in decisions if d.execute]
    taken = sorted({n for d in executed if d.action == "exclude_node_and_requeue"
                    for n in d.nodes})
    held = [d for d in decisions if d.held]
    stopped = sorted(j for j, r in store_jobs.items() if r.status == "stopped")
    causes = [v.detail["shared_cause"] for v in verdicts if v.detail.get("shared_cause")]
    tripped = next((e for e in breaker_events if e.transition == "tripped"), None)
    return {
        "nodes_taken_out": len(taken), "jobs_stopped": len(stopped),
        "jobs_kept_training": len(layout) - len(stopped),
        "decisions": len(decisions),
        "decisions_held": len(held),
        "held_by_breaker": sum(1 for d in held if d.held.get("by") == "breaker"),
        "held_by_shared_cause": sum(1 for d in held if d.held.get("by") == "shared_cause"),
        "held_fallbacks": sorted({d.action for d in held}),
        "breaker_status": breaker.get("status"), "breaker_limit": breaker.get("limit"),
        "breaker_known_nodes": breaker.get("known_nodes"),
        "breaker_tripped_at_nodes": (tripped.taken + len(tripped.nodes)) if tripped else None,
        "breaker_transitions": [e.transition for e in breaker_events],
        "verdicts_naming_shared_cause": len(causes),
        "shared_cause": ({k: causes[-1][k] for k in ("layer", "common", "count", "jobs")}
                         if causes else None),
        "stop_reasons": sorted({d.reason.split(";")[0][:160] for d in executed
                                if d.action == "stop_job_notify_user"}),
        "jobs_world_sizes": {j: r.world_size for j, r in sorted(store_jobs.items())},
    }


async def run_arm(arm: str, schedules: list[str], args: argparse.Namespace,
                  logdir: Path) -> dict[str, Any]:
    layout, attrs, bad = fleet(args.nodes, args.jobs, args.seed)
    out: dict[str, Any] = {}
    with EmbeddedServers() as srv:
        admin = await Bus(srv.nats_url, "bench").connect()
        store = StateStore(srv.redis_url)
        for job, members in layout.items():
            await store.register_job(job, mode="action", generation=0, world_size=len(members),
                                     min_world_size=min_world(job, len(members)),
                                     retry_budget=100,
                                     retries_used=0, members=members, status="running",
                                     nnodes=len(members), nproc_per_node=1,
                                     hang_timeout_s=3600.0, node_timeout_s=3600.0)
        procs = []
        for s in SERVICES:
            nats_url, redis_url = srv.urls(s)
            log = open(logdir / f"{arm}-{'-'.join(schedules)}-{s}.log", "ab")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", f"trainguard.{s}"],
                env={**os.environ, "NATS_URL": nats_url, "REDIS_URL": redis_url,
                     "TG_LOG_LEVEL": "WARNING", "TG_DURABLE": "0", **ARMS[arm]},
                stdout=log, stderr=subprocess.STDOUT))
            log.close()
        sim = None
        try:
            for s in SERVICES:
                await _healthy(admin, s)
            got: dict[str, list] = {"decision": [], "verdict": [], "breaker": []}
            await admin.subscribe("tg.job.*.decision", lambda s, e: got["decision"].append(e))
            await admin.subscribe("tg.job.*.verdict", lambda s, e: got["verdict"].append(e))
            await admin.subscribe(subjects.FLEET_BREAKER, lambda s, e: got["breaker"].append(e))
            await admin.flush()
            sim = Sim(await Bus(srv.urls("worker")[0], "bench-ranks").connect(),
                      await Bus(srv.urls("agent")[0], "bench-agents").connect(), layout, attrs)
            sim.task = asyncio.create_task(sim.beat())
            await asyncio.sleep(args.warmup_s)  # the detector learns the jobs' members
            for sched in schedules:
                mark = {k: len(v) for k, v in got.items()}
                t0 = time.monotonic()
                if sched == "rollout":
                    for i, node in enumerate(bad):
                        await asyncio.sleep(max(0.0, t0 + i * args.rollout_s / len(bad)
                                                - time.monotonic()))
                        await sim.xid(node, 79)
                elif sched == "independent":
                    jobs = sorted(layout)
                    for i, x in enumerate(INDEPENDENT_XIDS):
                        node = layout[jobs[i % len(jobs)]][1 + i // len(jobs)]["node"]
                        await sim.xid(node, x)
                        await asyncio.sleep(args.gap_s)
                elif sched == "after_reset":
                    await breaker_cli.reset(store, "bench@fleet", "driver rollout rolled "
                                            "back; the nodes passed their canary", admin)
                    # three healthy nodes of jobs still running fail on their own
                    healthy = [n for n in sorted(attrs) if attrs[n]["driver"] == OLD_DRIVER]
                    recs = await store.job_records(sorted(layout))
                    running = {m["node"] for j, r in recs.items() if r.status != "stopped"
                               for m in r.members}
                    picks = [n for n in healthy if n in running][::5][:3]
                    for node, x in zip(picks, (48, 74, 94)):
                        await sim.xid(node, x)
                        await asyncio.sleep(args.gap_s)
                await _quiet(lambda: len(got["decision"]), args.settle_s, 120.0)
                elapsed = time.monotonic() - t0
                decisions = got["decision"][mark["decision"]:]
                recs = await store.job_records(sorted(layout))
                b = await breaker_cli.status(store)
                res = _summary(decisions, recs, layout, b, got["verdict"][mark["verdict"]:],
                               got["breaker"][mark["breaker"]:])
                res["seconds"] = round(elapsed, 1)
                if sched == "rollout":
                    res["rollout_nodes"] = len(bad)
                if sched == "after_reset":
                    res["nodes_taken_out_after_reset"] = res["nodes_taken_out"]
                out[sched] = res
        finally:
            if sim is not None and sim.task is not None:
                sim.task.cancel()
                await sim.bus.close()
                await sim.agents.close()
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            await admin.close()
            await store.close()
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="tg-fleet-"))
    logdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    t0 = time.time()
    load0 = os.getloadavg()
    for arm in args.arms.split(","):  # the arms one after the other, each schedule in each
        results.setdefault(arm, {}).update(await run_arm(arm, ["rollout", "after_reset"],
                                                         args, logdir))
        results[arm].update(await run_arm(arm, ["independent"], args, logdir))
    return {
        "benchmark": "bench/fleet.py", "nodes": args.nodes, "jobs": args.jobs,
        "ranks_per_node": 1,
        "min_world_size": "a quarter of each job's nodes",
        "rollout": {"xid": 79, "fraction": 0.6, "within_s": args.rollout_s},
        "independent": {"xids": list(INDEPENDENT_XIDS), "gap_s": args.gap_s},
        "arms": {k: v for k, v in ARMS.items()}, "results": results,
        "conditions": {"host": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "loadavg_before": load0,
                       "loadavg_after": os.getloadavg(), "wall_s": round(time.time() - t0, 1),
                       "note": "shared 2-core machine, other work running: counts are the "
                               "result, seconds are indicative only"},
        "logs": str(logdir), "provenance": provenance.record(list(load0)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--rollout-s", type=float, default=30.0,
                    help="seconds over which the rollout's XIDs arrive (a minute at most)")
    ap.add_argument("--gap-s", type=float, default=2.0,
                    help="seconds between independent faults (far faster than a few an hour: "
                         "a harder case for the breaker)")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=6.0,
                    help="a schedule ends once no decision came for this long")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    ap.add_argument("--json", default="", help="write the results to this path")
    ap.add_argument("--log-dir", default="")
    args = ap.parse_args(argv)
    res = asyncio.run(bench(args))
    text = json.dumps(res, indent=2, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    for arm, scheds in res["results"].items():
        for sched, r in scheds.items():
            print(f"{arm:8} {sched:12} taken out {r['nodes_taken_out']:3}  stopped "
                  f"{r['jobs_stopped']}  kept training {r['jobs_kept_training']}  held "
                  f"{r['decisions_held']} (breaker {r['held_by_breaker']}, shared cause "
                  f"{r['held_by_shared_cause']})  breaker {r['breaker_status']}"
                  + (f" tripped at {r['breaker_tripped_at_nodes']}"
                     if r['breaker_tripped_at_nodes'] else "")
                  + (f"  cause {r['shared_cause']['layer']} {r['shared_cause']['common']}"
                     if r["shared_cause"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

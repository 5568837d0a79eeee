"""Scale-out benchmark: N simulated ranks on M nodes over R replicas of each service.

    python bench/scale.py [--ranks 400] [--nodes 50] [--replicas 2] [--ranks-per-job 8]
                          [--publishers 2] [--hb-interval 1.0] [--seconds 8] [--partitions 32]
                          [--json]
    python bench/scale.py --ranks 10000 --nodes 1250 --replicas 3 --publishers 4
    python bench/scale.py --plain      # the same on plain subscriptions, for comparison

Embedded NATS (with the streams) and Valkey with the roles' users, ``--replicas`` processes
each of ``python -m trainguard.detector|attributor|remediator --replica r<i>`` sharing the jobs
by rendezvous hashing of the streams' partitions (``trainguard.services.membership``,
``trainguard.core.partitions``; ``--partitions 0``: jobs hashed one by one and every replica reads
every message, the layout before partitions), ``--publishers`` processes sending a rank
heartbeat for every rank every ``--hb-interval`` seconds and a node heartbeat per node. Jobs
are registered in action mode. Printed (``--json``: one JSON object):

* ``hb_to_anomaly_ms`` p50/p99 — a heartbeat carrying a NaN loss (each on a rank that had none:
  one anomaly each) to the anomaly's arrival on the bus, over ``--seconds`` seconds;
* ``fault_to_decision_ms`` p50/p99 — a ``worker.exited`` of a fresh job's rank killed by
  SIGKILL (attributed at once; an exit code waits up to ``symptom_hold_s`` for its traceback)
  to its decision
  (detector → attributor → remediator, each partitioned);
* ``takeover_s`` — replica ``r0`` of every service SIGKILLed while the faults of jobs it owned
  arrive: seconds from the kill until each such fault's decision (max and p50) — the lease
  running out, the survivors replaying the jobs' streams, the chain deciding; ``rebuilds``:
  for each survivor, when its takeover began (seconds after the kill) and how long it took;
* ``bytes_per_rank`` — growth of the detectors' RSS (all replicas) from before the heartbeats
  to after the warm-up, divided by the ranks;
* ``detector_cpu`` — each detector replica's CPU (cores: CPU seconds over wall seconds) while
  the probes ran, and ``cpu_us_per_hb``: all detectors' CPU per heartbeat published;
  ``nats_server_cpu_cores``: the server's over the same time (the partition filters are its
  work); ``services_cpu_cores``: all replicas of each service, ``publishers_cpu_cores``: the
  simulated ranks' publishers (on a real cluster they run on the ranks' own nodes).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard import schemas  # noqa: E402
from trainguard.clients.bus import Bus  # noqa: E402
from trainguard.stack.embedded import EmbeddedServers  # noqa: E402
from trainguard.services.membership import job_owner  # noqa: E402
from trainguard.core.partitions import configured as partition_count  # noqa: E402
from trainguard.schemas import subjects  # noqa: E402
from trainguard.services.base import health_subject  # noqa: E402
from trainguard.clients.store import StateStore  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

SERVICES = ("detector", "attributor", "remediator")


def layout(ranks: int, nodes: int, per_job: int) -> dict[str, list[dict]]:
    """job name → members (``rank``, ``node``, ``local_rank``): ranks fill nodes in order."""
    per_node = max(1, math.ceil(ranks / nodes))
    jobs: dict[str, list[dict]] = {}
    for g in range(ranks):
        job = f"s{g // per_job}"
        jobs.setdefault(job, []).append({"rank": g % per_job, "node": f"n{g // per_node}",
                                         "local_rank": g % per_node})
    return jobs


SLOT_S = 0.02  # s: a publisher's heartbeats are spread over slots of this length


def _publisher(url: str, beats: list[tuple[str, int, str, int]], nodes: list[str],
               interval: float, stop_at: float) -> None:
    """One publisher process: a heartbeat per (job, rank, node, local_rank) every
    ``interval`` seconds and a node heartbeat per node, until ``stop_at`` (Unix s)."""
    async def run() -> None:
        bus = await Bus(url, "bench-publisher").connect()
        assert bus.nc is not None
        step = 0
        # Each beat is the wire form of a schemas.RankHeartbeat / NodeHeartbeat, its fields
        # validated once (to_dict) and the changing ones (event id, ts, step) set per beat: a
        # model built per beat cost the publishers ≈ 0.5 cores of the 2 the services share,
        # where real ranks run on their own nodes.
        def rank_beat(job: str, rank: int, node: str, lr: int):
            """(subject, bytes) of this rank's heartbeat at a step."""
            subject = subjects.rank_hb(job, rank)
            wire = schemas.RankHeartbeat(
                job=job, rank=rank, node=node, local_rank=lr, step=0, collective_seq=0,
                phase="train", step_time_s=interval, interval_s=interval).to_dict()

            def make(step: int) -> tuple[str, bytes]:
                wire["event_id"], wire["ts"] = uuid.uuid4().hex, time.time_ns()
                wire["step"] = wire["collective_seq"] = step
                return subject, msgpack.packb(wire, use_bin_type=True)
            return make

        def node_beat(node: str):
            subject = subjects.node(node, "heartbeat")
            wire = schemas.NodeHeartbeat(node=node, role="agent").to_dict()

            def make(step: int) -> tuple[str, bytes]:
                wire["event_id"], wire["ts"] = uuid.uuid4().hex, time.time_ns()
                return subject, msgpack.packb(wire, use_bin_type=True)
            return make

        # Real ranks are not synchronised: each beats at its own phase of the interval. The
        # beats are spread over SLOT_S slots of the interval, so no probe waits behind a burst
        # of every rank's heartbeat at once (which the bench measured before, not the services).
        work = [*(rank_beat(*b) for b in beats), *(node_beat(n) for n in nodes)]
        slots = max(1, min(len(work), int(interval / SLOT_S)))
        per_slot = -(-len(work) // slots)
        while time.time() < stop_at:
            t0 = time.monotonic()
            step += 1
            for i in range(slots):
                for make in work[i * per_slot:(i + 1) * per_slot]:
                    await bus.nc.publish(*make(step))
                await bus.nc.flush()
                await asyncio.sleep(max(0.0, t0 + (i + 1) * interval / slots - time.monotonic()))
        await bus.close()

    asyncio.run(run())


def _rss(pid: int) -> int:
    """Resident set size of ``pid``, bytes (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 2)


async def _healthy(bus: Bus, service: str, replica: str, members: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = json.loads(await bus.request(health_subject(service, replica), timeout=0.5))
            if body.get("ok") and len(body.get("members", ())) >= members:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{service}/{replica} not healthy with {members} members")


async def bench(args: argparse.Namespace, srv: EmbeddedServers, logdir: Path) -> dict:
    admin = await Bus(srv.nats_url, "bench").connect()
    await admin.ensure_streams(partitions=args.partitions)
    jobs = layout(args.ranks, args.nodes, args.ranks_per_job)
    store = StateStore(srv.redis_url)
    for job, members in jobs.items():
        await store.register_job(job, mode="action", generation=0, world_size=len(members),
                                 min_world_size=1, retry_budget=1000, retries_used=0,
                                 members=members, status="running")
    replicas = [f"r{i}" for i in range(args.replicas)]
    procs: dict[tuple[str, str], subprocess.Popen] = {}
    for s in SERVICES:
        nats_url, redis_url = srv.urls(s)
        for r in replicas:
            log = open(logdir / f"{s}-{r}.log", "ab")
            procs[(s, r)] = subprocess.Popen(
                [sys.executable, "-m", f"trainguard.{s}", "--replica", r],
                env={**os.environ, "NATS_URL": nats_url, "REDIS_URL": redis_url,
                     "TG_LOG_LEVEL": "WARNING", "TG_DURABLE": "0" if args.plain else "1"},
                stdout=log, stderr=subprocess.STDOUT)
            log.close()
    pubs: list = []
    try:
        for s in SERVICES:
            for r in replicas:
                await _healthy(admin, s, r, len(replicas), 60)
        anomalies: dict[tuple[str, int], float] = {}
        decisions: dict[str, float] = {}

        def on_anomaly(subject: str, ev: schemas.Event) -> None:
            if ev.kind == "nan_loss" and ev.rank is not None:
                anomalies.setdefault((ev.job, ev.rank), time.time_ns())

        def on_decision(subject: str, ev: schemas.Event) -> None:
            decisions.setdefault(ev.job, time.time_ns())

        await admin.subscribe("tg.job.*.anomaly", on_anomaly)
        await admin.subscribe("tg.job.*.decision", on_decision)
        rss0 = sum(_rss(procs[("detector", r)].pid) for r in replicas)

        beats = [(job, m["rank"], m["node"], m["local_rank"])
                 for job, ms in jobs.items() for m in ms]
        nodes = sorted({m["node"] for ms in jobs.values() for m in ms})
        total = args.seconds * 2 + args.warmup + 30
        stop_at = time.time() + total
        ctx = mp.get_context("spawn")
        worker_url = srv.urls("worker")[0]
        for i in range(args.publishers):
            p = ctx.Process(target=_publisher, args=(
                worker_url, beats[i::args.publishers], nodes[i::args.publishers],
                args.hb_interval, stop_at), daemon=True)
            p.start()
            pubs.append(p)
        await asyncio.sleep(args.warmup)
        rss1 = sum(_rss(procs[("detector", r)].pid) for r in replicas)
        cpu0 = {r: _cpu_s(procs[("detector", r)].pid) for r in replicas}
        nats_pid = srv._server("nats").proc.pid
        nats_cpu0 = _cpu_s(nats_pid)
        pub_cpu0 = sum(_cpu_s(p.pid) for p in pubs)
        svc_cpu0 = {k: _cpu_s(pr.pid) for k, pr in procs.items()}
        t_cpu0 = time.monotonic()

        names = sorted(jobs)
        half = max(1, len(names) // 4)  # NaN probes need ranks, not whole jobs
        nan_jobs, crash_jobs = names[:half], names[half:]
        # 1. heartbeat → anomaly: a NaN loss on a fresh (job, rank) per probe
        probes = max(1, int(args.seconds / 0.1))
        sent: dict[tuple[str, int], int] = {}
        keys = [(j, m["rank"], m["node"]) for j in nan_jobs for m in jobs[j]][:probes]
        for job, rank, node in keys:
            ts = time.time_ns()
            sent[(job, rank)] = ts
            await admin.publish(subjects.rank_hb(job, rank), schemas.RankHeartbeat(
                job=job, rank=rank, node=node, step=10**6, loss=float("nan"), ts=ts))
            await asyncio.sleep(args.seconds / max(1, len(keys)))
        # 2. fault → decision: a crash of a fresh job per probe, avoiding r0's for step 3
        victim = replicas[0] if len(replicas) > 1 else None
        n_parts = 0 if args.plain else args.partitions
        others = ([j for j in crash_jobs if job_owner(j, replicas, n_parts) != victim]
                  if victim else crash_jobs)
        mine = [j for j in crash_jobs if victim and job_owner(j, replicas, n_parts) == victim]
        fsent: dict[str, int] = {}
        n_faults = max(1, min(len(others), int(args.seconds / 0.2)))
        for job in others[:n_faults]:
            ts = time.time_ns()
            fsent[job] = ts
            m = jobs[job][0]
            await admin.publish(subjects.job(job, "worker"), schemas.WorkerExited(
                job=job, node=m["node"], rank=m["rank"], local_rank=m["local_rank"], pid=1,
                generation=0, signal=9, ts=ts))
            await asyncio.sleep(args.seconds / n_faults)
        await asyncio.sleep(3.0)
        wall = time.monotonic() - t_cpu0
        cpu = {r: (_cpu_s(procs[("detector", r)].pid) - cpu0[r]) / wall for r in replicas}
        nats_cpu = (_cpu_s(nats_pid) - nats_cpu0) / wall
        pub_cpu = (sum(_cpu_s(p.pid) for p in pubs) - pub_cpu0) / wall
        svc_cpu: dict[str, float] = {}
        for (service, r), pr in procs.items():
            svc_cpu[service] = svc_cpu.get(service, 0.0) + (
                _cpu_s(pr.pid) - svc_cpu0[(service, r)]) / wall
        hb_ms = [(anomalies[k] - t) / 1e6 for k, t in sent.items() if k in anomalies]
        fd_ms = [(decisions[j] - t) / 1e6 for j, t in fsent.items() if j in decisions]
        # 3. takeover: kill r0 of every service as faults of its jobs arrive
        takeover: list[float] = []
        rebuilds: dict[str, dict] = {}
        lost = 0
        if victim and mine:
            victims = mine[:5]
            t_kill = time.time_ns()
            for s in SERVICES:
                procs[(s, victim)].send_signal(signal.SIGKILL)
            for job in victims:
                m = jobs[job][0]
                await admin.publish(subjects.job(job, "worker"), schemas.WorkerExited(
                    job=job, node=m["node"], rank=m["rank"], local_rank=m["local_rank"],
                    pid=1, generation=0, signal=9, ts=time.time_ns()))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(j in decisions for j in victims):
                await asyncio.sleep(0.05)
            takeover = [(decisions[j] - t_kill) / 1e9 for j in victims if j in decisions]
            lost = sum(j not in decisions for j in victims)
            for s in SERVICES:  # when each survivor began its takeover, and for how long
                for r in replicas[1:]:
                    try:
                        st = json.loads(await admin.request(health_subject(s, r),
                                                            timeout=2.0))["stats"]
                        t = {**st["takeovers"], **st.get("last_rebuild", {})}
                    except Exception:  # noqa: BLE001 - not answering: not reported
                        continue
                    if t.get("last_began_ns"):
                        rebuilds[f"{s}/{r}"] = {
                            "began_s": round((t["last_began_ns"] - t_kill) / 1e9, 2),
                            "took_s": t["last_s"],
                            **{k: t[k] for k in ("read_s", "messages", "step_s") if k in t}}
        return {
            "ranks": args.ranks, "nodes": args.nodes, "replicas": args.replicas,
            "durable": not args.plain,
            "partitions": 0 if args.plain else args.partitions,
            "jobs": len(jobs), "publishers": args.publishers, "hb_interval_s": args.hb_interval,
            "heartbeats_per_s": round(args.ranks / args.hb_interval),
            "hb_to_anomaly_ms": {"p50": _pct(hb_ms, 50), "p99": _pct(hb_ms, 99),
                                 "n": len(hb_ms), "sent": len(sent)},
            "fault_to_decision_ms": {"p50": _pct(fd_ms, 50), "p99": _pct(fd_ms, 99),
                                     "n": len(fd_ms), "sent": len(fsent)},
            "takeover_s": {"max": round(max(takeover), 2) if takeover else None,
                           "p50": round(statistics.median(takeover), 2) if takeover else None,
                           "n": len(takeover), "lost": lost, "rebuilds": rebuilds},
            "bytes_per_rank": round((rss1 - rss0) / args.ranks) if args.ranks else None,
            "detector_cpu": {"cores": {r: round(c, 3) for r, c in cpu.items()},
                             "cpu_us_per_hb": round(sum(cpu.values()) * args.hb_interval
                                                    / args.ranks * 1e6, 1)
                             if args.ranks else None},
            "nats_server_cpu_cores": round(nats_cpu, 3),
            "publishers_cpu_cores": round(pub_cpu, 3),
            "services_cpu_cores": {k: round(v, 3) for k, v in sorted(svc_cpu.items())},
            "host_cores": os.cpu_count(),
        }
    finally:
        for p in pubs:
            p.terminate()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(10)
        await store.close()
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=400)
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--ranks-per-job", type=int, default=8)
    ap.add_argument("--publishers", type=int, default=2)
    ap.add_argument("--hb-interval", type=float, default=1.0, help="seconds between a rank's "
                    "heartbeats (the shim's default is 0.1 s; 1 s keeps 10,000 ranks at "
                    "10,000 messages/s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds of each probe phase")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--partitions", type=int, default=partition_count(),
                    help="partitions of the job streams (env TG_PARTITIONS, default 32; 0: "
                         "none, every replica reads every message)")
    ap.add_argument("--plain", action="store_true", help="services on plain subscriptions "
                    "(TG_DURABLE=0), to compare the latency of durable consumption")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--log-dir", default="")
    args = ap.parse_args(argv)
    load0 = provenance.loadavg()
    import tempfile

    logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="tg-scale-"))
    logdir.mkdir(parents=True, exist_ok=True)
    with EmbeddedServers() as srv:
        res = asyncio.run(bench(args, srv, logdir))
    if args.json:
        res["provenance"] = provenance.record(load0)
        print(json.dumps(res))
    else:
        print(f"{res['ranks']} ranks, {res['nodes']} nodes, {res['jobs']} jobs, "
              f"{res['replicas']} replicas of each service, {res['heartbeats_per_s']} hb/s")
        for k in ("hb_to_anomaly_ms", "fault_to_decision_ms", "takeover_s"):
            print(f"  {k}: {res[k]}")
        print(f"  bytes per tracked rank (detector RSS): {res['bytes_per_rank']}")
        print(f"  detector CPU: {res['detector_cpu']}, nats-server CPU (cores): "
              f"{res['nats_server_cpu_cores']}")
        print(f"  CPU (cores) of every replica of each service: {res['services_cpu_cores']}; "
              f"the simulated ranks' publishers: {res['publishers_cpu_cores']} "
              f"(of {res['host_cores']} cores)")
        print(f"  logs: {logdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Detector ingest benchmark on a real nats-server (embedded, started here).

    python bench/detector.py [--ranks 10000] [--nodes 1250] [--jobs 10] [--seconds 5]
                             [--json PATH]

One ``python -m trainguard.detector`` process; this process publishes rank heartbeats for ``--ranks``
simulated ranks on ``--nodes`` simulated nodes (``--jobs`` jobs) and prints:

* ingest: heartbeats per second the detector consumed while offered more than it can take
  (target ≥ 20,000/s), read from its health counters;
* latency: heartbeat-to-anomaly p50/p99 at 10,000 heartbeats/s, where 1 in 20 heartbeats
  carries a NaN loss on a rank that has not had one (each gives exactly one anomaly); latency is
  anomaly receive time minus the heartbeat's producer timestamp (target p99 ≤ 50 ms);
* memory per tracked rank: the detector's per-rank state measured with tracemalloc over
  ``--ranks`` ranks (target ≤ 2 KB), and the detector process's RSS growth.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from trainguard import schemas  # noqa: E402
from trainguard.detector import rules  # noqa: E402
from trainguard.schemas import subjects  # noqa: E402
from trainguard.clients.bus import Bus  # noqa: E402
from trainguard.stack.embedded import EmbeddedServers  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402


def layout(ranks: int, nodes: int, jobs: int) -> list[tuple[str, str, int, int]]:
    """[(job, node, rank, local_rank)] for every simulated rank."""
    per_node = max(1, ranks // nodes)
    per_job = max(1, ranks // jobs)
    out = []
    for g in range(ranks):
        out.append((f"job{g // per_job}", f"node{g // per_node:04d}", g % per_job, g % per_node))
    return out


def memory_per_rank(n: int) -> float:
    """Bytes of detector state per rank (RankState + ring + dict slot), via tracemalloc."""
    cfg = rules.DetectorConfig()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    jobs = {}
    for job, node, rank, lr in layout(n, max(1, n // 8), 10):
        js = jobs.get(job) or jobs.setdefault(job, rules.JobState(job, cfg.step_window))
        for step in range(20):  # fill the ring
            rules.observe_heartbeat(js, rank, node, lr, 0, step, step, "train", 0.25 + step * 1e-3,
                                    1.0 + step, cfg)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / n


async def health(bus: Bus) -> dict:
    return json.loads(await bus.request("tg.svc.detector.health", b"", timeout=10.0))


async def run(args) -> dict:
    res: dict = {}
    res["bytes_per_rank_state"] = round(memory_per_rank(args.ranks), 1)
    with EmbeddedServers(nats_url="", redis_url="") as srv:
        env = {**os.environ, "NATS_URL": srv.nats_url, "REDIS_URL": srv.redis_url,
               "TG_LOG_LEVEL": "WARNING"}
        proc = subprocess.Popen([sys.executable, "-m", "trainguard.detector"], cwd=ROOT, env=env)
        bus = await Bus(srv.nats_url, "bench").connect()
        try:
            for _ in range(200):
                try:
                    await health(bus)
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    await asyncio.sleep(0.05)
            p = psutil.Process(proc.pid)
            rss0 = p.memory_info().rss
            lay = layout(args.ranks, args.nodes, args.jobs)
            payloads = [(subjects.rank_hb(j, r), schemas.encode(schemas.RankHeartbeat(
                job=j, node=n, rank=r, local_rank=lr, world_size=args.ranks // args.jobs,
                step=1, collective_seq=1, step_time_s=0.25, loss=1.0, interval_s=1.0)))
                for j, n, r, lr in lay]
            # warm: every rank tracked once
            for s, d in payloads:
                await bus.publish_raw(s, d)
            await bus.flush(10)
            await asyncio.sleep(1.0)
            h = await health(bus)
            res["ranks_tracked"] = h.get("ranks")
            res["rss_bytes_per_rank"] = round((p.memory_info().rss - rss0) / args.ranks, 1)

            # ---- ingest: offer ~2x the target, measure what the detector consumed ----
            h0 = await health(bus)
            t0 = time.perf_counter()
            sent = 0
            i = 0
            while time.perf_counter() - t0 < args.seconds:
                for _ in range(500):
                    s, d = payloads[i % len(payloads)]
                    i += 1
                    await bus.publish_raw(s, d)
                sent += 500
                target = (time.perf_counter() - t0) * args.offer
                if sent > target:
                    await asyncio.sleep((sent - target) / args.offer)
            await bus.flush(10)
            # consumed = the detector's handler ran for it; wait until all of them were
            got = 0
            deadline = time.perf_counter() + 20.0
            while time.perf_counter() < deadline:
                h1 = await health(bus)
                got = h1["stats"]["received"] - h0["stats"]["received"]
                if got >= sent:
                    break
                await asyncio.sleep(0.01)
            t1 = time.perf_counter()
            res["offered_per_s"] = round(sent / (t1 - t0))
            res["ingest_per_s"] = round(got / (t1 - t0))
            res["ingest_lost"] = max(0, sent - got)
            await asyncio.sleep(2.0)  # drain

            # ---- latency at 10k/s ----
            lat: list[float] = []

            kinds: dict[str, int] = {}

            def on_anom(_s, ev):
                kinds[ev.kind] = kinds.get(ev.kind, 0) + 1
                if isinstance(ev, schemas.Anomaly) and ev.kind == "nan_loss":
                    lat.append((time.time_ns() - ev.first_ts) / 1e6)

            await bus.subscribe("tg.job.*.anomaly", on_anom)
            await bus.flush()
            rate = args.rate
            t0 = time.perf_counter()
            sent = 0
            nan_i = 0
            while time.perf_counter() - t0 < args.seconds:
                for _ in range(100):
                    if sent % 20 == 0 and nan_i < len(lay):
                        j, n, r, lr = lay[nan_i]
                        nan_i += 1
                        await bus.publish_raw(subjects.rank_hb(j, r), schemas.encode(
                            schemas.RankHeartbeat(job=j, node=n, rank=r, local_rank=lr,
                                                  step=2, collective_seq=2, loss=float("nan"),
                                                  step_time_s=0.25, interval_s=1.0)))
                    else:
                        s, d = payloads[sent % len(payloads)]
                        await bus.publish_raw(s, d)
                    sent += 1
                target = (time.perf_counter() - t0) * rate
                if sent > target:
                    await asyncio.sleep((sent - target) / rate)
            await bus.flush(10)
            await asyncio.sleep(1.0)
            lat.sort()
            res["latency_rate_per_s"] = round(sent / (time.perf_counter() - t0 - 1.0))
            res["latency_samples"] = len(lat)
            res["nan_heartbeats_sent"] = nan_i
            if lat:
                res["latency_p50_ms"] = round(lat[len(lat) // 2], 2)
                res["latency_p99_ms"] = round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2)
                res["latency_max_ms"] = round(lat[-1], 2)
            res["anomalies_by_kind"] = kinds
            res["detector_cpu_s"] = round(sum(p.cpu_times()[:2]), 1)
        finally:
            await bus.close()
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=10000)
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--offer", type=float, default=100000.0, help="heartbeats/s offered for ingest")
    ap.add_argument("--rate", type=float, default=10000.0, help="heartbeats/s for latency")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    load0 = provenance.loadavg()
    res = asyncio.run(run(args))
    print(f"simulated: {args.ranks} ranks on {args.nodes} nodes in {args.jobs} jobs; "
          f"tracked by the detector: {res.get('ranks_tracked')}")
    print(f"ingest: {res['ingest_per_s']:,} heartbeats/s consumed "
          f"(offered at up to {args.offer:,.0f}/s, {res['ingest_lost']} not consumed; "
          f"target >= 20,000/s)")
    print(f"latency at {res.get('latency_rate_per_s', 0):,}/s: p50 {res.get('latency_p50_ms')} ms,"
          f" p99 {res.get('latency_p99_ms')} ms, max {res.get('latency_max_ms')} ms over "
          f"{res.get('latency_samples')} of {res.get('nan_heartbeats_sent')} NaN heartbeats "
          f"(target p99 <= 50 ms)")
    print(f"anomalies seen during the latency run: {res.get('anomalies_by_kind')}")
    print(f"memory: {res['bytes_per_rank_state']} B of detector state per rank (tracemalloc), "
          f"{res.get('rss_bytes_per_rank')} B RSS growth per rank (target <= 2048 B)")
    if args.json:
        res["provenance"] = provenance.record(load0)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

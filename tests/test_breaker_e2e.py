"""The fleet breaker, the shared cause and the progress count on a real NATS and Valkey,
through the services: the breaker trips past its limit, holds a node-taking decision (published
and audited as held, the job respawned in place instead), stays tripped across a remediator
restart, and a person's reset resumes exclusions; its write is compare-and-set; the attributor
blames one shared cause and names the driver the nodes share; a restart loop whose failing step
drifts stops; a job that makes progress between faults survives more faults than its budget."""
from __future__ import annotations

import asyncio
import contextlib
import json

from trainguard.tools import breaker as breaker_cli
from trainguard.clients.bus import Bus
from trainguard.remediator.breaker import BreakerConfig
from trainguard.remediator.service import Remediator, RemediatorConfig
from trainguard.schemas import BreakerChanged, Decision, Verdict, subjects
from trainguard.services.base import ServiceConfig, health_subject
from trainguard.clients.store import StateStore

from test_remediator_service import wait_for

#: 3 jobs of 3 nodes, one rank a node: 9 known nodes, limit max(2, floor(0.5 × 9)) = 4
JOBS = {f"j{k}": [f"{c}{k}" for c in "abc"] for k in range(3)}
BREAKER = BreakerConfig(mode="action", window_s=300, fraction=0.5, min_nodes=2, max_nodes=None,
                        fleet_nodes=0)


async def register_fleet(store: StateStore) -> None:
    for job, nodes in JOBS.items():
        await store.register_job(job, mode="action", generation=0, world_size=3,
                                 min_world_size=1, retry_budget=5, retries_used=0,
                                 members=[{"rank": i, "node": n, "local_rank": 0}
                                          for i, n in enumerate(nodes)])


@contextlib.asynccontextmanager
async def remediator(servers, redis_url, policy=None):
    cfg = RemediatorConfig(decision_timeout_s=600, controller="local", breaker=BREAKER,
                           breaker_poll_s=0.1)
    if policy is not None:
        cfg.policy = policy
    svc = Remediator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_url), cfg)
    task = asyncio.create_task(svc.run())
    probe = await Bus(servers.nats_url, "probe").connect()
    for _ in range(250):
        try:
            if json.loads(await probe.request(health_subject("remediator"), timeout=0.2)).get(
                    "ok"):
                break
        except Exception:  # noqa: BLE001 - not up yet
            await asyncio.sleep(0.02)
    await probe.close()
    try:
        yield svc
    finally:
        svc.stop()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def watcher(servers):
    """Collects every job's decisions and the breaker's transitions."""
    bus = await Bus(servers.nats_url, "test-watch").connect()
    got: dict[str, list] = {"decision": [], "breaker": []}
    await bus.subscribe("tg.job.*.decision", lambda s, e: got["decision"].append(e))
    await bus.subscribe(subjects.FLEET_BREAKER, lambda s, e: got["breaker"].append(e))
    await bus.flush()
    bus.got = got
    try:
        yield bus
    finally:
        await bus.close()


def xid(job: str, node: str) -> Verdict:
    return Verdict(job=job, fault_class="gpu_xid", layer="hardware", confidence="high",
                   culprit={"nodes": [node]}, detail={"xid": 79}, evidence=[
                       f"NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus ({node})"])


async def decide(bus, job: str, node: str) -> Decision:
    n = len(bus.got["decision"])
    await bus.publish(subjects.job(job, "verdict"), xid(job, node))
    assert await wait_for(lambda: len(bus.got["decision"]) > n), f"no decision for {node}"
    return bus.got["decision"][-1]


async def test_breaker_trips_holds_survives_a_restart_and_a_reset_resumes(servers, redis_db):
    store = StateStore(redis_db)
    await register_fleet(store)
    async with watcher(servers) as bus:
        async with remediator(servers, redis_db) as svc:
            # four nodes of three jobs: within the limit, each excluded
            for job, node in (("j0", "a0"), ("j1", "a1"), ("j2", "a2"), ("j0", "b0")):
                d = await decide(bus, job, node)
                assert d.action == "exclude_node_and_requeue" and d.nodes == [node], d.reason
                assert not d.held
            assert (await store.node("a0"))["status"] == "excluded"
            # the fifth would take the window past 4: held, the job respawns in place
            d = await decide(bus, "j1", "b1")
            assert d.action == "restart_workers" and d.execute and d.ranks == [0]  # b1, re-ranked
            assert d.held["action"] == "exclude_node_and_requeue" and d.held["nodes"] == ["b1"]
            assert "held by the fleet breaker" in d.reason
            assert await wait_for(lambda: svc.breaker()["status"] == "tripped")
            assert svc.breaker()["held"] == 1 and svc.breaker()["taken"] == 4
            rec = await store.job("j1")
            assert rec.world_size == 2 and len(rec.members) == 2  # b1 still in the job
            held = [r for r in await store.audit_trail("j1") if r["type"] == "held"]
            assert held and held[0]["held_action"] == "exclude_node_and_requeue"
            assert await wait_for(lambda: bus.got["breaker"])
            ev = bus.got["breaker"][0]
            assert isinstance(ev, BreakerChanged) and ev.transition == "tripped"
            assert (ev.taken, ev.limit, ev.known_nodes) == (4, 4, 9) and ev.nodes == ["b1"]
        assert (await store.node("b1")) == {}  # never excluded

        # a new remediator process: the breaker is in the store, still tripped
        async with remediator(servers, redis_db) as svc:
            d = await decide(bus, "j2", "b2")
            assert d.action == "restart_workers" and d.held["nodes"] == ["b2"]
            st = await breaker_cli.status(store, BREAKER)
            assert st["status"] == "tripped" and st["held"] == 2
            assert [t["type"] for t in st["trail"]] == ["tripped", "held"]

            # a person resets it: who, when and why in the trail; exclusions resume
            await breaker_cli.reset(store, "ops@site", "driver rollout rolled back", bus)
            d = await decide(bus, "j2", "c2")
            assert d.action == "exclude_node_and_requeue" and d.nodes == ["c2"] and not d.held
            assert await wait_for(lambda: svc.breaker()["status"] == "closed")
        trail = await store.breaker_trail()
        assert trail[-1]["type"] == "reset" and trail[-1]["by"] == "ops@site"
        assert trail[-1]["reason"] == "driver rollout rolled back" and trail[-1]["was"] == \
            "tripped"
        assert await wait_for(lambda: any(e.transition == "reset" for e in bus.got["breaker"]))
    await store.close()


def crash(job: str, gen: int, step: int) -> Verdict:
    return Verdict(job=job, fault_class="app_exception", layer="application",
                   culprit={"ranks": [gen % 3]}, generation=gen, detail={"step": step},
                   evidence=[f"RuntimeError: loss is NaN at step {step} (attempt {gen})"])


async def faults(bus, job: str, steps: list[int]) -> list[Decision]:
    out = []
    for gen, step in enumerate(steps):
        n = len(bus.got["decision"])
        await bus.publish(subjects.job(job, "verdict"), crash(job, gen, step))
        assert await wait_for(lambda: len(bus.got["decision"]) > n)
        out.append(bus.got["decision"][-1])
        if out[-1].action == "stop_job_notify_user":
            break
    return out


async def test_restart_loop_with_drifting_step_stops_and_progress_outlives_the_budget(
        servers, redis_db):
    store = StateStore(redis_db)
    await register_fleet(store)
    async with watcher(servers) as bus, remediator(servers, redis_db):
        # j0 restores step 100 each time and fails a few steps later, never at the same step
        ds = await faults(bus, "j0", [103, 102, 101, 103, 102])
        assert [d.action for d in ds] == ["restart_in_process"] * 3 + ["stop_job_notify_user"]
        assert "restart loop: 3 restarts in a row without progress past step 103" in ds[-1].reason
        assert (await store.job("j0")).status == "stopped"
        # j1 trains on between faults: 7 faults against a budget of 5, never stopped
        ds = await faults(bus, "j1", [150, 420, 700, 910, 1300, 1720, 2000])
        assert [d.action for d in ds] == ["restart_in_process"] * 7
        rec = await store.job("j1")
        assert rec.retries_used == 7 and rec.last_fault["stalled"] == 0
        assert rec.status != "stopped"
    await store.close()


async def test_the_breaker_write_is_compare_and_set(redis_db):
    """Two writers from the same version (two replicas, or a replica and a person's reset):
    one wins, the other is told to read again; nothing is lost."""
    from trainguard.schemas import BreakerState
    a, b = StateStore(redis_db), StateStore(redis_db)
    base = await a.breaker()
    tripped = BreakerState(status="tripped", tripped_ts=1, trip_reason="r", held=1)
    closed = BreakerState(held=0)
    got = await asyncio.gather(a.put_breaker(tripped, base.version),
                               b.put_breaker(closed, base.version))
    assert [g for g in got if g is not None] == [base.version + 1] and got.count(None) == 1
    now = await a.breaker()
    assert now.version == base.version + 1 and now.status in ("tripped", "closed")
    assert await a.put_breaker(closed, base.version) is None  # a stale version never writes
    await a.close()
    await b.close()


async def test_attributor_blames_one_shared_cause_with_real_servers(servers, redis_db):
    """Node telemetry carries each node's attributes; XIDs from 4 nodes of 2 jobs within a
    minute: the fourth verdict blames system software and names the driver they share."""
    from trainguard.attributor.service import Attributor
    from trainguard.schemas import Anomaly, Culprit, NodeTelemetry

    svc = Attributor(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db))
    task = asyncio.create_task(svc.run())
    bus = await Bus(servers.nats_url, "test-attr").connect()
    verdicts: list = []
    await bus.subscribe("tg.job.*.verdict", lambda s, e: verdicts.append(e))
    await bus.flush()
    store = StateStore(redis_db)
    try:
        for _ in range(250):
            try:
                if json.loads(await bus.request(health_subject("attributor"), timeout=0.2)).get(
                        "ok"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.02)
        for i in range(8):
            await bus.publish(subjects.node(f"g{i}", "telemetry"), NodeTelemetry(
                node=f"g{i}", cpu_percent=1.0, mem_used_bytes=1, mem_total_bytes=2,
                attributes={"driver": "550.54" if i < 5 else "535.10", "rack": f"r{i % 2}"}))
        assert await wait_for(lambda: len(svc.model.node_attrs) == 8)
        assert await wait_for_async(lambda: store.node_attrs(), lambda v: len(v) == 8)
        for i, job in enumerate(("ja", "jb", "ja", "jb")):
            await bus.publish(subjects.job(job, "anomaly"), Anomaly(
                job=job, kind="gpu_fault", fault_class="gpu_xid", generation=i,
                culprit=Culprit(nodes=[f"g{i}"]), detail={"xid": 79, "layer": "hardware"},
                evidence=["NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"]))
            assert await wait_for(lambda: len(verdicts) > i)
        assert [("shared_cause" in v.detail) for v in verdicts] == [False] * 3 + [True]
        cause = verdicts[-1].detail["shared_cause"]
        assert verdicts[-1].layer == "system_software" and cause["common"] == {"driver": "550.54"}
        assert cause["count"] == 4 and cause["jobs"] == 2
    finally:
        await bus.close()
        await store.close()
        svc.stop()
        await asyncio.wait_for(task, 10)


async def wait_for_async(read, pred, timeout=10.0):
    for _ in range(int(timeout / 0.05)):
        if pred(await read()):
            return True
        await asyncio.sleep(0.05)
    return pred(await read())


async def test_observe_mode_jobs_show_when_the_breaker_would_have_tripped(servers, redis_db):
    """Jobs in observe mode: the same decisions, never executed; the breaker's shadow counts
    them apart, never holds, and says when it would have tripped."""
    store = StateStore(redis_db)
    await register_fleet(store)
    for job in JOBS:
        await store.update_job(job, mode="observe")
    async with watcher(servers) as bus, remediator(servers, redis_db) as svc:
        nodes = [("j0", "a0"), ("j1", "a1"), ("j2", "a2"), ("j0", "b0"), ("j1", "b1")]
        ds = [await decide(bus, job, node) for job, node in nodes]
        assert [d.action for d in ds] == ["exclude_node_and_requeue"] * 5
        assert not any(d.execute or d.held for d in ds)
        assert "would have held" in ds[-1].reason and "would have held" not in ds[-2].reason
        st = await breaker_cli.status(store, BREAKER)
        assert st["status"] == "closed" and st["taken"] == 0 and st["held"] == 0
        assert st["would_trip_ts"] and st["observe_jobs_taken"] == 5
        assert await wait_for(lambda: [e.transition for e in bus.got["breaker"]] == [
            "would_trip"])
        assert bus.got["breaker"][0].detail == {"observe_jobs": True}
        assert svc.breaker()["status"] == "closed"
        await breaker_cli.reset(store, "ops", "looked: one driver", None)
        assert not (await breaker_cli.status(store, BREAKER))["would_trip_ts"]
    await store.close()

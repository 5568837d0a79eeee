"""No event lost, no decision lost or repeated, replicas that share the jobs: real service
processes (``python -m trainguard.<service> --replica …``) on embedded NATS + Valkey with the
roles' users, killed with SIGKILL while events arrive."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard import schemas
from trainguard.clients.bus import Bus
from trainguard.services.durable import replay
from trainguard.stack.embedded import EmbeddedServers
from trainguard.services.membership import job_owner
from trainguard.core.partitions import configured as partition_count
from trainguard.schemas import Verdict, subjects
from trainguard.services.base import health_subject
from trainguard.clients.store import StateStore

MEMBERS = [{"rank": 0, "node": "n1", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 1},
           {"rank": 2, "node": "n2", "local_rank": 0}, {"rank": 3, "node": "n2", "local_rank": 1}]


def _with_streams(srv: EmbeddedServers) -> EmbeddedServers:
    """``srv`` with trainguard's JetStream streams created (as the admin role)."""
    async def streams():
        bus = await Bus(srv.nats_url, "admin").connect()
        await bus.ensure_streams()
        await bus.close()

    asyncio.run(streams())
    return srv


@pytest.fixture
def secured():
    with EmbeddedServers() as srv:
        yield _with_streams(srv)


class Procs:
    """Service processes of one test, each stopped (SIGKILL) at the end."""

    def __init__(self, srv: EmbeddedServers, tmp_path):
        self.srv, self.dir, self.procs = srv, tmp_path, {}

    def start(self, service: str, replica: str, **env: str) -> subprocess.Popen:
        nats_url, redis_url = self.srv.urls(service)
        e = {**os.environ, "NATS_URL": nats_url, "REDIS_URL": redis_url,
             "PYTHONUNBUFFERED": "1", **env}
        log = open(self.dir / f"{service}-{replica}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", f"trainguard.{service}", "--replica",
                              replica], env=e, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[(service, replica)] = p
        return p

    def kill(self, service: str, replica: str) -> None:
        p = self.procs.pop((service, replica))
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def log(self, service: str, replica: str) -> str:
        return (self.dir / f"{service}-{replica}.log").read_text()[-3000:]

    def stop(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGKILL)
            p.wait(10)


@pytest.fixture
def procs(secured, tmp_path):
    p = Procs(secured, tmp_path)
    yield p
    p.stop()


async def healthy(bus: Bus, service: str, replica: str, members: int = 1,
                  timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = json.loads(await bus.request(health_subject(service, replica), timeout=0.3))
            if body.get("ok") and len(body.get("members", ())) >= members:
                return body
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{service}/{replica} not healthy with {members} members")


async def stored(bus: Bus, job: str, kind: str) -> list:
    """The events the stream keeps on ``tg.job.<job>.<kind>`` (the last 10 minutes)."""
    assert bus.nc is not None
    msgs = await replay(bus.nc, subjects.job(job, kind), time.time_ns() - 600 * 10**9)
    return [schemas.decode(m.data) for m, _ in msgs]


async def wait_until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.1)
    return await pred()


def crash(job: str, rank: int) -> schemas.WorkerExited:
    return schemas.WorkerExited(job=job, node="n1", rank=rank, local_rank=rank, pid=1000 + rank,
                                generation=0, exit_code=1)


async def test_killed_detector_handles_what_arrived_while_down(secured, procs):
    bus = await Bus(secured.nats_url, "test").connect()
    procs.start("detector", "d1")
    await healthy(bus, "detector", "d1")
    await bus.publish(subjects.job("jk", "worker"), crash("jk", 0))
    assert await wait_until(lambda: _count(bus, "jk", "anomaly", 1), 10), procs.log("detector",
                                                                                 "d1")
    procs.kill("detector", "d1")
    for r in (1, 2):  # while no detector runs
        await bus.publish(subjects.job("jk", "worker"), crash("jk", r))
    await bus.flush()
    procs.start("detector", "d1")
    assert await wait_until(lambda: _count(bus, "jk", "anomaly", 3), 20), procs.log("detector",
                                                                                 "d1")
    ranks = sorted(a.culprit.ranks[0] for a in await stored(bus, "jk", "anomaly"))
    assert ranks == [0, 1, 2]
    await bus.close()


async def _exited(p: subprocess.Popen) -> bool:
    return p.poll() is not None


async def _count(bus: Bus, job: str, kind: str, n: int) -> bool:
    return len(await stored(bus, job, kind)) >= n


async def test_remediator_killed_after_storing_publishes_once_after_restart(secured, procs):
    bus = await Bus(secured.nats_url, "test").connect()
    store = StateStore(secured.redis_url)
    await store.register_job("jo", mode="action", generation=0, world_size=4, min_world_size=2,
                             retry_budget=5, retries_used=0, members=MEMBERS, status="running")
    p = procs.start("remediator", "r1", TG_TEST_CRASH_AFTER_OUTBOX="1")
    await healthy(bus, "remediator", "r1")
    v = Verdict(job="jo", fault_class="crash", layer="unknown", culprit={"ranks": [1]},
                generation=0, first_ts=1000)
    await bus.publish(subjects.job("jo", "verdict"), v)
    await bus.flush()
    assert await wait_until(lambda: _exited(p), 20), procs.log("remediator", "r1")
    assert p.returncode == 70  # died at the publish, the decision stored in the outbox
    procs.procs.pop(("remediator", "r1"))
    [kept] = (await store.outbox(["jo"]))["jo"]
    assert await stored(bus, "jo", "decision") == []
    assert (await store.job("jo")).generation == 1  # the record was committed with it

    procs.start("remediator", "r1")
    assert await wait_until(lambda: _count(bus, "jo", "decision", 1), 20), procs.log(
        "remediator", "r1")
    await asyncio.sleep(3)  # two outbox sweeps more: nothing is published again
    [d] = await stored(bus, "jo", "decision")
    assert d.event_id == kept["event_id"] and d.action == "restart_workers"
    assert await store.outbox(["jo"]) == {}
    assert [r["type"] for r in await store.audit_trail("jo")].count("decision") == 1
    await store.close()
    await bus.close()


async def _start_replicas(store, procs, bus, names, jobs) -> tuple[str, ...]:
    """Register ``jobs`` in action mode and start replicas ``names`` of the detector, the
    attributor and the remediator, each healthy with every replica a member; returns the
    services."""
    for job in jobs:
        await store.register_job(job, mode="action", generation=0, world_size=4,
                                 min_world_size=2, retry_budget=5, retries_used=0,
                                 members=MEMBERS, status="running")
    services = ("detector", "attributor", "remediator")
    for s in services:
        for r in names:
            procs.start(s, r)
    for s in services:
        for r in names:
            await healthy(bus, s, r, members=len(names))
    return services


async def test_two_replicas_one_fault_once_and_a_killed_owner_is_taken_over(secured, procs):
    bus = await Bus(secured.nats_url, "test").connect()
    store = StateStore(secured.redis_url)
    names = ("ra", "rb")
    # jobs owned by each replica (the same for every service: same member names; the streams
    # store jobs in partitions, and a replica owns whole partitions)
    n = partition_count()
    jobs = {r: next(f"j2-{i}" for i in range(100) if job_owner(f"j2-{i}", names, n) == r)
            for r in names}
    services = await _start_replicas(store, procs, bus, names, jobs.values())

    first = jobs["rb"]  # one fault: one anomaly, one verdict, one decision
    await bus.publish(subjects.job(first, "worker"), crash(first, 1))
    assert await wait_until(lambda: _count(bus, first, "decision", 1), 15)
    await asyncio.sleep(2.0)
    counts = [len(await stored(bus, first, k)) for k in ("anomaly", "verdict", "decision")]
    assert counts == [1, 1, 1]

    # the fault of ra's job arrives as ra's replicas are killed: rb finishes it
    second = jobs["ra"]
    await bus.publish(subjects.job(second, "worker"), crash(second, 2))
    await bus.flush()
    for s in services:
        procs.kill(s, "ra")
    t0 = time.monotonic()
    assert await wait_until(lambda: _count(bus, second, "decision", 1), 20), procs.log(
        "remediator", "rb")
    took = time.monotonic() - t0
    await asyncio.sleep(2.0)
    counts = [len(await stored(bus, second, k)) for k in ("anomaly", "verdict", "decision")]
    assert counts == [1, 1, 1], (counts, took)
    [d] = await stored(bus, second, "decision")
    assert d.ranks == [2] and d.action == "restart_workers"
    await store.close()
    await bus.close()


@pytest.fixture
def persistent(tmp_path):
    """As ``secured``, with Valkey keeping its append-only file, so it can be stopped and
    started again with its data (``trainguard up``'s setting)."""
    with EmbeddedServers(data_dir=tmp_path / "state") as srv:
        yield _with_streams(srv)


async def _holding(bus: Bus, replica: str, n: int) -> bool:
    try:
        body = json.loads(await bus.request(health_subject("remediator", replica), timeout=0.5))
    except Exception:  # noqa: BLE001 - not answering yet
        return False
    return body["stats"]["holding"] == n


async def test_a_verdict_held_through_a_valkey_outage_and_a_sigkill_is_decided_once(
        persistent, tmp_path):
    """bench/chaos.py found it: Valkey was down when a verdict arrived, and the remediator was
    SIGKILLed while it waited to try its claim again; the verdict's message had been acked, so
    nothing decided it. Now the message is held unacked while its chain waits, and the
    restarted replica gets it again and decides it: one decision, carried out once."""
    from trainguard.remediator.model import decision_id

    procs = Procs(persistent, tmp_path)
    bus = await Bus(persistent.nats_url, "test").connect()
    store = StateStore(persistent.redis_url)
    try:
        await store.register_job("jv", mode="action", generation=0, world_size=4,
                                 min_world_size=2, retry_budget=5, retries_used=0,
                                 members=MEMBERS, status="running")
        procs.start("remediator", "r1")
        await healthy(bus, "remediator", "r1")
        valkey = persistent._server("valkey")
        port = valkey.port
        valkey.proc.terminate()  # stopped (its append-only file written)
        valkey.proc.wait(10)
        v = Verdict(job="jv", fault_class="node_lost", layer="infrastructure",
                    culprit={"nodes": ["n2"]}, generation=0, first_ts=2000)
        await bus.publish(subjects.job("jv", "verdict"), v)
        await bus.flush()
        # the verdict's claim waits for Valkey: its message is held, not acked
        assert await wait_until(lambda: _holding(bus, "r1", 1), 15), procs.log("remediator",
                                                                               "r1")
        procs.kill("remediator", "r1")
        valkey.start()
        assert valkey.port == port
        await store.close()
        store = StateStore(persistent.redis_url)  # its connection closed with that Valkey
        procs.start("remediator", "r1")
        assert await wait_until(lambda: _count(bus, "jv", "action", 1), 40), procs.log(
            "remediator", "r1")
        await asyncio.sleep(3.0)  # outbox sweeps and an ack wait more: nothing again
        [d] = await stored(bus, "jv", "decision")
        assert d.event_id == decision_id(v.event_id)
        assert (d.action, d.execute, d.nodes, d.generation) == (
            "exclude_node_and_requeue", True, ["n2"], 1)
        [ar] = await stored(bus, "jv", "action")
        assert ar.ok and ar.decision_id == d.event_id and ar.node == "n2"
        rec = await store.job("jv")
        assert rec.generation == 1 and rec.world_size == 2
        assert (await store.node("n2"))["status"] == "excluded"
        assert [r["type"] for r in await store.audit_trail("jv")].count("decision") == 1
        assert await wait_until(lambda: _holding(bus, "r1", 0), 5)  # acked once decided
    finally:
        procs.stop()
        await store.close()
        await bus.close()


async def _health(bus: Bus, service: str, replica: str) -> dict:
    return json.loads(await bus.request(health_subject(service, replica), timeout=2.0))


async def test_three_replicas_split_the_partitions_and_a_killed_ones_are_served(secured, procs):
    """The streams store jobs by partition: each replica's consumers receive only the
    partitions it owns (no foreign message reaches it), one fault gives one anomaly, verdict
    and decision, and a replica killed as a fault of its partition arrives has its partitions
    taken over by the two others, which replay it from the stream."""
    bus = await Bus(secured.nats_url, "test").connect()
    store = StateStore(secured.redis_url)
    names = ("ra", "rb", "rc")
    n = partition_count()
    jobs = {r: [f"j3-{i}" for i in range(200) if job_owner(f"j3-{i}", names, n) == r][:2]
            for r in names}
    services = await _start_replicas(store, procs, bus, names,
                                     (j for js in jobs.values() for j in js))
    owned = {r: set((await _health(bus, "detector", r))["partitions"]["owned"]) for r in names}
    assert sorted(p for o in owned.values() for p in o) == list(range(n)), owned  # a split

    # heartbeats of each replica's second job (they fall silent after: anomalies of their
    # own): each detector is sent only its own partitions' messages
    for rnd in range(3):
        for job in (js[1] for js in jobs.values()):
            for m in MEMBERS:
                await bus.publish(subjects.rank_hb(job, m["rank"]), schemas.RankHeartbeat(
                    job=job, rank=m["rank"], node=m["node"], local_rank=m["local_rank"],
                    step=rnd, phase="train", step_time_s=0.1, interval_s=0.1))
    await bus.flush()
    await asyncio.sleep(1.0)
    for r in names:
        body = await _health(bus, "detector", r)
        assert body["stats"]["consumed"]["foreign"] == 0, body["stats"]
        assert body["ranks"] == 4, (r, body)  # its job's ranks, no other's

    first = jobs["rb"][0]  # one fault: one anomaly, one verdict, one decision
    await bus.publish(subjects.job(first, "worker"), crash(first, 1))
    assert await wait_until(lambda: _count(bus, first, "decision", 1), 15)

    # ra is killed as a fault of its partitions arrives: nobody's consumer filters them until
    # its lease runs out; then rb and rc take its partitions over and replay the fault
    second = jobs["ra"][0]
    for s in services:
        procs.kill(s, "ra")
    await bus.publish(subjects.job(second, "worker"), crash(second, 2))
    await bus.flush()
    t0 = time.monotonic()
    assert await wait_until(lambda: _count(bus, second, "decision", 1), 20), procs.log(
        "remediator", "rb") + procs.log("remediator", "rc")
    took = time.monotonic() - t0
    await asyncio.sleep(2.0)
    for job in (first, second):
        counts = [len(await stored(bus, job, k)) for k in ("anomaly", "verdict", "decision")]
        kinds = [a.kind for a in await stored(bus, job, "anomaly")]
        assert counts == [1, 1, 1], (job, counts, kinds, took)
    [d] = await stored(bus, second, "decision")
    assert d.ranks == [2] and d.action == "restart_workers"
    after = {r: set((await _health(bus, "detector", r))["partitions"]["owned"])
             for r in ("rb", "rc")}
    assert after["rb"] | after["rc"] == set(range(n)) and not after["rb"] & after["rc"]
    # ra's moved, and at most two of the others' (bounded loads)
    assert len(owned["rb"] - after["rb"]) + len(owned["rc"] - after["rc"]) <= 2, (owned, after)
    await store.close()
    await bus.close()


async def test_the_detectors_heartbeat_consumer_acks_in_batches(secured, procs):
    """The detector's heartbeat consumer, made by the detector's own role, acks with
    ``AckPolicy.ALL``: it handles heartbeats and leaves none unacked once a batch is due."""
    from nats.js.api import AckPolicy

    from trainguard.services.durable import ACK_BATCH_S, consumer_name

    bus = await Bus(secured.nats_url, "test").connect()  # admin
    js = bus.nc.jetstream()
    topic = "tg.job.*.rank.*.hb"
    name = consumer_name("detector", "d1", topic)
    procs.start("detector", "d1")
    await healthy(bus, "detector", "d1")
    info = await js.consumer_info("TG_TELEMETRY", name)
    assert info.config.ack_policy == AckPolicy.ALL, procs.log("detector", "d1")
    for step in range(5):
        for m in MEMBERS:
            await bus.publish(subjects.rank_hb("jup", m["rank"]), schemas.RankHeartbeat(
                job="jup", rank=m["rank"], node=m["node"], local_rank=m["local_rank"],
                step=step, interval_s=0.1))
    await bus.flush()

    async def all_acked() -> bool:
        i = await js.consumer_info("TG_TELEMETRY", name)
        return i.delivered.consumer_seq == 20 and i.num_ack_pending == 0

    assert await wait_until(all_acked, 5 + ACK_BATCH_S), await js.consumer_info(
        "TG_TELEMETRY", name)
    assert (await _health(bus, "detector", "d1"))["ranks"] == 4
    await bus.close()

"""The replicated control plane (``trainguard.stack.ha``) with real servers: 3 nats-servers in
a JetStream cluster, a Valkey primary with a replica under 3 sentinels, and a real remediator
process (``python -m trainguard.remediator``) connected with a server list and a sentinel URL.
The server its bus is connected to, or the Valkey primary, is SIGKILLed as a fault arrives: the
fault is decided once, and the decision carried out once."""
from __future__ import annotations

import asyncio
import time

import nats
import psutil
import pytest

from test_durable_e2e import MEMBERS, Procs, healthy, stored, wait_until
from trainguard.clients.bus import Bus, NotStored
from trainguard.stack.ha import HAServers
from trainguard.remediator.model import decision_id
from trainguard.schemas import Verdict, subjects
from trainguard.clients.store import StateStore


@pytest.fixture
def ha(tmp_path):
    with HAServers() as srv:
        async def streams() -> None:
            bus = await Bus(srv.nats_url, "admin").connect()
            await bus.ensure_streams()
            await bus.close()

        asyncio.run(streams())
        yield srv


@pytest.fixture
def procs(ha, tmp_path):
    p = Procs(ha, tmp_path)
    yield p
    p.stop()


def _nats_server_of(pid: int, ha: HAServers):
    """The NATS server of ``ha`` that process ``pid`` has a connection to (None: none)."""
    ports = {s.port: s for s in ha.nats}
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED:
            return ports[c.raddr.port]
    return None


async def _publish_stored(bus: Bus, v: Verdict, timeout: float = 20.0) -> None:
    """Publish ``v`` until a stream stored it (a stream whose leader was just killed answers
    once it elected another)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await bus.publish_stored(subjects.job(v.job, "verdict"), v)
            return
        except NotStored:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _register(store: StateStore, job: str) -> None:
    await store.register_job(job, mode="action", generation=0, world_size=4, min_world_size=2,
                             retry_budget=5, retries_used=0, members=MEMBERS, status="running")


async def _decided_and_carried_out_once(bus: Bus, store: StateStore, v: Verdict,
                                        procs: Procs) -> None:
    job = v.job
    assert await wait_until(lambda: _count(bus, job, "action", 1), 40), procs.log(
        "remediator", "r1")
    await asyncio.sleep(3.0)  # outbox sweeps and redeliveries more: nothing again
    [d] = await stored(bus, job, "decision")
    assert d.event_id == decision_id(v.event_id)
    assert (d.action, d.execute, d.nodes, d.generation) == (
        "exclude_node_and_requeue", True, ["n2"], 1)
    [ar] = await stored(bus, job, "action")
    assert ar.ok and ar.decision_id == d.event_id and ar.node == "n2"
    rec = await store.job(job)
    assert rec.generation == 1 and rec.world_size == 2
    assert (await store.node("n2"))["status"] == "excluded"
    assert [r["type"] for r in await store.audit_trail(job)].count("decision") == 1


async def _count(bus: Bus, job: str, kind: str, n: int) -> bool:
    try:
        return len(await stored(bus, job, kind)) >= n
    except nats.errors.TimeoutError:  # the cluster elects a new meta leader: ask again
        return False


def _verdict(job: str) -> Verdict:
    return Verdict(job=job, fault_class="node_lost", layer="infrastructure",
                   culprit={"nodes": ["n2"]}, generation=0, first_ts=2000)


async def test_every_stream_has_three_copies(ha):
    bus = await Bus(ha.nats_url, "admin").connect()
    try:
        js = bus.nc.jetstream()
        copies = {n: (await js.stream_info(n)).config.num_replicas
                  for n in ("TG_EVENTS", "TG_DLQ", "TG_TELEMETRY")}
        assert copies == {"TG_EVENTS": 3, "TG_DLQ": 3, "TG_TELEMETRY": 3}
        info = await js.stream_info("TG_EVENTS")
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    finally:
        await bus.close()


async def test_the_nats_server_of_the_remediator_killed_mid_incident_one_decision(ha, procs):
    store = StateStore(ha.redis_url)
    await _register(store, "hn")
    p = procs.start("remediator", "r1")
    admin = await Bus(ha.nats_url, "test").connect()
    await healthy(admin, "remediator", "r1")
    await admin.close()
    victim = _nats_server_of(p.pid, ha)
    assert victim is not None
    survivors = ",".join(s.url_for("admin") for s in ha.nats if s is not victim)
    bus = await Bus(survivors, "test").connect()
    try:
        victim.proc.kill()  # the remediator's server, and perhaps the stream's leader, gone
        victim.proc.wait(5)
        v = _verdict("hn")
        await _publish_stored(bus, v)  # the fault arrives while the remediator reconnects
        await _decided_and_carried_out_once(bus, store, v, procs)
        now = _nats_server_of(p.pid, ha)
        assert now is not None and now is not victim  # it moved to a survivor
    finally:
        await store.close()
        await bus.close()


async def test_the_valkey_primary_killed_mid_incident_one_decision(ha, procs):
    store = StateStore(ha.redis_url)  # through the sentinels, as the remediator
    await _register(store, "hv")
    procs.start("remediator", "r1")
    bus = await Bus(ha.nats_url, "test").connect()
    try:
        await healthy(bus, "remediator", "r1")
        old = ha.primary()
        assert old is ha.valkey[0]
        old.proc.kill()  # the primary gone; the sentinels promote the replica
        old.proc.wait(5)
        v = _verdict("hv")
        await _publish_stored(bus, v)  # the fault arrives during the failover
        await _decided_and_carried_out_once(bus, store, v, procs)
        new = ha.primary()
        assert new is not None and new is not old and new.proc.poll() is None
        assert (await healthy(bus, "remediator", "r1"))["ok"]
        log = procs.log("remediator", "r1")
        # the failover was not an error for the service: its commands waited for the new
        # primary and were sent again
        assert "a primary answers, sending again" in log, log
        assert "lease not renewed" not in log and "claim failed" not in log, log
    finally:
        await store.close()
        await bus.close()


def test_a_restarted_stack_keeps_its_urls_and_the_promoted_primary(tmp_path):
    """After a failover the promoted replica has the newest data: a stack stopped and started
    again on the same data directory starts it as the primary (the old primary replicates
    it), on the same ports, so the URLs a launcher was given still work."""
    with HAServers(data_dir=tmp_path / "state") as srv:
        urls = srv.urls("worker")
        srv.valkey[0].proc.kill()
        deadline = time.monotonic() + 30
        while srv.primary() in (None, srv.valkey[0]):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.1)
        promoted = srv.primary()
        with srv._admin(promoted.host, promoted.port) as r:
            r.set("tg:after-failover", "kept")
    with HAServers(data_dir=tmp_path / "state") as again:
        assert again.urls("worker") == urls
        assert again.primary() is again.valkey[1]
        with again._admin(again.valkey[1].host, again.valkey[1].port) as r:
            assert r.get("tg:after-failover") == "kept"

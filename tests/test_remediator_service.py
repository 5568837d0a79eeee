"""The remediator service on a real NATS and Valkey: one decision per incident, audit records,
observe mode, no repeat after a restart, bad messages survived, the watchdog."""
import asyncio
import contextlib
import json

from trainguard import schemas
from trainguard.schemas.vocabulary import signature
from trainguard.remediator.service import Remediator, RemediatorConfig
from trainguard.schemas import ActionResult, Decision, TrainingResumed, Verdict, subjects
from trainguard.clients.bus import Bus
from trainguard.services.base import ServiceConfig, health_subject
from trainguard.clients.store import StateStore

MEMBERS = [{"rank": 0, "node": "n1", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 1},
           {"rank": 2, "node": "n2", "local_rank": 0}, {"rank": 3, "node": "n2", "local_rank": 1}]


async def register(store, job, **kw):
    fields = {"mode": "action", "generation": 0, "world_size": 4, "min_world_size": 2,
              "retry_budget": 5, "retries_used": 0, "members": MEMBERS}
    fields.update(kw)
    await store.register_job(job, **fields)


@contextlib.asynccontextmanager
async def remediator(servers, redis_url, timeout_s=60.0, controller=None):
    svc = Remediator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_url),
                     RemediatorConfig(decision_timeout_s=timeout_s, controller="local"),
                     controller=controller)
    task = asyncio.create_task(svc.run())
    probe = await Bus(servers.nats_url, "probe").connect()
    for _ in range(200):
        try:
            body = json.loads(await probe.request(health_subject("remediator"), timeout=0.2))
            if body.get("ok"):
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
async def client(servers, job):
    """A bus client collecting decisions and action results of ``job``."""
    bus = await Bus(servers.nats_url, "test-client").connect()
    got = {"decision": [], "action": []}
    await bus.subscribe(subjects.job(job, "decision"), lambda s, e: got["decision"].append(e))
    await bus.subscribe(subjects.job(job, "action"), lambda s, e: got["action"].append(e))
    await bus.flush()
    bus.got = got
    try:
        yield bus
    finally:
        await bus.close()


async def wait_for(pred, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


async def settle(s=0.4):
    await asyncio.sleep(s)


def crash(job, rank=1, gen=0, **kw):
    return Verdict(job=job, fault_class="crash", layer="unknown", action="restart_workers",
                   culprit={"ranks": [rank]}, generation=gen, first_ts=1000, **kw)


async def test_verdict_to_one_decision_with_audit(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j1")
    async with remediator(servers, redis_db) as svc, client(servers, "j1") as c:
        v = crash("j1", rank=3)
        await c.publish(subjects.job("j1", "verdict"), v)
        assert await wait_for(lambda: c.got["decision"])
        await settle()
        [d] = c.got["decision"]
        assert isinstance(d, Decision)
        assert (d.action, d.generation, d.execute, d.ranks, d.nodes) == (
            "restart_workers", 1, True, [3], ["n2"])
        assert d.idempotency_key == "j1:g0" and d.verdict_id == v.event_id and d.fault_ts == 1000
        st = await store.job("j1")
        assert st.generation == 1 and st.retries_used == 1
        assert st.last_fault["fault_class"] == "crash" and st.last_fault["generation"] == 0
        assert st.pending_decision["event_id"] == d.event_id
        [rec] = await store.audit_trail("j1")
        assert rec["type"] == "decision" and rec["decision_id"] == d.event_id
        assert rec["action"] == "restart_workers" and "crash" in rec["reason"]

        # the same verdict again, and a symptom verdict of the same generation: folded
        await c.publish(subjects.job("j1", "verdict"), v)
        await c.publish(subjects.job("j1", "verdict"), crash("j1", rank=2))
        assert await wait_for(lambda: svc.counts["folded"] == 2)
        await settle()
        assert len(c.got["decision"]) == 1
        trail = await store.audit_trail("j1")
        assert [r["type"] for r in trail] == ["decision", "folded", "folded"]
        assert (await store.job("j1")).generation == 1
    await store.close()


async def test_node_lost_after_crash_escalates_once(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j2")
    async with remediator(servers, redis_db), client(servers, "j2") as c:
        await c.publish(subjects.job("j2", "verdict"), crash("j2", rank=2))
        assert await wait_for(lambda: len(c.got["decision"]) == 1)
        lost = Verdict(job="j2", fault_class="node_lost", layer="infrastructure",
                       action="exclude_node_and_requeue", culprit={"nodes": ["n2"]}, generation=0)
        await c.publish(subjects.job("j2", "verdict"), lost)
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
        assert await wait_for(lambda: c.got["action"])
        await c.publish(subjects.job("j2", "verdict"), lost.model_copy(
            update={"event_id": schemas.new_event_id()}))
        await settle()
        assert len(c.got["decision"]) == 2
        d = c.got["decision"][1]
        assert d.action == "exclude_node_and_requeue" and d.generation == 2
        assert d.idempotency_key == "j2:g0:exclude_node_and_requeue"
        assert [(m.rank, m.node) for m in d.members] == [(0, "n1"), (1, "n1")]
        st = await store.job("j2")
        assert st.generation == 2 and st.world_size == 2
        assert [m["node"] for m in st.members] == ["n1", "n1"]
        assert (await store.node("n2"))["status"] == "excluded"
        [ar] = c.got["action"]
        assert isinstance(ar, ActionResult) and ar.ok and ar.executor == "controller:local"
        assert ar.idempotency_key == d.idempotency_key and ar.node == "n2"
    await store.close()


async def test_observe_mode_changes_nothing(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j3", mode="observe")
    before = await store.job("j3")
    async with remediator(servers, redis_db), client(servers, "j3") as c:
        await c.publish(subjects.job("j3", "verdict"), Verdict(
            job="j3", fault_class="node_lost", layer="infrastructure",
            action="exclude_node_and_requeue", culprit={"nodes": ["n1"]}, generation=0))
        await c.publish(subjects.job("j3", "verdict"), crash("j3", rank=3))
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
        await settle()
        assert [(d.action, d.execute, d.mode) for d in c.got["decision"]] == [
            ("exclude_node_and_requeue", False, "observe"), ("restart_workers", False, "observe")]
        assert c.got["action"] == []  # no controller ran
    assert await store.job("j3") == before
    assert await store.node("n1") == {}
    assert [r["type"] for r in await store.audit_trail("j3")] == ["decision", "decision"]
    await store.close()


async def test_restarted_remediator_does_not_repeat(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j4")
    v = crash("j4", rank=0)
    async with client(servers, "j4") as c:
        async with remediator(servers, redis_db):
            await c.publish(subjects.job("j4", "verdict"), v)
            assert await wait_for(lambda: c.got["decision"])
        async with remediator(servers, redis_db) as second:
            await c.publish(subjects.job("j4", "verdict"), v)
            await c.publish(subjects.job("j4", "verdict"), crash("j4", rank=1))
            assert await wait_for(lambda: second.counts["folded"] == 2)
            await settle()
            # the new instance re-armed the watchdog of the decision it did not make
            assert "j4" in second.pending
    assert len(c.got["decision"]) == 1
    assert (await store.job("j4")).generation == 1
    await store.close()


async def test_bad_messages_do_not_kill_it(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j5")
    async with remediator(servers, redis_db) as svc, client(servers, "j5") as c:
        await c.nc.publish(subjects.job("j5", "verdict"), b"\xc1not msgpack")
        await c.nc.publish(subjects.job("j5", "verdict"), schemas.encode(
            schemas.LogLine(job="j5", line="wrong type on this subject")))
        await c.publish(subjects.job("j5", "verdict"), Verdict(
            job="j5", fault_class="crash", layer="unknown", action="x", culprit={"ranks": [99]}))
        await c.publish(subjects.job("j5", "verdict"), crash("j5", rank=1, gen=5))
        assert await wait_for(lambda: any(d.ranks == [1] for d in c.got["decision"]))
        assert svc.bus.stats.bad["malformed"] == 1
    await store.close()


async def test_exception_repeating_at_same_step_stops(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j6")
    ev = ["Traceback (most recent call last):", "ValueError: injected fault in step"]

    def exc(gen):
        return Verdict(job="j6", fault_class="app_exception", layer="application",
                       action="restart_in_process", culprit={"ranks": [1]}, generation=gen,
                       evidence=ev, detail={"step": 30})

    async with remediator(servers, redis_db), client(servers, "j6") as c:
        await c.publish(subjects.job("j6", "verdict"), exc(0))
        assert await wait_for(lambda: len(c.got["decision"]) == 1)
        await c.publish(subjects.job("j6", "verdict"), exc(1))
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
    d1, d2 = c.got["decision"]
    assert (d1.action, d2.action) == ("restart_in_process", "stop_job_notify_user")
    assert "would loop" in d2.reason and "step 30" in d2.reason
    st = await store.job("j6")
    assert st.status == "stopped" and st.last_fault["signature"] == signature(exc(1))
    await store.close()


async def test_watchdog_escalates_until_stop(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j7", min_world_size=4)
    async with remediator(servers, redis_db, timeout_s=0.3) as svc, client(servers, "j7") as c:
        await c.publish(subjects.job("j7", "verdict"), crash("j7", rank=2))
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
        # restart not followed by training → exclude n2; that leaves 2 < 4 ranks → stop
        await settle(1.0)
        assert not svc.pending
    acts = [(d.action, d.generation) for d in c.got["decision"]]
    assert acts == [("restart_workers", 1), ("stop_job_notify_user", 2)]
    assert "watchdog" in c.got["decision"][1].reason
    assert "min_world_size 4" in c.got["decision"][1].reason
    trail = await store.audit_trail("j7")
    assert [r["action"] for r in trail] == ["restart_workers", "stop_job_notify_user"]
    await store.close()


async def test_watchdog_quiet_when_training_resumes_and_fast_on_failure(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j8")
    async with remediator(servers, redis_db, timeout_s=0.5) as svc, client(servers, "j8") as c:
        await c.publish(subjects.job("j8", "verdict"), crash("j8", rank=1))
        assert await wait_for(lambda: c.got["decision"])
        d = c.got["decision"][0]
        await c.publish(subjects.job("j8", "recovery"), TrainingResumed(
            job="j8", rank=0, generation=d.generation, world_size=4, restored_step=10,
            resumed_step=11))
        assert await wait_for(lambda: "j8" not in svc.pending)
        await settle(1.0)
        assert len(c.got["decision"]) == 1
        assert (await store.job("j8")).pending_decision is None

        # next incident: the executor reports a failure → escalation without waiting
        svc.rconfig.decision_timeout_s = 60
        await c.publish(subjects.job("j8", "verdict"), crash("j8", rank=3, gen=1))
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
        d2 = c.got["decision"][1]
        await c.publish(subjects.job("j8", "action"), ActionResult(
            job="j8", decision_id=d2.event_id, idempotency_key=d2.idempotency_key,
            executor="launcher:n2", action="restart_workers", ok=False, detail="spawn failed"))
        assert await wait_for(lambda: len(c.got["decision"]) == 3)
    d3 = c.got["decision"][2]
    assert d3.action == "exclude_node_and_requeue" and d3.nodes == ["n2"]
    assert "spawn failed" in d3.reason and d3.generation == 3
    await store.close()


async def test_straggler_flag_is_published_once_and_keeps_the_watchdog(servers, redis_db):
    store = StateStore(redis_db)
    await register(store, "j9")
    async with remediator(servers, redis_db) as svc, client(servers, "j9") as c:
        await c.publish(subjects.job("j9", "verdict"), crash("j9", rank=0))
        assert await wait_for(lambda: "j9" in svc.pending)
        slow = Verdict(job="j9", fault_class="straggler", layer="unknown", action="none",
                       culprit={"ranks": [3], "nodes": ["n2"]}, generation=1)
        await c.publish(subjects.job("j9", "verdict"), slow)
        await c.publish(subjects.job("j9", "verdict"), slow.model_copy(
            update={"event_id": schemas.new_event_id()}))
        assert await wait_for(lambda: len(c.got["decision"]) == 2)
        await settle()
        assert len(c.got["decision"]) == 2
        flag = c.got["decision"][1]
        assert flag.action == "none" and flag.execute is False and flag.generation == 1
        assert "no spare node" in flag.reason
        assert "j9" in svc.pending  # the restart is still watched
        assert (await store.job("j9")).generation == 1
    await store.close()


async def test_failed_node_drain_is_audited_not_escalated(servers, redis_db):
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    store = StateStore(redis_db)
    await register(store, "j10")
    slurm = SlurmController(store, SlurmConfig(scontrol="/nonexistent/scontrol"))
    async with remediator(servers, redis_db, controller=slurm) as svc, \
            client(servers, "j10") as c:
        await c.publish(subjects.job("j10", "verdict"), Verdict(
            job="j10", fault_class="node_lost", layer="infrastructure",
            action="exclude_node_and_requeue", culprit={"nodes": ["n1"]}, generation=0))
        assert await wait_for(lambda: c.got["action"])
        await settle()
        [ar] = c.got["action"]
        assert not ar.ok and ar.executor == "controller:slurm" and "scontrol" in ar.detail
        assert len(c.got["decision"]) == 1 and "j10" in svc.pending
    trail = await store.audit_trail("j10")
    assert [r["type"] for r in trail] == ["decision", "controller_failed"]
    await store.close()

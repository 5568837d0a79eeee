"""Detector + attributor running in-process against real NATS and Valkey, fed real events."""
from __future__ import annotations

import asyncio
import time

import pytest

from trainguard import schemas
from trainguard.attributor.decide import AttributorConfig
from trainguard.attributor.service import Attributor
from trainguard.detector.rules import DetectorConfig
from trainguard.detector.service import Detector, DetectorServiceConfig
from trainguard.schemas import subjects
from trainguard.clients.bus import Bus
from trainguard.services.base import ServiceConfig
from trainguard.clients.store import StateStore

pytestmark = pytest.mark.timeout(60)


class Stack:
    def __init__(self, servers, job: str, silence_s: float = 0.5):
        cfg = ServiceConfig(nats_url=servers.nats_url, redis_url=servers.redis_url, node="t")
        self.det = Detector(cfg, DetectorServiceConfig(rules=DetectorConfig(
            silence_timeout_s=silence_s), job_refresh_s=0.2))
        self.att = Attributor(ServiceConfig(nats_url=servers.nats_url,
                                            redis_url=servers.redis_url, node="t"),
                              AttributorConfig(symptom_hold_s=0.3))
        self.job = job
        self.bus = Bus(servers.nats_url, "test-client")
        self.verdicts: list[schemas.Verdict] = []
        self.anomalies: list[schemas.Anomaly] = []
        self.dlq: list = []
        self.state = StateStore(servers.redis_url)

    async def __aenter__(self):
        await self.bus.connect()
        await self.bus.subscribe(subjects.job(self.job, "verdict"),
                                 lambda s, e: self.verdicts.append(e))
        await self.bus.subscribe(subjects.job(self.job, "anomaly"),
                                 lambda s, e: self.anomalies.append(e))
        await self.bus.nc.subscribe("tg.dlq.>", cb=self._dlq)
        self.tasks = [asyncio.create_task(self.det.run()), asyncio.create_task(self.att.run())]
        for _ in range(200):
            if self.det.bus.connected and self.att.bus.connected and self.det.state:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # subscriptions in place
        return self

    async def _dlq(self, msg):
        self.dlq.append(msg)

    async def __aexit__(self, *exc):
        self.det.stop()
        self.att.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.bus.close()
        await self.state.close()

    async def pub(self, subject, ev):
        await self.bus.publish(subject, ev)
        await self.bus.flush()

    async def wait(self, pred, timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            await asyncio.sleep(0.02)
        return False


async def test_sigkill_then_gloo_cascade_names_the_killed_rank(servers, redis_db):
    job = "cascade"
    async with Stack(servers, job) as st:
        now = time.time_ns()
        await st.pub(subjects.job(job, "worker"), schemas.WorkerExited(
            job=job, node="node-b", rank=2, local_rank=0, pid=4242, signal=9, ts=now))
        for r in (1, 3):
            await st.pub(subjects.job(job, "log"), schemas.LogLine(
                job=job, node="node-a" if r == 1 else "node-b", rank=r, stream="exception",
                line=f"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
                     f"Connection closed by peer [127.0.0.1]:{29500 + r}", ts=now + 25_000_000))
        assert await st.wait(lambda: len(st.anomalies) >= 3)
        await asyncio.sleep(0.6)  # past the symptom hold: the symptoms must fold, not fire
        assert len(st.verdicts) == 1, [v.fault_class for v in st.verdicts]
        v = st.verdicts[0]
        assert v.culprit.ranks == [2] and v.culprit.nodes == ["node-b"]
        assert (v.fault_class, v.layer, v.action) == ("crash", "unknown", "")  # no action
        assert v.generation == 0 and v.first_ts == now
        symptoms = [a for a in st.anomalies if a.symptom]
        assert len(symptoms) == 2 and all(a.fault_class == "network" for a in symptoms)
        # the fault went into the cross-job history
        assert await st.state.node_history("node-b")


async def test_silent_rank_is_the_hang_culprit(servers, redis_db):
    job = "hangjob"
    async with Stack(servers, job, silence_s=0.5) as st:
        t_stop = None
        for i in range(25):                 # 0.1 s heartbeats; rank 2 stops after 0.5 s
            for r in range(4):
                if r == 2 and i >= 5:
                    continue
                await st.bus.publish(subjects.rank_hb(job, r), schemas.RankHeartbeat(
                    job=job, node=f"n{r // 2}", rank=r, local_rank=r % 2, world_size=4,
                    step=10, collective_seq=11 if r != 2 else 10, step_time_s=0.2))
            if i == 4:
                t_stop = time.monotonic()
            await st.bus.flush()
            await asyncio.sleep(0.1)
        assert await st.wait(lambda: st.verdicts)
        v = st.verdicts[0]
        assert v.fault_class == "hang" and v.culprit.ranks == [2] and v.culprit.nodes == ["n1"]
        hangs = [a for a in st.anomalies if a.kind == "hang"]
        assert len(hangs) == 1                 # one incident, not one per tick


async def test_xid_on_a_node_reaches_its_job_and_excludes_the_node(servers, redis_db):
    job = "xidjob"
    st_ = StateStore(servers.redis_url)
    await st_.register_job(job, generation=0, members=[
        {"rank": 0, "node": "g1", "local_rank": 0}, {"rank": 1, "node": "g1", "local_rank": 1},
        {"rank": 2, "node": "g2", "local_rank": 0}])
    await st_.close()
    async with Stack(servers, job) as st:
        # the detector learns the job from a heartbeat, then reads its hash
        await st.pub(subjects.rank_hb(job, 0), schemas.RankHeartbeat(job=job, node="g1", rank=0))
        assert await st.wait(lambda: "g1" in st.det.node_jobs)
        line = "NVRM: Xid (PCI:0000:4e:00): 79, pid=31877, name=python3, GPU has fallen off the bus."
        await st.pub(subjects.node("g1", "xid"), schemas.XidEvent(
            node="g1", xid=79, pci="0000:4e:00", gpu_index=1, pid=31877, raw=line))
        assert await st.wait(lambda: st.verdicts)
        v = st.verdicts[0]
        assert (v.fault_class, v.layer) == ("gpu_xid", "hardware")
        assert v.culprit.nodes == ["g1"] and v.culprit.ranks == [1]


async def test_bad_message_goes_to_dead_letter_and_service_goes_on(servers, redis_db):
    job = "badmsg"
    async with Stack(servers, job) as st:
        await st.bus.publish_raw(subjects.job(job, "worker"), b"\xc1 not msgpack")
        await st.bus.publish_raw(subjects.job(job, "log"), b"\x81\xa6schema\xa5bogus")
        await st.bus.flush()
        assert await st.wait(lambda: len(st.dlq) >= 2)
        assert {m.subject for m in st.dlq} == {"tg.dlq.detector"}
        await st.pub(subjects.job(job, "worker"), schemas.WorkerExited(
            job=job, node="n", rank=0, exit_code=1))
        assert await st.wait(lambda: st.verdicts)
        assert st.verdicts[0].culprit.ranks == [0]
        assert st.det.bus.stats.bad["malformed"] == 1


async def test_failed_save_is_flagged_and_training_goes_on(servers, redis_db):
    """A ``ckpt.save_failed`` (disk full) becomes a ``checkpoint_save`` anomaly and a verdict
    the policy flags (action ``none``): the Checkpointer keeps training and the last valid checkpoint, so
    the job is flagged, not stopped. A skipped save (overlap_policy="skip") is no fault."""
    from trainguard.remediator.plan import rule_for

    job = "savefail"
    async with Stack(servers, job) as st:
        await st.pub(subjects.job(job, "ckpt"), schemas.CheckpointSaveFailed(
            job=job, node="n0", rank=1, step=40, generation=2, errno=28,
            error="[Errno 28] No space left on device: '/ckpt/.tmp-step_40/__1_0.distcp'"))
        await st.pub(subjects.job(job, "ckpt"), schemas.CheckpointSaveFailed(
            job=job, node="n0", rank=0, step=60, generation=2,
            error="skipped: the previous save (step 40) is still being written"))
        assert await st.wait(lambda: st.verdicts)
        await asyncio.sleep(0.5)
        (a,) = st.anomalies
        assert (a.fault_class, a.rank, a.generation) == ("checkpoint_save", 1, 2)
        assert a.detail["errno"] == 28 and "No space left" in a.evidence[0]
        (v,) = st.verdicts
        assert (v.fault_class, v.culprit.ranks) == ("checkpoint_save", [1])
        assert rule_for(v.fault_class, v.layer).action == "none"
        assert not st.dlq


async def test_refresh_now_reads_the_records_at_once(servers, redis_db):
    """``refresh_now`` re-reads every known job's record and returns once the replies are
    stepped: with the periodic refresh an hour away, the members registered after the detector
    first read the job are known right after it."""
    job = "refreshjob"
    async with Stack(servers, job) as st:
        st.det.dc.job_refresh_s = 3600.0
        await st.pub(subjects.rank_hb(job, 0), schemas.RankHeartbeat(job=job, node="r1", rank=0))
        assert await st.wait(lambda: job in st.det.job_cfg)   # the new job's first read
        assert st.det.node_jobs == {}
        await st.state.register_job(job, generation=4, members=[
            {"rank": 0, "node": "r1", "local_rank": 0}])
        await st.det.refresh_now()
        assert st.det.node_jobs == {"r1": {job}} and st.det.job_cfg[job].generation == 4


async def test_launcher_beats_on_their_subject_keep_the_node_alive_and_a_forged_one_counts(
        servers, redis_db):
    """A launcher beating on ``tg.node.<node>.launcher.<job>`` (no agent on the node) keeps
    its node alive; its silence past the job's node timeout is a node loss of its ranks. A
    beat that names another job than its subject is refused, counted as a handler error, and
    tracks nothing."""
    job, node = "lbeat", "lb1"
    st_ = StateStore(servers.redis_url)
    await st_.register_job(job, generation=0, node_timeout_s=1.0,
                           members=[{"rank": 0, "node": node, "local_rank": 0}])
    await st_.close()
    async with Stack(servers, job, silence_s=60.0) as st:
        await st.pub(subjects.rank_hb(job, 0), schemas.RankHeartbeat(job=job, node=node, rank=0))
        assert await st.wait(lambda: node in st.det.node_jobs)
        errors = st.det.bus.stats.handler_errors
        await st.pub(subjects.launcher("lb2", job), schemas.NodeHeartbeat(
            node="lb2", job="other", role="launcher"))
        assert await st.wait(lambda: st.det.bus.stats.handler_errors == errors + 1)
        for _ in range(10):  # 2 s of beats, twice the node timeout
            await st.pub(subjects.launcher(node, job), schemas.NodeHeartbeat(
                node=node, job=job, role="launcher", interval_s=0.2))
            await asyncio.sleep(0.2)
        assert set(st.det.nodes[node].launchers) == {job} and "lb2" not in st.det.nodes
        assert not [a for a in st.anomalies if a.kind == "node_lost"]
        assert await st.wait(lambda: [a for a in st.anomalies if a.kind == "node_lost"])
        (lost,) = [a for a in st.anomalies if a.kind == "node_lost"]
        assert lost.culprit.nodes == [node] and lost.culprit.ranks == [0]

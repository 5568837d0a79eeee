"""The Slurm node controller against a real Slurm (``trainguard.cluster.slurm``: slurmctld on the
host, a slurmd in each of 2 node namespaces): it acts on the *training job's* Slurm id from the
job record (not the remediator's environment), drains with the evidence as the reason, requeues
excluding the node, cancels on stop with the decision's reason on the job (also through the
remediator service: observe mode leaves Slurm alone), and does each once (it re-reads Slurm's
state first).

Skips, saying why, without CAP_NET_ADMIN or without Slurm. About 20 s.
"""
from __future__ import annotations

import time

import pytest

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

from cluster_helpers import slurm  # noqa: F401 - the module's Slurm cluster fixture

pytestmark = [pytest.mark.skipif(cnet.unavailable_reason() is not None,
                                 reason=f"no network namespaces: {cnet.unavailable_reason()}"),
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]


def _wait_state(slurm, jid, states, timeout=20):
    deadline = time.monotonic() + timeout
    st = {}
    while time.monotonic() < deadline:
        st = slurm.job_state(jid)
        if st.get("JobState") in states:
            return st
        time.sleep(0.2)
    raise AssertionError(f"job {jid} not {states}: {st}")


async def test_drain_requeue_cancel_for_the_training_jobs_slurm_id(slurm, redis_db, tmp_path,
                                                                     monkeypatch):
    from trainguard.scheduler.local import make_controller
    from trainguard.schemas import JobSettings
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    jid = slurm.sbatch(None, "-N", "1", "-w", "node1", "--requeue", "--wrap",
                       "sleep 120", "-o", str(tmp_path / "out-%j"))
    _wait_state(slurm, jid, ("RUNNING",))
    # the remediator's own environment names another job: it must not be the one acted on
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    st = StateStore(redis_db)
    await st.register_settings("tj", JobSettings(mode="action", world_size=2, slurm_job_id=jid))
    ctl = SlurmController(st, SlurmConfig(requeue="always"))
    assert make_controller("slurm", st).name == "slurm"

    res = await ctl.exclude("node1", "tj", "node_lost: no heartbeat from node1\n for 3.0 s")
    assert res.ok, res
    assert slurm.reasons()["node1"] == "trainguard: node_lost: no heartbeat from node1 for 3.0 s"
    job = _wait_state(slurm, jid, ("PENDING", "REQUEUED"))
    assert "node1" in job.get("ExcNodeList", ""), job
    assert f"requeued Slurm job {jid} without node1" in res.detail
    assert (await st.node("node1"))["status"] == "excluded"

    again = await ctl.exclude("node1", "tj", "node_lost: the same decision again")
    assert again.ok and "already drained" in again.detail and "already requeued" in again.detail
    assert all(isinstance(c, dict) and "skipped" in c for c in again.commands)
    assert slurm.reasons()["node1"].startswith("trainguard: node_lost: no heartbeat")  # kept

    stop = await ctl.stop("tj", "retry budget spent")
    assert stop.ok and f"cancelled Slurm job {jid}" in stop.detail
    assert _wait_state(slurm, jid, ("CANCELLED",)).get("AdminComment") == (
        "trainguard: retry budget spent")
    stop2 = await ctl.stop("tj", "again")
    assert stop2.ok and "already ended" in stop2.detail
    # a job Slurm no longer knows (ended before MinJobAge): already satisfied, nothing run
    await st.register_settings("tg", JobSettings(mode="action", slurm_job_id="987654"))
    gone = await SlurmController(st).stop("tg", "budget", 0)
    assert gone.ok and "no longer knows it" in gone.detail, gone
    slurm.run("scontrol", "update", "nodename=node1", "state=resume")
    await st.close()


async def test_auto_requeue_leaves_a_job_that_goes_on_in_place(slurm, redis_db, tmp_path,
                                                                monkeypatch):
    from trainguard.schemas import JobSettings
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    jid = slurm.sbatch(None, "-N", "2", "--requeue", "--wrap", "sleep 120",
                       "-o", str(tmp_path / "out-%j"))
    _wait_state(slurm, jid, ("RUNNING",))
    st = StateStore(redis_db)
    # 4 ranks shrunk to 2 by the exclusion, minimum 2: trainguard goes on without the node
    await st.register_settings("tk", JobSettings(mode="action", world_size=2, min_world_size=2,
                                                 slurm_job_id=jid))
    res = await SlurmController(st, SlurmConfig(requeue="auto")).exclude("node0", "tk", "xid 79")
    assert res.ok and "goes on in place" in res.detail, res
    assert slurm.job_state(jid)["JobState"] == "RUNNING"
    assert slurm.reasons()["node0"] == "trainguard: xid 79"
    slurm.run("scancel", jid)
    slurm.run("scontrol", "update", "nodename=node0", "state=resume")
    # outside Slurm (no id in the record): the drain alone, and it says so
    await st.register_settings("tl", JobSettings(mode="action"))
    res = await SlurmController(st).exclude("node0", "tl", "ecc")
    assert res.ok and "nothing to requeue" in res.detail
    slurm.run("scontrol", "update", "nodename=node0", "state=resume")
    await st.close()


async def test_a_stop_decision_cancels_the_slurm_job_with_its_reason(slurm, servers, redis_db,
                                                                      tmp_path, monkeypatch):
    """The remediator service on a real NATS and Valkey, with the Slurm controller: a stop
    decision in action mode cancels the training job's Slurm job and records the decision's
    reason on it; the same verdict for an observe-mode job leaves its Slurm job untouched."""
    import asyncio
    import json

    from trainguard.clients.bus import Bus
    from trainguard.remediator.service import Remediator, RemediatorConfig
    from trainguard.schemas import ActionResult, Decision, Verdict, subjects
    from trainguard.services.base import ServiceConfig, health_subject
    from trainguard.scheduler.slurm.commands import slurm_reason
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    jids = {job: slurm.sbatch(None, "-N", "1", "-w", "node0", "--wrap", "sleep 120",
                              "-o", str(tmp_path / f"out-{job}-%j")) for job in ("ta", "to")}
    for jid in jids.values():
        _wait_state(slurm, jid, ("RUNNING",))
    st = StateStore(redis_db)
    members = [{"rank": 0, "node": "node0", "local_rank": 0},
               {"rank": 1, "node": "node1", "local_rank": 0}]
    for job, mode in (("ta", "action"), ("to", "observe")):
        await st.register_job(job, mode=mode, generation=0, world_size=2, min_world_size=2,
                              retry_budget=0, members=members, status="running",
                              slurm_job_id=jids[job])
    svc = Remediator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db),
                     RemediatorConfig(controller="slurm"), controller=SlurmController(st))
    task = asyncio.create_task(svc.run())
    bus = await Bus(servers.nats_url, "test-slurm-stop").connect()
    got: dict[str, list] = {"decision": [], "action": []}
    try:
        for _ in range(200):
            try:
                if json.loads(await bus.request(health_subject("remediator"),
                                                timeout=0.2)).get("ok"):
                    break
            except Exception:  # noqa: BLE001 - not up yet
                await asyncio.sleep(0.05)
        for job in jids:
            for kind in got:
                await bus.subscribe(subjects.job(job, kind),
                                    lambda s, e, kind=kind: got[kind].append(e))
        await bus.flush()
        for job in jids:  # an XID on both nodes, the retry budget spent: a stop
            await bus.publish(subjects.job(job, "verdict"), Verdict(
                job=job, fault_class="gpu_xid", layer="hardware",
                culprit={"nodes": ["node0", "node1"]}, generation=0))
        for _ in range(300):
            if len(got["decision"]) == 2 and any(
                    isinstance(a, ActionResult) and a.executor == "controller:slurm"
                    for a in got["action"]):
                break
            await asyncio.sleep(0.05)
    finally:
        await bus.close()
        svc.stop()
        await asyncio.wait_for(task, 10)
    decs = {d.job: d for d in got["decision"] if isinstance(d, Decision)}
    assert {j: (d.action, d.execute) for j, d in decs.items()} == {
        "ta": ("stop_job_notify_user", True), "to": ("stop_job_notify_user", False)}, got
    [ar] = [a for a in got["action"] if a.executor == "controller:slurm"]
    assert (ar.job, ar.ok, ar.decision_id) == ("ta", True, decs["ta"].event_id), ar
    assert f"cancelled Slurm job {jids['ta']}" in ar.detail
    # really cancelled, with the decision's reason on the job (scontrol show job)
    job = _wait_state(slurm, jids["ta"], ("CANCELLED",))
    assert job.get("AdminComment") == slurm_reason(decs["ta"].reason), job
    # observe mode: Slurm untouched
    other = slurm.job_state(jids["to"])
    assert other["JobState"] == "RUNNING" and "AdminComment" not in other, other
    # carried out again (a second remediator, the same decision): already satisfied
    again = await SlurmController(st).stop("ta", decs["ta"].reason, decs["ta"].generation)
    assert again.ok and "already ended (CANCELLED)" in again.detail
    assert all(isinstance(c, dict) and "skipped" in c for c in again.commands)
    # a stop for a generation the job has moved past (a new run since) leaves it running
    late = await SlurmController(st).stop("to", "stale", -1)
    assert late.ok and "superseded" in late.detail
    assert slurm.job_state(jids["to"])["JobState"] == "RUNNING"
    slurm.run("scancel", jids["to"])
    await st.close()

"""The Slurm node controller against a real Slurm (``trainguard.cluster.slurm``: slurmctld on the
host, a slurmd in each of 2 node namespaces): it acts on the *training job's* Slurm id from the
job record (not the remediator's environment), drains with the evidence as the reason, requeues
excluding the node, cancels on stop, and does each once (it re-reads Slurm's state first).

Skips, saying why, without CAP_NET_ADMIN or without Slurm. About 15 s.
"""
from __future__ import annotations

import time

import pytest

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

pytestmark = [pytest.mark.skipif(cnet.unavailable_reason() is not None,
                                 reason=f"no network namespaces: {cnet.unavailable_reason()}"),
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    from trainguard.cluster.net import ClusterNet
    from trainguard.cluster.slurm import SlurmCluster

    net = ClusterNet(2).start()
    s = None
    try:
        s = SlurmCluster(net, str(tmp_path_factory.mktemp("slurm"))).start()
        yield s
    finally:
        if s is not None:
            s.stop()
        net.stop()


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
    from trainguard.controllers import make_controller
    from trainguard.schemas import JobSettings
    from trainguard.slurm_controller import SlurmConfig, SlurmController
    from trainguard.state import StateStore

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
    _wait_state(slurm, jid, ("CANCELLED",))
    stop2 = await ctl.stop("tj", "again")
    assert stop2.ok and "already ended" in stop2.detail
    slurm.run("scontrol", "update", "nodename=node1", "state=resume")
    await st.close()


async def test_auto_requeue_leaves_a_job_that_goes_on_in_place(slurm, redis_db, tmp_path,
                                                                monkeypatch):
    from trainguard.schemas import JobSettings
    from trainguard.slurm_controller import SlurmConfig, SlurmController
    from trainguard.state import StateStore

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

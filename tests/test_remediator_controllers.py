"""Node exclusion controllers: local records in the state store; Slurm command lines (run for
real only where scontrol exists); the registry (the Kubernetes controller itself is tested
against an API emulator in tests/test_k8s_controller.py)."""
import shutil
import sys

import pytest

from trainguard.scheduler.local import LocalController, make_controller
from trainguard.scheduler.slurm.commands import should_requeue, slurm_drain_command
from trainguard.scheduler.slurm.config import SlurmConfig
from trainguard.scheduler.slurm.controller import SlurmController
from trainguard.clients.store import StateStore


async def test_local_controller_records_exclusion(redis_db):
    st = StateStore(redis_db)
    res = await LocalController(st).exclude("node-7", "jobA", "gpu_xid 79 on GPU 3")
    assert res.ok
    node = await st.node("node-7")
    assert node["status"] == "excluded" and "jobA: gpu_xid 79" in node["reason"]
    await st.close()


def test_slurm_commands():
    cmd = slurm_drain_command("gpu-012", "node_lost:\n agent heartbeat gone " + "x" * 300)
    assert cmd[:4] == ["scontrol", "update", "nodename=gpu-012", "state=drain"]
    assert cmd[4].startswith("reason=trainguard: node_lost: agent heartbeat gone")
    assert "\n" not in cmd[4] and len(cmd[4]) < 160
    c = SlurmController(None, SlurmConfig(scontrol="/opt/slurm/bin/scontrol", slurm_job_id="4242"))
    assert c.commands("gpu-012", "r")[1] == ["/opt/slurm/bin/scontrol", "requeue", "4242"]
    assert len(SlurmController(None, SlurmConfig(slurm_job_id="")).commands("n", "r")) == 1


@pytest.mark.parametrize("state,in_force,generation,plan,says", [
    ("RUNNING", 3, 3, "cancel", "is RUNNING"),
    ("PENDING", 3, 3, "cancel", "is PENDING"),          # requeued, waiting: cancelled too
    ("RUNNING", None, 3, "cancel", "is RUNNING"),       # no record read: the decision's job
    ("RUNNING", 2, None, "cancel", "is RUNNING"),       # no generation given: any
    ("RUNNING", 4, 3, "skip", "superseded: generation 4 is in force"),  # a new run since
    ("CANCELLED", 3, 3, "skip", "already ended (CANCELLED)"),
    ("COMPLETED", 3, 3, "skip", "already ended (COMPLETED)"),
    ("NODE_FAIL", 3, 3, "skip", "already ended (NODE_FAIL)"),
    ("GONE", 3, 3, "skip", "Slurm no longer knows it"),
    ("COMPLETING", 3, 3, "skip", "already ending (COMPLETING)"),  # a cancel just landed
])
def test_slurm_stop_plan(state, in_force, generation, plan, says):
    from trainguard.scheduler.slurm.commands import stop_plan

    got, why = stop_plan(state, in_force, generation, "42")
    assert got == plan and says in why


_NOW = __import__("datetime").datetime(2025, 1, 2, 10, 0, 0)


@pytest.mark.parametrize("job,node_state,lost,skipped", [
    # a running job, its node cut off: DOWN, requeue, exclude, release Slurm's 2-minute hold
    ({"JobState": "RUNNING", "ExcNodeList": "(null)"}, "ALLOCATED+DRAIN", True,
     [None, None, None, None]),
    # a node that still answers (an XID): drained only, never DOWN (other jobs run on it)
    ({"JobState": "RUNNING"}, "", False, [None, None, None]),
    # done before: requeued, DOWN, excluded, eligible since 09:59 → nothing to do
    ({"JobState": "PENDING", "ExcNodeList": "n1", "EligibleTime": "2025-01-02T09:59:00"},
     "DOWN+DRAIN", True, ["DOWN already", "PENDING already", "excluded already",
                          "eligible since 09:59:00"]),
    # requeued by Slurm itself (its NODE_FAIL path), held for 2 minutes: released
    ({"JobState": "PENDING", "ExcNodeList": "n0", "EligibleTime": "2025-01-02T10:02:00"},
     "IDLE+DRAIN", True, [None, "PENDING already", None, None]),
])
def test_slurm_requeue_commands(job, node_state, lost, skipped):
    from trainguard.scheduler.slurm.commands import requeue_commands

    plan = requeue_commands("42", "n1", job, node_state, "node_lost: silent 3 s", lost, _NOW)
    assert [(w is None) if s is None else (s in (w or "")) for (_, w), s in
            zip(plan, skipped)] == [True] * len(skipped) and len(plan) == len(skipped), plan
    argvs = [" ".join(c) for c, _ in plan]
    # DOWN first: then the requeue ends the job's part on the node at once
    down = "scontrol update nodename=n1 state=down reason=trainguard: node_lost: silent 3 s"
    assert argvs[int(lost)] == "scontrol requeue 42" and (down in argvs) == (argvs[0] == down) == lost
    exc = next(a for a in argvs if "excnodelist=" in a).split("excnodelist=")[1]
    assert "n1" in exc.split(",") and exc.split(",").count("n1") == 1
    assert argvs[-1] == "scontrol update jobid=42 starttime=now"


def test_slurm_requeues_unless_told_never():
    assert SlurmController(None, SlurmConfig(requeue="auto")).requeues_jobs
    assert not SlurmController(None, SlurmConfig(requeue="never")).requeues_jobs
    assert not LocalController(None).requeues_jobs


def test_slurm_auto_requeues_a_job_that_cannot_go_on_in_place():
    from dataclasses import replace

    from trainguard.schemas import JobRecord

    two = [{"rank": r, "node": f"n{r // 2}", "local_rank": r % 2} for r in range(4)]
    run = JobRecord(status="running", members=two, world_size=4, min_world_size=4)
    assert not should_requeue("auto", run, {"n1"})  # world 4 still (spare in place): goes on
    left = replace(run, world_size=2, members=two[:2])
    assert should_requeue("auto", left, {"n1"})  # 2 < 4
    lone = replace(run, members=two[2:], world_size=2, min_world_size=1)
    assert should_requeue("auto", lone, {"n1"})  # every member on n1: nothing left in place
    assert not should_requeue("auto", lone, {"n0"})
    assert should_requeue("auto", run, {"n0", "n1"})  # both nodes out
    assert should_requeue("auto", replace(run, status="stopped"), {"n1"})
    assert not should_requeue("auto", None, {"n1"})
    assert should_requeue("always", None, {"n1"})
    assert not should_requeue("never", run, {"n0", "n1"})


@pytest.mark.parametrize("rc,out,state", [
    (0, "RUNNING\n", "RUNNING"),
    (0, "", "GONE"),                                  # -t all, past MinJobAge: no line
    (1, "slurm_load_jobs error: Invalid job id specified", "GONE"),
    (1, "slurm_load_jobs error: Unable to contact slurm controller", None),  # OSError
])
def test_slurm_squeue_state(rc, out, state):
    from trainguard.scheduler.slurm.commands import parse_squeue_state

    if state is None:
        with pytest.raises(OSError, match="squeue exited 1"):
            parse_squeue_state(rc, out)
    else:
        assert parse_squeue_state(rc, out) == state


def test_slurm_stop_commands_record_the_reason_then_cancel():
    from trainguard.scheduler.slurm.commands import slurm_squeue_command, slurm_stop_commands

    comment, cancel = slurm_stop_commands("42", "retry budget spent:\n 10 of 10 " + "x" * 300)
    assert comment[:3] == ["scontrol", "update", "jobid=42"]
    assert comment[3].startswith("admincomment=trainguard: retry budget spent: 10 of 10")
    assert "\n" not in comment[3] and len(comment[3]) < 160
    assert cancel == ["scancel", "42"]
    assert slurm_squeue_command("42") == ["squeue", "-h", "-t", "all", "-j", "42", "-o", "%T"]


async def test_slurm_stop_outside_slurm_cancels_nothing(redis_db):
    from trainguard.schemas import JobSettings

    st = StateStore(redis_db)
    await st.register_settings("j", JobSettings(mode="action"))
    res = await SlurmController(st, SlurmConfig(scontrol="/nonexistent/scontrol")).stop(
        "j", "budget", 1)
    assert res.ok and "nothing to cancel" in res.detail and res.commands == []
    assert SlurmController.cancels_jobs and not LocalController.cancels_jobs
    await st.close()


async def test_slurm_without_scontrol_says_what_to_do(redis_db):
    st = StateStore(redis_db)
    c = SlurmController(st, SlurmConfig(scontrol="/nonexistent/scontrol", slurm_job_id="1"))
    res = await c.exclude("n3", "j", "ecc")
    assert not res.ok and "scontrol not found" in res.detail and "drain n3 by hand" in res.detail
    assert (await st.node("n3"))["status"] == "excluded"  # recorded even so
    await st.close()


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no Slurm on this machine")
async def test_slurm_real_scontrol_reports_result():
    res = await SlurmController(None, SlurmConfig(slurm_job_id="")).exclude(
        "trainguard-no-such-node", "j", "test")
    assert not res.ok and "exited" in res.detail


def test_make_controller():
    assert make_controller("local", None).name == "local"
    with pytest.raises(ValueError, match="local, slurm, kubernetes"):
        make_controller("pbs", None)


def test_kubernetes_without_its_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r"pip install 'trainguard\[kubernetes\]'"):
        make_controller("kubernetes", None)

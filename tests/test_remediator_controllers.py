"""Node exclusion controllers: local records in the state store; Slurm command lines (run for
real only where scontrol exists); the registry (the Kubernetes controller itself is tested
against an API emulator in tests/test_k8s_controller.py)."""
import shutil
import sys

import pytest

from trainguard.controllers import (LocalController, SlurmConfig, SlurmController,
                                    make_controller, slurm_drain_command)
from trainguard.state import StateStore


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

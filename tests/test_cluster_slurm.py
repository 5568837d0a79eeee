"""trainguard under a real Slurm on the one-machine cluster (``trainguard.cluster.slurm``):
slurmctld on the host, a slurmd in each node's namespace. A 2-node job submitted with sbatch
runs one ``trainguard launch`` per node through srun; when a node is powered off, the
remediator's Slurm controller drains it for the training job's Slurm id, with the evidence as
the reason (``sinfo -R``), and training goes on on the other node.

Skips (saying why) without CAP_NET_ADMIN or without Slurm (``apt-get install slurm-wlm``).
"""
from __future__ import annotations

import asyncio
import os
import shlex
import time

import pytest
from cluster_helpers import audit, wait_for

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cnet.unavailable_reason() is not None,
                                 reason=f"no network namespaces: {cnet.unavailable_reason()}"),
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]




def test_power_off_under_slurm_drains_the_node_with_the_reason(tmp_path):
    from trainguard.cluster import Cluster, ClusterConfig, training_again
    from trainguard.state import StateStore

    # SlurmdTimeout longer than the test: the drain seen is trainguard's, not Slurm's own DOWN
    c = Cluster(ClusterConfig(nodes=2, slurm=True, slurmd_timeout_s=300)).start()
    try:
        job = "c-slurm"
        argv = c.launch_argv(job, 2, None, "$(hostname)", 2, script_args=[
            "--records", c.records_dir(job), "--steps", "60", "--ckpt-every", "5",
            "--step-sleep", "0.05"])
        cmd = " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)
        script = tmp_path / "train.sbatch"
        script.write_text("#!/bin/bash\n"
                          f"srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 "
                          f"bash -c {shlex.quote('exec ' + cmd)}\n")
        env = {**c.worker_env(), "GLOO_SOCKET_IFNAME": "eth0"}
        os.environ.update(env)  # sbatch exports the submitting environment to the job
        try:
            jid = c.slurm.sbatch(str(script), "-N", "2", "--no-kill", "--requeue",
                                 "-o", str(tmp_path / "slurm-%j.out"))
        finally:
            for k in env:
                os.environ.pop(k, None)
        r = c.wait_step(job, 10, rank=3, timeout=150)
        assert r is not None, (tmp_path / f"slurm-{jid}.out").read_text()[-3000:] if (
            tmp_path / f"slurm-{jid}.out").exists() else c.slurm.job_state(jid)
        assert r["host"] == "node1"
        fault_s = c.net.power_off("node1") / 1e9
        reasons = wait_for(lambda: c.slurm.reasons().get("node1"), 40)
        assert reasons and reasons.startswith("trainguard: "), c.slurm.reasons()
        print(f"sinfo -R: node1 {reasons!r} ({time.time() - fault_s:.1f} s after the power-off)")
        # the reason is the exclusion decision's evidence, as the remediator audited it
        from trainguard.slurm_controller import slurm_drain_command

        trail = audit(c, job)
        excl = next(r for r in trail if r.get("action") == "exclude_node_and_requeue")
        assert excl["nodes"] == ["node1"]
        assert "reason=" + reasons == slurm_drain_command("node1", excl["reason"])[4]

        async def _rec():
            st = StateStore(c.stack.redis_url)
            try:
                return await st.job(job)
            finally:
                await st.close()

        # the controller acted on the training job's Slurm id, registered by its launchers
        assert asyncio.run(_rec()).slurm_job_id == jid
        assert "DRAIN" in c.slurm.run("scontrol", "show", "node", "-o", "node1")
        # trainguard went on in place on node0 (requeue=auto: no requeue)
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again and again["hosts"] == ["node0"] and again["world"] == 2, again
        assert c.slurm.job_state(jid).get("JobState") == "RUNNING"
    finally:
        c.stop()

"""trainguard under a real Slurm on the one-machine cluster (``trainguard.cluster.slurm``):
slurmctld on the host, a slurmd in each of 3 node namespaces, one cluster for the module. A job
of 2 nodes × 2 ranks (``--min-world-size 4``: it never trains smaller) submitted with sbatch
(``Cluster.sbatch``: one ``trainguard launch`` per node through srun, action mode):

* with a spare node in its allocation, a node powered off: the spare takes its ranks and
  training goes on from the step the survivors held, the node drained with the evidence as the
  reason (``sinfo -R``), the Slurm job left running;
* without a spare, a node cut off: the remediator's Slurm controller requeues the job without
  it (``scontrol requeue``, the node DOWN, ``ExcNodeList``, the 2-minute hold released) and the
  requeued job — a new run of the trainguard job — resumes at world 4 on the other nodes from
  the newest valid checkpoint; the cut-off launcher fences itself before the partition heals:
  none of its processes is left, and nothing was written into the checkpoint directory after
  the exclusion but by the new run.

Skips (saying why) without CAP_NET_ADMIN or without Slurm (``apt-get install slurm-wlm``).
About 30 s per scenario on 2 cores, plus one cluster start.
"""
from __future__ import annotations

import asyncio
import os
import re
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

CKPT_EVERY = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainguard.cluster import Cluster, ClusterConfig

    # SlurmdTimeout longer than the module: a node DOWN or drained is trainguard's doing
    c = Cluster(ClusterConfig(nodes=3, slurm=True, slurmd_timeout_s=300,
                              run_dir=str(tmp_path_factory.mktemp("cluster-slurm")))).start()
    try:
        yield c
    finally:
        c.stop()


def _submit(c, job, spares):
    return c.sbatch(job, 2, spares, 2, ckpt_dir=os.path.join(c.run_dir, f"ckpt-{job}"),
                    extra=["--min-world-size", "4"], script_args=[
                        "--records", c.records_dir(job), "--steps", "400", "--ckpt-every",
                        str(CKPT_EVERY), "--step-sleep", "0.05"])


def _started(c, job, jid):
    """The record of rank 3 at step 10 (the fault's trigger)."""
    r = c.wait_step(job, 10, rank=3, timeout=150)
    out = os.path.join(c.run_dir, "logs", f"slurm-{job}-{jid}.out")
    assert r is not None, (open(out).read()[-3000:] if os.path.exists(out)
                           else c.slurm.job_state(jid))
    return r


def _exclusion(c, job):
    return next((r for r in audit(c, job) if r.get("type") == "decision"
                 and r.get("action") == "exclude_node_and_requeue"), None)


def _record(c, job):
    from trainguard.clients.store import StateStore

    async def _q():
        st = StateStore(c.stack.redis_url)
        try:
            return await st.job(job), await st.checkpoints(job)
        finally:
            await st.close()

    return asyncio.run(_q())


def _common_step(recs, gen):
    """The newest step every rank of the generations before ``gen`` had completed."""
    old = [r for r in recs if r["gen"] < gen]
    return min(max(r["step"] for r in old if r["rank"] == k) for k in {r["rank"] for r in old})


def _cancel(c, job, jid):
    """End the test's job: marked finished first, so that trainguard reads the silence of the
    launchers that ``scancel`` kills as the end of the job, not as lost nodes."""
    from trainguard.clients.store import StateStore

    async def _fin():
        st = StateStore(c.stack.redis_url)
        try:
            await st.end_run(job, "finished")
        finally:
            await st.close()

    asyncio.run(_fin())
    c.slurm.run("scancel", jid, check=False)
    # once seen: a process of the step that outlived Slurm's signals, and the node drained
    # "Kill task failed" 60 s later; end what is left of the job, for the next test
    mine = f"--job {job} "
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and c.slurm.job_state(jid).get("JobState") in (
            "RUNNING", "COMPLETING", "CONFIGURING"):
        time.sleep(0.5)
        for n in c.net.names:
            if c.net.node(n).state == "up" and time.monotonic() > deadline - 25:
                for p in c.net.pids(n):
                    if mine in _cmdline(p) or c.records_dir(job) in _cmdline(p):
                        try:
                            os.kill(p, 9)
                        except OSError:
                            pass


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as fh:
            return fh.read().replace("\0", " ")
    except OSError:
        return ""


def _give_back(c, node):
    """``node`` powered on again, its slurmd and agent running, back in service."""
    if c.net.node(node).state == "off":
        c.net.power_on(node)
    if c.slurm.slurmd.get(node) is None or c.slurm.slurmd[node].poll() is not None:
        c.slurm.start_slurmd(node)
    if c.agents.get(node) is None or c.agents[node].poll() is not None:
        c.start_agent(node)
    c.slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)


def test_power_off_with_a_spare_node_under_sbatch(cluster):
    from trainguard.cluster import training_again
    from trainguard.scheduler.slurm.commands import slurm_drain_command

    c, job = cluster, "s-spare"
    jid = _submit(c, job, spares=1)
    try:
        victim = _started(c, job, jid)["host"]
        fault_s = c.net.power_off(victim) / 1e9
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again, c.steps(job)[-5:]
        print(f"power-off of {victim}: every rank training again "
              f"{again['t'] - fault_s:.2f} s later on {again['hosts']}")
        # the spare node of the allocation took the node's ranks: the world kept its size
        alloc = {victim, *again["hosts"]}
        assert len(alloc) == 3 and victim not in again["hosts"] and again["world"] == 4, again
        recs = c.steps(job)
        # from the step the survivors held (recovery from healthy peers), or a checkpoint's
        s0 = again["first_step"]
        assert s0 - 1 == _common_step(recs, again["gen"]) or (s0 - 1) % CKPT_EVERY == 0, s0
        assert not [r for r in recs if r["host"] == victim and r["t"] > fault_s + 0.5]
        # drained for the training job's Slurm id, with the exclusion's evidence as the reason
        reason = wait_for(lambda: c.slurm.reasons().get(victim), 20)
        excl = _exclusion(c, job)
        assert excl and excl["nodes"] == [victim], audit(c, job)
        assert "reason=" + reason == slurm_drain_command(victim, excl["reason"])[4]
        assert "DRAIN" in c.slurm.run("scontrol", "show", "node", "-o", victim)
        rec, _ = _record(c, job)
        assert rec.slurm_job_id == jid and rec.run_id == f"{jid}.0"
        # trainguard went on in place: no requeue
        st = c.slurm.job_state(jid)
        assert (st.get("JobState"), st.get("Restarts")) == ("RUNNING", "0"), st
    finally:
        # powered on first: until its slurmd answers, the job stays COMPLETING on it
        _give_back(c, victim if "victim" in locals() else "node1")
        _cancel(c, job, jid)
        for n, why in c.slurm.reasons().items():
            if "Kill task failed" in why:
                c.slurm.run("scontrol", "update", f"nodename={n}", "state=resume", check=False)
        c.slurm.wait_state(c.net.names, ("idle",), 60)


def test_partition_without_a_spare_requeues_and_the_cut_off_node_is_fenced(cluster):
    from trainguard.cluster import training_again

    c, job = cluster, "s-requeue"
    ckpt_dir = os.path.join(c.run_dir, f"ckpt-{job}")
    jid = _submit(c, job, spares=0)
    victim = None
    try:
        victim = _started(c, job, jid)["host"]
        old_hosts = {r["host"] for r in c.steps(job)}
        fault_s = c.net.partition(victim) / 1e9
        # the requeued job, a new run of the trainguard job, trains at world 4 elsewhere
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again, (c.steps(job)[-5:], c.slurm.job_state(jid))
        excl = _exclusion(c, job)
        assert excl and excl["nodes"] == [victim] and excl["world_size"] == 2, audit(c, job)
        assert "requeues the job without" in excl["reason"]
        decided_s = excl["ts"] / 1e9
        print(f"partition of {victim}: decision {decided_s - fault_s:.2f} s after the fault, "
              f"training again {again['t'] - decided_s:.2f} s after the decision "
              f"(requeue path) on {again['hosts']}")
        assert again["world"] == 4 and victim not in again["hosts"], again
        assert set(again["hosts"]) != old_hosts  # another allocation
        st = c.slurm.job_state(jid)
        assert st.get("Restarts") == "1" and victim in st.get("ExcNodeList", ""), \
            (st, audit(c, job))
        assert c.slurm.reasons()[victim].startswith("trainguard: "), c.slurm.reasons()
        rec, ckpts = _record(c, job)
        assert rec.run_id == f"{jid}.1" and rec.generation == again["gen"], rec
        # resumed from the newest checkpoint the validator found valid
        valid = [e["step"] for e in ckpts if e["status"] == "valid"
                 and int(re.search(r"_g(\d+)", e["path"]).group(1)) < again["gen"]]
        assert valid and again["first_step"] - 1 == max(valid), (again, ckpts)
        # trainguard's requeue, not Slurm's own of a lost node (minutes); the seconds are
        # bench/cluster.py's (a run at load 12 once took 30.2 s)
        assert again["t"] - decided_s < 90
        # the restore from disk passed its loss check: the new run goes on (no stop decision,
        # which would cancel the requeued job; it came ≈ 1 s after the first step when it did)
        time.sleep(3.0)
        assert not [r for r in audit(c, job) if r.get("action") == "stop_job_notify_user"], \
            audit(c, job)
        assert c.slurm.job_state(jid).get("JobState") == "RUNNING"
        # cut off for more than its lease (10 s): the launcher stopped its ranks and exited
        # while the node is still cut off (Slurm cannot reach it to do so)
        node, agent = c.net.node(victim), c.agents[victim].pid

        def left():
            return [p for p in c.net.pids(victim) if p not in (node.init.pid, agent)
                    and "trainguard" in _cmdline(p)]
        assert wait_for(lambda: not left(), fault_s + 20 - time.time()), \
            [_cmdline(p) for p in left()]
        print(f"{victim}'s launcher and ranks gone {time.time() - fault_s:.1f} s after the cut")
        c.net.heal(victim)
        time.sleep(2.0)  # healed: anything left of the old run would act now
        assert not left()
        # nothing of the old run was written into the checkpoint directory after the exclusion
        late = []
        for root, _, files in os.walk(ckpt_dir):
            for f in files:
                p = os.path.join(root, f)
                gen = re.search(r"step_\d+_g(\d+)", p)
                if os.path.getmtime(p) > decided_s and (gen is None
                                                        or int(gen.group(1)) < again["gen"]):
                    late.append(p)
        assert not late, late
    finally:
        _cancel(c, job, jid)
        if victim:
            c.net.heal(victim)


def test_a_job_on_one_node_cut_off_is_requeued_on_another(cluster):
    """A job whose every rank is on one node (1 node × 2 ranks, no spare): excluding the node
    leaves no world in the allocation, so the decision is the requeue (world 0) and the job
    restarts on another node from the newest valid checkpoint, not a stop."""
    from trainguard.cluster import training_again

    c, job = cluster, "s-lone"
    for n in c.net.names:  # what the tests before left drained or down
        if c.net.node(n).state == "partitioned":
            c.net.heal(n)
        _give_back(c, n)
    c.slurm.wait_state(c.net.names, ("idle",), 60)
    jid = c.sbatch(job, 1, 0, 2, ckpt_dir=os.path.join(c.run_dir, f"ckpt-{job}"),
                   extra=["--min-world-size", "2"], script_args=[
                       "--records", c.records_dir(job), "--steps", "400", "--ckpt-every",
                       str(CKPT_EVERY), "--step-sleep", "0.05"])
    victim = None
    try:
        r = c.wait_step(job, 10, rank=1, timeout=150)
        assert r is not None, c.slurm.job_state(jid)
        victim = r["host"]
        fault_s = c.net.partition(victim) / 1e9
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again, (c.steps(job)[-5:], c.slurm.job_state(jid), audit(c, job))
        excl = _exclusion(c, job)
        assert excl and excl["nodes"] == [victim] and excl["world_size"] == 0, audit(c, job)
        assert "no node of the job is left" in excl["reason"], excl["reason"]
        print(f"one-node job, {victim} cut off: training again "
              f"{again['t'] - excl['ts'] / 1e9:.2f} s after the decision on {again['hosts']}")
        assert again["world"] == 2 and victim not in again["hosts"], again
        st = c.slurm.job_state(jid)
        assert st.get("Restarts") == "1" and victim in st.get("ExcNodeList", ""), st
        assert not [d for d in audit(c, job) if d.get("action") == "stop_job_notify_user"]
        # alone on its node, the cut-off run trained on (and saved) until its lease ran out;
        # the new run resumed from the newest checkpoint saved before generation 0 ended (the
        # exclusion), nothing the fenced run wrote later, and nothing had been deleted
        from trainguard.checkpoint import format as fmt

        rec, _ = _record(c, job)
        end = int(rec.generation_ends["0"])
        root = os.path.join(c.run_dir, f"ckpt-{job}", job)
        made = {e.step: int(fmt.read_manifest(e.path)["created_ns"])
                for e in fmt.list_checkpoints(root) if e.committed and e.generation == 0}
        before = [s for s, ns in made.items() if ns <= end]
        assert min(made) == CKPT_EVERY and before, made  # retention deleted nothing
        assert again["first_step"] - 1 == max(before), (again, made, end)
        late = sorted(s for s, ns in made.items() if ns > end)
        print(f"resumed from step {max(before)}; passed over, saved after the exclusion by the "
              f"cut-off run: {late}")
    finally:
        _cancel(c, job, jid)
        if victim:
            c.net.heal(victim)

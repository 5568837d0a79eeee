"""The Slurm watcher against a real Slurm (``trainguard.cluster``: slurmctld on the host, a
slurmd per namespaced node) and real NATS/Valkey and services (detector, attributor, the
watcher): a job submitted with the comment directive is registered with its Slurm id, nodes and
directive; a node an operator sets DOWN is a ``slurm.node`` event, a ``node_lost`` anomaly for
the job's ranks on it and a verdict naming the node; a drain by trainguard itself is reported as
such and is no anomaly. No training runs: the job's ranks are registered as its launchers would
(``add_members``), so the whole scenario takes one cluster start.

Skips (saying why) without CAP_NET_ADMIN or without Slurm (``apt-get install slurm-wlm``).
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cnet.unavailable_reason() is not None,
                                 reason=f"no network namespaces: {cnet.unavailable_reason()}"),
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]

JOB = "w-e2e"


async def _until(fn, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await fn() if asyncio.iscoroutinefunction(fn) else fn()
        if got:
            return got
        await asyncio.sleep(every)
    return None


def test_directive_registration_and_a_node_set_down_under_a_real_slurm():
    from trainguard.clients.bus import Bus
    from trainguard.cluster import Cluster, ClusterConfig
    from trainguard.clients.store import StateStore

    t0 = time.monotonic()
    c = Cluster(ClusterConfig(nodes=2, slurm=True, slurmd_timeout_s=300,
                              services=("detector", "attributor", "slurm_watch"),
                              env={"TG_SLURM_POLL_S": "0.5"})).start()
    try:
        async def scenario():
            got: list = []
            bus = await Bus(c.stack.nats_url, "e2e-watch").connect()
            st = StateStore(c.stack.redis_url)
            try:
                for subject in ("tg.job.*.slurm", "tg.node.*.slurm", "tg.job.*.anomaly",
                                "tg.node.*.anomaly", "tg.job.*.verdict"):
                    await bus.subscribe(subject, lambda s, ev: got.append((s, ev)))
                directive = {"trainguard": {"mode": "action", "retry_budget": 3, "job": JOB}}
                jid = await asyncio.to_thread(
                    c.slurm.sbatch, None, "-N", "2", "--no-kill", "--job-name", "tg-e2e",
                    f"--comment={json.dumps(directive)}", "--wrap", "sleep 120",
                    "-o", "/dev/null")

                async def registered():
                    rec = await st.job(JOB)
                    return rec if rec.slurm_state == "RUNNING" else None
                rec = await _until(registered, 15)
                assert rec is not None, (await st.job(JOB), got)
                assert (rec.slurm_job_id, rec.slurm_nodes, rec.slurm_partition) == (
                    jid, ["node0", "node1"], "tg")
                assert rec.slurm_directive == {"mode": "action", "retry_budget": 3, "job": JOB}
                assert rec.slurm_directive_error == "" and rec.mode == ""  # the launchers'
                # the job's ranks, as its launchers register them; the detector reads them
                await st.add_members(JOB, [{"rank": r, "node": f"node{r // 2}",
                                            "local_rank": r % 2} for r in range(4)])
                await asyncio.sleep(2.5)  # the detector's record refresh (job_refresh_s 2 s)

                await asyncio.to_thread(c.slurm.run, "scontrol", "update", "nodename=node0",
                                        "state=drain", "reason=trainguard: e2e exclusion")
                await asyncio.to_thread(c.slurm.run, "scontrol", "update", "nodename=node1",
                                        "state=down", "reason=operator: e2e")
                t_down = time.monotonic()

                def verdict():
                    return [ev for s, ev in got if s == f"tg.job.{JOB}.verdict"]
                assert await _until(verdict, 10), got
                print(f"node1 DOWN → verdict in {time.monotonic() - t_down:.2f} s")
                await asyncio.sleep(1.0)  # anything else that would follow
                by = {}
                for s, ev in got:
                    by.setdefault(s, []).append(ev)
                node1 = [ev for ev in by.get("tg.node.node1.slurm", []) if ev.change == "down"]
                assert len(node1) == 1 and node1[0].jobs == [JOB] and \
                    node1[0].slurm_jobs == [jid] and node1[0].reason == "operator: e2e"
                drain = by.get("tg.node.node0.slurm", [])
                assert [(d.change, d.by_trainguard) for d in drain] == [("drain", True)]
                jobev = [str(ev.change) for ev in by.get(f"tg.job.{JOB}.slurm", [])]
                assert jobev[:2] == ["registered", "started"] or jobev[:1] == ["registered"], \
                    jobev
                anomalies = by.get(f"tg.job.{JOB}.anomaly", [])
                assert [(a.kind, a.culprit.ranks, a.culprit.nodes) for a in anomalies] == [
                    ("node_lost", [2, 3], ["node1"])], anomalies  # once, not per source
                # from whichever source came first: the node's DOWN (with its reason) or the
                # job's lost node (the same pattern: one anomaly either way)
                a0 = anomalies[0].detail
                assert a0["rule"] in ("slurm.node:down", "slurm.job:nodes_lost"), a0
                if a0["rule"] == "slurm.node:down":
                    assert a0["slurm"]["reason"] == "operator: e2e", a0
                assert not [a for a in by.get("tg.node.node0.anomaly", [])]  # our own drain
                v = verdict()
                assert len(v) == 1 and (v[0].fault_class, v[0].culprit.nodes) == (
                    "node_lost", ["node1"])
                if "nodes_lost" in jobev:  # Slurm took node1 out of the --no-kill job too
                    lost = [ev for ev in by[f"tg.job.{JOB}.slurm"] if ev.change == "nodes_lost"]
                    assert lost[0].lost_nodes == ["node1"]
            finally:
                await bus.close()
                await st.close()

        asyncio.run(scenario())
    finally:
        c.stop()
    print(f"whole test {time.monotonic() - t0:.1f} s")

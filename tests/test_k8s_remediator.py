"""The remediator with the Kubernetes node controller, on a real NATS and Valkey, against the
API emulator (``tests/k8s_fixtures/emulator.py``): a launcher lost on a healthy node makes the
decision ``restart_workers`` carried out as the deletion of that one pod — asserted on the
DELETE the emulator received — and never a cordon or an eviction; the controller leaves a
replacement pod made after the fault alone."""
from __future__ import annotations

from k8s_fixtures.emulator import cluster
from test_remediator_service import client, register, remediator, wait_for
from trainguard.scheduler.k8s.api import KubeConfig
from trainguard.scheduler.k8s.controller import KubernetesNodeController
from trainguard.schemas import Verdict, subjects
from trainguard.clients.store import StateStore

NODE, OTHER = "ip-10-0-1-2.ec2.internal", "ip-10-0-1-3.ec2.internal"
MEMBERS = [{"rank": 0, "node": OTHER, "local_rank": 0}, {"rank": 1, "node": OTHER, "local_rank": 1},
           {"rank": 2, "node": NODE, "local_rank": 0}, {"rank": 3, "node": NODE, "local_rank": 1}]
FAULT_NS = 1_767_225_600 * 10**9 + 5 * 10**9  # 2026-01-01T00:00:05Z


def _controller(c, tmp_path) -> KubernetesNodeController:
    return KubernetesNodeController(None, KubeConfig(
        kubeconfig=str(c.kubeconfig(tmp_path / "kubeconfig")), evict_backoff_s=0.05))


async def test_a_lost_launcher_pod_is_deleted_and_its_node_left_in_service(servers, redis_db,
                                                                          tmp_path):
    store = StateStore(redis_db)
    await register(store, "llm", members=MEMBERS)
    async with cluster() as c:
        c.add_node(NODE)
        c.add_node(OTHER)
        c.add_pod("llm-workers-0-0-abcde", OTHER, "llm")
        c.add_pod("llm-workers-0-1-fghij", NODE, "llm")
        ctl = _controller(c, tmp_path)
        try:
            async with remediator(servers, redis_db, controller=ctl), \
                    client(servers, "llm") as bus:
                v = Verdict(job="llm", fault_class="crash", layer="infrastructure",
                            culprit={"ranks": [2, 3], "nodes": [NODE]}, generation=0,
                            first_ts=FAULT_NS,
                            detail={"root_kind": "launcher_lost", "launcher_lost": [NODE]})
                await bus.publish(subjects.job("llm", "verdict"), v)
                assert await wait_for(lambda: bus.got["action"], timeout=10.0)
                [d] = bus.got["decision"]
                [ar] = bus.got["action"]
        finally:
            await ctl.kube.close()
        assert (d.action, d.execute, d.nodes, d.ranks) == ("restart_workers", True, [NODE],
                                                            [2, 3])
        assert "JobSet, PyTorchJob" in d.reason
        assert ar.ok and ar.executor == "controller:kubernetes" and ar.node == NODE, ar.detail
        assert [r.url.path for r in c.requests("DELETE")] == [
            "/api/v1/namespaces/train/pods/llm-workers-0-1-fghij"]
        assert not c.pod_exists("train", "llm-workers-0-1-fghij")
        assert c.pod_exists("train", "llm-workers-0-0-abcde")      # the other node's pod
        assert c.requests("PATCH") == [] and c.evictions == []    # no cordon, no eviction
        assert "unschedulable" not in c.node(NODE).get("spec", {})
    await store.close()


async def test_restart_pod_leaves_a_pod_being_replaced_already_alone(tmp_path):
    async with cluster() as c:
        c.add_node(NODE)
        c.add_pod("llm-workers-0-1-new", NODE, "llm", created="2026-01-01T00:00:09Z")
        c.add_pod("llm-workers-0-1-failed", NODE, "llm", phase="Failed")  # the Job replaces it
        c.add_pod("llm-pt-worker-0", NODE, "llm", started="2026-01-01T00:00:07Z")  # OnFailure
        ctl = _controller(c, tmp_path)
        res = await ctl.restart_pod(NODE, "llm", before_ns=FAULT_NS)
        assert res.ok, res.detail
        assert sorted(x["why"] for x in res.commands) == [
            "Failed: its controller replaces it", "created after the fault: a replacement",
            "its container restarted after the fault (restartPolicy OnFailure)"]
        assert c.requests("DELETE") == []
        c.add_pod("llm-workers-0-1-old", NODE, "llm", created="2026-01-01T00:00:01Z")
        res = await ctl.restart_pod(NODE, "llm", before_ns=FAULT_NS)
        await ctl.kube.close()
        assert res.ok, res.detail
        assert [r.url.path for r in c.requests("DELETE")] == [
            "/api/v1/namespaces/train/pods/llm-workers-0-1-old"]
        assert c.pod_exists("train", "llm-workers-0-1-new")


def test_detector_attributor_and_remediator_offline_restart_the_lost_pods_ranks():
    """The three services' reducers (``trainguard.tools.replay_decide``), fed a recording: the pod on
    ``NODE`` (launcher, ranks 2 and 3) falls silent at 2 s while the node's agent and the other
    pod go on. The decision restarts that pod's ranks and excludes no node; outside Kubernetes
    (this replay's controller is the local one) its reason says to start the launcher again."""
    from trainguard import schemas
    from trainguard.tools.recording import Record
    from trainguard.tools.replay_decide import decide

    t0 = 1_767_225_600 * 10**9
    recs = []

    def put(t, subject, ev):
        recs.append(Record(t0 + int(t * 1e9), subject, schemas.encode(ev)))

    for k in range(0, 17):
        t = k * 0.5
        for node in (NODE, OTHER):
            put(t, subjects.node(node, "heartbeat"),
                schemas.NodeHeartbeat(node=node, role="agent", ts=t0 + int(t * 1e9)))
        for node, ranks in ((OTHER, (0, 1)), (NODE, (2, 3))):
            if node == NODE and t > 2.0:
                continue  # this pod is gone: its launcher and ranks say nothing more
            put(t, subjects.launcher(node, "llm"), schemas.NodeHeartbeat(
                node=node, job="llm", role="launcher", ts=t0 + int(t * 1e9)))
            for r in ranks:
                put(t, subjects.rank_hb("llm", r), schemas.RankHeartbeat(
                    job="llm", rank=r, node=node, local_rank=r % 2, step=k, collective_seq=k,
                    phase="train", ts=t0 + int(t * 1e9)))
    res = decide(recs, job_records={"llm": {"mode": "action", "world_size": 4, "runs": 1,
                                            "status": "running", "members": MEMBERS}})
    [d] = res.replayed
    assert (d.action, d.nodes, d.ranks, d.fault_class) == ("restart_workers", [NODE], [2, 3],
                                                            "crash"), d.reason
    assert f"launcher_lost on {NODE}" in d.reason and "start the launcher" in d.reason

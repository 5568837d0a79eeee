"""The Kubernetes node controller against an API emulator (``tests/k8s_fixtures/emulator.py``:
kmock, real API paths, stored objects): cordon, suspect label, eviction of the trainguard pods
(and only those), a PodDisruptionBudget's 429 retried with backoff and reported, the deletion of
one failed pod, readmission only after a canary — each asserted on what the emulator received
and stores. Credentials come from a real kubeconfig file pointing at the emulator."""
from __future__ import annotations

import json

import pytest

from k8s_fixtures.emulator import cluster
from trainguard.scheduler.local import make_controller
from trainguard.scheduler.k8s.api import Kube, KubeConfig, KubeUnavailable, load_client
from trainguard.scheduler.k8s.controller import KubernetesNodeController
from trainguard.clients.store import StateStore

NODE = "ip-10-0-1-2.ec2.internal"  # EKS: a dotted name, as spec.nodeName gives it


def _controller(c, tmp_path, state=None, **kw) -> KubernetesNodeController:
    cfg = KubeConfig(kubeconfig=str(c.kubeconfig(tmp_path / "kubeconfig")),
                     evict_backoff_s=0.05, **kw)
    return KubernetesNodeController(state, cfg)


def _patches(c, path):
    return [r.data for r in c.requests("PATCH") if r.url.path == path]


async def test_exclude_cordons_labels_and_evicts_only_trainguard_pods(tmp_path, redis_db):
    st = StateStore(redis_db)
    async with cluster() as c:
        c.add_node(NODE)
        c.add_node("ip-10-0-1-3.ec2.internal")
        c.add_pod("llm-workers-0-0", NODE, "llm")
        c.add_pod("llm-workers-0-1", "ip-10-0-1-3.ec2.internal", "llm")
        c.add_pod("someone-else", NODE, "other", managed=False)
        ctl = _controller(c, tmp_path, st)
        try:
            res = await ctl.exclude(NODE, "llm", "gpu_xid 79: GPU fell off the bus")
        finally:
            await ctl.kube.close()
        assert res.ok, res.detail
        node = c.node(NODE)
        assert node["spec"]["unschedulable"] is True
        assert node["metadata"]["labels"]["trainguard.io/suspect"] == "true"
        assert "gpu_xid 79" in node["metadata"]["annotations"]["trainguard.io/suspect-reason"]
        assert node["metadata"]["labels"]["kubernetes.io/hostname"] == NODE  # merged, not replaced
        patches = _patches(c, f"/api/v1/nodes/{NODE}")
        assert {"spec": {"unschedulable": True}} in patches
        # the official client sends a strategic merge patch
        hdrs = [r.headers.get("Content-Type") for r in c.requests("PATCH")]
        assert all(h == "application/strategic-merge-patch+json" for h in hdrs), hdrs
        assert c.evictions == [("train", "llm-workers-0-0", 201)]  # not the other node's, not
        assert not c.pod_exists("train", "llm-workers-0-0")        # the unmanaged pod
        assert c.pod_exists("train", "someone-else")
        body = [r.data for r in c.requests("POST") if r.url.path.endswith("/eviction")][0]
        assert body["kind"] == "Eviction" and body["apiVersion"] == "policy/v1" and body["metadata"] == {
            "name": "llm-workers-0-0", "namespace": "train"}
        assert (await st.node(NODE))["status"] == "excluded"
    await st.close()


async def test_a_disruption_budget_429_is_retried_with_backoff_and_reported(tmp_path):
    async with cluster() as c:
        c.add_node(NODE)
        c.add_pod("llm-workers-0-0", NODE, "llm")
        c.pdb_blocks = 2  # the budget allows the eviction on the third try
        ctl = _controller(c, tmp_path)
        res = await ctl.exclude(NODE, "llm", "node_lost")
        assert res.ok, res.detail
        assert [s for _, _, s in c.evictions] == [429, 429, 201]
        ev = [x for x in res.commands if x["path"].endswith("/eviction")][0]
        assert ev["attempts"] == 3 and ev["blocked"] == 2
        # a budget that never allows it: reported as failed, never ignored
        c.add_pod("llm-workers-0-1", NODE, "llm")
        c.pdb_blocks = 100
        ctl.kube.cfg.evict_attempts = 3
        res = await ctl.exclude(NODE, "llm", "node_lost")
        await ctl.kube.close()
        assert not res.ok
        assert "disruption budget" in res.detail and "gave up after 3 attempts" in res.detail
        assert c.pod_exists("train", "llm-workers-0-1")


async def test_restart_pod_deletes_only_the_failed_pod_of_the_job(tmp_path):
    async with cluster() as c:
        c.add_node(NODE)
        c.add_node("n2")
        c.add_pod("llm-workers-0-0", NODE, "llm")
        c.add_pod("llm-workers-0-1", "n2", "llm")
        c.add_pod("other-workers-0-0", NODE, "other")
        ctl = _controller(c, tmp_path)
        res = await ctl.restart_pod(NODE, "llm")
        await ctl.kube.close()
        assert res.ok, res.detail
        deletes = [r.url.path for r in c.requests("DELETE")]
        assert deletes == ["/api/v1/namespaces/train/pods/llm-workers-0-0"]
        assert c.pod_exists("train", "llm-workers-0-1") and c.pod_exists("train",
                                                                        "other-workers-0-0")
        assert not c.node(NODE).get("spec", {}).get("unschedulable")  # no cordon for a restart


async def test_readmit_only_after_the_canary_passes(tmp_path):
    async with cluster() as c:
        c.add_node(NODE, ready=False)
        ctl = _controller(c, tmp_path)
        await ctl.exclude(NODE, "llm", "xid 79")
        res = await ctl.readmit(NODE)  # default canary: Ready=False → stays cordoned
        assert not res.ok and "not Ready" in res.detail
        assert c.node(NODE)["spec"]["unschedulable"] is True
        res = await ctl.readmit(NODE, canary=lambda n: _ok(n))
        await ctl.kube.close()
        assert res.ok, res.detail
        node = c.node(NODE)
        assert node["spec"]["unschedulable"] is False
        assert "trainguard.io/suspect" not in node["metadata"]["labels"]
        assert {"spec": {"unschedulable": False}} in _patches(c, f"/api/v1/nodes/{NODE}")


async def _ok(node):
    return True, f"nvidia-smi and an all-reduce passed on {node}"


async def test_kubeconfig_and_missing_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeUnavailable, match="no Kubernetes credentials"):
        await load_client(KubeConfig(kubeconfig=str(tmp_path / "missing")))
    async with cluster() as c:
        c.add_node(NODE)
        kube = Kube(KubeConfig(kubeconfig=str(c.kubeconfig(tmp_path / "kc"))))
        assert (await kube.node(NODE))["metadata"]["name"] == NODE
        await kube.close()
        got = [r for r in c.requests("GET") if r.url.path == f"/api/v1/nodes/{NODE}"][0]
        assert got.headers.get("Authorization") == "Bearer test-token"  # the kubeconfig user


async def test_outside_a_cluster_the_result_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ctl = KubernetesNodeController(None, KubeConfig(kubeconfig=str(tmp_path / "none")))
    res = await ctl.exclude(NODE, "j", "r")
    assert not res.ok and f"kubectl cordon {NODE}" in res.detail
    json.dumps(res.commands)  # audit-trail ready


def test_registered_as_the_kubernetes_controller():
    assert isinstance(make_controller("kubernetes", None), KubernetesNodeController)


async def test_the_readmit_command_runs_the_canary_command_before_uncordoning(tmp_path,
                                                                             monkeypatch):
    from trainguard.scheduler.k8s.__main__ import readmit

    async with cluster() as c:
        c.add_node(NODE)
        monkeypatch.setenv("KUBECONFIG", str(c.kubeconfig(tmp_path / "kc")))
        monkeypatch.delenv("REDIS_URL", raising=False)
        ctl = _controller(c, tmp_path)
        await ctl.exclude(NODE, "llm", "xid 79")
        await ctl.kube.close()
        # the canary sees the node's name; a failing one keeps it cordoned and labelled
        failing = f'test "$TG_NODE" = {NODE} && echo "GPU 3 failed the all-reduce" && exit 4'
        assert await readmit([NODE, "--canary-cmd", failing]) == 1
        node = c.node(NODE)
        assert node["spec"]["unschedulable"] is True
        assert node["metadata"]["labels"]["trainguard.io/suspect"] == "true"
        assert await readmit([NODE, "--canary-cmd", f'test "$TG_NODE" = {NODE}']) == 0
        node = c.node(NODE)
        assert node["spec"]["unschedulable"] is False
        assert "trainguard.io/suspect" not in node["metadata"]["labels"]

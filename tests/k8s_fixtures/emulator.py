"""A Kubernetes API emulator for the tests: ``kmock.KubernetesEmulator`` (PyPI ``kmock``), which
answers the real API paths (``/api/v1/nodes/<name>``, ``/api/v1/pods``, ``…/pods/<pod>``) from
objects it stores and patches, and records every request it received. The Eviction subresource
(``POST …/pods/<pod>/eviction``) is answered here as the API server does: ``201`` with a
``Status`` and the pod deleted, or ``429 TooManyRequests`` while a disruption budget forbids it
(``Cluster.pdb_blocks``). Objects are shaped as in the Kubernetes API reference (v1 Node, Pod
with a JobSet owner), and the official client deserialises them into its models (a missing
required field such as ``spec.containers`` fails there)."""
from __future__ import annotations

import contextlib
import datetime
from pathlib import Path
from typing import Any

import kmock
from kmock import resource, subresource

NODES = resource("", "v1", "nodes")
PODS = resource("", "v1", "pods")


def node_object(name: str, ready: bool = True) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1",
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "node.kubernetes.io/instance-type": "p5.48xlarge"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"providerID": f"aws:///us-east-1a/i-{abs(hash(name)) % 10**8:08d}"},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                   "reason": "KubeletReady", "lastHeartbeatTime": now,
                                   "lastTransitionTime": now,
                                   "message": "kubelet is posting ready status"}],
                   "addresses": [{"type": "InternalIP", "address": "10.0.1.2"},
                                 {"type": "Hostname", "address": name}],
                   "capacity": {"cpu": "192", "memory": "2097152Mi", "nvidia.com/gpu": "8"},
                   "allocatable": {"cpu": "191", "memory": "2000000Mi", "nvidia.com/gpu": "8"}},
    }


def pod_object(name: str, node: str, job: str, namespace: str = "train",
               managed: bool = True, created: str = "2026-01-01T00:00:00Z",
               phase: str = "Running", started: str | None = None) -> dict[str, Any]:
    """A Pod of ``job`` on ``node``; ``started``: when its container last started (a kubelet
    restart in place shows as a later time and a restart count of 1)."""
    status: dict[str, Any] = {"phase": phase, "podIP": "10.1.0.7"}
    if started is not None:
        status["containerStatuses"] = [{
            "name": "trainer", "image": "registry.example/trainguard:1",
            "imageID": "registry.example/trainguard@sha256:0", "ready": True,
            "restartCount": 1, "state": {"running": {"startedAt": started}}}]
    labels = {"jobset.sigs.k8s.io/jobset-name": job,
              "jobset.sigs.k8s.io/replicatedjob-name": "workers",
              "batch.kubernetes.io/job-name": f"{job}-workers-0"}
    if managed:
        labels |= {"trainguard.io/managed": "true", "trainguard.io/job": job}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "creationTimestamp": created, "labels": labels,
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                          "name": f"{job}-workers-0", "uid": f"uid-{job}-job",
                                          "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"nodeName": node, "restartPolicy": "Never",
                 "containers": [{"name": "trainer", "image": "registry.example/trainguard:1",
                                 "command": ["trainguard", "launch"],
                                 "env": [{"name": "TG_NODE", "valueFrom": {"fieldRef": {
                                     "apiVersion": "v1", "fieldPath": "spec.nodeName"}}}]}]},
        "status": status,
    }


class Cluster:
    """The emulator, its URL and what it received. ``pdb_blocks``: how many evictions (in all)
    to answer 429 before allowing them; ``on_evict(ns, name)`` is called on an allowed one."""

    def __init__(self, km: Any):
        self.km = km
        self.url = str(km.url).rstrip("/")
        self.pdb_blocks = 0
        self.evictions: list[tuple[str, str, int]] = []  # (ns, pod, HTTP status answered)
        self.on_evict = None
        km["post", PODS, subresource("eviction")] << self._evict

    def _evict(self, request: Any) -> Any:
        ns, name = request.namespace, request.name
        if self.pdb_blocks > 0:
            self.pdb_blocks -= 1
            self.evictions.append((ns, name, 429))
            return kmock.Response(status=429, payload={
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "Cannot evict pod as it would violate the pod's disruption budget.",
                "reason": "TooManyRequests", "code": 429,
                "details": {"causes": [{"reason": "DisruptionBudget", "message":
                            "The disruption budget train-pdb needs 2 healthy pods and has 2 "
                            "currently"}]}})
        self.evictions.append((ns, name, 201))
        obj = self._pod(ns, name)
        if obj is not None and not obj.deleted:
            obj.delete()
        if self.on_evict is not None:
            self.on_evict(ns, name)
        return kmock.Response(status=201, payload={"kind": "Status", "apiVersion": "v1",
                                                   "metadata": {}, "status": "Success",
                                                   "code": 201})

    def add_node(self, name: str, **kw: Any) -> None:
        self.km.objects[NODES, None, name] = node_object(name, **kw)

    def add_pod(self, name: str, node: str, job: str, **kw: Any) -> None:
        obj = pod_object(name, node, job, **kw)
        self.km.objects[PODS, obj["metadata"]["namespace"], name] = obj

    def node(self, name: str) -> dict[str, Any]:
        return dict(self.km.objects[NODES, None, name].raw)

    def _pod(self, ns: str, name: str) -> Any:
        key = (PODS, ns, name)
        return self.km.objects[key] if key in self.km.objects else None

    def pod_exists(self, ns: str, name: str) -> bool:
        obj = self._pod(ns, name)
        return obj is not None and not obj.deleted

    def requests(self, method: str | None = None) -> list[Any]:
        return [r for r in self.km if method is None or str(r.method).upper().endswith(method)]

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig file for this emulator (what ``KUBECONFIG`` points at)."""
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: emulator
  cluster: {{server: "{self.url}"}}
users:
- name: tester
  user: {{token: "test-token"}}
contexts:
- name: emulator
  context: {{cluster: emulator, user: tester}}
current-context: emulator
""")
        return path


@contextlib.asynccontextmanager
async def cluster():
    async with kmock.KubernetesEmulator() as km, kmock.Server(km):
        yield Cluster(km)

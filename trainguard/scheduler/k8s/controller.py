"""The Kubernetes node controller: what the remediator's ``exclude_node_and_requeue`` does on a
cluster (``TG_NODE_CONTROLLER=kubernetes``, registered in ``trainguard.scheduler.local``).

``exclude(node, job, reason)``:

1. records the exclusion in the state store (as every controller does);
2. cordons the node (``spec.unschedulable = true``) and labels it ``trainguard.io/suspect=true``
   with the reason in the annotation ``trainguard.io/suspect-reason`` (the reputation the
   scheduler and operators see: ``kubectl get nodes -l trainguard.io/suspect``);
3. evicts the trainguard-managed training pods on it through the Eviction API, so their
   controller (JobSet, PyTorchJob) recreates them elsewhere; a PodDisruptionBudget that answers
   HTTP 429 is retried with backoff and, when it still forbids the eviction, the result is not
   ``ok`` and says so (``trainguard.scheduler.k8s.api.Kube.evict``).

``restart_pod(node, job, before_ns)`` deletes only the failed pod of a job on a node (one created
before the fault) and lets the job's controller recreate it; the remediator calls it when a
job's launcher is lost while its node is healthy (``remediator.policy_table.POD_RESTARTS``), and
never cordons the node for it. ``readmit(node, canary)`` (``NodeController.readmit``: the same
reputation and policy as every controller) uncordons a suspect node and removes its label only
when the policy allows it and ``canary(node)`` passes (default: the node's ``Ready`` condition is
``True`` and it has no ``trainguard.io/drain-requested`` annotation); a failing canary or a
repeat offender keeps it cordoned with the evidence in ``trainguard.io/suspect-reason``. Node
names are Kubernetes names as the downward API gives them (``spec.nodeName``), dots included.

Like every controller it never raises for an API failure: ``ok`` is False, ``detail`` says what
to do, and ``commands`` lists the requests made, for the audit trail.
"""
from __future__ import annotations

import datetime
from typing import Any

from trainguard.scheduler.base import ControllerResult, NodeController
from trainguard.core.reputation import NodeView
from trainguard.clients.store import StateStore

from trainguard.scheduler.k8s.api import (DRAIN_REQUESTED, JOB_LABEL, OWNER_LABELS, SUSPECT_LABEL, SUSPECT_REASON, Kube,
                  KubeConfig)

def _req(method: str, path: str, **extra: Any) -> dict[str, Any]:
    return {"method": method, "path": path, **extra}


class KubernetesNodeController(NodeController):
    """Cordon, label and drain a node through the API server (see the module docstring).
    The service account needs ``get``/``list``/``patch`` on nodes, ``list``/``delete`` on pods
    and ``create`` on ``pods/eviction`` (deploy/kubernetes/base/rbac.yaml)."""

    name = "kubernetes"
    restarts_pods = True

    def __init__(self, state: StateStore | None = None, config: KubeConfig | None = None,
                 kube: Kube | None = None):
        super().__init__(state)
        self.kube = kube or Kube(config)

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        path = f"/api/v1/nodes/{node}"
        cmds: list[Any] = [_req("PATCH", path, body={"spec": {"unschedulable": True}})]
        try:
            await self.kube.cordon(node)
            why = " ".join(f"{job}: {reason}".split())[:250]
            cmds.append(_req("PATCH", path, labels={SUSPECT_LABEL: "true"},
                             annotations={SUSPECT_REASON: why}))
            await self.kube.label_node(node, {SUSPECT_LABEL: "true"}, {SUSPECT_REASON: why})
            pods = await self.kube.managed_pods(node)
        except Exception as exc:  # noqa: BLE001 - reported in the action result
            return ControllerResult(False, f"cordon {node}: {_why(exc)} — cordon it by hand: "
                                           f"kubectl cordon {node}", cmds)
        failed = []
        for p in pods:
            ns, name = p["metadata"].get("namespace", ""), p["metadata"]["name"]
            res = await self.kube.evict(ns, name)
            cmds.append(_req("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction",
                             attempts=res.attempts, blocked=res.blocked, ok=res.ok))
            if not res.ok:
                failed.append(f"{ns}/{name}: {res.detail}")
        if failed:
            return ControllerResult(False, f"cordoned {node}; eviction failed for "
                                           f"{'; '.join(failed)}", cmds)
        return ControllerResult(True, f"cordoned and labelled {node}, evicted {len(pods)} "
                                      f"trainguard pod(s)", cmds)

    async def restart_pod(self, node: str, job: str, before_ns: int = 0) -> ControllerResult:
        """Delete the pod of ``job`` on ``node`` when a job controller owns it (JobSet or
        PyTorchJob labels, ``OWNER_LABELS``): that controller recreates it; nothing else of
        the job is touched and the node is not cordoned. Only a running pod created before
        ``before_ns`` (Unix ns, the fault's time: the launcher's last heartbeat; 0: any) whose
        containers have not restarted since is the failed one — a pod that is being replaced
        already is left alone (``commands`` says why): one terminating, one ``Failed`` (its
        Job recreates it), a replacement made since, a container the kubelet restarted in
        place (``restartPolicy: OnFailure``). A pod without such an owner is left alone
        (nothing would recreate it) and the result is not ``ok``."""
        try:
            pods = await self.kube.managed_pods(node, job)
        except Exception as exc:  # noqa: BLE001
            return ControllerResult(False, f"list pods of {job} on {node}: {_why(exc)}")
        if not pods:
            return ControllerResult(False, f"no pod of job {job} on node {node}: deleted "
                                           f"already, or not labelled {JOB_LABEL}={job} and "
                                           f"{self.kube.cfg.managed_selector}")
        cmds: list[Any] = []
        deleted = 0
        for p in pods:
            meta = p["metadata"]
            labels = meta.get("labels") or {}
            ns, name = meta.get("namespace", ""), meta["name"]
            path = f"/api/v1/namespaces/{ns}/pods/{name}"
            if meta.get("deletionTimestamp"):
                cmds.append({"skipped": path, "why": "already terminating"})
                continue
            status = p.get("status") or {}
            if status.get("phase") in ("Failed", "Succeeded"):
                cmds.append({"skipped": path, "why": f"{status['phase']}: its controller "
                                                     f"replaces it"})
                continue
            created = _unix_ns(meta.get("creationTimestamp"))
            if before_ns and created is not None and created >= before_ns:
                cmds.append({"skipped": path, "why": "created after the fault: a replacement"})
                continue
            started = [_unix_ns(((c.get("state") or {}).get("running") or {}).get("startedAt"))
                       for c in status.get("containerStatuses") or []]
            if before_ns and any(t is not None and t >= before_ns for t in started):
                cmds.append({"skipped": path, "why": "its container restarted after the fault "
                                                     "(restartPolicy OnFailure)"})
                continue
            if not any(k in labels for k in OWNER_LABELS):
                return ControllerResult(False, f"pod {ns}/{name} has no JobSet or PyTorchJob "
                                               f"owner: deleting it would not recreate it", cmds)
            cmds.append(_req("DELETE", path))
            try:
                await self.kube.delete_pod(ns, name)
            except Exception as exc:  # noqa: BLE001
                return ControllerResult(False, f"delete {ns}/{name}: {_why(exc)}", cmds)
            deleted += 1
        if not deleted:
            return ControllerResult(True, f"no pod of {job} on {node} to delete: "
                                          f"{cmds[0]['why']}", cmds)
        return ControllerResult(True, f"deleted {deleted} pod(s) of {job} on {node}; "
                                      f"their controller recreates them", cmds)

    async def ready_canary(self, node: str) -> tuple[bool, str]:
        """Default canary: the node reports ``Ready=True`` and no drain is requested."""
        n = await self.kube.node(node)
        conds = {c.get("type"): c.get("status") for c in
                 ((n.get("status") or {}).get("conditions") or [])}
        if conds.get("Ready") != "True":
            return False, f"node {node} is not Ready ({conds.get('Ready', 'unknown')})"
        if DRAIN_REQUESTED in ((n.get("metadata") or {}).get("annotations") or {}):
            return False, f"node {node} is still annotated {DRAIN_REQUESTED}"
        return True, f"node {node} is Ready"

    # ---- readmission hooks (the policy and the reputation: NodeController.readmit) -----------
    async def node_view(self, node: str) -> tuple[NodeView, str]:
        """Cordoned with the suspect label: ours; cordoned without it: an operator's; else in
        service. Raises the API's error when the node cannot be read."""
        n = await self.kube.node(node)
        cordoned = bool((n.get("spec") or {}).get("unschedulable"))
        labels = (n.get("metadata") or {}).get("labels") or {}
        if cordoned and labels.get(SUSPECT_LABEL) == "true":
            return NodeView.OURS, f"cordoned, {SUSPECT_LABEL}=true"
        if cordoned:
            return NodeView.OTHER, f"cordoned without {SUSPECT_LABEL}"
        return NodeView.IN_SERVICE, "schedulable"

    async def canary(self, node: str) -> tuple[bool, str]:
        return await self.ready_canary(node)

    async def return_to_service(self, node: str, why: str) -> ControllerResult:
        """Remove the suspect label and uncordon."""
        path = f"/api/v1/nodes/{node}"
        cmds = [_req("PATCH", path, labels={SUSPECT_LABEL: None}),
                _req("PATCH", path, body={"spec": {"unschedulable": False}})]
        try:
            await self.kube.label_node(node, {SUSPECT_LABEL: None}, {SUSPECT_REASON: None})
            await self.kube.cordon(node, False)
        except Exception as exc:  # noqa: BLE001
            return ControllerResult(False, f"uncordon {node}: {_why(exc)}", cmds)
        return ControllerResult(True, f"uncordoned {node}", cmds)

    async def keep_out(self, node: str, why: str) -> ControllerResult:
        """Keep ``node`` cordoned and labelled, ``why`` in ``trainguard.io/suspect-reason``."""
        path = f"/api/v1/nodes/{node}"
        text = " ".join(why.split())[:250]
        cmds = [_req("PATCH", path, labels={SUSPECT_LABEL: "true"},
                     annotations={SUSPECT_REASON: text})]
        try:
            await self.kube.label_node(node, {SUSPECT_LABEL: "true"}, {SUSPECT_REASON: text})
        except Exception as exc:  # noqa: BLE001
            return ControllerResult(False, f"annotate {node}: {_why(exc)}", cmds)
        return ControllerResult(True, f"kept {node} cordoned", cmds)


def _unix_ns(stamp: Any) -> int | None:
    """An API timestamp (RFC 3339 text, or a datetime) as Unix ns; None when absent or
    unreadable."""
    if isinstance(stamp, str):
        try:
            stamp = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            return None
    if not isinstance(stamp, datetime.datetime):
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return int(stamp.timestamp() * 1e9)


def _why(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else \
        f"{type(exc).__name__}: {exc}"

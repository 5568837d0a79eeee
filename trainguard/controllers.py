"""Node exclusion controllers: take a node out of service when the remediator decides
``exclude_node_and_requeue``.

* ``LocalController`` — records the exclusion in the state store (``tg:node:<node>`` status
  ``excluded`` with the reason); what the local stack and the demo use. Launchers and the
  scheduler glue read it.
* ``SlurmController`` (``trainguard.slurm_controller``) — for the training job's Slurm id (from
  its job record): drains the node with the evidence as the reason, requeues when the job cannot
  go on in place, ``scancel`` on stop; re-reads Slurm's state first (idempotent); also records
  locally.
* ``kubernetes`` — ``trainguard.k8s.controller.KubernetesNodeController`` (official async
  client): cordon, suspect label, eviction of the trainguard pods; ``KubernetesController`` below
  is the former hand-written cordon, kept for its callers.

One interface (``trainguard.controller_base.NodeController``): ``exclude(node, job, reason)`` and
``stop(job, reason)`` are coroutines returning a ``ControllerResult`` (``ok``, ``detail``, and the
``commands`` or requests it issued, for the audit trail). Controllers never raise for an external
failure: ``ok`` is False and ``detail`` says what to do.
"""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .controller_base import ControllerResult, NodeController
from .slurm_controller import (SLURM_REASON_MAX, SlurmConfig, SlurmController,  # noqa: F401
                               slurm_drain_command, slurm_requeue_command)
from .state import StateStore

__all__ = ["ControllerResult", "NodeController", "LocalController", "SlurmConfig",
           "SlurmController", "KubernetesConfig", "KubernetesController", "CONTROLLERS",
           "make_controller", "slurm_drain_command", "slurm_requeue_command", "k8s_cordon_request"]


class LocalController(NodeController):
    """Exclusion recorded in the state store only (local stack, demo, tests)."""

    name = "local"

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        return ControllerResult(True, f"node {node} marked excluded in the state store")


@dataclass
class KubernetesConfig:
    """In-cluster API access: ``host`` (env ``KUBERNETES_SERVICE_HOST``/``_PORT``), the service
    account ``token_path`` and ``ca_path``; ``timeout_s`` per request."""

    host: str = field(default_factory=lambda: (
        f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:"
        f"{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
        if os.environ.get("KUBERNETES_SERVICE_HOST") else ""))
    token_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    timeout_s: float = 10.0


@dataclass
class HttpRequest:
    """A built HTTP request (what the controller sends; tests inspect it)."""

    method: str
    url: str
    headers: dict[str, str]
    body: bytes


def k8s_cordon_request(host: str, node: str, token: str = "") -> HttpRequest:
    """The strategic-merge PATCH that cordons ``node`` (``spec.unschedulable = true``, what
    ``kubectl cordon`` does)."""
    headers = {"Content-Type": "application/strategic-merge-patch+json",
               "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return HttpRequest("PATCH", f"{host.rstrip('/')}/api/v1/nodes/{node}", headers,
                       json.dumps({"spec": {"unschedulable": True}}).encode())


class KubernetesController(NodeController):
    """Cordon the node through the API server (the training job's operator then reschedules
    its pods elsewhere). The service account needs ``patch`` on ``nodes``
    (deploy/kubernetes/rbac.yaml)."""

    name = "kubernetes"

    def __init__(self, state: StateStore | None = None, config: KubernetesConfig | None = None):
        super().__init__(state)
        self.config = config or KubernetesConfig()

    def request(self, node: str) -> HttpRequest:
        token = ""
        if os.path.exists(self.config.token_path):
            with open(self.config.token_path) as fh:
                token = fh.read().strip()
        return k8s_cordon_request(self.config.host, node, token)

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        if not self.config.host:
            return ControllerResult(False, "not inside a Kubernetes cluster "
                                           "(KUBERNETES_SERVICE_HOST unset): cordon "
                                           f"{node} with `kubectl cordon {node}`")
        req = self.request(node)
        shown = {"method": req.method, "url": req.url}
        try:
            status = await asyncio.to_thread(self._send, req)
        except Exception as exc:  # noqa: BLE001 - reported in the action result
            return ControllerResult(False, f"cordon {node}: {exc}", [shown])
        ok = 200 <= status < 300
        return ControllerResult(ok, f"cordon {node}: HTTP {status}", [shown])

    def _send(self, req: HttpRequest) -> int:
        ctx = ssl.create_default_context(
            cafile=self.config.ca_path if os.path.exists(self.config.ca_path) else None)
        r = urllib.request.Request(req.url, data=req.body, headers=req.headers, method=req.method)
        with urllib.request.urlopen(r, timeout=self.config.timeout_s, context=ctx) as resp:
            return resp.status


def _kubernetes(state: StateStore | None) -> NodeController:
    """The Kubernetes controller of ``trainguard.k8s`` (official async client, extra
    ``[kubernetes]``; imported only when chosen)."""
    from .k8s.controller import KubernetesNodeController

    return KubernetesNodeController(state)


CONTROLLERS: dict[str, Any] = {
    "local": LocalController, "slurm": SlurmController, "kubernetes": _kubernetes,
}


def make_controller(name: str, state: StateStore | None) -> NodeController:
    """The controller called ``name`` (``CONTROLLERS``); raises ValueError listing the known
    ones."""
    try:
        return CONTROLLERS[name](state)
    except KeyError:
        raise ValueError(f"unknown node controller {name!r}: use one of "
                         f"{', '.join(CONTROLLERS)} (env TG_NODE_CONTROLLER)") from None

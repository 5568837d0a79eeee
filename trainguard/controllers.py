"""Node exclusion controllers: take a node out of service when the remediator decides
``exclude_node_and_requeue``.

* ``LocalController`` — records the exclusion in the state store (``tg:node:<node>`` status
  ``excluded`` with the reason); what the local stack and the demo use. Launchers and the
  scheduler glue read it.
* ``SlurmController`` — ``scontrol update nodename=<node> state=drain reason="<reason>"`` and,
  when a Slurm job id is known, ``scontrol requeue <jobid>``; also records locally.
* ``KubernetesController`` — cordons the node through the API server (``PATCH
  /api/v1/nodes/<node>`` with ``{"spec": {"unschedulable": true}}``), in-cluster credentials;
  also records locally.

Each ``exclude(node, job, reason)`` is a coroutine returning a ``ControllerResult`` (``ok``,
``detail``, and the ``commands`` or requests it issued, for the audit trail). Controllers never
raise for an external failure: ``ok`` is False and ``detail`` says what to do.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .state import StateStore

#: Slurm drain reasons are shown by ``sinfo -R``; keep them short and on one line.
SLURM_REASON_MAX = 120


@dataclass
class ControllerResult:
    ok: bool
    detail: str = ""
    commands: list[Any] = field(default_factory=list)


class NodeController:
    """Base: ``name`` identifies it in ``action.result.executor`` (``controller:<name>``)."""

    name = "base"

    def __init__(self, state: StateStore | None = None):
        self.state = state

    async def record(self, node: str, job: str, reason: str) -> None:
        if self.state is not None:
            await self.state.set_node(node, "excluded", f"{job}: {reason}"[:500])

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        raise NotImplementedError


class LocalController(NodeController):
    """Exclusion recorded in the state store only (local stack, demo, tests)."""

    name = "local"

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        return ControllerResult(True, f"node {node} marked excluded in the state store")


@dataclass
class SlurmConfig:
    """``scontrol`` path (default: found on PATH) and the Slurm job id to requeue (env
    ``SLURM_JOB_ID`` of the remediator, or the job hash's ``slurm_job_id`` passed by the caller;
    empty: drain only). ``timeout_s`` bounds each command."""

    scontrol: str = field(default_factory=lambda: shutil.which("scontrol") or "scontrol")
    slurm_job_id: str = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID", ""))
    timeout_s: float = 30.0


def slurm_drain_command(node: str, reason: str, scontrol: str = "scontrol") -> list[str]:
    """argv that drains ``node`` with ``reason`` (one line, at most ``SLURM_REASON_MAX``
    characters; Slurm shows it in ``sinfo -R``)."""
    one_line = " ".join(reason.split())[:SLURM_REASON_MAX] or "trainguard"
    return [scontrol, "update", f"nodename={node}", "state=drain", f"reason=trainguard: {one_line}"]


def slurm_requeue_command(job_id: str, scontrol: str = "scontrol") -> list[str]:
    """argv that requeues Slurm job ``job_id`` (it restarts without the drained node)."""
    return [scontrol, "requeue", str(job_id)]


class SlurmController(NodeController):
    """Drain the node and requeue the Slurm job (see ``SlurmConfig``)."""

    name = "slurm"

    def __init__(self, state: StateStore | None = None, config: SlurmConfig | None = None):
        super().__init__(state)
        self.config = config or SlurmConfig()

    def commands(self, node: str, reason: str) -> list[list[str]]:
        cmds = [slurm_drain_command(node, reason, self.config.scontrol)]
        if self.config.slurm_job_id:
            cmds.append(slurm_requeue_command(self.config.slurm_job_id, self.config.scontrol))
        return cmds

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        cmds = self.commands(node, reason)
        if not (os.path.exists(self.config.scontrol) or shutil.which(self.config.scontrol)):
            return ControllerResult(False, f"scontrol not found ({self.config.scontrol}): run the "
                                           f"remediator on a Slurm login/controller node or drain "
                                           f"{node} by hand", cmds)
        for cmd in cmds:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                out, _ = await asyncio.wait_for(proc.communicate(), self.config.timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                return ControllerResult(False, f"{' '.join(cmd)}: {exc or 'timed out'}", cmds)
            if proc.returncode != 0:
                return ControllerResult(False, f"{' '.join(cmd)} exited {proc.returncode}: "
                                               f"{out.decode(errors='replace').strip()[:300]}",
                                        cmds)
        return ControllerResult(True, f"drained {node}" + (
            f", requeued Slurm job {self.config.slurm_job_id}" if self.config.slurm_job_id else ""),
            cmds)


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


CONTROLLERS: dict[str, type[NodeController]] = {
    "local": LocalController, "slurm": SlurmController, "kubernetes": KubernetesController,
}


def make_controller(name: str, state: StateStore | None) -> NodeController:
    """The controller called ``name`` (``CONTROLLERS``); raises ValueError listing the known
    ones."""
    try:
        return CONTROLLERS[name](state)
    except KeyError:
        raise ValueError(f"unknown node controller {name!r}: use one of "
                         f"{', '.join(CONTROLLERS)} (env TG_NODE_CONTROLLER)") from None

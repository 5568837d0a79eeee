"""Node exclusion controllers: take a node out of service when the remediator decides
``exclude_node_and_requeue``.

* ``LocalController`` — records the exclusion in the state store (``tg:node:<node>`` status
  ``excluded`` with the reason); what the local stack and the demo use. Launchers and the
  scheduler glue read it.
* ``SlurmController`` (``trainguard.scheduler.slurm.controller``) — for the training job's Slurm id (from
  its job record): drains the node with the evidence as the reason, requeues when the job cannot
  go on in place, ``scancel`` on stop; re-reads Slurm's state first (idempotent); also records
  locally.
* ``kubernetes`` — ``trainguard.scheduler.k8s.controller.KubernetesNodeController`` (official async
  client, extra ``[kubernetes]``): cordon, suspect label, eviction of the trainguard pods
  through the Eviction API, deletion of the one pod whose launcher was lost
  (``restart_pod``), readmission after a canary. Imported only when chosen; without the extra,
  ``make_controller("kubernetes", …)`` raises ImportError naming it.

One interface (``trainguard.scheduler.base.NodeController``): ``exclude(node, job, reason)`` and
``stop(job, reason)`` are coroutines returning a ``ControllerResult`` (``ok``, ``detail``, and the
``commands`` or requests it issued, for the audit trail). Controllers never raise for an external
failure: ``ok`` is False and ``detail`` says what to do.
"""
from __future__ import annotations

from typing import Any

from trainguard.clients.store import StateStore
from trainguard.scheduler.base import ControllerResult, NodeController
from trainguard.scheduler.slurm.controller import SlurmController

__all__ = ["LocalController", "CONTROLLERS", "make_controller"]


class LocalController(NodeController):
    """Exclusion recorded in the state store only (local stack, demo, tests)."""

    name = "local"

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        return ControllerResult(True, f"node {node} marked excluded in the state store")


def _kubernetes(state: StateStore | None) -> NodeController:
    """The Kubernetes controller of ``trainguard.scheduler.k8s`` (official async client, extra
    ``[kubernetes]``; imported only when chosen). Raises ImportError saying what to install
    when the extra is missing."""
    try:
        import kubernetes_asyncio  # noqa: F401 - the extra's one dependency
    except ImportError as exc:
        raise ImportError("TG_NODE_CONTROLLER=kubernetes needs the official Kubernetes async "
                          "client: pip install 'trainguard[kubernetes]'") from exc
    from trainguard.scheduler.k8s.controller import KubernetesNodeController

    return KubernetesNodeController(state)


CONTROLLERS: dict[str, Any] = {
    "local": LocalController, "slurm": SlurmController, "kubernetes": _kubernetes,
}


def make_controller(name: str, state: StateStore | None) -> NodeController:
    """The controller called ``name`` (``CONTROLLERS``); raises ValueError listing the known
    ones, ImportError naming the extra to install (``kubernetes`` without
    ``trainguard[kubernetes]``)."""
    try:
        return CONTROLLERS[name](state)
    except KeyError:
        raise ValueError(f"unknown node controller {name!r}: use one of "
                         f"{', '.join(CONTROLLERS)} (env TG_NODE_CONTROLLER)") from None

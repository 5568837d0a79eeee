"""The one interface of node controllers (local, Slurm, Kubernetes) and what they return.

A controller is what the remediator calls to take a node out of service, to stop a job through
the scheduler where the scheduler holds the job (``cancels_jobs``: Slurm) and, where the
scheduler recreates a job's pods (``restarts_pods``: Kubernetes), to replace the one pod whose
launcher was lost (``restart_pod``). ``exclude``, ``stop`` and ``restart_pod`` are coroutines
returning a ``ControllerResult``; they never raise for an external failure (``ok`` False,
``detail`` says what to do), and they re-read the scheduler's state before acting, so that doing
one twice is harmless (the detail says ``already …``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ControllerResult", "NodeController"]


@dataclass
class ControllerResult:
    """``ok``; ``detail`` (one line for the action result and the audit trail); ``commands``:
    the commands or requests issued, and ``{"skipped": …, "why": …}`` for those already
    satisfied."""

    ok: bool
    detail: str = ""
    commands: list[Any] = field(default_factory=list)


class NodeController:
    """Base: ``name`` identifies it in ``action.result.executor`` (``controller:<name>``);
    ``state`` is the ``trainguard.state.StateStore`` (or None) where exclusions are recorded and
    job records are read."""

    name = "base"
    #: Whether ``restart_pod`` can replace a job's pod on a node (its scheduler recreates it).
    restarts_pods = False
    #: Whether ``stop`` ends the job in its scheduler (Slurm: ``scancel``); the remediator
    #: calls ``stop`` for an executed stop decision only then.
    cancels_jobs = False
    #: Whether ``exclude`` requeues the job in its scheduler without the node when the world it
    #: leaves is below the job's ``min_world_size`` (Slurm); the policy then excludes instead
    #: of stopping the job.
    requeues_jobs = False

    def __init__(self, state: Any = None):
        self.state = state

    async def record(self, node: str, job: str, reason: str) -> None:
        """``tg:node:<node>`` status ``excluded`` with ``<job>: <reason>``."""
        if self.state is not None:
            await self.state.set_node(node, "excluded", f"{job}: {reason}"[:500])

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        """Take ``node`` out of service for ``job`` (``reason``: the decision's evidence)."""
        raise NotImplementedError

    async def stop(self, job: str, reason: str, generation: int | None = None
                   ) -> ControllerResult:
        """End ``job`` through the scheduler for a stop decision of ``generation`` (None: any;
        a later generation in force is a new run the stop was not about); by default there is
        nothing to end (the launchers stop their ranks on the stop decision themselves)."""
        return ControllerResult(True, f"{self.name}: nothing to cancel for {job!r} (its "
                                      f"launchers stop on the decision)")

    async def restart_pod(self, node: str, job: str, before_ns: int = 0) -> ControllerResult:
        """Replace ``job``'s pod on ``node`` (one created before ``before_ns``, Unix ns; 0: any)
        so that its scheduler recreates it; by default there are no pods to replace."""
        return ControllerResult(False, f"{self.name}: no pod to restart for {job!r} on "
                                       f"{node}: start its launcher there again")

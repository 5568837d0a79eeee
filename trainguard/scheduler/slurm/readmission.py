"""Readmission of a node through Slurm: the hooks of ``NodeController.readmit`` (the policy and
the reputation are the base class's). The canary runs inside a reservation of the node that no
other job can enter; see ``trainguard.scheduler.slurm.controller`` for the steps and why.
"""
from __future__ import annotations

import asyncio
import os
import pwd
from typing import Any

from trainguard.core.reputation import NodeView
from trainguard.scheduler.base import CanaryNotRun, ControllerResult, run_canary_command
from trainguard.scheduler.slurm.commands import parse_scontrol, slurm_drain_command, slurm_reason
from trainguard.scheduler.slurm.config import SlurmConfig
from trainguard.scheduler.slurm.runner import SlurmRunner


class SlurmReadmission:
    """``node_view``, ``canary``, ``return_to_service`` and ``keep_out`` of a node, for
    ``SlurmController``; ``slurm`` runs the commands, ``state`` (a ``StateStore``, or None)
    records a node kept out."""

    def __init__(self, slurm: SlurmRunner, state: Any = None):
        self.slurm = slurm
        self.state = state

    @property
    def config(self) -> SlurmConfig:
        return self.slurm.config

    def reservation(self, node: str) -> str:
        """The name of ``node``'s canary reservation."""
        return f"{self.config.reservation_prefix}{node}"

    async def reserved(self, node: str) -> bool:
        """Whether ``node``'s canary reservation exists."""
        rc, out = await self.slurm.run([self.config.scontrol, "show", "reservation", "-o",
                                        self.reservation(node)])
        return rc == 0 and out.startswith("ReservationName=")

    async def node_view(self, node: str) -> tuple[NodeView, str]:
        """``scontrol show node``: DRAIN with a ``trainguard:`` reason is ours (busy while
        jobs still run on it), any other DRAIN or DOWN is not; a node resumed inside its canary
        reservation is ``CANARY`` (an interrupted readmit). Raises OSError when slurmctld
        cannot be asked."""
        rc, out = await self.slurm.run([self.config.scontrol, "show", "node", "-o", node])
        if rc != 0:
            if "not found" in out or "Invalid node name" in out:
                return NodeView.UNKNOWN, out[:200]
            raise OSError(f"scontrol show node {node} exited {rc}: {out[:200]}")
        n = parse_scontrol(out)
        state, reason = n.get("State", ""), n.get("Reason", "")
        flags = state.split("+")
        words = f"State={state}" + (f" Reason={reason}" if reason else "")
        if "DRAIN" in flags:
            if not reason.startswith("trainguard:"):
                return NodeView.OTHER, words
            if flags[0] in ("ALLOCATED", "MIXED", "COMPLETING") or "COMPLETING" in flags:
                return NodeView.OURS_BUSY, words
            return NodeView.OURS, words
        if await self.reserved(node):
            return NodeView.CANARY, f"{words} in reservation {self.reservation(node)}"
        if flags[0] in ("DOWN", "FAIL", "FUTURE", "UNKNOWN"):
            return NodeView.OTHER, words
        return NodeView.IN_SERVICE, words

    def canary_argv(self, node: str) -> list[str]:
        """The ``srun`` of the canary on ``node`` inside its reservation."""
        minutes = max(1, int(self.config.canary_timeout_s // 60) + 1)
        return [self.config.srun, "-w", node, "-N1", "-n1",
                f"--reservation={self.reservation(node)}",
                "--immediate=60", f"--time={minutes}", "--job-name=trainguard-canary",
                *self.config.canary_cmd]

    async def canary(self, node: str) -> tuple[bool, str]:
        """Open the canary window (reservation, then resume; each only when not so already)
        and ``srun`` the canary program on ``node`` (see the module docstring)."""
        done: list[Any] = []
        try:
            if not await self.reserved(node):
                user = pwd.getpwuid(os.getuid()).pw_name
                await self.slurm.mutate([self.config.scontrol, "create", "reservation",
                                         f"reservationname={self.reservation(node)}",
                                         f"nodes={node}", "starttime=now", "duration=UNLIMITED",
                                         f"users={user}", "flags=maint,ignore_jobs"], done)
            if "DRAIN" in (await self.slurm.show("node", node)).get("State", ""):
                await self.slurm.mutate([self.config.scontrol, "update", f"nodename={node}",
                                         "state=resume"], done)
            ok, detail = await run_canary_command(self.canary_argv(node), node,
                                                  self.config.canary_timeout_s, launched=True)
        except (OSError, asyncio.TimeoutError) as exc:
            raise CanaryNotRun(f"Slurm: {exc or 'timed out'}") from exc
        return ok, f"srun on {node}: {detail}"

    async def return_to_service(self, node: str, why: str) -> ControllerResult:
        """Resume ``node`` (when still drained) and delete its canary reservation."""
        done: list[Any] = []
        try:
            if "DRAIN" in (await self.slurm.show("node", node)).get("State", ""):
                await self.slurm.mutate([self.config.scontrol, "update", f"nodename={node}",
                                         "state=resume"], done)
            if await self.reserved(node):
                await self.slurm.mutate([self.config.scontrol, "delete",
                                         f"reservationname={self.reservation(node)}"], done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)
        return ControllerResult(True, f"resumed {node}", done)

    async def keep_out(self, node: str, why: str) -> ControllerResult:
        """Drain ``node`` with ``why`` as its reason (a drained node's reason is replaced),
        then delete its canary reservation, in that order: no moment in service."""
        done: list[Any] = []
        try:
            await self.slurm.mutate(slurm_drain_command(node, why, self.config.scontrol), done)
            if await self.reserved(node):
                await self.slurm.mutate([self.config.scontrol, "delete",
                                         f"reservationname={self.reservation(node)}"], done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)
        if self.state is not None:
            await self.state.set_node(node, "excluded", why[:500])
        return ControllerResult(True, f"{node} drained: {slurm_reason(why)}", done)

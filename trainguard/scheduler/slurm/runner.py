"""Running Slurm's commands: argv lists (no shell), each bounded by ``SlurmConfig.timeout_s``,
and the reads the controller makes of Slurm's state (``scontrol show``, ``squeue``)."""
from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

from trainguard.scheduler.slurm.commands import (parse_scontrol, parse_squeue_state,
                                                 slurm_squeue_command)
from trainguard.scheduler.slurm.config import SlurmConfig


class SlurmRunner:
    """Runs the commands of one ``SlurmConfig``. Every method raises OSError (a command that
    cannot start, or one of ``mutate`` that failed) or asyncio.TimeoutError (past
    ``timeout_s``); the controller turns them into a ``ControllerResult``."""

    def __init__(self, config: SlurmConfig):
        self.config = config

    async def run(self, cmd: list[str]) -> tuple[int, str]:
        """``(exit status, output)`` of ``cmd``, stdout and stderr together; killed at
        ``timeout_s``."""
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.config.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        return proc.returncode or 0, out.decode(errors="replace").strip()

    async def show(self, what: str, ident: str) -> dict[str, str]:
        """``scontrol show <what> -o <ident>`` as a dict (``parse_scontrol``); empty when
        ``scontrol`` refused (an unknown job or node)."""
        rc, out = await self.run([self.config.scontrol, "show", what, "-o", ident])
        return parse_scontrol(out) if rc == 0 else {}

    async def squeue_state(self, jid: str) -> str:
        """Job ``jid``'s state as ``squeue`` gives it now (``GONE``: Slurm no longer knows
        it)."""
        rc, out = await self.run(slurm_squeue_command(jid, self.config.squeue))
        return parse_squeue_state(rc, out)

    async def mutate(self, cmd: list[str], done: list[Any]) -> None:
        """Run ``cmd`` and append it to ``done``; raises OSError when it exits non-zero."""
        rc, out = await self.run(cmd)
        done.append(cmd)
        if rc != 0:
            raise OSError(f"{' '.join(cmd)} exited {rc}: {out[:200]}")

    def missing(self) -> str | None:
        """Why ``scontrol`` cannot be run here (None: it can)."""
        exe = self.config.scontrol
        if os.path.exists(exe) or shutil.which(exe):
            return None
        return f"scontrol not found ({exe})"

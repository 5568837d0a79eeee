"""The Slurm watcher's service: every ``poll_s`` it runs ``squeue --json --states=all`` and
``sinfo --json`` (argv lists, no shell, each bounded by ``timeout_s``), reads them
(``snapshot``), steps the ``reducer`` with the ``Observation`` and carries its effects out
(``trainguard.services.live_reducer.ReducerService``: publishes, record writes, log lines). A command that
fails, times out or prints something else than its JSON becomes that part's error in the
observation (the reducer logs it once); the loop goes on.

One watcher per Slurm cluster is enough; a second publishes the same event ids, which the bus
keeps once (two-minute duplicate window). It consumes nothing from the bus.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.services.live_reducer import ReducerService
from trainguard.services.base import ServiceConfig

from trainguard.scheduler.slurm.watch import reducer
from trainguard.scheduler.slurm.watch.reducer import Observation, WatchState
from trainguard.scheduler.slurm.watch.snapshot import SnapshotError, parse_sinfo, parse_squeue

__all__ = ["SlurmWatch", "SlurmWatchConfig", "factory"]


@dataclass
class SlurmWatchConfig:
    """``poll_s`` — seconds between polls (env ``TG_SLURM_POLL_S``, default 5: two RPCs of
    slurmctld per poll; Slurm's own SlurmdTimeout is minutes, so a node it marks DOWN is seen
    within a few seconds of that); ``squeue`` / ``sinfo`` — the clients (default: found on
    PATH); ``timeout_s`` — bound of each command (seconds)."""

    poll_s: float = field(default_factory=lambda: float(os.environ.get("TG_SLURM_POLL_S",
                                                                       "5")))
    squeue: str = field(default_factory=lambda: shutil.which("squeue") or "squeue")
    sinfo: str = field(default_factory=lambda: shutil.which("sinfo") or "sinfo")
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise ValueError(f"TG_SLURM_POLL_S={self.poll_s}: give seconds > 0")


async def run_json(argv: list[str], timeout_s: float) -> str:
    """The stdout of ``argv``; raises OSError (with its stderr) on a non-zero exit, a missing
    program or a timeout."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL)
    except FileNotFoundError:
        raise OSError(f"{argv[0]} not found: install the Slurm clients (slurm-client) or "
                      f"give their path") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise OSError(f"{' '.join(argv)} gave no answer in {timeout_s:.0f} s") from None
    if proc.returncode:
        raise OSError(f"{' '.join(argv)} exited {proc.returncode}: "
                      f"{err.decode(errors='replace').strip()[:300]}")
    return out.decode(errors="replace")


class SlurmWatch(ReducerService[WatchState]):
    """``slurm_watch.reducer.step`` behind the Slurm clients, the bus and the state store."""

    name = "slurm_watch"
    topics = ()
    partitioned = False

    def __init__(self, config: ServiceConfig | None = None,
                 watch: SlurmWatchConfig | None = None):
        self.watch = watch or SlurmWatchConfig()
        super().__init__(config)
        self._next_poll = 0.0

    def initial_state(self) -> WatchState:
        return WatchState()

    def step(self, state: WatchState, event, now: float):
        return reducer.step(state, event, now)

    async def observe(self) -> Observation:
        """One poll of both commands (concurrently) as an ``Observation``."""
        cfg = self.watch
        got = await asyncio.gather(
            run_json([cfg.squeue, "--json", "--states=all"], cfg.timeout_s),
            run_json([cfg.sinfo, "--json"], cfg.timeout_s), return_exceptions=True)
        parts: dict[str, Any] = {}
        for name, parse, res in (("jobs", parse_squeue, got[0]), ("nodes", parse_sinfo, got[1])):
            try:
                if isinstance(res, BaseException):
                    raise res
                parts[name] = parse(res)
            except (OSError, SnapshotError) as exc:
                parts[f"{name}_error"] = str(exc)
        return Observation(wall_ns=time.time_ns(), **parts)

    async def poll(self) -> None:
        """Observe once and step it (tests call it directly)."""
        await self.feed(await self.observe())

    async def tick(self) -> None:
        await super().tick()
        if time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + self.watch.poll_s
            await self.poll()

    def health(self) -> dict[str, Any]:
        m = self.model
        return {"watched": {sid: w.job for sid, w in m.jobs.items()}, "nodes": len(m.nodes),
                "polls": m.polls, "events": m.events, "errors": dict(m.errors)}


def factory(cfg: ServiceConfig) -> SlurmWatch:
    return SlurmWatch(cfg)

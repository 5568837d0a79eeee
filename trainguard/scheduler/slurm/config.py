"""Settings of the Slurm controller (``trainguard.scheduler.slurm.controller``): where Slurm's
commands are, when an exclusion requeues, how long each command and the canary may take."""
from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass, field

from trainguard.scheduler.base import LOCAL_CANARY


@dataclass
class SlurmConfig:
    """``scontrol``/``scancel``/``squeue`` paths (default: found on PATH); ``requeue`` (env
    ``TG_SLURM_REQUEUE``: ``auto`` | ``always`` | ``never``, see the module docstring);
    ``slurm_job_id`` overrides the job record's (tests, a job registered without it; empty: the
    record's); ``timeout_s`` bounds each command (seconds)."""

    scontrol: str = field(default_factory=lambda: shutil.which("scontrol") or "scontrol")
    scancel: str = field(default_factory=lambda: shutil.which("scancel") or "scancel")
    squeue: str = field(default_factory=lambda: shutil.which("squeue") or "squeue")
    requeue: str = field(default_factory=lambda: os.environ.get("TG_SLURM_REQUEUE", "auto"))
    slurm_job_id: str = ""
    timeout_s: float = 30.0
    #: readmission: ``srun`` path; the canary program as run on the node (env
    #: ``TG_SLURM_CANARY_CMD``, shell words; default this Python's ``-m trainguard.agents.canary
    #: --json``: the node needs trainguard at the same path); ``canary_timeout_s`` bounds the
    #: whole ``srun`` (seconds); ``reservation_prefix`` names the canary's reservation.
    srun: str = field(default_factory=lambda: shutil.which("srun") or "srun")
    canary_cmd: list[str] = field(default_factory=lambda: shlex.split(
        os.environ.get("TG_SLURM_CANARY_CMD", "")) or list(LOCAL_CANARY))
    canary_timeout_s: float = 300.0
    reservation_prefix: str = "tg-canary-"
    #: seconds a requeue waits for the job to be PENDING to release Slurm's hold on it (its
    #: other nodes end their part within ``KillWait``, 30 s by default)
    release_wait_s: float = 45.0

    def __post_init__(self) -> None:
        if self.requeue not in ("auto", "always", "never"):
            raise ValueError(f"TG_SLURM_REQUEUE={self.requeue!r}: use auto, always or never")

"""What a benchmark's JSON records about the run behind it: commit, machine, load and date.

Every bench that writes JSON puts ``record(...)`` under the key ``provenance`` (at the top of
an object, or in each row of a list), so that ``docs/render_figures.py`` can say, under each
published table, which code, machine and day its figures come from.

``record(load_at_start)`` returns::

    {"commit": "ca759b4…" | None,     # git HEAD of the repository holding this file
     "dirty": bool | None,             # uncommitted changes to tracked files at the time
     "date": "2026-12-07T15:34:29Z",   # UTC, when the record was taken (the run's end)
     "cpus": 2, "machine": "x86_64", "python": "3.11.7", "torch": "2.13.0" | None,
     "loadavg_start": [1m, 5m, 15m] | None, "loadavg_end": [1m, 5m, 15m]}

Take ``loadavg()`` when the run starts and pass it in; the end reading is taken here. Nothing
raises: outside a git checkout, or without git, ``commit`` and ``dirty`` are ``None``.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def loadavg() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", HERE, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def record(load_at_start: list[float] | None = None) -> dict:
    """The run's provenance (see the module docstring); call it when the run's figures are in."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "loadavg_start": load_at_start,
        "loadavg_end": loadavg(),
    }

"""The services a local stack runs: which packages, under which role, and how each process is
named, asked for its health and started.

Each service is its own process (``python -m <package>``); an agent runs once per node name
(``agent-<node>``), a partitioned service once per replica (``<service>-<i>``) when there are
more than one. URLs with credentials go in the child's environment, never on its command line
(``trainguard.stack.local.Stack``).
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from trainguard.services.base import health_subject

#: The services of the design, in start order.
DEFAULT_SERVICES = ("agent", "detector", "attributor", "remediator", "checkpoint_validator")


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: the package run with ``python -m``; ``per_node`` services run
    once per node name with ``--node NAME`` and are named ``<name>-<node>``; ``role``: the
    ``trainguard.security.roles`` role it connects as."""

    module: str
    role: str
    per_node: bool = False
    partitioned: bool = False


SERVICE_SPECS: dict[str, ServiceSpec] = {
    "agent": ServiceSpec("trainguard.agents", "agent", per_node=True),
    "detector": ServiceSpec("trainguard.detector", "detector", partitioned=True),
    "attributor": ServiceSpec("trainguard.attributor", "attributor", partitioned=True),
    "remediator": ServiceSpec("trainguard.remediator", "remediator", partitioned=True),
    "checkpoint_validator": ServiceSpec("trainguard.checkpoint_validator", "checkpoint_validator",
                                        partitioned=True),
    # not in DEFAULT_SERVICES: it needs the Slurm clients (trainguard.cluster starts it with Slurm)
    "slurm_watch": ServiceSpec("trainguard.scheduler.slurm.watch", "slurm_watch"),
}


def service_available(name: str) -> bool:
    """True when ``python -m <module>`` of service ``name`` can run here."""
    spec = SERVICE_SPECS.get(name)
    if spec is None:
        return False
    try:
        return importlib.util.find_spec(f"{spec.module}.__main__") is not None
    except (ImportError, ValueError):
        return False


def check_services(services: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the services that ``SERVICE_SPECS`` does not know."""
    unknown = [s for s in services if s not in SERVICE_SPECS]
    if unknown:
        raise ValueError(f"unknown service(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(SERVICE_SPECS)}")


def service_names(services: Sequence[str], agent_nodes: Sequence[str],
                  replicas: int) -> list[str]:
    """Process names of ``services``: ``agent-<node>`` per node; ``<service>-<i>`` per replica
    of a partitioned service when ``replicas`` > 1; else the service name. A partitioned
    service's process name is its replica name (``--replica``), so a restarted one resumes its
    durable consumers."""
    out = []
    for s in services:
        spec = SERVICE_SPECS[s]
        if spec.per_node:
            out += [f"{s}-{n}" for n in agent_nodes]
        elif spec.partitioned and replicas > 1:
            out += [f"{s}-{i}" for i in range(replicas)]
        else:
            out.append(s)
    return out


def process_health_subject(services: Sequence[str], name: str) -> str:
    """The health subject of process ``name`` (a replica answers on its own)."""
    for s in services:
        if SERVICE_SPECS[s].partitioned and (name == s or name.startswith(f"{s}-")):
            return health_subject(s, name)
    return health_subject(name)


def kernel_log_file(kernel_log_dir: Path, node: str) -> Path:
    """The kernel-log file the agent of simulated node ``node`` follows."""
    return kernel_log_dir / f"kernel-{node}.log"


def memory_budget_file(sim_dir: Path, node: str) -> Path:
    """The file holding the memory budget (bytes) of simulated node ``node``."""
    return sim_dir / f"memory-budget-{node}"


def service_command(services: Sequence[str], name: str, replicas: int,
                    kernel_log_dir: Path | None = None,
                    sim_dir: Path | None = None) -> tuple[list[str], str]:
    """Command line and auth role of service process ``name`` (a name of ``service_names``):
    an agent follows ``kernel_log_file`` with ``kernel_log_dir`` and is a simulated node's
    (the demo's simulated NVML, a memory budget) with ``sim_dir``. Raises ``KeyError`` for a
    name no service has."""
    for s in services:
        spec = SERVICE_SPECS[s]
        if spec.per_node and name.startswith(f"{s}-"):
            node = name[len(s) + 1:]
            cmd = [sys.executable, "-m", spec.module, "--node", node]
            if kernel_log_dir is not None:
                cmd += ["--kmsg", str(kernel_log_file(kernel_log_dir, node))]
            if sim_dir is not None:
                cmd += ["--nvml-module", "trainguard.demo.fake_pynvml:for_node",
                        "--memory-budget-file", str(memory_budget_file(sim_dir, node))]
            return cmd, spec.role
        if spec.partitioned and (name == s or (replicas > 1 and name.startswith(f"{s}-")
                                               and name[len(s) + 1:].isdigit())):
            return [sys.executable, "-m", spec.module, "--replica", name], spec.role
        if name == s:
            return [sys.executable, "-m", spec.module], spec.role
    raise KeyError(f"no service process named {name!r}")

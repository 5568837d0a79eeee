"""The demo's settings and its fault schedule: the default faults (``DEFAULT_FAULTS``), the
kinds injected into a simulated node's hardware (``SIM_FAULTS``) or named by a node
(``NODE_FAULTS``), and ``DemoConfig``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The default fault schedule: (id, kind, global rank, step).
DEFAULT_FAULTS: tuple[dict[str, Any], ...] = (
    {"id": 1, "kind": "sigkill", "rank": 1, "step": 150},
    {"id": 2, "kind": "exception", "rank": 2, "step": 300},
    {"id": 3, "kind": "hang", "rank": 3, "step": 450},
)

#: Fault kinds of a degrading node: injected into the simulated node's hardware (``sim_dir``).
SIM_FAULTS = ("ecc_degrading", "memory_fill")
#: Fault kinds named by a node (their rank is the node's first).
NODE_FAULTS = ("node_loss", "xid", *SIM_FAULTS)


@dataclass
class DemoConfig:
    """Settings of the demo (defaults in brackets).

    ``steps`` [600] training steps; ``step_sleep_s`` [0.01] pause per step so faults land where
    scheduled; ``hang_timeout_s`` [2.0] job hang timeout; ``node_timeout_s`` [3.0];
    ``recovery_timeout_s`` [90] how long a fault may take to recover before it counts as not
    recovered; ``dropout`` [0], ``loss_log`` [False]: the script's ``--dropout``, ``--loss-log``;
    ``retry_budget`` [None: the launcher's default, 10] recoveries the remediator grants the job
    before it stops it (a long chaos run of many faults needs more).
    """

    mode: str = "action"
    job: str = "demo"
    steps: int = 600
    seed: int = 0
    nnodes: int = 2
    nproc_per_node: int = 2
    ckpt_every: int = 20
    step_sleep_s: float = 0.01
    hang_timeout_s: float = 2.0
    node_timeout_s: float = 3.0
    recovery_timeout_s: float = 90.0
    faults: list[dict[str, Any]] = field(default_factory=lambda: [dict(f) for f in DEFAULT_FAULTS])
    spare_nodes: int = 0
    run_dir: str = ""
    report: str = ""
    quiet: bool = False
    dropout: float = 0.0
    loss_log: bool = False
    retry_budget: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def __post_init__(self) -> None:
        for i, f in enumerate(self.faults):
            f.setdefault("id", i + 1)  # names the marker file of an in-rank fault

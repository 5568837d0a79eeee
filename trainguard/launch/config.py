"""The settings of one node's launch (``trainguard launch`` flags, parsed by
``trainguard.launch.args``): what the launcher's pool, lease and loop read."""
from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas import subjects


@dataclass(frozen=True)
class StdSpec:
    """Which local ranks' stdout (1) and stderr (2) go to files: ``--redirects``/``--tee`` as
    torchrun reads them (``"3"`` for every rank, or ``"0:1,1:2"`` per local rank)."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    def of(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default)


@dataclass
class LaunchConfig:
    """Settings of one node's launcher (defaults in brackets).

    ``mode`` [observe]: ``action`` executes decisions, ``observe`` only publishes them.
    ``spares`` [1]: warm spare processes kept ready on this node.
    ``hang_timeout_s`` [0 = learned by the detector], ``startup_timeout_s`` [120],
    ``node_timeout_s`` [3]: detection settings registered for the job.
    ``retry_budget`` [10], ``min_world_size`` [1]: remediator policy settings for the job.
    ``spare_node`` [False]: this node only waits to replace an excluded node.
    ``refill_delay_s`` [2]: seconds after a spare became a rank before its replacement spare
    starts warming — a spare importing torch takes a core for seconds, and during the
    recovery it would slow every rank's restore (measured on 2 cores: the restore of a hang
    recovery 0.47 s with an immediate refill).
    ``node_writer`` [True]: hold one checkpoint writer daemon for this node's ranks
    (``trainguard.checkpoint.NodeWriter``, exported as ``TG_CKPT_WRITER``); its writers share
    the daemon's imports, ≈ 4 MB per rank instead of ≈ 16 MB for a writer per rank. A rank falls
    back to a writer of its own when the daemon does not answer.
    ``fork_spares`` [True]: fork the spares from one warm template process per node
    (``trainguard.launch.forkserver``: torch imported and warmed once, not once per rank); False, or
    a template that fails to warm: each spare is a process of its own, started cold.
    ``job_imports`` [True]: local rank 0 records the modules the job imported
    (``trainguard.rank.job_imports``) and the template imports them too, within
    ``job_imports_budget_s`` [60: importing Lightning alone took 13 s on 2 busy cores], so that
    a replacement rank never imports its framework after a fault; idle spares forked before
    are replaced. ``auto_resume`` [True]: a restarted Lightning / Hugging Face ``Trainer``
    given no checkpoint resumes from its newest complete one (``trainguard.rank.auto_resume``;
    False exports ``TG_AUTO_RESUME=0``).
    torchrun's settings (``trainguard.launch.args``): ``max_restarts`` [0] (observe mode: group
    restarts after a failure), ``role`` ["default"], ``log_dir`` [""], ``redirects``/``tee``
    (which local ranks' stdout/stderr go to files), ``local_ranks_filter`` [all] (console),
    ``no_python`` [False] (run the program itself: no spare, no hooks),
    ``monitor_interval_s`` [0.5], ``standalone`` [False] (start an embedded stack when none is
    configured). ``faults`` [""]: the rank faults of ``--faults`` as JSON
    (``trainguard.core.fault_schedule``), handed to every rank with ``faults_dir``, the directory of
    the markers that make each fire once (``trainguard.rank.fault_inject``).
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    node: str = field(default_factory=subjects.default_node)
    job: str = "default"
    mode: str = "observe"
    rdzv_endpoint: str = ""
    nats_url: str = ""
    redis_url: str = ""
    ckpt_dir: str = ""
    spares: int = 1
    hang_timeout_s: float = 0.0
    startup_timeout_s: float = 120.0
    node_timeout_s: float = 3.0
    retry_budget: int = 10
    min_world_size: int = 1
    spare_node: bool = False
    heartbeat_interval_s: float = 0.5
    refill_delay_s: float = 2.0
    warm_imports: str = ""
    node_writer: bool = True
    fork_spares: bool = True
    job_imports: bool = True
    job_imports_budget_s: float = 60.0
    auto_resume: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    role: str = "default"
    log_dir: str = ""
    redirects: StdSpec = field(default_factory=StdSpec)
    tee: StdSpec = field(default_factory=StdSpec)
    local_ranks_filter: frozenset[int] = frozenset()
    no_python: bool = False
    monitor_interval_s: float = 0.5
    standalone: bool = False
    faults: str = ""
    faults_dir: str = ""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

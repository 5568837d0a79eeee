"""The detector's rule parameters (``DetectorConfig``) and what every rule returns (``Finding``).

Times are seconds unless a name says otherwise; ``Finding.ts`` is Unix ns. The rules themselves
live in ``detector.progress`` (windows over rank heartbeats: hang, straggler, throughput, NaN
loss) and ``detector.signals`` (one-off signals: worker exits, log lines, failed saves, XIDs,
GPU telemetry, node heartbeats); ``detector.rules`` re-exports all three.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# configuration


@dataclass
class DetectorConfig:
    """Rule parameters. Times in seconds.

    Hang (heartbeat silence): a rank's heartbeat thread beats every 0.1 s whatever the step
    length, even while the rank is blocked in a collective, so silence does not scale with step
    time: ``silence_timeout_s`` = 5 s (50 missed beats: a GC pause delays a beat by tens of ms,
    but an overloaded host — seen on the 2-core CI machine at load 9 — can starve a live rank's
    beat thread for over a second, and a false hang kills a healthy rank; jobs that want faster
    hang detection set ``hang_timeout_s``, e.g. 2 s in the demo — but in the phases of
    ``progress.SLOW_PHASES`` (start-up, compile, checkpoint, recovery, eval) a live rank can
    stall longer, so there it is ``silence_phase_s`` = 10 s); for a rank that beats slower,
    ``silence_beats`` (15) × its own ``interval_s`` when that is longer. A job's
    ``hang_timeout_s`` overrides both.

    Hang (no progress while beating): ``step_timeout = clamp(step_timeout_factor × p99 step
    time, step_timeout_floor_s, step_timeout_ceiling_s)`` over the job's last
    ``step_window`` step times. Factor 5: a healthy job's p99 step is rarely exceeded by 2× (data
    loader hiccups, eval steps), 5× leaves room without waiting minutes. Floor 10 s: below that,
    ordinary noise of a loaded host (steps slowed 0.28 → 0.42 s while a checkpoint was staged;
    multi-second stalls of every rank at load 9 on 2 cores) would trip it. Ceiling 600 s:
    NCCL's default collective timeout in recent PyTorch is 10 min; beyond it the collective
    itself fails. Until ``min_step_samples`` step times are
    known the floor is not trusted and ``unlearned_timeout_s`` (120 s) applies. Phases get
    their own, longer allowances (``phase_timeout_s``): startup 300 s (interpreter + torch import
    ≈ 4 s here, but dataset loading and a multi-node rendezvous take minutes), compile 900 s
    (torch.compile of a large model), checkpoint 600 s (a blocking save of a large state at
    ≈ 0.4 GB/s local disk), recovery 120 s (re-forming groups + restore). A job's
    ``startup_timeout_s`` overrides the startup allowance.

    Straggler: modified z-score of Iglewicz & Hoaglin (1993, "How to Detect and Handle
    Outliers"): ``z = 0.6745 (x − median) / MAD`` over the ranks of a job, x = each rank's median
    of its last ``straggler_recent`` (5) step times; flagged when ``z > straggler_z`` (3.5, their
    recommended cut-off) and ``x ≥ straggler_ratio`` (1.5) × the job median (MAD can be tiny
    on a uniform job). A 3× slowdown moves a rank's median of 5 after 3 slow steps, so it is
    flagged within 10 steps. Jobs with fewer than 3 reporting ranks use the ratio alone
    (``straggler_ratio_small`` = 2.0) against the fastest peer. Both also need
    ``x − reference ≥ straggler_min_excess_s`` (0.02 s): below that a difference is scheduler
    noise of a shared host, not a slow rank (seen on the 2-core CI machine: 4 gloo ranks of the
    demo, ≈ 12 ms compute per step, spread up to ≈ 2× by contention alone, never by 20 ms in a
    median of 5).

    Throughput: the job's step rate over ``throughput_window_s`` (10 s) against an exponential
    moving average baseline (``throughput_alpha`` 0.05 per window); a drop below
    ``throughput_drop_ratio`` (0.5) of the baseline after ``throughput_warmup_windows`` (6)
    windows is an anomaly.

    Node lost: ``node_timeout_s`` = 3 s after the last heartbeat of every role (agent,
    launcher) of that node (3 beats of the agent's 1 s interval); a job's ``node_timeout_s``
    overrides it for its nodes. Launcher lost: the same timeout, for one job's launcher and its
    ranks on a node whose agent still beats (their pod or process tree is gone; it comes before
    the ranks' own silence, ``silence_timeout_s``, so the verdict names the pod, not a hang).

    Thermal: ``thermal_samples`` (2) consecutive telemetry samples with a thermal clock-event
    reason.

    Host and link telemetry (``detector.telemetry``): ``telemetry`` (``TelemetryConfig``).

    A throughput drop names the slowest rank when its median step time (compute time where the
    heartbeats carry it) is ``throughput_culprit_ratio`` (1.25) × the median of the others or
    more; else no culprit.
    """

    silence_timeout_s: float = 5.0
    silence_phase_s: float = 10.0
    silence_beats: int = 15
    step_window: int = 256
    min_step_samples: int = 8
    step_timeout_factor: float = 5.0
    step_timeout_floor_s: float = 10.0
    step_timeout_ceiling_s: float = 600.0
    unlearned_timeout_s: float = 120.0
    phase_timeout_s: dict[str, float] = field(default_factory=lambda: {
        "startup": 300.0, "compile": 900.0, "checkpoint": 600.0, "recovery": 120.0,
        "eval": 900.0})
    rank_ring: int = 16
    straggler_recent: int = 5
    straggler_z: float = 3.5
    straggler_ratio: float = 1.5
    straggler_ratio_small: float = 2.0
    straggler_min_ranks: int = 3
    straggler_min_excess_s: float = 0.02
    throughput_window_s: float = 10.0
    throughput_alpha: float = 0.05
    throughput_drop_ratio: float = 0.5
    throughput_warmup_windows: int = 6
    node_timeout_s: float = 3.0
    thermal_samples: int = 2
    throughput_culprit_ratio: float = 1.25
    telemetry: "TelemetryConfig" = field(default_factory=lambda: TelemetryConfig())


@dataclass
class TelemetryConfig:
    """Thresholds of the host and link rules (``detector.telemetry.RULES``). Times in seconds.

    Host memory: ``mem_critical_ratio`` (0.97) of the total in use (total − available) — the
    kernel's OOM killer runs when an allocation finds no memory to reclaim (linux
    mm/oom_kill.c), and MemAvailable (proc(5)) is its estimate of what is left;
    ``mem_trend_window_s`` (60) of samples fitted by least squares, flagged when the fit reaches
    the total within ``mem_horizon_s`` (120) while ``mem_trend_floor_ratio`` (0.8) is in use
    (a growing but small heap is no pressure). CPU: ``cpu_saturated_percent`` (95) for
    ``cpu_samples`` (5) consecutive samples (the agent samples every second: 5 s of a host with
    no idle CPU, which slows every rank on it — findings: oversubscribed cores stall each gloo
    collective). Latency to a peer: TCP connect round trip ≥ ``latency_warn_s`` (0.05: a data
    centre LAN answers in well under 1 ms) or unreachable, for ``latency_samples`` (3)
    consecutive samples. NVLink: a rise of a replay or recovery counter above
    ``nvlink_error_limit`` (1) between samples, or CRC errors at ``nvlink_crc_per_s`` (100) per
    second or more; PCIe replays at ``pcie_replays_per_min`` (8) per minute or more — NVIDIA
    DCGM's hardware limits (dcgm_gpu_hardware_limits.h: DCGM_LIMIT_MAX_LWLINK_ERROR 1,
    DCGM_LIMIT_MAX_LWLINK_CRC_ERROR 100 per second, DCGM_LIMIT_MAX_PCIREPLAY_RATE 8 per
    minute). Corrected (single-bit) ECC errors at ``ecc_corrected_per_min`` (10) per minute or
    more: DCGM_LIMIT_MAX_SBE_RATE 10 of the same file (DCGM marks that value provisional and
    states no unit; it is read per minute here, as the PCIe replay rate beside it is), the rate
    the driver reports as XID 92 "High single-bit ECC error rate".
    """

    mem_critical_ratio: float = 0.97
    mem_trend_window_s: float = 60.0
    mem_horizon_s: float = 120.0
    mem_trend_floor_ratio: float = 0.8
    mem_trend_min_samples: int = 5
    cpu_saturated_percent: float = 95.0
    cpu_samples: int = 5
    latency_warn_s: float = 0.05
    latency_samples: int = 3
    nvlink_error_limit: int = 1
    nvlink_crc_per_s: float = 100.0
    pcie_replays_per_min: float = 8.0
    ecc_corrected_per_min: float = 10.0


# ---------------------------------------------------------------------------------------------
# findings


@dataclass
class Finding:
    """What a rule found, before it becomes an ``Anomaly``. ``ts`` is Unix ns of the earliest
    evidence (0 = unknown); ``detail`` carries facts plus the ``layer``/``weight`` hints the
    attributor uses (no action: only the remediator chooses one)."""

    kind: str
    fault_class: str
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)
    symptom: bool = False
    severity: str = "error"
    evidence: list[str] = field(default_factory=list)
    detail: dict = field(default_factory=dict)
    ts: int = 0
    generation: int | None = None

    def dedup_key(self, job: str) -> tuple:
        """One anomaly per (job, subject, kind, generation) incident."""
        subject = tuple(self.ranks) or tuple(self.nodes) or tuple(self.gpus)
        return (job, subject, self.kind, self.detail.get("pattern", ""), self.generation)

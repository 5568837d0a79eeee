"""Detector rules: pure functions over small per-job / per-rank / per-node state objects.

Nothing here does I/O or reads a clock: callers pass ``now`` (seconds on a monotonic clock) and
the events. Each rule returns ``Finding`` objects; the service turns them into
``schemas.Anomaly`` events and ``diagnose`` into an offline verdict.

Defaults and their reasoning live in ``DetectorConfig``.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Iterable

from trainguard.schemas.job import JobRecord
from trainguard.schemas.vocabulary import FaultClass, Layer
from trainguard.xid import XidMatch, xid_info

from . import patterns as pat

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
    hang detection set ``hang_timeout_s``, e.g. 2 s in the demo — but in the phases of ``SLOW_PHASES`` (start-up, compile,
    checkpoint, recovery) a live rank can stall longer, so there it is ``silence_phase_s``
    = 10 s); for a rank that beats slower, ``silence_beats`` (15)
    × its own ``interval_s`` when that is longer. A job's ``hang_timeout_s`` overrides both.

    Hang (no progress while beating): ``step_timeout = clamp(step_timeout_factor × p99 step
    time, step_timeout_floor_s, step_timeout_ceiling_s)`` over the job's last
    ``step_window`` step times. Factor 5: a healthy job's p99 step is rarely exceeded by 2× (data
    loader hiccups, eval steps), 5× leaves room without waiting minutes. Floor 10 s: below that,
    ordinary noise of a loaded host (steps slowed 0.28 → 0.42 s while a checkpoint was staged;
    multi-second stalls of every rank at load 9 on 2 cores) would trip it. Ceiling 600 s: NCCL's default collective timeout in recent PyTorch is
    10 min; beyond it the collective itself fails. Until ``min_step_samples`` step times are
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
    overrides it for its nodes.

    Thermal: ``thermal_samples`` (2) consecutive telemetry samples with a thermal clock-event
    reason.
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


# ---------------------------------------------------------------------------------------------
# per-rank and per-job state (small: __slots__ and fixed-size rings)


class RankState:
    """Last heartbeat facts of one rank. Times: ``last_hb``/``last_advance`` monotonic seconds
    of this process. ``times`` is a ring of the last step times (float32 seconds)."""

    __slots__ = ("rank", "node", "local_rank", "generation", "step", "seq", "phase", "last_hb",
                 "last_advance", "times", "n_times", "exited", "interval")

    def __init__(self, rank: int, ring: int = 16):
        self.rank = rank
        self.node = ""
        self.local_rank = 0
        self.generation = 0
        self.step = -1
        self.seq = 0
        self.phase = "startup"
        self.last_hb = 0.0
        self.last_advance = 0.0
        self.times = array("f", bytes(4 * ring))
        self.n_times = 0
        self.exited = False
        self.interval = 0.1

    def add_time(self, t: float) -> None:
        self.times[self.n_times % len(self.times)] = t
        self.n_times += 1

    def recent(self, k: int) -> list[float]:
        """Up to ``k`` most recent step times (seconds)."""
        n = min(k, self.n_times, len(self.times))
        size = len(self.times)
        return [self.times[(self.n_times - 1 - i) % size] for i in range(n)]


class JobState:
    """Windows of one job: its ranks, a ring of recent step times for the learned hang timeout,
    and throughput bookkeeping."""

    __slots__ = ("name", "ranks", "times", "n_times", "max_step", "tp_mark", "tp_step",
                 "tp_base", "tp_windows", "dirty", "p99", "p99_n", "gen", "gen_started")

    def __init__(self, name: str, window: int = 256):
        self.name = name
        self.ranks: dict[int, RankState] = {}
        self.times = array("f", bytes(4 * window))
        self.n_times = 0
        self.max_step = -1
        self.tp_mark = 0.0
        self.tp_step = -1
        self.tp_base = 0.0
        self.tp_windows = 0
        self.dirty = False
        self.p99 = 0.0
        self.p99_n = -1
        self.gen = 0
        self.gen_started = 0.0  # monotonic time the job's newest generation was first seen

    def add_time(self, t: float) -> None:
        self.times[self.n_times % len(self.times)] = t
        self.n_times += 1


# ---------------------------------------------------------------------------------------------
# heartbeat ingestion (hot path: no allocation beyond the state objects)


def observe_heartbeat(job: JobState, rank: int, node: str | None, local_rank: int,
                      generation: int, step: int, seq: int, phase: str,
                      step_time_s: float | None, now: float, cfg: DetectorConfig,
                      interval: float = 0.1, compute_s: float | None = None) -> RankState:
    """Fold one rank heartbeat into ``job``; returns the rank's state.

    The job's ring (learned hang timeout) takes the step wall time; the rank's ring (straggler
    score) takes ``compute_s`` when the shim measured it — in synchronous data parallelism every
    rank's wall time equals the slowest rank's, and only the time before the first collective
    tells the straggler — else the wall time."""
    rs = job.ranks.get(rank)
    if rs is None:
        rs = job.ranks[rank] = RankState(rank, cfg.rank_ring)
        rs.last_advance = now
    if generation > job.gen:
        # the job restarted from a checkpoint: progress and throughput windows start over
        job.gen = generation
        job.gen_started = now
        job.max_step = -1
        job.tp_mark = 0.0
    if generation != rs.generation:
        # a new process-group generation restarts from a checkpoint: steps may go back
        rs.generation = generation
        rs.last_advance = now
        rs.step, rs.seq = -1, 0
    if node:
        rs.node = node
    rs.local_rank = local_rank
    rs.last_hb = now
    rs.exited = False
    rs.phase = phase
    rs.interval = interval
    if step > rs.step:
        rs.last_advance = now
        if step_time_s is not None and step_time_s > 0:
            job.add_time(step_time_s)
            job.dirty = True
        t = compute_s if compute_s is not None and compute_s > 0 else step_time_s
        if t is not None and t > 0:
            rs.add_time(t)
    elif seq > rs.seq:
        rs.last_advance = now
    rs.step = step
    rs.seq = seq
    if step > job.max_step:
        job.max_step = step
    return rs


def nan_loss_rule(loss: float | None, rank: int, node: str | None, step: int,
                  generation: int, ts: int) -> Finding | None:
    """A heartbeat whose loss is NaN or ±Inf."""
    if loss is None or math.isfinite(loss):
        return None
    return Finding("nan_loss", "nan_loss", ranks=[rank], nodes=[node] if node else [],
                   evidence=[f"rank {rank} reported loss={loss} at step {step}"],
                   detail={"step": step, "layer": "application", "weight": 0.9},
                   ts=ts, generation=generation)


# ---------------------------------------------------------------------------------------------
# crash


#: signal number -> (fault class, layer, name). SIGKILL with oom_killed is oom_host. SIGBUS is
#: infrastructure: in a training process it is nearly always /dev/shm too small (patterns.py).
SIGNALS: dict[int, tuple[FaultClass, Layer, str]] = {
    9: (FaultClass.CRASH, Layer.UNKNOWN, "SIGKILL"),
    11: (FaultClass.CRASH, Layer.UNKNOWN, "SIGSEGV"),
    7: (FaultClass.CRASH, Layer.INFRASTRUCTURE, "SIGBUS"),
    6: (FaultClass.CRASH, Layer.UNKNOWN, "SIGABRT"),
    15: (FaultClass.CRASH, Layer.UNKNOWN, "SIGTERM"),
    4: (FaultClass.CRASH, Layer.UNKNOWN, "SIGILL"),
    8: (FaultClass.CRASH, Layer.APPLICATION, "SIGFPE"),
}


def crash_rule(rank: int | None, node: str | None, exit_code: int | None, signal: int | None,
               oom_killed: bool, expected: bool, generation: int, ts: int,
               pid: int = 0) -> Finding | None:
    """``worker.exited`` that was not expected: killed by a signal or a non-zero exit code.
    Exit codes above 128 are read as 128 + signal (shell convention)."""
    if expected:
        return None
    sig = signal
    if sig is None and exit_code is not None and 128 < exit_code < 160:
        sig = exit_code - 128
    if sig is None and (exit_code is None or exit_code == 0):
        return None
    ranks = [rank] if rank is not None else []
    nodes = [node] if node else []
    if sig == 9 and oom_killed:
        return Finding("crash", "oom_host", ranks=ranks, nodes=nodes,
                       evidence=[f"rank {rank} (pid {pid}) on {node} killed by the kernel OOM "
                                 f"killer (SIGKILL)"],
                       detail={"signal": 9, "oom_killed": True, "layer": "application",
                               "weight": 0.95},
                       ts=ts, generation=generation)
    if sig is not None:
        fc, layer, name = SIGNALS.get(sig, (FaultClass.CRASH, Layer.UNKNOWN, f"signal {sig}"))
        why = f"rank {rank} (pid {pid}) on {node} killed by {name}"
    else:
        fc, layer = FaultClass.CRASH, Layer.UNKNOWN
        why = f"rank {rank} (pid {pid}) on {node} exited with code {exit_code}"
    return Finding("crash", fc, ranks=ranks, nodes=nodes, evidence=[why],
                   detail={"signal": sig, "exit_code": exit_code, "layer": layer.value,
                           "weight": 0.8},
                   ts=ts, generation=generation)


# ---------------------------------------------------------------------------------------------
# hang


def p99(values: Iterable[float]) -> float:
    """99th percentile (nearest rank) of ``values``; 0.0 when empty."""
    v = sorted(values)
    if not v:
        return 0.0
    return v[min(len(v) - 1, max(0, math.ceil(0.99 * len(v)) - 1))]


def learned_step_timeout(job: JobState, cfg: DetectorConfig,
                         explicit: float | None = None) -> float:
    """No-progress timeout (seconds) of a job in phase ``train``: the job's explicit
    ``hang_timeout_s`` when set, else clamp(factor × p99, floor, ceiling) over the job's recent
    step times, else ``unlearned_timeout_s``. Caches the p99 on the job."""
    if explicit:
        return explicit
    n = min(job.n_times, len(job.times))
    if n < cfg.min_step_samples:
        return cfg.unlearned_timeout_s
    if job.p99_n != job.n_times:
        job.p99 = p99(job.times[:n])
        job.p99_n = job.n_times
    return min(cfg.step_timeout_ceiling_s,
               max(cfg.step_timeout_floor_s, cfg.step_timeout_factor * job.p99))


def phase_timeout(phases: Iterable[str], job: JobState, cfg: DetectorConfig,
                  jc: JobRecord | None = None) -> float:
    """Allowance for a job whose ranks are in ``phases``: the longest of the phases present
    (a rank saving a checkpoint holds everyone at the next collective)."""
    jc = jc or JobRecord()
    out = learned_step_timeout(job, cfg, jc.hang_timeout_s)
    for ph in set(phases):
        if ph == "startup" and jc.startup_timeout_s:
            out = max(out, jc.startup_timeout_s)
        elif ph in cfg.phase_timeout_s:
            out = max(out, cfg.phase_timeout_s[ph])
    return out


#: Phases in which a live rank may fall briefly silent (imports holding the GIL, process-group
#: formation, a large synchronous serialisation, an overloaded host): silence there needs
#: ``silence_phase_s``.
SLOW_PHASES = ("startup", "compile", "checkpoint", "recovery", "eval")


def silence_rule(job: JobState, now: float, cfg: DetectorConfig,
                 jc: JobRecord | None = None) -> list[Finding]:
    """Hang (a): ranks whose heartbeats stopped for longer than the silence timeout while not
    ``done`` and not known to have exited. The silent rank is the culprit: a stopped process's
    heartbeat thread stops too, while ranks blocked in a collective keep beating."""
    jc = jc or JobRecord()
    explicit = jc.hang_timeout_s
    base = explicit or cfg.silence_timeout_s
    out = []
    for rs in job.ranks.values():
        if rs.exited or rs.phase == "done" or rs.last_hb == 0.0 or rs.generation < job.gen:
            continue
        silent = now - rs.last_hb
        if silent > base:
            timeout = explicit or max(base, cfg.silence_beats * rs.interval)
            if rs.phase in SLOW_PHASES:
                timeout = max(timeout, cfg.silence_phase_s)
            if silent <= timeout:
                continue
            out.append(Finding(
                "hang", "hang", ranks=[rs.rank], nodes=[rs.node] if rs.node else [],
                evidence=[f"rank {rs.rank} on {rs.node or '?'} sent no heartbeat for "
                          f"{silent:.2f} s (timeout {timeout:.2f} s) at step {rs.step}, "
                          f"phase {rs.phase}"],
                detail={"rule": "silence", "silent_s": round(silent, 3), "timeout_s": timeout,
                        "step": rs.step, "collective_seq": rs.seq, "layer": "unknown",
                        "weight": 0.85},
                generation=rs.generation))
    return out


def stall_rule(job: JobState, now: float, cfg: DetectorConfig,
               jc: JobRecord | None = None) -> list[Finding]:
    """Hang (b): every live rank still beats but none advanced for longer than the phase
    timeout. The culprit is the rank behind (lowest ``(step, collective_seq)``): the others
    entered the next collective and wait for it. When all are level, no rank is singled out."""
    silence = (jc.hang_timeout_s if jc else None) or cfg.silence_timeout_s
    live = [rs for rs in job.ranks.values()
            if not rs.exited and rs.phase != "done" and rs.last_hb > 0.0
            and rs.generation >= job.gen and now - rs.last_hb <= silence]
    if not live:
        return []
    last_adv = max(rs.last_advance for rs in live)
    timeout = phase_timeout((rs.phase for rs in live), job, cfg, jc)
    stalled = now - last_adv
    if stalled <= timeout:
        return []
    low = min((rs.step, rs.seq) for rs in live)
    behind = sorted(rs.rank for rs in live if (rs.step, rs.seq) == low)
    level = len(behind) == len(live)
    gen = max(rs.generation for rs in live)
    ranks = [] if level and len(live) > 1 else behind
    nodes = sorted({rs.node for rs in live if rs.rank in ranks and rs.node})
    ev = [f"no rank advanced for {stalled:.2f} s (timeout {timeout:.2f} s); "
          + (f"ranks {behind} are behind at step {low[0]} / collective {low[1]}, the others "
             f"wait for them in the next collective" if not level or len(live) == 1
             else f"all {len(live)} ranks level at step {low[0]} / collective {low[1]}")]
    return [Finding("hang", "hang", ranks=ranks, nodes=nodes, evidence=ev,
                    detail={"rule": "no_progress", "stalled_s": round(stalled, 3),
                            "timeout_s": timeout, "step": low[0], "collective_seq": low[1],
                            "layer": "unknown", "weight": 0.6 if level else 0.8},
                    generation=gen)]


def missing_member_rule(job: JobState, jc: JobRecord, started: float, now: float,
                        cfg: DetectorConfig) -> list[Finding]:
    """Registered members that never sent a heartbeat within the startup allowance while
    others did: they never came up (the rendezvous waits for them). The allowance runs from the
    job's start or from its newest generation, whichever is later: a rank started again by a
    decision gets a start-up of its own (without that, a rank slow to come up was "missing"
    again at once in every generation after the first, until the retry budget was spent)."""
    if not jc.members or not job.ranks:
        return []
    allowance = jc.startup_timeout_s or cfg.phase_timeout_s["startup"]
    if now - max(started, job.gen_started) <= allowance:
        return []
    missing = sorted(int(m["rank"]) for m in jc.members
                     if "rank" in m and int(m["rank"]) not in job.ranks)
    if not missing:
        return []
    nodes = sorted({str(m.get("node")) for m in jc.members
                    if m.get("rank") in missing and m.get("node")})
    return [Finding("hang", "hang", ranks=missing, nodes=nodes,
                    evidence=[f"ranks {missing} never sent a heartbeat in {allowance:.0f} s of "
                              f"start-up while {len(job.ranks)} ranks did"],
                    detail={"rule": "never_started", "layer": "unknown", "weight": 0.7},
                    generation=jc.generation)]


# ---------------------------------------------------------------------------------------------
# straggler and throughput


def robust_z(values: list[float]) -> tuple[float, float, list[float]]:
    """(median, MAD, modified z-scores) of ``values`` (Iglewicz & Hoaglin 1993)."""
    v = sorted(values)
    n = len(v)
    med = v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
    dev = sorted(abs(x - med) for x in values)
    mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
    floor = 0.05 * med if med > 0 else 1e-9
    mad_eff = max(mad, floor)
    return med, mad, [0.6745 * (x - med) / mad_eff for x in values]


def straggler_scores(series: dict, cfg: DetectorConfig) -> list[tuple]:
    """Stragglers among ``series`` (key -> recent step times, seconds, newest first):
    ``[(key, x, median, z)]`` for each flagged key. Pure: used live (keys = ranks) and offline
    (keys = ranks or devices parsed from logs)."""
    stats = {}
    for k, times in series.items():
        if times:
            t = sorted(times[:cfg.straggler_recent])
            m = len(t) // 2
            stats[k] = t[m] if len(t) % 2 else 0.5 * (t[m - 1] + t[m])
    if len(stats) < 2:
        return []
    keys = list(stats)
    xs = [stats[k] for k in keys]
    if len(xs) < cfg.straggler_min_ranks:
        fastest = min(xs)
        return [(k, x, fastest, float("nan")) for k, x in zip(keys, xs)
                if fastest > 0 and x >= cfg.straggler_ratio_small * fastest
                and x - fastest >= cfg.straggler_min_excess_s]
    med, _mad, zs = robust_z(xs)
    return [(k, x, med, z) for k, x, z in zip(keys, xs, zs)
            if z > cfg.straggler_z and med > 0 and x >= cfg.straggler_ratio * med
            and x - med >= cfg.straggler_min_excess_s]


def straggler_rule(job: JobState, cfg: DetectorConfig) -> list[Finding]:
    """Per-rank step-time score against the job's median (see ``DetectorConfig``)."""
    series = {rs.rank: rs.recent(cfg.straggler_recent) for rs in job.ranks.values()
              if not rs.exited and rs.phase == "train"}
    out = []
    for rank, x, med, z in straggler_scores(series, cfg):
        rs = job.ranks[rank]
        zs = "n/a" if z != z else f"{z:.1f}"
        out.append(Finding(
            "straggler", "straggler", ranks=[rank], nodes=[rs.node] if rs.node else [],
            severity="warning",
            evidence=[f"rank {rank} median step time {x:.3f} s vs job median {med:.3f} s "
                      f"({x / med:.1f}x, robust z {zs})"],
            detail={"step_time_s": round(x, 4), "job_median_s": round(med, 4),
                    "z": None if z != z else round(z, 2), "layer": "unknown",
                    "weight": 0.7},
            generation=rs.generation))
    return out


def throughput_rule(job: JobState, now: float, cfg: DetectorConfig) -> Finding | None:
    """Job step rate over the last window against its own moving-average baseline; evaluated
    when a window closes (call as often as you like)."""
    if job.tp_mark == 0.0:
        job.tp_mark, job.tp_step = now, job.max_step
        return None
    span = now - job.tp_mark
    if span < cfg.throughput_window_s:
        return None
    rate = max(0, job.max_step - job.tp_step) / span
    job.tp_mark, job.tp_step = now, job.max_step
    job.tp_windows += 1
    base = job.tp_base
    if job.tp_windows == 1 or base == 0.0:
        job.tp_base = rate
        return None
    finding = None
    if job.tp_windows > cfg.throughput_warmup_windows and rate < cfg.throughput_drop_ratio * base:
        gen = max((rs.generation for rs in job.ranks.values()), default=0)
        finding = Finding(
            "throughput_drop", "straggler", symptom=True, severity="warning",
            evidence=[f"job {job.name} made {rate:.2f} steps/s over the last {span:.0f} s "
                      f"against its baseline of {base:.2f} steps/s"],
            detail={"rate": round(rate, 4), "baseline": round(base, 4), "layer": "unknown",
                    "weight": 0.5},
            generation=gen)
    else:
        job.tp_base = (1 - cfg.throughput_alpha) * base + cfg.throughput_alpha * rate
    return finding


# ---------------------------------------------------------------------------------------------
# nodes: lost, XID, telemetry


class NodeState:
    """Liveness and GPU counters of one node. ``last`` maps heartbeat role -> monotonic s."""

    __slots__ = ("name", "last", "lost", "gpu_prev", "thermal_run")

    def __init__(self, name: str):
        self.name = name
        self.last: dict[str, float] = {}
        self.lost = False
        self.gpu_prev: dict[int, dict] = {}
        self.thermal_run: dict[int, int] = {}


def observe_node_heartbeat(ns: NodeState, role: str, now: float) -> None:
    ns.last[role] = now
    ns.lost = False


def node_lost_rule(ns: NodeState, now: float, timeout: float) -> Finding | None:
    """A node whose every heartbeat role (agent and launcher) has been silent for longer than
    ``timeout`` seconds. Fires once until a heartbeat returns."""
    if ns.lost or not ns.last:
        return None
    newest = max(ns.last.values())
    silent = now - newest
    if silent <= timeout:
        return None
    ns.lost = True
    roles = ", ".join(sorted(ns.last))
    return Finding("node_lost", "node_lost", nodes=[ns.name],
                   evidence=[f"node {ns.name}: no heartbeat from {roles} for {silent:.2f} s "
                             f"(timeout {timeout:.2f} s)"],
                   detail={"silent_s": round(silent, 3), "timeout_s": timeout,
                           "layer": "infrastructure", "weight": 0.9})


def xid_rule(xid: int, node: str | None, pci: str, gpu_index: int | None, pid: int | None,
             raw: str, ts: int, message: str = "") -> Finding | None:
    """A GPU XID: fault class and layer from the XID table. Informational XIDs
    (severity ``info``, e.g. 63 row-remap event) become warnings, not faults."""
    info = xid_info(xid)
    gpu = f"{node}:{gpu_index}" if gpu_index is not None and node else (pci or "")
    sev = "warning" if info.severity == "info" else "error"
    return Finding(
        "gpu_fault", info.fault_class, nodes=[node] if node else [], gpus=[gpu] if gpu else [],
        severity=sev,
        evidence=[raw or f"XID {xid} on {node} {pci}: {message}",
                  f"XID {xid} {info.mnemonic}: {info.description} ({info.source})"],
        detail={"xid": xid, "pci": pci, "gpu_index": gpu_index, "pid": pid,
                "mnemonic": info.mnemonic, "layer": info.layer, "xid_severity": info.severity, "weight": 0.95 if info.layer != "unknown" else 0.5},
        ts=ts)


def xid_finding_from_match(m: XidMatch, node: str | None, ts: int = 0,
                           gpu_index: int | None = None) -> Finding | None:
    return xid_rule(m.xid, node, m.pci, gpu_index, m.pid, m.raw, ts, m.message)


#: NVML clock-event reason bits that mean thermal slowdown (nvml.h: nvmlClocksEventReason*).
THERMAL_REASON_BITS = {0x08: "HwSlowdown", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown"}
THERMAL_NAME_WORDS = ("thermal", "hwslowdown", "hw_slowdown")

#: GPU counters whose rise is a fault: field -> (kind, fault class, severity). All hardware.
COUNTER_RULES: dict[str, tuple[str, FaultClass, str]] = {
    "ecc_volatile_uncorrected": ("ecc", FaultClass.ECC, "error"),
    "ecc_aggregate_uncorrected": ("ecc", FaultClass.ECC, "error"),
    "retired_pages_dbe": ("ecc", FaultClass.ECC, "error"),
    "remapped_rows_uncorrectable": ("ecc", FaultClass.ECC, "error"),
    "ecc_volatile_corrected": ("ecc_corrected", FaultClass.ECC, "warning"),
    "remapped_rows_correctable": ("ecc_corrected", FaultClass.ECC, "warning"),
    "pcie_replay_counter": ("pcie_replay", FaultClass.GPU_XID, "warning"),
}
#: GPU flags whose becoming True is a fault: field -> (kind, fault class, severity). Hardware.
FLAG_RULES: dict[str, tuple[str, FaultClass, str]] = {
    "remapped_rows_failure": ("ecc", FaultClass.ECC, "error"),
    "retired_pages_pending": ("ecc", FaultClass.ECC, "warning"),
    "remapped_rows_pending": ("ecc", FaultClass.ECC, "warning"),
}


def telemetry_rule(ns: NodeState, gpus: list[dict], cfg: DetectorConfig, ts: int = 0
                   ) -> list[Finding]:
    """Thermal slowdown from clock-event reasons, and ECC / row-remap / PCIe-replay counters
    rising between two samples of the same GPU. ``gpus`` are ``GpuSample`` dicts."""
    out = []
    for g in gpus:
        idx = int(g.get("index", 0))
        gid = f"{ns.name}:{idx}"
        reasons = g.get("clock_event_reasons") or 0
        names = [str(n) for n in g.get("clock_event_names") or []]
        hot = [THERMAL_REASON_BITS[b] for b in THERMAL_REASON_BITS if reasons & b]
        hot += [n for n in names if any(w in n.lower() for w in THERMAL_NAME_WORDS)]
        if hot:
            run = ns.thermal_run.get(idx, 0) + 1
            ns.thermal_run[idx] = run
            if run == cfg.thermal_samples:
                out.append(Finding(
                    "thermal", "thermal", nodes=[ns.name], gpus=[gid], severity="warning",
                    evidence=[f"GPU {gid} clock-event reasons {sorted(set(hot))} for {run} "
                              f"samples, temperature {g.get('temperature_c')} °C"],
                    detail={"gpu_index": idx, "reasons": sorted(set(hot)),
                            "temperature_c": g.get("temperature_c"), "layer": "hardware",
                            "weight": 0.8},
                    ts=ts))
        else:
            ns.thermal_run[idx] = 0
        prev = ns.gpu_prev.get(idx)
        if prev is not None:
            for fld, (kind, fc, sev) in COUNTER_RULES.items():
                a, b = prev.get(fld), g.get(fld)
                if a is not None and b is not None and b > a:
                    out.append(Finding(
                        kind, fc, nodes=[ns.name], gpus=[gid], severity=sev,
                        evidence=[f"GPU {gid} {fld} rose {a} -> {b}"],
                        detail={"gpu_index": idx, "counter": fld, "before": a, "after": b,
                                "layer": "hardware", "weight": 0.9 if sev == "error" else 0.4},
                        ts=ts))
            for fld, (kind, fc, sev) in FLAG_RULES.items():
                if g.get(fld) and not prev.get(fld):
                    out.append(Finding(
                        kind, fc, nodes=[ns.name], gpus=[gid], severity=sev,
                        evidence=[f"GPU {gid} {fld} became true"],
                        detail={"gpu_index": idx, "flag": fld, "layer": "hardware",
                                "weight": 0.85},
                        ts=ts))
        ns.gpu_prev[idx] = {k: g.get(k) for k in (*COUNTER_RULES, *FLAG_RULES)}
    return out


# ---------------------------------------------------------------------------------------------
# log lines


def log_rule(line: str, stream: str, rank: int | None, node: str | None,
             generation: int | None, ts: int, step: int | None = None) -> Finding | None:
    """A log line through the XID parser and the pattern table. A line from
    ``stream == "exception"`` (a traceback the shim caught) that matches no specific row is an
    application exception of the rank that sent it. For a multi-line traceback the last
    matching line decides (Python prints the exception last)."""
    lines = [ln for ln in line.splitlines() if ln.strip()] or [line]
    found: pat.PatternMatch | None = None
    hit = ""
    for ln in lines:
        x = pat_xid(ln, node, ts)
        if x is not None:
            x.ranks = [rank] if rank is not None else []
            x.generation = generation
            return x
        m = pat.match_line(ln)
        if m is not None and (found is None or _better(m, found)):
            found, hit = m, ln.strip()
    if found is None:
        if stream != "exception":
            return None
        last = lines[-1].strip()
        return Finding("log_pattern", "app_exception", ranks=[rank] if rank is not None else [],
                       nodes=[node] if node else [], evidence=[last[:500]],
                       detail={"pattern": "exception", "layer": "application", "weight": 0.6,
                               "step": step},
                       ts=ts, generation=generation)
    p = found.pattern
    r = rank if rank is not None else pat.line_rank(hit)
    g = found.groups
    detail = {"pattern": p.name, "layer": p.layer.value, "weight": p.weight,
              "why": p.why, "step": step, **{k: v for k, v in g.items()}}
    nodes = [node] if node else []
    if "peer_host" in g and p.fault_class == "node_lost":
        nodes = [g["peer_host"]]
        detail["reporter_node"] = node
        detail["reporter_rank"] = r
    ranks = [r] if r is not None and p.fault_class != "node_lost" else []
    if p.name == "horovod_stall" and "ready" in g:
        ready = sorted({int(x) for x in g["ready"].replace(" ", "").split(",") if x})
        ranks = [x for x in range(max(ready) + 1) if x not in ready] if ready else []
        detail["ready_ranks"] = ready
    return Finding("log_pattern", p.fault_class, ranks=ranks, nodes=nodes,
                   symptom=p.symptom, evidence=[hit[:500]], detail=detail, ts=ts,
                   generation=generation)


def _better(a: pat.PatternMatch, b: pat.PatternMatch) -> bool:
    """Within one multi-line message: a root-cause row beats a symptom row, then weight."""
    if a.pattern.symptom != b.pattern.symptom:
        return not a.pattern.symptom
    return a.pattern.weight > b.pattern.weight


def pat_xid(line: str, node: str | None, ts: int) -> Finding | None:
    from trainguard.xid import parse_xid_line

    m = parse_xid_line(line)
    return xid_finding_from_match(m, node, ts) if m else None


def save_failed_finding(rank: int | None, node: str | None, step: int, error: str,
                        errno: int | None, generation: int | None, ts: int) -> Finding:
    """A checkpoint save that failed (schema ``ckpt.save_failed``). Its own fault class,
    ``checkpoint_save``: the Checkpointer keeps training going and the last valid checkpoint in
    place, so the policy flags it (policy table) instead of stopping the job the way the
    ``filesystem`` class does for a rank that crashed on a full disk. A warning, like the other
    flags: it does not settle an incident whose root cause is still to come. One anomaly per rank
    and generation (the dedup key)."""
    return Finding("log_pattern", "checkpoint_save", ranks=[rank] if rank is not None else [],
                   nodes=[node] if node else [],
                   evidence=[f"checkpoint save at step {step} failed: {error}"[:500]],
                   severity="warning",
                   detail={"pattern": "checkpoint_save_failed", "layer": "infrastructure",
                           "weight": 0.8, "errno": errno, "step": step},
                   ts=ts, generation=generation)

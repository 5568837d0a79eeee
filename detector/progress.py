"""Rank and job windows, and the rules over them: hang (silence, no progress, members that never
started), straggler, throughput drop, NaN loss.

Pure: nothing here does I/O or reads a clock. Callers pass ``now`` (seconds on a monotonic
clock) and the heartbeat facts; each rule returns ``Finding`` objects (``detector.core``).
Defaults and the sources of the thresholds are in ``DetectorConfig``.
"""
from __future__ import annotations

import math
from array import array
from typing import Iterable

from trainguard.schemas.job import JobRecord

from trainguard.detector.core import DetectorConfig, Finding

# ---------------------------------------------------------------------------------------------
# per-rank and per-job state (small: __slots__ and fixed-size rings)


class RankState:
    """Last heartbeat facts of one rank. Times: ``last_hb``/``last_advance`` monotonic seconds
    of this process. ``times`` is a ring of the last step times (float32 seconds). ``seq``:
    collectives (or steps) entered; ``done``: collectives completed, None when the sender does
    not count them. The ring grows with the steps reported, up to ``ring`` entries: a rank that
    never reports a step time (a hostile or a stillborn one) keeps none."""

    __slots__ = ("rank", "node", "local_rank", "generation", "step", "seq", "done", "phase",
                 "last_hb", "last_advance", "times", "ring", "n_times", "exited", "interval")

    def __init__(self, rank: int, ring: int = 16):
        self.rank = rank
        self.node = ""
        self.local_rank = 0
        self.generation = 0
        self.step = -1
        self.seq = 0
        self.done: int | None = None
        self.phase = "startup"
        self.last_hb = 0.0
        self.last_advance = 0.0
        self.times = array("f")
        self.ring = ring
        self.n_times = 0
        self.exited = False
        self.interval = 0.1

    def add_time(self, t: float) -> None:
        _ring_add(self.times, self.ring, self.n_times, t)
        self.n_times += 1

    def recent(self, k: int) -> list[float]:
        """Up to ``k`` most recent step times (seconds)."""
        n = min(k, self.n_times, len(self.times))
        size = len(self.times)
        return [self.times[(self.n_times - 1 - i) % size] for i in range(n)]


class JobState:
    """Windows of one job: its ranks, a ring of recent step times for the learned hang timeout
    (grown with the steps reported, up to ``window`` entries: 1 KiB at 256, kept only by a job
    that reports steps), and throughput bookkeeping."""

    __slots__ = ("name", "ranks", "times", "window", "n_times", "max_step", "tp_mark", "tp_step",
                 "tp_base", "tp_windows", "dirty", "p99", "p99_n", "gen", "gen_started",
                 "silence_due")

    def __init__(self, name: str, window: int = 256):
        self.name = name
        self.ranks: dict[int, RankState] = {}
        self.times = array("f")
        self.window = window
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
        # monotonic s before which no rank can be found silent (``silence_rule`` sets it; a
        # caller that changes a timeout sets it back to -inf)
        self.silence_due = -math.inf

    def add_time(self, t: float) -> None:
        _ring_add(self.times, self.window, self.n_times, t)
        self.n_times += 1


def _ring_add(ring: array, size: int, n: int, t: float) -> None:
    """Put the ``n``-th value ``t`` (0-based) into ``ring`` of at most ``size`` entries: appended
    while it is shorter, over the oldest after that."""
    if len(ring) < size:
        ring.append(t)
    else:
        ring[n % size] = t


# ---------------------------------------------------------------------------------------------
# heartbeat ingestion (hot path: no allocation beyond the state objects)


def observe_heartbeat(job: JobState, rank: int, node: str | None, local_rank: int,
                      generation: int, step: int, seq: int, phase: str,
                      step_time_s: float | None, now: float, cfg: DetectorConfig,
                      interval: float = 0.1, compute_s: float | None = None,
                      completed: int | None = None) -> RankState:
    """Fold one rank heartbeat into ``job``; returns the rank's state.

    The job's ring (learned hang timeout) takes the step wall time; the rank's ring (straggler
    score) takes ``compute_s`` when the shim measured it — in synchronous data parallelism every
    rank's wall time equals the slowest rank's, and only the time before the first collective
    tells the straggler — else the wall time. ``completed``: collectives completed (the hooks
    of an unmodified script count them; None otherwise); a completion is progress too."""
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
        rs.step, rs.seq, rs.done = -1, 0, None
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
    elif seq > rs.seq or (completed is not None and rs.done is not None
                          and completed > rs.done):
        rs.last_advance = now
    rs.step = step
    rs.seq = seq
    rs.done = completed
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
    heartbeat thread stops too, while ranks blocked in a collective keep beating.

    Sets ``job.silence_due``: the earliest time any rank not found silent now could be (its
    last heartbeat plus its timeout, or plus the base timeout while it is under it; with no
    such rank, ``now`` plus the base timeout). A heartbeat only moves a rank's deadline later,
    and a rank that becomes a candidate (it beats again, a new generation) does so with a
    heartbeat at or after ``now``, so a caller may skip the job until then; a changed record
    (``hang_timeout_s``) must reset it to -inf.

    ``detail["since_progress_s"]``: seconds from the silent rank's last progress (its
    ``last_advance``: a step or collective it completed, or its start) to ``now``: the hang's
    fault is that last progress, not the tick that found it (the reducer turns it into
    ``detail["last_progress_ts"]``, Unix ns, and the anomaly's ``first_ts``)."""
    jc = jc or JobRecord()
    explicit = jc.hang_timeout_s
    base = explicit or cfg.silence_timeout_s
    out = []
    due = now + base
    for rs in job.ranks.values():
        if rs.exited or rs.phase == "done" or rs.last_hb == 0.0 or rs.generation < job.gen:
            continue
        silent = now - rs.last_hb
        if silent <= base:
            due = min(due, rs.last_hb + base)
            continue
        timeout = explicit or max(base, cfg.silence_beats * rs.interval)
        if rs.phase in SLOW_PHASES:
            timeout = max(timeout, cfg.silence_phase_s)
        if silent <= timeout:
            due = min(due, rs.last_hb + timeout)
            continue
        out.append(Finding(
            "hang", "hang", ranks=[rs.rank], nodes=[rs.node] if rs.node else [],
            evidence=[f"rank {rs.rank} on {rs.node or '?'} sent no heartbeat for "
                      f"{silent:.2f} s (timeout {timeout:.2f} s) at step {rs.step}, "
                      f"phase {rs.phase}"],
            detail={"rule": "silence", "silent_s": round(silent, 3), "timeout_s": timeout,
                    "since_progress_s": round(now - min(rs.last_advance, rs.last_hb), 3),
                    "step": rs.step, "collective_seq": rs.seq, "layer": "unknown",
                    "weight": 0.85},
            generation=rs.generation))
    job.silence_due = due
    return out


def stall_rule(job: JobState, now: float, cfg: DetectorConfig,
               jc: JobRecord | None = None) -> list[Finding]:
    """Hang (b): every live rank still beats but none advanced for longer than the phase
    timeout. The culprit is the rank behind (lowest ``(step, collective_seq)``): the others
    entered the next collective and wait for it. When all are level, no rank is singled out.

    With collective counts (``RankState.done``, from the hooks of an unmodified script) the
    evidence says where each rank is: ``detail["in_compute"]`` — ranks that completed every
    collective they entered (busy in their own step: the rank behind is one of them),
    ``detail["blocked"]`` — ranks inside a collective (more entered than completed), waiting for
    the rank behind; they are never culprits.

    ``detail["since_progress_s"]``: seconds from the last progress of the rank behind (of the
    job, when all are level) to ``now``: the hang's fault time (see ``silence_rule``)."""
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
    counted = [rs for rs in live if rs.done is not None]
    in_compute = sorted(rs.rank for rs in counted if rs.seq <= rs.done)
    blocked = sorted(rs.rank for rs in counted if rs.seq > rs.done)
    where = ""
    if counted:
        where = (f"; in compute (every collective entered completed): {in_compute}, inside a "
                 f"collective waiting: {blocked}")
    ev = [f"no rank advanced for {stalled:.2f} s (timeout {timeout:.2f} s); "
          + (f"ranks {behind} are behind at step {low[0]} / collective {low[1]}, the others "
             f"wait for them in the next collective" if not level or len(live) == 1
             else f"all {len(live)} ranks level at step {low[0]} / collective {low[1]}")
          + where]
    last = max((rs.last_advance for rs in live if rs.rank in ranks), default=last_adv)
    detail = {"rule": "no_progress", "stalled_s": round(stalled, 3), "timeout_s": timeout,
              "since_progress_s": round(now - last, 3),
              "step": low[0], "collective_seq": low[1], "layer": "unknown",
              "weight": 0.6 if level else 0.8}
    if counted:
        detail.update(in_compute=in_compute, blocked=blocked)
    return [Finding("hang", "hang", ranks=ranks, nodes=nodes, evidence=ev, detail=detail,
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


def slowest_rank(job: JobState, cfg: DetectorConfig) -> tuple[RankState, float, float] | None:
    """The live training rank whose median recent step time (compute time where the heartbeats
    carry it) is ``throughput_culprit_ratio`` × the median of the others' or more:
    ``(rank state, its median, the others' median)``; None when no rank stands out."""
    med = {}
    for rs in job.ranks.values():
        t = sorted(rs.recent(cfg.straggler_recent)) if not rs.exited else []
        if t:
            med[rs.rank] = t[len(t) // 2]
    if len(med) < 2:
        return None
    worst = max(med, key=lambda r: (med[r], -r))
    rest = sorted(v for r, v in med.items() if r != worst)
    ref = rest[len(rest) // 2]
    if ref <= 0 or med[worst] < cfg.throughput_culprit_ratio * ref:
        return None
    return job.ranks[worst], med[worst], ref


def throughput_rule(job: JobState, now: float, cfg: DetectorConfig) -> Finding | None:
    """Job step rate over the last window against its own moving-average baseline; evaluated
    when a window closes (call as often as you like). The finding names the slowest rank
    (``slowest_rank``) when one stands out, else no culprit."""
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
        slow = slowest_rank(job, cfg)
        ev = [f"job {job.name} made {rate:.2f} steps/s over the last {span:.0f} s "
              f"against its baseline of {base:.2f} steps/s"]
        ranks, nodes = [], []
        if slow is not None:
            rs, mine, others = slow
            ranks, nodes = [rs.rank], [rs.node] if rs.node else []
            ev.append(f"slowest: rank {rs.rank} on {rs.node or '?'}, median step "
                      f"{mine:.3f} s against {others:.3f} s for the others")
        finding = Finding(
            "throughput_drop", "straggler", ranks=ranks, nodes=nodes, symptom=True,
            severity="warning", evidence=ev,
            detail={"rate": round(rate, 4), "baseline": round(base, 4), "layer": "unknown",
                    "weight": 0.5},
            generation=gen)
    else:
        job.tp_base = (1 - cfg.throughput_alpha) * base + cfg.throughput_alpha * rate
    return finding

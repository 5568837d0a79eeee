"""The detector's memory and its service parameters (``detector.reducer`` steps over them;
``detector.memory`` keeps them tidy). Data only: no I/O, no rules."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from trainguard.schemas import JobRecord

from trainguard.detector.core import DetectorConfig
from trainguard.detector.progress import JobState
from trainguard.detector.signals import NodeState

__all__ = ["DetectorServiceConfig", "DetectorState"]


@dataclass
class DetectorServiceConfig:
    """The detector's service parameters; times in seconds.

    ``rules`` — rule parameters (``DetectorConfig``). ``job_refresh_s`` — how often the job
    records (members, timeouts, generation) are re-read (2 s). ``eval_s`` — period of the
    per-job stall / straggler / throughput / missing-member evaluation (0.25 s; silence and
    node-lost run on every tick, 50 ms by ``ServiceConfig.tick_s``). ``forget_after_s`` — a rank
    or node silent this long, and a job with no rank left first seen this long ago, is dropped
    from memory (600 s). ``dedup_ttl_s`` — how long an incident key is remembered: the same
    incident is published again after it (3600 s). ``gc_s`` — period of that collection
    (30 s). ``refresh_timeout_s`` — a record read with no reply after this long is issued again
    (10 s: a call lost with a dropped connection must not stop a job's refreshes for good).
    ``max_reads_in_flight`` — record reads out at once; more jobs wait for the next tick (16:
    thousands of new job names at once exhausted the store client's connection pool and
    failed every job's read, bench/fuzz.py).

    Capacity (``capacity``): ``max_jobs`` jobs, ``max_ranks`` ranks over all jobs and
    ``max_nodes`` nodes tracked at once. An event that would track one more past a bound is
    refused (counted in ``DetectorState.refused``, a warning at most every
    ``refused_log_s``) and what is tracked already is kept: without the bounds, memory was
    bounded only by ``forget_after_s``, so a flood of new job names, ranks or nodes (≈ 2 KB a
    job, 0.3 KB a rank) at 3,000 messages/s could hold gigabytes for ten minutes. The defaults
    (20,000 jobs, 200,000 ranks, 65,536 nodes, at most ≈ 150 MB) are far above what one replica
    serves (bench/scale.py: 10,000 ranks over 3 replicas).
    """

    rules: DetectorConfig = field(default_factory=DetectorConfig)
    job_refresh_s: float = 2.0
    eval_s: float = 0.25
    forget_after_s: float = 600.0
    dedup_ttl_s: float = 3600.0
    gc_s: float = 30.0
    refresh_timeout_s: float = 10.0
    max_reads_in_flight: int = 16
    max_jobs: int = 20_000
    max_ranks: int = 200_000
    max_nodes: int = 65_536
    refused_log_s: float = 60.0


@dataclass
class DetectorState:
    """The detector's memory. Times are service-clock seconds (``now``).

    ``jobs`` — per-job windows; ``job_seen`` — when each job (or its current run) was first
    seen; ``records`` — the last job record read for each job (absent until one was read);
    ``nodes`` — per-node liveness and GPU counters; ``node_jobs`` — node → jobs with members on
    it, from the records; ``node_timeouts`` — node → its ``node_timeout`` (a cache, emptied of
    a node when a record naming it changes); ``emitted`` — incident key → when it was
    published; ``reads`` — job → (sequence number, when issued) of its record read in flight,
    numbered by ``read_seq``;
    ``due`` — jobs to read at the next tick (first seen since the last refresh);
    ``last_eval`` / ``last_refresh`` / ``last_gc`` — when the periodic parts last ran (−inf: at
    the first tick); ``anomalies`` — anomalies published so far; ``serves`` — whether this
    replica serves a partition key (``node:<node>``; every key when alone); ``blind`` — the
    bus is not answering (``BusDown``): the silence rules (silence, node lost, stall, missing
    member) are not judged until it answers again; ``ranks`` — ranks tracked over all jobs (an
    upper bound between collections, exact after each); ``refused`` — bound → events refused
    by it (``capacity``), ``refused_logged`` — when that was last logged; ``nodes_due`` — no
    node can be found lost before this time, so a tick before it skips the nodes (the earliest
    node deadline of the last look, lowered by every change that could bring one nearer: a
    heartbeat, a changed node timeout; a node with a launcher is looked at every tick)."""

    config: DetectorServiceConfig = field(default_factory=DetectorServiceConfig)
    jobs: dict[str, JobState] = field(default_factory=dict)
    job_seen: dict[str, float] = field(default_factory=dict)
    records: dict[str, JobRecord] = field(default_factory=dict)
    nodes: dict[str, NodeState] = field(default_factory=dict)
    node_jobs: dict[str, set[str]] = field(default_factory=dict)
    node_timeouts: dict[str, float] = field(default_factory=dict)
    emitted: dict[tuple, float] = field(default_factory=dict)
    reads: dict[str, tuple[int, float]] = field(default_factory=dict)
    due: set[str] = field(default_factory=set)
    read_seq: int = 0
    last_eval: float = -math.inf
    last_refresh: float = -math.inf
    last_gc: float = -math.inf
    anomalies: int = 0
    serves: Callable[[str], bool] = field(default=lambda key: True, repr=False)
    blind: bool = False
    ranks: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    refused_logged: float = -math.inf
    nodes_due: float = -math.inf

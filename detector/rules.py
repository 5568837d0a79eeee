"""Detector rules: pure functions over small per-job / per-rank / per-node state objects.

Nothing here does I/O or reads a clock: callers pass ``now`` (seconds on a monotonic clock) and
the events. Each rule returns ``Finding`` objects; the detector's reducer
(``detector.reducer``) turns them into ``schemas.Anomaly`` events and ``diagnose`` into an
offline verdict.

This module is the one import of the rules (``from trainguard.detector import rules``); they
live in three modules, one concept each:

* ``detector.core`` — ``DetectorConfig`` (parameters, defaults and their sources) and
  ``Finding``;
* ``detector.progress`` — rank and job windows fed by heartbeats, and the rules over them:
  silence, no progress, members that never started, straggler, throughput drop, NaN loss;
* ``detector.signals`` — one-off signals: worker exits, log lines, failed saves, XIDs, GPU
  telemetry, node heartbeats (node lost);
* ``detector.scheduler`` — the Slurm watcher's node and job events (its ``ROWS``).
"""
from __future__ import annotations

from trainguard.detector.core import DetectorConfig, Finding
from trainguard.detector.progress import (SLOW_PHASES, JobState, RankState, learned_step_timeout,
                       missing_member_rule, nan_loss_rule, observe_heartbeat, p99,
                       phase_timeout, robust_z, silence_rule, stall_rule, straggler_rule,
                       straggler_scores, throughput_rule)
from trainguard.detector.signals import (COUNTER_RULES, FLAG_RULES, SIGNALS, THERMAL_NAME_WORDS,
                      THERMAL_REASON_BITS, NodeState, crash_rule, launcher_lost_rule, log_rule,
                      node_lost_rule, observe_node_heartbeat, pat_xid, save_failed_finding,
                      telemetry_rule, xid_finding_from_match, xid_rule)

__all__ = [
    "DetectorConfig", "Finding",
    "SLOW_PHASES", "JobState", "RankState", "learned_step_timeout", "missing_member_rule",
    "nan_loss_rule", "observe_heartbeat", "p99", "phase_timeout", "robust_z", "silence_rule",
    "stall_rule", "straggler_rule", "straggler_scores", "throughput_rule",
    "COUNTER_RULES", "FLAG_RULES", "SIGNALS", "THERMAL_NAME_WORDS", "THERMAL_REASON_BITS",
    "NodeState", "crash_rule", "launcher_lost_rule", "log_rule", "node_lost_rule",
    "observe_node_heartbeat",
    "pat_xid", "save_failed_finding", "telemetry_rule", "xid_finding_from_match", "xid_rule",
]

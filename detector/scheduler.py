"""Rules over the scheduler's word: the Slurm watcher's ``slurm.node`` and ``slurm.job`` events
(``schemas.slurm``, ``trainguard.scheduler.slurm.watch``) as findings. Pure.

``ROWS`` is the table: for each event type and change (and, for a drain, whose reason it is)
the anomaly it makes, or none, and why. ``scheduler_row`` looks a row up; ``node_finding`` and
``job_findings`` build the findings; the detector's reducer fans them out to the jobs on the
node (``detector.reducer``).

What the rows keep in mind:

* **Corroborate, do not duplicate.** A node Slurm marks DOWN or NOT_RESPONDING is a
  ``node_lost`` finding for the jobs on it — the same kind and class as the heartbeat rule's
  (``signals.node_lost_rule``), with ``detail["slurm"]``, so the attributor folds it into the
  incident trainguard already has (same job and generation, same conclusion: no second
  verdict) and counts the scheduler as a source of its own (``attributor.evidence.SOURCES``).
  Every Slurm node-loss row shares the pattern ``slurm_node_lost``: NOT_RESPONDING, then DOWN,
  then the job's own NODE_FAIL are one anomaly per (job, node, generation), not three.
* **trainguard's own drain is no news.** A drain whose reason starts with ``"trainguard: "``
  (``slurm_controller.slurm_reason``) is the exclusion trainguard decided: no finding.
* **Someone else's drain is a warning.** An operator or a health check draining a node of the
  job (NHC, a prolog) means it is to be taken away while the ranks there still run: a warning
  of kind ``slurm_drain``, which the remediator turns into a planned migration when a spare
  node is registered (``remediator.policy_table.MIGRATIONS``) and flags otherwise.
* **Requeue, cancel, end** are the scheduler carrying out someone's decision (trainguard's
  controller, the user, an operator, a time limit): no fault of the training.

Sources: slurm.conf(5) ``SlurmdTimeout`` (slurmctld sets a node DOWN when its slurmd has not
answered that long, NOT_RESPONDING before); scontrol(1) ``State=DOWN`` / ``DRAIN``; sbatch(1)
``--no-kill`` and ``--requeue``; squeue(1) job state codes.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainguard.schemas.slurm import JobChange, NodeChange, SlurmJobEvent, SlurmNodeEvent
from trainguard.schemas.vocabulary import FaultClass, Layer

from trainguard.detector.core import Finding

__all__ = ["SchedulerRow", "ROWS", "scheduler_row", "node_finding", "job_findings",
           "NODE_LOST_PATTERN", "DRAIN_KIND"]

#: The pattern of every Slurm node-loss finding (one anomaly per job, node and generation).
NODE_LOST_PATTERN = "slurm_node_lost"
#: The kind of a drain someone else set (a warning; ``remediator.policy_table.MIGRATIONS``).
DRAIN_KIND = "slurm_drain"


@dataclass(frozen=True)
class SchedulerRow:
    """One row: ``event`` (``slurm.node`` | ``slurm.job``) and ``change``; ``own`` — for a
    node row, whether the node's reason is trainguard's (True), someone else's (False) or
    either (None); ``kind`` / ``fault_class`` / ``severity`` / ``weight`` of the finding, or
    ``kind`` None for none; ``reason`` — why."""

    event: str
    change: str
    own: bool | None
    kind: str | None
    fault_class: FaultClass | None
    severity: str
    weight: float
    reason: str


_N, _J = SlurmNodeEvent.SCHEMA, SlurmJobEvent.SCHEMA

ROWS: tuple[SchedulerRow, ...] = (
    SchedulerRow(_N, NodeChange.DOWN, None, "node_lost", FaultClass.NODE_LOST, "error", 0.9,
                 "slurmctld set the node DOWN: its slurmd did not answer for SlurmdTimeout, a "
                 "health check failed or an operator took it down; the ranks there are gone "
                 "or killed with it (slurm.conf(5) SlurmdTimeout, scontrol(1) State=DOWN)"),
    SchedulerRow(_N, NodeChange.NOT_RESPONDING, None, "node_lost", FaultClass.NODE_LOST,
                 "error", 0.8,
                 "slurmd missed slurmctld's pings: the node or its link is gone; Slurm sets it "
                 "DOWN once SlurmdTimeout has passed"),
    SchedulerRow(_N, NodeChange.DRAIN, True, None, None, "", 0.0,
                 "trainguard's own exclusion (its reason starts with 'trainguard: '): the fault "
                 "behind it was reported and decided already"),
    SchedulerRow(_N, NodeChange.DRAIN, False, DRAIN_KIND, FaultClass.NODE_LOST, "warning", 0.7,
                 "an operator or a health check drained the node: it takes no new work and "
                 "is to be taken out of service while the job's ranks there still run — a "
                 "planned migration with a spare node, a flag without one"),
    SchedulerRow(_N, NodeChange.RESUMED, None, None, None, "", 0.0,
                 "the node is back in service; whether its ranks live is the heartbeats' to say"),
    SchedulerRow(_J, JobChange.NODE_FAIL, None, "node_lost", FaultClass.NODE_LOST, "error",
                 0.9, "Slurm ended the job with NODE_FAIL: a node of its allocation failed (the "
                      "nodes the watcher saw DOWN or not responding)"),
    SchedulerRow(_J, JobChange.NODES_LOST, None, "node_lost", FaultClass.NODE_LOST, "error",
                 0.9, "a --no-kill job still runs but Slurm took failed nodes out of its "
                      "allocation: their ranks are gone (sbatch(1) --no-kill)"),
    SchedulerRow(_J, JobChange.REQUEUED, None, None, None, "", 0.0,
                 "a requeue (trainguard's controller, an operator, NODE_FAIL of a --requeue "
                 "job) starts the job again as a new run its launchers register; a node fault "
                 "behind it is its node's row"),
    SchedulerRow(_J, JobChange.CANCELLED, None, None, None, "", 0.0,
                 "scancel by the user, an operator or trainguard's stop: the job ends on "
                 "purpose"),
    SchedulerRow(_J, JobChange.ENDED, None, None, None, "", 0.0,
                 "the job completed, failed or ran out of time: its launchers report how its "
                 "ranks ended"),
    SchedulerRow(_J, JobChange.REGISTERED, None, None, None, "", 0.0,
                 "the watcher found the job's directive and registered it"),
    SchedulerRow(_J, JobChange.STARTED, None, None, None, "", 0.0,
                 "an allocation: the job's launchers start"),
    SchedulerRow(_J, JobChange.DIRECTIVE_INVALID, None, None, None, "", 0.0,
                 "a configuration error of the submission, logged by the watcher; the job runs "
                 "in observe mode: no fault of the training"),
)


def scheduler_row(event: str, change: str, own: bool = False) -> SchedulerRow | None:
    """The row of ``event`` (schema name) and ``change``; ``own``: the node's reason is
    trainguard's. None for a pair the table does not hold."""
    for row in ROWS:
        if row.event == event and row.change == change and row.own in (None, own):
            return row
    return None


def _finding(row: SchedulerRow, nodes: list[str], evidence: str, slurm: dict, ts: int
             ) -> Finding:
    pattern = NODE_LOST_PATTERN if row.kind == "node_lost" else row.kind
    return Finding(row.kind or "", str(row.fault_class), nodes=nodes, severity=row.severity,
                   evidence=[evidence],
                   detail={"pattern": pattern, "rule": f"{row.event}:{row.change}",
                           "slurm": slurm, "layer": Layer.INFRASTRUCTURE.value,
                           "weight": row.weight},
                   ts=ts)


def node_finding(ev: SlurmNodeEvent, node: str) -> Finding | None:
    """The finding of a ``slurm.node`` event about ``node`` (its row), or None."""
    row = scheduler_row(_N, ev.change, ev.by_trainguard)
    if row is None or row.kind is None:
        return None
    state = "+".join([ev.state.upper(), *ev.flags]) if ev.state else "+".join(ev.flags)
    why = f", reason {ev.reason!r}" + (f" set by {ev.reason_by}" if ev.reason_by else "") \
        if ev.reason else ""
    jobs = f" (Slurm jobs {', '.join(ev.slurm_jobs)})" if ev.slurm_jobs else ""
    return _finding(row, [node], f"Slurm: node {node} is {state}{why}{jobs}: {row.reason}",
                    {"change": str(ev.change), "state": ev.state, "flags": list(ev.flags),
                     "reason": ev.reason, "slurm_jobs": list(ev.slurm_jobs)},
                    ev.reason_ts or ev.ts)


def job_findings(ev: SlurmJobEvent) -> list[Finding]:
    """The findings of a ``slurm.job`` event: one per node it lost (``lost_nodes``), or none."""
    row = scheduler_row(_J, ev.change)
    if row is None or row.kind is None:
        return []
    return [_finding(row, [n], f"Slurm: job {ev.slurm_job_id} is {ev.state} and lost node {n} "
                               f"(was {ev.previous_state or '?'}): {row.reason}",
                     {"change": str(ev.change), "state": ev.state,
                      "slurm_job_id": ev.slurm_job_id}, ev.ts)
            for n in ev.lost_nodes]

"""What a job does when its node-taking decision is held. Pure.

Two things hold a decision that would take nodes out (``breaker.NODE_TAKING``):

* ``breaker`` — the fleet breaker is tripped (``remediator.breaker``);
* ``shared_cause`` — the attributor blamed the fault on a layer many nodes share (a driver
  rollout, a switch, a file system: ``verdict.detail["shared_cause"]``), so taking this node out
  would not cure it and would take capacity from every job.

The job then falls back to what needs no node (``no_node_decision``), or stops, and is never
left waiting:

* a fault of a process on a node that is up (an XID, an ECC error, a crash, a hang …):
  ``restart_workers`` of the ranks on those nodes, on the same nodes (respawn in place); the
  progress rules still apply (``remediator.progress``), so a job that cannot train there stops
  on its restart loop or budget rather than cycling;
* a lost node (nothing left there to respawn on) or a watchdog escalation (the respawn in place
  was tried and training did not resume): ``stop_job_notify_user``, the reason naming what was
  held.

The decision keeps its id, key and time; ``Decision.held`` records the action it would have
taken, on which nodes, held by what and why.
"""
from __future__ import annotations

from typing import Any

from trainguard.schemas import Decision, JobRecord, Verdict
from trainguard.schemas.vocabulary import Action, FaultClass

from trainguard.remediator import plan as pol
from trainguard.remediator.policy_table import DEFAULT_POLICY, Policy
from trainguard.remediator.world import ranks_on

__all__ = ["no_node_decision", "shared_cause_words"]


def shared_cause_words(cause: Any) -> str:
    """A verdict's ``detail["shared_cause"]`` in words: ``{layer, nodes, signature, common}``
    → "system_software: 40 nodes with the same signature …; in common: driver=550.54"."""
    if not isinstance(cause, dict):
        return str(cause)
    common = cause.get("common") or {}
    said = ", ".join(f"{k}={v}" for k, v in sorted(common.items())) if common else \
        "nothing the telemetry names"
    return (f"{cause.get('layer', 'shared layer')}: {cause.get('count', '?')} nodes with "
            f"{cause.get('signature', 'the same signature')} within "
            f"{cause.get('window_s', '?')} s; in common: {said}")


def no_node_decision(dec: Decision, verdict: Verdict | None, job: JobRecord, by: str,
                     why: str, policy: Policy = DEFAULT_POLICY) -> Decision:
    """The decision that replaces node-taking ``dec`` when ``by`` (``breaker`` |
    ``shared_cause``) holds it, for ``why`` (words). ``verdict`` None: a watchdog escalation.
    ``job`` is the job record (defaults are applied here)."""
    job = pol.with_defaults(job, policy)
    held = {"action": str(dec.action), "nodes": list(dec.nodes), "by": by, "reason": why}
    head = (f"held by the {'fleet breaker' if by == 'breaker' else 'shared cause'}: would "
            f"have taken {dec.action} on {', '.join(dec.nodes) or 'no node'} ({why})")
    keep = {"event_id": dec.event_id, "ts": dec.ts, "trace": dec.trace, "held": held}
    if verdict is None or verdict.fault_class == FaultClass.NODE_LOST:
        tail = ("the node is gone and no node may be taken out: the job stops"
                if verdict is not None else
                "the respawn on the same nodes did not resume training: the job stops")
        return dec.model_copy(update={
            **keep, "action": Action.STOP_JOB_NOTIFY_USER, "members": [],
            "world_size": job.world_size, "reason": f"{head}; {tail}"})
    ranks = ranks_on(list(dec.nodes), job.members) or list(verdict.culprit.ranks)
    local = verdict.model_copy(update={"culprit": verdict.culprit.model_copy(
        update={"ranks": ranks})})
    fault_gen = pol.fault_generation(verdict, job)
    alt = pol.plan(local, job, Action.RESTART_WORKERS,
                   [head, "respawn on the same nodes"], fault_gen, policy,
                   key=dec.idempotency_key)
    return alt.model_copy(update=keep)

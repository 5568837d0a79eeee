"""The remediator's policy: a verdict plus the job's state becomes a decision.

Everything here is pure (no I/O, no clock unless passed in) so it is unit-tested as a table.

The policy is data (the tables are ``remediator.policy_table``'s, the steps between them
``remediator.plan``'s, the fallback of a held decision ``remediator.holds``'; this module is
the entry point, ``decide``):

* ``TABLE`` — ``(fault_class, layer) → Rule``: the cheapest recovery action that survives the
  fault (the nested layers of the design: in-process restart < worker restart < node exclusion <
  stop). ``layer=None`` matches any layer; a row with the exact layer wins over it.
* ``FACT_RULES`` — facts the attributor found in cross-job history (a node that fails across
  jobs, a job that fails the same way on different nodes) that call for a *stronger* action than
  the table's, taken when the verdict is confident enough.
* ``CONTEXT_LOST_PATTERNS`` — detector patterns of a sticky CUDA error (illegal address,
  device-side assert, launch failure: the CUDA context is lost for the life of the process,
  ``trainguard.core.cuda_errors``): their ``restart_in_process`` becomes ``restart_workers``, as
  does any verdict whose evidence quotes a sticky error (``plan.context_lost``).
* ``ACTION_ALIASES`` — actions no executor carries out, mapped to one that does.
* ``ACTING_WARNINGS`` — a verdict whose root is a warning (``detail["severity"]``: a
  corrected-ECC count, a PCIe replay rate, host memory pressure before any kill) is flagged,
  never acted on, unless its root is one of these kinds: a rank measured slow or a throttled
  GPU, which a spare node may replace (their rows require a spare and a culprit).
* ``MIGRATIONS`` — warnings that a node is degrading (corrected ECC errors at a rate, host
  memory trending to exhaustion or nearly exhausted) or is to be taken away (drained in Slurm
  by someone else than trainguard): with a spare node registered they become
  a *planned migration* — the node is excluded and the spare takes its ranks (the world size
  kept; the state comes from the surviving ranks, the peer path), before any rank dies; without
  a spare, or without a culprit node, they are flagged like any other warning.

* ``POD_RESTARTS`` — root kinds whose recovery, under a node controller that recreates pods
  (Kubernetes: ``restarts_pods``), also replaces the culprit node's training pod: the lost
  launcher's pod is deleted and its job controller (JobSet, PyTorchJob) recreates it, while the
  node stays in service (``pod_restart``).

* ``ESCALATIONS`` — checks run after the table, in order; the first that fires replaces the
  action (retry budget spent, the same fault at the same step again → stop).
* ``WATCHDOG_LADDER`` — what the watchdog escalates to when an executed decision is not followed
  by ``recovery.resumed`` within ``decision_timeout_s`` (or its executor reports a failure).

The words (fault classes, layers, actions and their order by strength) are
``schemas.vocabulary``'s; this is the only place that chooses an action (the verdict's own
``action`` is advisory, never read). The new world of an exclusion is ``remediator.world``'s.

The job's state is its record (``schemas.job.JobRecord``, from ``StateStore.job``); the
fields a launch left unset take the policy's defaults in ``with_defaults``: ``mode``
(``Policy.default_mode``), ``retry_budget`` (``Policy.default_retry_budget``), ``world_size``
(the number of members).

Verdict fields read beyond the schema's own: ``detail["step"]`` (int, the training step the
culprit was in, for loop detection), ``detail["signature"]`` (str, a normalised fault signature;
derived from the verdict by ``schemas.vocabulary.signature`` when absent),
``detail["detected_ts"]`` (Unix ns of the first anomaly; the verdict's own ``ts`` when absent),
and the facts of ``FACT_RULES``: ``detail["repeat_offender"]`` (culprit nodes that failed in
other jobs too: a node fault) and ``detail["systematic"]`` (nodes of this job where the same
failure happened: an application fault).
"""
from __future__ import annotations

from trainguard.schemas import Decision, JobRecord, Verdict
from trainguard.schemas.vocabulary import Action

from trainguard.remediator import holds
from trainguard.remediator.plan import fault_generation, plan, pod_restart, table_action, with_defaults
from trainguard.remediator.policy_table import DEFAULT_POLICY, Policy

A = Action


def decide(verdict: Verdict, job_state: JobRecord,
           policy: Policy = DEFAULT_POLICY, restarts_pods: bool = False,
           requeues: bool = False) -> Decision | None:
    """The decision for ``verdict`` given ``job_state`` (the job record) and ``policy``;
    ``restarts_pods``: whether the remediator's node controller recreates pods (Kubernetes),
    which ``pod_restart`` adds to the reason; ``requeues``: whether it requeues the job in its
    scheduler without the excluded nodes (``NodeController.requeues_jobs``: Slurm), see
    ``plan``.

    Returns a ``schemas.Decision`` (not yet published) whose ``generation`` is the generation to
    join (current + 1 for a recovery or a stop, the current one for ``none``) and whose
    ``idempotency_key`` is ``<job>:g<fault generation>`` in action mode,
    ``…:observe:<fault class>:<culprit>`` in observe mode (the generation never moves there) and
    ``…:none:<fault class>:<culprit>`` for a flag. Returns None when the verdict names no job (nothing can be decided for it).
    Raises nothing: settings a launch left unset take the policy's defaults (``with_defaults``).
    """
    if not verdict.job:
        return None
    job = with_defaults(job_state, policy)
    fault_gen = fault_generation(verdict, job)
    action, reasons = table_action(verdict, job, policy)
    dec = plan(verdict, job, action, reasons, fault_gen, policy, requeues=requeues)
    cause = verdict.detail.get("shared_cause")
    if cause and dec.action in (A.EXCLUDE_NODE_AND_REQUEUE, A.RESET_GPU):
        dec = holds.no_node_decision(dec, verdict, job, "shared_cause",
                                     holds.shared_cause_words(cause), policy)
    _, why = pod_restart(dec, verdict, restarts_pods, policy)
    return dec.model_copy(update={"reason": f"{dec.reason}; {why}"}) if why else dec

"""The remediator's policy: a verdict plus the job's state becomes a decision.

Everything here is pure (no I/O, no clock unless passed in) so it is unit-tested as a table.

The policy is data:

* ``TABLE`` — ``(fault_class, layer) → Rule``: the cheapest recovery action that survives the
  fault (the nested layers of the design: in-process restart < worker restart < node exclusion <
  stop). ``layer=None`` matches any layer; a row with the exact layer wins over it.
* ``FACT_RULES`` — facts the attributor found in cross-job history (a node that fails across
  jobs, a job that fails the same way on different nodes) that call for a *stronger* action than
  the table's, taken when the verdict is confident enough.
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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from trainguard.schemas import Decision, JobRecord, Member, Verdict
from trainguard.schemas.vocabulary import (Action, FaultClass, Layer, first_error_line, signature,
                                           stronger)

from . import progress
from .world import new_world, nodes_of, ranks_on

A, F, L = Action, FaultClass, Layer

#: Actions that recover the job in a new generation (they count against the retry budget and
#: are watched by the watchdog when executed).
RECOVERY_ACTIONS = (A.RESTART_IN_PROCESS, A.RESTART_WORKERS, A.EXCLUDE_NODE_AND_REQUEUE)

#: Confidence levels of a verdict, weakest first.
CONFIDENCE = ("low", "medium", "high")


@dataclass(frozen=True)
class Rule:
    """One row of the policy table.

    ``fault_class`` / ``layer`` / ``action`` — words of ``schemas.vocabulary`` (``layer`` None:
    any layer); ``requires_spare`` — only when a spare node is registered (else ``fallback``);
    ``source`` — why this is the cheapest action that survives the fault; ``overridable`` —
    False when no fact of ``FACT_RULES`` makes it stronger (the rule is deliberate).
    """

    fault_class: str
    layer: str | None
    action: str
    source: str
    requires_spare: bool = False
    fallback: str = A.NONE
    overridable: bool = True


#: fault class (+ layer) → cheapest surviving action. Sources: the recovery layers of
#: docs/protocol.md and the design; the corpus of real failures (shared/corpus, field
#: ``recommended_action``) for the hardware rows; measured behaviour of gloo on the CI machine for
#: why a hang or a crash needs the process replaced rather than an in-process restart.
TABLE: tuple[Rule, ...] = (
    Rule(F.APP_EXCEPTION, None, A.RESTART_IN_PROCESS,
         "a Python exception leaves the interpreter intact: rejoin in process and restore; "
         "a deterministic bug is caught by loop detection"),
    Rule(F.NAN_LOSS, None, A.RESTART_IN_PROCESS,
         "restore picks the newest valid checkpoint; the validator rejects NaN/Inf state"),
    Rule(F.CHECKPOINT_CORRUPT, None, A.RESTART_IN_PROCESS,
         "restore skips checkpoints the validator marked invalid and loads an older valid one"),
    Rule(F.CHECKPOINT_CORRUPT, L.APPLICATION, A.STOP_JOB_NOTIFY_USER,
         "a restored state failed the loss check (recovery.verified: the checkpoint read back "
         "whole, but its loss is off the saved one): every replica holds that state now, so a "
         "restart would bring it back from the peers; the validator marks the checkpoint "
         "invalid, so a new launch of the job resumes from an older valid one",
         overridable=False),
    Rule(F.CRASH, None, A.RESTART_WORKERS,
         "the rank's process is gone: start it again (warm spare) and rejoin"),
    Rule(F.CRASH, L.HARDWARE, A.EXCLUDE_NODE_AND_REQUEUE,
         "a crash attributed to the node's hardware recurs on that node: move off it"),
    Rule(F.OOM_HOST, None, A.RESTART_WORKERS,
         "the kernel killed the process; a fresh one starts with clean memory"),
    Rule(F.OOM_GPU, None, A.RESTART_WORKERS,
         "a fresh process frees the caching allocator; a deterministic OOM is caught by loop "
         "detection"),
    Rule(F.HANG, None, A.RESTART_WORKERS,
         "a stuck gloo collective cannot be aborted from another thread: the hung rank is killed and "
         "restarted"),
    Rule(F.HANG, L.HARDWARE, A.EXCLUDE_NODE_AND_REQUEUE,
         "a hang attributed to the node's hardware recurs on that node"),
    Rule(F.RENDEZVOUS, None, A.RESTART_WORKERS,
         "the group is re-formed under a new generation prefix of the store"),
    Rule(F.NETWORK, None, A.RESTART_WORKERS,
         "a transient connection reset: re-form the group"),
    Rule(F.NETWORK, L.HARDWARE, A.EXCLUDE_NODE_AND_REQUEUE,
         "a failing NIC or link stays broken: corpus (IB/RoCE completion errors)"),
    Rule(F.FILESYSTEM, None, A.STOP_JOB_NOTIFY_USER,
         "a full or failing file system fails every retry: corpus (disk full, write errors)"),
    Rule(F.CHECKPOINT_SAVE, None, A.NONE,
         "a failed save leaves the ranks training and the last valid checkpoint in place "
         "(the Checkpointer's contract): flag it so that someone frees the disk or fixes the "
         "directory", overridable=False),
    Rule(F.NODE_LOST, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "the node is gone: continue on the remaining nodes or a spare"),
    Rule(F.GPU_XID, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "hardware XIDs (e.g. 48, 79, 94/95) need a GPU reset or node service: corpus, NVIDIA "
         "XID catalog"),
    Rule(F.GPU_XID, L.APPLICATION, A.RESTART_WORKERS,
         "application XIDs (13, 31, 43) end the process, not the GPU: NVIDIA XID catalog"),
    Rule(F.ECC, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "uncorrectable ECC / row-remap failure: the GPU must be reset or replaced: corpus"),
    Rule(F.NVLINK, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "NVLink errors persist until the node is serviced: corpus"),
    Rule(F.STRAGGLER, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "a slow node slows every step; replacing it pays only when a spare exists, otherwise "
         "it is flagged", requires_spare=True, fallback=A.NONE, overridable=False),
    Rule(F.THERMAL, None, A.EXCLUDE_NODE_AND_REQUEUE,
         "throttling slows every step but breaks nothing: like a straggler, the node is replaced "
         "only by a spare (corpus: a throttled GPU's node is moved off), else flagged",
         requires_spare=True, fallback=A.NONE, overridable=False),
)

#: Unknown fault classes are flagged, never acted on.
DEFAULT_RULE = Rule("*", None, A.NONE, "unknown fault class: flagged, no action taken")


@dataclass(frozen=True)
class FactRule:
    """A fact the attributor found (``detail[fact]`` truthy) that makes the action at least
    ``action`` — when that is stronger than the table's, the rule is overridable and the
    verdict's confidence is at least ``min_confidence``. ``source`` says why."""

    fact: str
    action: str
    min_confidence: str
    source: str


FACT_RULES: tuple[FactRule, ...] = (
    FactRule("repeat_offender", A.EXCLUDE_NODE_AND_REQUEUE, "medium",
             "a node with faults in different jobs is a node fault (docs/design.md)"),
    # stopping needs the attributor's cross-job finding, not a single exception
    FactRule("systematic", A.STOP_JOB_NOTIFY_USER, "high",
             "the same failure on different nodes is the program's: a restart elsewhere would "
             "repeat it (docs/design.md)"),
)

#: Root kinds whose warning verdict may act (their rows replace a measured slow rank's node or a
#: throttled GPU's by a spare); any other warning is flagged (see the module docstring).
ACTING_WARNINGS: tuple[str, ...] = ("straggler", "throughput_drop", "thermal")

@dataclass(frozen=True)
class Migration:
    """One row of ``MIGRATIONS``: a warning of kind ``root_kind`` (the detector's finding kind,
    ``detail["root_kind"]`` of the verdict) says that its node is degrading; ``source`` says why
    moving its ranks now, while every rank still trains, is cheaper than waiting for the
    failure."""

    root_kind: str
    source: str


#: Warnings of a degrading node that move its ranks to a spare node (a planned migration).
#: Why ahead of the failure: the surviving ranks hold the state of the step they completed and
#: hand it to the spare's ranks (the peer path: nothing rolled back), while a failure that
#: kills a rank mid-step or takes the node down loses the step, the warm processes of that
#: node and, when the node is gone, its ranks' replicas.
MIGRATIONS: tuple[Migration, ...] = (
    Migration("ecc_corrected_rate",
              "corrected ECC errors at a rising rate: the memory is degrading (DCGM's SBE rate "
              "limit, dcgm_gpu_hardware_limits.h; XID 92 'High single-bit ECC error rate'); "
              "the next error at a worn address is uncorrectable (XID 48/94/95) and ends the "
              "rank: NVIDIA GPU memory error management (dynamic page retirement, row "
              "remapping)"),
    Migration("host_memory_trend",
              "host memory in use heading for the total: the kernel's OOM killer ends a "
              "process of the node when an allocation finds nothing to reclaim (linux "
              "mm/oom_kill.c), most likely a rank (the largest resident set)"),
    Migration("host_memory_exhausted",
              "host memory nearly exhausted: the OOM killer is next (linux mm/oom_kill.c; "
              "MemAvailable, proc(5))"),
    Migration("slurm_drain",
              "an operator or a health check drained the node in Slurm (not trainguard): it "
              "is to be taken out of service, and whoever drained it may reboot it or set it "
              "DOWN, which kills its ranks (scontrol(1) State=DRAIN; detector.scheduler)"),
)

#: Actions without an executor and what is done instead (no row of ``TABLE`` names them).
ACTION_ALIASES: dict[str, str] = {
    A.RESET_GPU: A.EXCLUDE_NODE_AND_REQUEUE,  # the node is drained so the GPU can be reset
    A.FIX_CONFIG: A.STOP_JOB_NOTIFY_USER,     # a configuration needs a person
}


@dataclass(frozen=True)
class PodRestart:
    """When the verdict's root is ``root_kind`` and the decision is ``action``, the nodes named
    in ``detail[fact]`` (and in the decision) get a new pod from the node controller, where it
    recreates pods; elsewhere ``elsewhere`` says what must happen instead. ``source``: why."""

    root_kind: str
    fact: str
    action: str
    source: str
    elsewhere: str


POD_RESTARTS: tuple[PodRestart, ...] = (
    PodRestart("launcher_lost", "launcher_lost", A.RESTART_WORKERS,
               "the node's agent still beats, so the node is healthy and only the pod (its "
               "launcher and ranks) is gone or wedged: its pod is deleted and the job's "
               "controller (JobSet, PyTorchJob) recreates it, whose launcher rejoins at the new "
               "generation; cheaper than cordoning a healthy node and moving the job off it",
               "no node controller here recreates pods: start the launcher on that node again "
               "(`trainguard launch` with the same arguments), else the watchdog escalates"),
)


@dataclass(frozen=True)
class Escalation:
    """After the table: when check ``check`` (a name in ``CHECKS``) fires for an action in
    ``applies_to``, the action becomes ``then``; ``reason`` is formatted with the check's facts."""

    check: str
    applies_to: tuple[str, ...]
    then: str
    reason: str


ESCALATIONS: tuple[Escalation, ...] = (
    Escalation("would_loop", RECOVERY_ACTIONS, A.STOP_JOB_NOTIFY_USER,
               "would loop: {fault_class} with the same signature {where} again after "
               "the restart of generation {last_generation}"),
    Escalation("restart_loop", RECOVERY_ACTIONS, A.STOP_JOB_NOTIFY_USER,
               "restart loop: {stalled} restarts in a row without progress past step "
               "{high_water} (failing at steps {steps}), whatever the signature "
               "(remediator.progress)"),
    Escalation("budget_spent", RECOVERY_ACTIONS, A.STOP_JOB_NOTIFY_USER,
               "retry budget spent ({retries_used} of {retry_budget} used: restarts after "
               "which the job made no progress; one followed by progress is not counted)"),
)

#: Watchdog: executed action not followed by training again → the next stronger action.
WATCHDOG_LADDER: dict[str, str] = {
    A.RESTART_IN_PROCESS: A.RESTART_WORKERS,
    A.RESTART_WORKERS: A.EXCLUDE_NODE_AND_REQUEUE,
    A.EXCLUDE_NODE_AND_REQUEUE: A.STOP_JOB_NOTIFY_USER,
}


@dataclass(frozen=True)
class Policy:
    """The remediator's policy; every part is data (see the module docstring).

    ``default_mode`` — mode of a job whose state has no ``mode`` ("observe": decisions are
    published and audited, never executed). ``default_retry_budget`` — recovery actions allowed
    per job when the job registered none.
    """

    table: tuple[Rule, ...] = TABLE
    default_rule: Rule = DEFAULT_RULE
    fact_rules: tuple[FactRule, ...] = FACT_RULES
    action_aliases: dict[str, str] = field(default_factory=lambda: dict(ACTION_ALIASES))
    escalations: tuple[Escalation, ...] = ESCALATIONS
    watchdog_ladder: dict[str, str] = field(default_factory=lambda: dict(WATCHDOG_LADDER))
    default_mode: str = "observe"
    default_retry_budget: int = 10
    #: stalled restarts in a row (every fault naming a step) that stop a job as a restart
    #: loop, whatever the signature (``remediator.progress``)
    loop_restarts: int = 3
    #: seconds between two faults that count as progress when neither names a step
    progress_s: float = 1800.0
    acting_warnings: tuple[str, ...] = ACTING_WARNINGS
    pod_restarts: tuple[PodRestart, ...] = POD_RESTARTS
    migrations: tuple[Migration, ...] = MIGRATIONS


DEFAULT_POLICY = Policy()


# ---- job state helpers ---------------------------------------------------------------------------
def with_defaults(job: JobRecord, policy: Policy = DEFAULT_POLICY) -> JobRecord:
    """A copy of ``job`` with the policy's defaults for the settings a launch left unset and
    members of its own (the rules below never change the caller's record)."""
    members = [dict(m) for m in job.members]
    return dataclasses.replace(
        job, mode=job.mode or policy.default_mode,
        retry_budget=(job.retry_budget if job.retry_budget is not None
                      else policy.default_retry_budget),
        world_size=job.world_size or len(members), members=members,
        spare_nodes=list(job.spare_nodes))


def _int(v: Any, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def fault_step(verdict: Verdict) -> int | None:
    """``detail["step"]`` as int, or None when the attributor did not give the step."""
    step = verdict.detail.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


# ---- the table ---------------------------------------------------------------------------------
def rule_for(fault_class: str, layer: str, policy: Policy = DEFAULT_POLICY) -> Rule:
    """The row for ``(fault_class, layer)``: an exact layer match, else the any-layer row, else
    ``policy.default_rule``."""
    any_layer = None
    for r in policy.table:
        if r.fault_class != fault_class:
            continue
        if r.layer == layer:
            return r
        if r.layer is None and any_layer is None:
            any_layer = r
    return any_layer or policy.default_rule


def _fact(verdict: Verdict, action: str, policy: Policy) -> tuple[str, str] | None:
    """The first fact rule that applies to ``verdict`` and is stronger than ``action``: the
    action and the reason, in words; else None."""
    for f in policy.fact_rules:
        if not verdict.detail.get(f.fact) or not stronger(f.action, action):
            continue
        if _conf(verdict.confidence) < _conf(f.min_confidence):
            continue
        found = verdict.detail[f.fact]
        found = ", ".join(map(str, found)) if isinstance(found, list) else str(found)
        why = (f"{f.fact.replace('_', ' ')} ({found}, {verdict.confidence} confidence): "
               f"{f.source}")
        error = verdict.detail.get(f"{f.fact}_error") or _root_line(verdict)
        return f.action, why + (f"; the error: {error}" if error else "")
    return None


def _root_line(verdict: Verdict) -> str:
    """The error line of the root cause's first ``[root …]`` evidence entry, else the first."""
    for e in verdict.evidence:
        if e.startswith("[root "):
            return first_error_line(e)
    return first_error_line(verdict.evidence[0]) if verdict.evidence else ""


def _conf(c: str) -> int:
    return CONFIDENCE.index(c) if c in CONFIDENCE else 0


# ---- escalation checks (pure predicates; facts for the reason, or None) ------------------------
def _would_loop(v: Verdict, job: JobRecord, fault_gen: int) -> dict[str, Any] | None:
    """The same fault (signature) at the same step as the last one, after a restart. A fault
    without a step counts only for an application exception whose last occurrence had none
    either: a script that fails the same way before its first step (seen: every restart of a
    rank whose script raised at import failed alike until the retry budget was spent)."""
    last, step = job.last_fault, fault_step(v)
    if not last or last.get("step") != step:
        return None
    if step is None and v.fault_class != "app_exception":
        return None
    if last.get("signature") != signature(v):
        return None
    last_gen = _int(last.get("generation"), -1)
    if last_gen >= fault_gen:  # the same incident, not a repeat after a restart
        return None
    # no step: no report named one (start-up, a plain script whose steps trainguard does not
    # see, a traceback only the launcher relayed): said as unknown, not as "before any step"
    return {"fault_class": v.fault_class, "step": step,
            "where": f"at step {step}" if step is not None else
            "at an unknown step (no report of either fault named one)",
            "last_generation": last_gen}


def _budget_spent(v: Verdict, job: JobRecord, fault_gen: int,
                  policy: "Policy") -> dict[str, Any] | None:
    """The retry budget counts stalled restarts (``remediator.progress``), not attempts."""
    used = progress.stalled_restarts(v, job, fault_gen, policy.progress_s)
    if used >= job.retry_budget:
        return {"retries_used": used, "retry_budget": job.retry_budget}
    return None


def _restart_loop(v: Verdict, job: JobRecord, fault_gen: int,
                  policy: "Policy") -> dict[str, Any] | None:
    return progress.loop_facts(v, job, fault_gen, policy.progress_s, policy.loop_restarts)


CHECKS: dict[str, Callable[..., dict[str, Any] | None]] = {
    "would_loop": lambda v, job, fault_gen, policy: _would_loop(v, job, fault_gen),
    "restart_loop": _restart_loop,
    "budget_spent": _budget_spent,
}


# ---- decide ------------------------------------------------------------------------------------
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
        from . import holds  # holds builds on plan: imported here, not at the top
        dec = holds.no_node_decision(dec, verdict, job, "shared_cause",
                                     holds.shared_cause_words(cause), policy)
    _, why = pod_restart(dec, verdict, restarts_pods, policy)
    return dec.model_copy(update={"reason": f"{dec.reason}; {why}"}) if why else dec


def pod_restart(decision: Decision, verdict: Verdict | None, restarts_pods: bool,
                policy: Policy = DEFAULT_POLICY) -> tuple[list[str], str]:
    """The nodes whose training pod of ``decision.job`` the node controller replaces
    (``restart_pod``) when it carries ``decision`` out, and why, in words.

    A row of ``policy.pod_restarts`` applies when the verdict's root kind and the decision's
    action are its own; its nodes are those of ``verdict.detail[row.fact]`` that the decision
    names. With ``restarts_pods`` False (a controller that cannot recreate pods: local, Slurm)
    no node is returned and the reason says what must happen instead. No row applies: ``([],
    "")`` — e.g. an escalation to a stop, or an exclusion that a repeat-offender fact chose."""
    if verdict is None:
        return [], ""
    kind = verdict.detail.get("root_kind")
    row = next((r for r in policy.pod_restarts
                if r.root_kind == kind and r.action == decision.action), None)
    if row is None:
        return [], ""
    named = verdict.detail.get(row.fact) or []
    nodes = sorted({str(n) for n in named} & set(decision.nodes))
    if not nodes:
        return [], ""
    where = ", ".join(nodes)
    if not restarts_pods:
        return [], f"{kind} on {where}: {row.elsewhere}"
    return nodes, f"{kind} on {where}: {row.source}"


def fault_generation(verdict: Verdict, job: JobRecord) -> int:
    """The generation the fault happened in: the verdict's own when it has one; else, for a
    fault whose first evidence predates the job's last decision (a late verdict of the incident
    that decision handled), that decision's fault generation; else the job's generation."""
    if verdict.generation is not None:
        return verdict.generation
    last = job.last_decision or {}
    if (verdict.first_ts and last.get("fault_generation") is not None
            and verdict.first_ts < _int(last.get("ts"), 0)):
        return _int(last.get("fault_generation"), job.generation)
    return job.generation


def table_action(verdict: Verdict, job: JobRecord,
                 policy: Policy = DEFAULT_POLICY) -> tuple[str, list[str]]:
    """The action the table (with the fact rules, aliases and the spare requirement) gives
    for ``verdict``, before the escalation checks; and the reasons, in words."""
    root_kind = verdict.detail.get("root_kind")
    if verdict.detail.get("severity") == "warning":
        mig = next((m for m in policy.migrations if m.root_kind == root_kind), None)
        if mig is not None:
            return planned_migration(verdict, job, mig)
    rule = rule_for(verdict.fault_class, verdict.layer, policy)
    action, reasons = rule.action, [f"{verdict.fault_class}/{verdict.layer}: {rule.source}"]
    if (verdict.detail.get("severity") == "warning" and action != A.NONE
            and root_kind not in policy.acting_warnings):
        return A.NONE, reasons + [f"a warning ({root_kind}): flagged until an error confirms it"]
    fact = _fact(verdict, action, policy) if rule.overridable else None
    if fact:
        action, why = fact
        reasons.append(why)
    if action in policy.action_aliases:
        reasons.append(f"{action} is carried out as {policy.action_aliases[action]}")
        action = policy.action_aliases[action]
    if action == A.EXCLUDE_NODE_AND_REQUEUE and rule.requires_spare:
        # an optional replacement needs a spare and a culprit (never a stop for want of one)
        if not _spare_left(job, verdict):
            reasons.append(f"no spare node registered: {rule.fallback} (flag only)")
            action = rule.fallback
        elif not (verdict.culprit.nodes or verdict.culprit.ranks):
            reasons.append(f"no culprit rank or node named: {rule.fallback} (flag only)")
            action = rule.fallback
    return action, reasons


def planned_migration(verdict: Verdict, job: JobRecord, mig: Migration) -> tuple[str, list[str]]:
    """The action for a warning of a degrading node (row ``mig`` of ``MIGRATIONS``):
    ``exclude_node_and_requeue`` of its node when a spare node is left to take its ranks and the
    verdict names a node (``plan`` then builds the new world: the spare in the node's place),
    else ``none`` (flagged); and the reasons, in words (the first starts "planned migration")."""
    reasons = [f"planned migration ({verdict.fault_class}/{verdict.layer}, {mig.root_kind}): "
               f"{mig.source}"]
    if not (verdict.culprit.nodes or verdict.culprit.ranks):
        return A.NONE, reasons + ["no culprit node named: none (flag only)"]
    if not _spare_left(job, verdict):
        return A.NONE, reasons + ["no spare node registered: none (flag only)"]
    return A.EXCLUDE_NODE_AND_REQUEUE, reasons + [
        "the node's ranks move to the spare while every rank still trains (state from the "
        "surviving ranks)"]


def _spare_left(job: JobRecord, verdict: Verdict) -> bool:
    members_nodes = {m.get("node") for m in job.members}
    return any(s not in members_nodes and s not in verdict.culprit.nodes for s in job.spare_nodes)


def plan(verdict: Verdict, job: JobRecord, action: str, reasons: list[str], fault_gen: int,
         policy: Policy = DEFAULT_POLICY, key: str | None = None,
         requeues: bool = False) -> Decision:
    """Turn an action into a full decision: escalation checks, culprit ranks/nodes, the new
    world for an exclusion (below ``min_world_size``: a stop, or, when the node controller
    ``requeues`` the job in its scheduler, the exclusion with the world it leaves — none when
    the job ran on the excluded nodes alone — which the survivors do not train at: the scheduler restarts the job at full size on an allocation
    without the nodes, from the newest valid checkpoint), generation and key.
    Used by ``decide`` and by the watchdog (with ``key`` given). ``reasons`` is not changed:
    the decision's reason is a new list of them with what the checks added."""
    reasons = list(reasons)
    if action == A.EXCLUDE_NODE_AND_REQUEUE and job.members:
        present = {m.get("node") for m in job.members}
        named = sorted(set(verdict.culprit.nodes)) or nodes_of(sorted(verdict.culprit.ranks),
                                                                job.members)
        if named and not any(n in present for n in named):
            # e.g. the agent of an excluded node stays silent: a late node_lost is no new fault
            reasons.append(f"node(s) {', '.join(named)} already out of the job: nothing to "
                           f"exclude")
            action = A.NONE
    for esc in policy.escalations:
        if action not in esc.applies_to:
            continue
        facts = CHECKS[esc.check](verdict, job, fault_gen, policy)
        if facts is not None:
            reasons.append(esc.reason.format(**facts))
            action = esc.then
            if verdict.evidence:  # the user reads why in the decision itself
                reasons.append(f"the error: {_root_line(verdict)}")
            break

    ranks = sorted(set(verdict.culprit.ranks))
    nodes = sorted(set(verdict.culprit.nodes))
    members: list[Member] = []
    world = job.world_size
    if action in (A.RESTART_IN_PROCESS, A.RESTART_WORKERS):
        if not ranks:
            if action == A.RESTART_WORKERS and verdict.fault_class == F.NETWORK:
                # a reset with no culprit: no process is known to be bad, and killing every
                # rank would be a full restart;
                # re-forming the group in place is the cheaper layer that survives a transient
                # fault, and a rank that is really gone shows up as a crash or node loss
                action = A.RESTART_IN_PROCESS
                reasons.append("no culprit rank named: re-form the group in place")
            else:
                reasons.append("no culprit rank named: every rank restarts")
            ranks = sorted(int(m["rank"]) for m in job.members) or list(range(job.world_size))
        nodes = nodes_of(ranks, job.members) or nodes
    elif action == A.EXCLUDE_NODE_AND_REQUEUE:
        nodes = nodes or nodes_of(ranks, job.members)
        if job.members:
            nodes = [n for n in nodes if n in {m.get("node") for m in job.members}]
        if not nodes:
            reasons.append("exclusion needs a culprit node and the verdict named none")
            action = A.STOP_JOB_NOTIFY_USER
        else:
            ranks = ranks_on(nodes, job.members)
            members, used = new_world(job.members, nodes, job.spare_nodes, job.nproc_per_node)
            world = len(members)
            if used:
                reasons.append(f"spare node(s) {', '.join(used)} replace {', '.join(nodes)}")
            if world < job.min_world_size:
                reasons.append(f"excluding {', '.join(nodes)} leaves a world of {world} < "
                               f"min_world_size {job.min_world_size}")
                if requeues:
                    reasons.append("the scheduler requeues the job without "
                                   f"{', '.join(nodes)}: it restarts at world "
                                   f"{job.world_size} from the newest valid checkpoint"
                                   + ("" if members else " on another allocation (no node of "
                                                         "the job is left)"))
                else:
                    action, members, world = A.STOP_JOB_NOTIFY_USER, [], job.world_size

    recovering = action in RECOVERY_ACTIONS
    culprit = ",".join(map(str, ranks)) + "|" + ",".join(nodes)
    if action == A.NONE:
        key = key or f"{verdict.job}:g{fault_gen}:none:{verdict.fault_class}:{culprit}"
        generation = job.generation
    else:
        generation = job.generation + 1
        if job.mode != "action":
            # observe mode never bumps the generation: one key per fault and culprit, so each
            # fault still shows the decision it would have had
            key = key or f"{verdict.job}:g{fault_gen}:observe:{verdict.fault_class}:{culprit}"
        key = key or f"{verdict.job}:g{fault_gen}"
    execute = job.mode == "action" and action != A.NONE
    return Decision(
        job=verdict.job, node=verdict.node, trace=verdict.child_trace(),
        action=action, mode=job.mode, execute=execute, generation=generation,
        ranks=ranks, nodes=nodes, members=members, world_size=world,
        idempotency_key=key, reason="; ".join(reasons), verdict_id=verdict.event_id,
        fault_class=verdict.fault_class, fault_ts=verdict.first_ts,
        detected_ts=_int(verdict.detail.get("detected_ts"), 0) or verdict.ts,
        retries_used=job.retries_used + (1 if recovering else 0),
        retry_budget=job.retry_budget,
    )


def escalate(prev: Decision, job_state: JobRecord, why: str,
             policy: Policy = DEFAULT_POLICY) -> Decision | None:
    """The watchdog's next decision after ``prev`` (executed, but training did not resume or an
    executor failed): the next rung of ``policy.watchdog_ladder`` for the same culprit, key
    ``<prev key>:wd``, the job's next generation. None when ``prev`` has no next rung."""
    nxt = policy.watchdog_ladder.get(prev.action)
    if nxt is None or not prev.job:
        return None
    job = with_defaults(job_state, policy)
    culprit_ranks = list(prev.ranks)
    culprit_nodes = list(prev.nodes) or nodes_of(culprit_ranks, job.members)
    synthetic = Verdict(job=prev.job, fault_class=prev.fault_class, layer=L.UNKNOWN,
                        culprit={"ranks": culprit_ranks, "nodes": culprit_nodes},
                        first_ts=prev.fault_ts, generation=prev.generation, trace=prev.child_trace(),
                        detail={"detected_ts": prev.detected_ts},
                        **({"event_id": prev.verdict_id} if prev.verdict_id else {}))
    reasons = [f"watchdog: {prev.action} of generation {prev.generation} {why}: escalating "
               f"to {nxt}"]
    return plan(synthetic, job, nxt, reasons, prev.generation, policy,
                key=f"{prev.idempotency_key}:wd")

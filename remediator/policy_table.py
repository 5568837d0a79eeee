"""The remediator's policy tables: the data ``remediator.policy`` decides with.

``TABLE`` (fault class and layer → the cheapest surviving action), ``FACT_RULES``,
``ACTION_ALIASES``, ``CONTEXT_LOST_PATTERNS``, ``ACTING_WARNINGS``, ``MIGRATIONS``, ``POD_RESTARTS``, ``ESCALATIONS`` and
``WATCHDOG_LADDER``: what each means is ``remediator.policy``'s module docstring. Data only: no
I/O, no decisions; ``Policy`` gathers them (the policy's
one object; a site's own is built with ``dataclasses.replace``). ``remediator.policy`` re-exports
every name (``pol.TABLE``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.schemas.vocabulary import Action, FaultClass, Layer

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
    Rule(F.OOM_GPU, None, A.RESTART_IN_PROCESS,
         "a CUDA OOM is no sticky error (CUDA Runtime API cudaErrorMemoryAllocation; PyTorch's "
         "torch.OutOfMemoryError): the context survives, the rank empties the caching "
         "allocator and rejoins in process (a rank that cannot is restarted by its launcher); "
         "a deterministic OOM is caught by loop detection"),
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

#: Detector patterns whose error leaves the CUDA context unusable for the life of the process
#: (``trainguard.core.cuda_errors.STICKY_ERRORS``): their ``restart_in_process`` becomes
#: ``restart_workers`` — the rank is respawned. A verdict whose evidence quotes a sticky error
#: is escalated the same way, whatever its pattern.
CONTEXT_LOST_PATTERNS: dict[str, str] = {
    "cuda_device_assert": "cudaErrorAssert 710 (CUDA Runtime API enum cudaError: 'the process "
                          "must be terminated and relaunched')",
    "cuda_illegal_access": "cudaErrorIllegalAddress 700, cudaErrorMisalignedAddress 716, "
                           "cudaErrorLaunchFailure 719 (CUDA Runtime API enum cudaError: 'the "
                           "process must be terminated and relaunched')",
}

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
    context_lost_patterns: dict[str, str] = field(
        default_factory=lambda: dict(CONTEXT_LOST_PATTERNS))


DEFAULT_POLICY = Policy()

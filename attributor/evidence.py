"""Time, causality and agreement among the anomalies of one incident. Pure.

* ``onset_ns`` — when a fault began (Unix ns): an anomaly's ``first_ts``, moved back by the
  silence or stall its rule waited for (a node found lost after 3 s of silence went silent 3 s
  before it was found, so its peers' errors come *after* it, not before).
* ``is_peer_report`` — an error line a rank prints about its link to others (connection reset,
  IB/NCCL completion error, watchdog or collective timeout, c10d store error: the classes of
  ``PEER_REPORT_CLASSES``). After a death these are what the survivors see.
* ``victims`` — the peer reports that a rank's or a node's death explains: reported by another
  rank (or node) than the dead one, from ``cause_lead_s`` before its onset to
  ``causal_window_s`` after it. They are its symptoms whatever their class: "NET/IB completion
  with error" on the survivor of a SIGSEGV names no fault of the survivor's node.
* ``choose_root`` — the earliest root cause wins; a later anomaly replaces it only when it
  explains it (the same rank or node, a stronger class of ``schemas.vocabulary``: the XID of the
  GPU the crashed rank ran on, the OOM kill of the killed rank). An unrelated later fault is a
  second fault, folded as evidence, not the root. Among warnings alone (no error yet) time
  order says nothing — a flag breaks nothing, so it causes nothing — and the strongest warning
  is the root with those about the same place: a failed save of one rank seen first must not
  hide a degrading node's warning that calls for a planned migration.
* ``sources`` / ``confidence`` — how many independent sources agree with the verdict (see
  ``SOURCES``); the confidence is a function of that count alone (``SCORES``: none — only a
  guess or symptoms — low, one medium, two or more high), not of the detector's per-rule
  weights (one exception: a row that infers its class, weight below ``GUESS_BELOW``, counts as
  no source).

Sources of the timing numbers: gloo's ring neighbours raise 20–35 ms after a SIGKILL
(``shared/findings.md``); NCCL's watchdog and gloo's timeout raise at the collective timeout
(minutes); the attributor only sees an incident's first ``incident_window_s`` (60 s), so the
causal window is that long.
"""
from __future__ import annotations

from typing import Iterable

from trainguard.schemas import Anomaly
from trainguard.schemas.vocabulary import FaultClass, priority

#: Classes of the error lines survivors print about a peer: connection resets and completion
#: errors (network), watchdog and collective timeouts (hang), c10d store errors (rendezvous), a
#: socket closed by a remote host (node_lost, the ``remote_peer_closed`` row).
PEER_REPORT_CLASSES = frozenset({FaultClass.NETWORK.value, FaultClass.HANG.value,
                                 FaultClass.RENDEZVOUS.value, FaultClass.NODE_LOST.value})

#: Detail keys (seconds) by which a rule's finding lags the fault's onset.
LAG_KEYS = ("silent_s", "stalled_s")

#: Independent sources of evidence, by what produced an anomaly. Two anomalies from the same
#: source count once: ten ranks printing the same reset are one kind of evidence.
#: (kind, detail key present or stream) -> source
SOURCES: tuple[tuple[str, str, str], ...] = (
    # (anomaly kind, condition, source)
    ("crash", "", "exit_status"),          # the launcher's waitpid: signal or exit code
    ("gpu_fault", "xid", "xid"),           # the driver's XID (kernel log or NVML event)
    ("gpu_fault", "", "telemetry"),
    ("log_pattern", "stream=kernel", "kernel_log"),
    ("log_pattern", "", "log"),            # the program's own log or traceback
    ("hang", "", "heartbeat"),             # silence or no progress of rank heartbeats
    ("node_lost", "slurm", "scheduler"),   # Slurm set the node DOWN / NOT_RESPONDING
    ("node_lost", "", "heartbeat"),        # silence of the node's agent and launcher
    ("slurm_drain", "", "scheduler"),      # Slurm drained the node (someone else than us)
    ("launcher_lost", "", "heartbeat"),    # silence of one job's launcher and ranks on a node
    ("straggler", "", "heartbeat"),        # step times in the heartbeats
    ("throughput_drop", "", "heartbeat"),
    ("nan_loss", "", "heartbeat"),
)
#: Source of anomaly kinds not in ``SOURCES`` (the host and GPU telemetry rules).
DEFAULT_SOURCE = "telemetry"
#: Score by the number of independent sources that agree: one source is a single observation
#: (medium), two that agree are corroborated (high). Symptoms alone (no root seen) are low.
SCORES = {0: 0.3, 1: 0.6, 2: 0.8, 3: 0.9}
#: A row weight below this marks a class the row infers rather than observes (``is_guess``).
GUESS_BELOW = 0.5
SYMPTOM_ONLY_SCORES = {0: 0.25, 1: 0.35, 2: 0.45}


def onset_ns(a: Anomaly) -> int:
    """When the fault of ``a`` began (Unix ns): a hang's ``detail["last_progress_ts"]`` (the
    detector puts the same in ``first_ts``); else ``first_ts`` (else ``ts``) less the silence or
    stall (``detail["silent_s"]`` / ``["stalled_s"]``, seconds) its rule waited for (a node
    lost, and anomalies recorded before hangs carried their last progress)."""
    last = a.detail.get("last_progress_ts")
    if isinstance(last, int) and not isinstance(last, bool) and last > 0:
        return last
    t = a.first_ts or a.ts
    for k in LAG_KEYS:
        v = a.detail.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return t - int(v * 1e9)
    return t


def is_peer_report(a: Anomaly) -> bool:
    """A log line of a class survivors print about a peer (``PEER_REPORT_CLASSES``), not a
    node's own kernel log (a NIC's driver reporting its own port is that node's fault)."""
    return (a.kind == "log_pattern" and a.fault_class in PEER_REPORT_CLASSES
            and a.detail.get("stream") != "kernel")


def is_exit_report(a: Anomaly) -> bool:
    """A rank that exited with a non-zero code, not killed by a signal (``detector.signals.
    crash_rule``): what an uncaught Python exception ends in, with the traceback that names the
    exception on its stderr. The two reach the bus in either order (the exit from the launcher,
    the traceback relayed from the rank's output), and a verdict on the exit alone names a
    different fault (``crash``) than the traceback's (``app_exception``): the remediator's loop
    check then saw two signatures for one deterministic bug and stopped it a generation late."""
    return (a.kind == "crash" and a.detail.get("signal") is None
            and a.detail.get("exit_code") not in (None, 0))


def is_cause(a: Anomaly) -> bool:
    """An anomaly that can explain what its peers report next: a root-cause error that is not
    itself a peer report (a crash, an exception, an XID, a node lost, a silent or stuck rank)."""
    return not a.symptom and a.severity == "error" and not is_peer_report(a)


def _other_subject(report: Anomaly, cause: Anomaly) -> bool:
    """True when ``report`` comes from another rank than ``cause`` (else, when either names no
    rank, another node); False when that cannot be told."""
    rr, cr = set(report.culprit.ranks), set(cause.culprit.ranks)
    if rr and cr:
        return not rr & cr
    rn, cn = set(report.culprit.nodes), set(cause.culprit.nodes)
    if rn and cn:
        return not rn & cn
    return False


def related(a: Anomaly, b: Anomaly) -> bool:
    """Whether ``a`` and ``b`` may be about the same place: they share a rank or a node, or
    what they name cannot be compared (one names no one — an offline log line often does not —
    or one names only ranks and the other only nodes)."""
    ar, br = set(a.culprit.ranks), set(b.culprit.ranks)
    an, bn = set(a.culprit.nodes), set(b.culprit.nodes)
    compared = False
    for x, y in ((ar, br), (an, bn)):
        if x and y:
            if x & y:
                return True
            compared = True
    return not compared


def victims(anomalies: list[Anomaly], causal_window_s: float, cause_lead_s: float
            ) -> dict[int, int]:
    """Index of each peer report that a death explains -> index of that cause (the earliest
    one). A report counts from ``cause_lead_s`` before the cause's onset (clocks of different
    hosts, an exit seen by the launcher a moment after the sockets closed) to
    ``causal_window_s`` after it. Symptom rows are included: a held symptom is a victim too."""
    causes = sorted((onset_ns(a), i) for i, a in enumerate(anomalies) if is_cause(a))
    out: dict[int, int] = {}
    lead, window = int(cause_lead_s * 1e9), int(causal_window_s * 1e9)
    for i, a in enumerate(anomalies):
        if not (is_peer_report(a) or a.symptom) or is_cause(a):
            continue
        t = onset_ns(a)
        for ct, ci in causes:
            if ct - lead <= t <= ct + window and _other_subject(a, anomalies[ci]):
                out[i] = ci
                break
    return out


def _strength(a: Anomaly) -> float:
    try:
        w = float(a.detail.get("weight", 0.6))
    except (TypeError, ValueError):
        w = 0.6
    return priority(a.fault_class) + 10 * w


def root_key(a: Anomaly) -> tuple:
    """Order of symptoms when only symptoms were seen: strongest class first, then earliest."""
    return (a.symptom, -_strength(a), a.first_ts or a.ts)


def choose_root(anomalies: list[Anomaly], causal_window_s: float = 60.0,
                cause_lead_s: float = 0.25) -> Anomaly:
    """The root cause among ``anomalies`` (non-empty); see the module docstring. Only when
    every anomaly is a symptom (or a victim) is the strongest of them returned."""
    vict = victims(anomalies, causal_window_s, cause_lead_s)
    cands = [(onset_ns(a), i, a) for i, a in enumerate(anomalies)
             if not a.symptom and i not in vict]
    errors = [c for c in cands if c[2].severity == "error"]
    pool = errors or cands
    if not pool:
        return min(enumerate(anomalies), key=lambda ia: (root_key(ia[1]), ia[0]))[1]
    pool.sort(key=lambda c: (c[0], c[1]))
    # the earliest error explains what follows it; among warnings only, the strongest leads
    first = pool[0][2] if errors else max(pool, key=lambda c: (_strength(c[2]), -c[0], -c[1]))[2]
    near = [c for c in pool if c[2] is first or related(c[2], first)]
    return max(near, key=lambda c: (_strength(c[2]), -c[0], -c[1]))[2]


def source(a: Anomaly) -> str:
    """The independent source that produced ``a`` (``SOURCES``)."""
    for kind, cond, src in SOURCES:
        if a.kind != kind:
            continue
        if not cond:
            return src
        if cond.startswith("stream="):
            if a.detail.get("stream") == cond[7:]:
                return src
        elif a.detail.get(cond) is not None:
            return src
    return DEFAULT_SOURCE


def is_guess(a: Anomaly) -> bool:
    """True when the anomaly's class is an inference, not an observation: a row whose weight is
    below ``GUESS_BELOW`` (e.g. a SIGKILL read as an OOM kill: an operator can send one too)."""
    try:
        return float(a.detail.get("weight", 0.6)) < GUESS_BELOW
    except (TypeError, ValueError):
        return False


def agreeing_sources(root: Anomaly, supporting: Iterable[Anomaly], facts: dict) -> list[str]:
    """The independent sources that agree with a verdict: the root's and those of the
    anomalies that support it (the same fault elsewhere, or a fault of the same rank or node
    the root explains or is explained by), and ``history`` when a cross-job or cross-node fact
    was found (``repeat_offender``, ``systematic``, ``suspect_gpu``). Peers' reports and other
    symptoms are not counted (they show that something died, not what), nor anomalies whose
    class is a guess (``is_guess``)."""
    out = set()
    for a in (root, *supporting):
        if a.symptom or is_peer_report(a) or is_guess(a):
            continue
        out.add(source(a))
    if any(facts.get(k) for k in ("repeat_offender", "systematic", "suspect_gpu")):
        out.add("history")
    return sorted(out)


def score_of(n_sources: int, symptom_only: bool) -> float:
    """The score (0..1) of a verdict with ``n_sources`` agreeing independent sources
    (``SCORES``; ``SYMPTOM_ONLY_SCORES`` when no root cause was seen)."""
    table = SYMPTOM_ONLY_SCORES if symptom_only else SCORES
    return table[max(0, min(n_sources, max(table)))]


def confidence(score: float) -> str:
    """``high`` (≥ 0.8: two or more sources agree), ``medium`` (≥ 0.55: one), else ``low``."""
    return "high" if score >= 0.8 else "medium" if score >= 0.55 else "low"

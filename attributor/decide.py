"""Attribution: anomalies of one incident (+ cross-job history) -> one verdict. Pure.

``decide(anomalies, history, config) -> VerdictSpec``

1. Evidence is ordered in time: each anomaly's onset (``evidence.onset_ns``: ``first_ts``, less
   the silence or stall its rule waited for), then arrival order.
2. Cascades (``evidence.victims``): the errors peers report after a rank's or a node's death —
   connection resets, IB/NCCL completion errors, watchdog and collective timeouts, c10d store
   errors —, from another rank or node within ``causal_window_s`` of it, are that death's
   symptoms whatever their class; they are folded into the verdict as evidence
   (``detail["symptoms"]``, ``detail["victims"]``), never culprits.
3. Root cause (``evidence.choose_root``): the earliest root-cause anomaly wins; a later one
   replaces it only when it explains it — the same rank or node and a stronger class of
   ``schemas.vocabulary.VOCABULARY`` (a GPU's XID explains the crash of the rank on it, the OOM
   killer explains the SIGKILL). Only when every anomaly is a symptom (a peer's connection reset,
   a watchdog timeout) is the strongest symptom attributed on its own — at low confidence.
4. Hung vs blocked: for hangs, the culprit is the rank the detector found behind (its
   collective counts: ``detail["in_compute"]`` / ``["blocked"]``); watchdog timeouts from the
   blocked ranks are symptoms. Among symptom-only watchdog timeouts, the rank with the lowest
   collective sequence number is named, at low confidence.
5. Cross-job history (``History``, filled by the service from the state store):
   * a culprit node with hardware, system-software or infrastructure faults in
     ``node_repeat_jobs`` (2) or more different jobs within the window is a node fault:
     ``detail["repeat_offender"]`` names it (and an unknown or application layer becomes
     hardware; ``detail["evidence_layer"]`` keeps the layer the evidence gave, which is what
     the history records of this verdict, so a conclusion drawn from history never feeds it);
   * the same failure signature on ``app_repeat_nodes`` (2) or more different nodes of one job
     (earlier incidents or this one) is an application fault: layer ``application``,
     ``detail["systematic"]`` names the nodes and ``detail["systematic_error"]`` quotes the
     error (a restart elsewhere would repeat it: the remediator's policy stops the job);
   * XIDs 13/31/43 (the catalog's application XIDs) from ``app_xid_pids`` (3) or more
     different processes on one GPU make that GPU suspect hardware (``gpu_xid``/``hardware``,
     ``detail["suspect_gpu"]``).
7. A shared cause (``attributor.shared``): the root's signature from ``shared_min_nodes`` (4)
   nodes of ``shared_min_jobs`` (2) jobs within ``shared_window_s`` (60 s) is blamed on the
   layer they share, not on each node: ``detail["shared_cause"]`` names it and what the nodes
   have in common (their telemetry's attributes), and the remediator takes no node out.
8. Confidence (``evidence.agreeing_sources``): how many independent sources — exit status,
   the program's log, a peer's log, the kernel log, an XID, telemetry, heartbeats, history —
   agree with the verdict: one is ``medium``, two or more ``high``, symptoms alone ``low``
   (``detail["sources"]`` lists them). The detector's per-rule weights order root candidates of
   one place; they do not make a verdict more certain.

The verdict names no action: the remediator's policy turns fault class, layer and these facts
into one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from trainguard.schemas import Anomaly
from trainguard.schemas.vocabulary import (FaultClass, Layer, default_layer, first_error_line,
                                           signature, spec)

from trainguard.attributor import evidence as ev
from trainguard.attributor import shared

#: The XIDs NVIDIA's catalog names as application errors (13, 31, 43).
APP_XIDS = (13, 31, 43)


@dataclass
class AttributorConfig:
    """``symptom_hold_s`` — how long a symptom waits for its root cause (1.0 s: gloo peers
    raise 20–35 ms after a death, NCCL watchdogs within the collective timeout, and the shim
    publishes a rank's own exception before it aborts its sockets, so a root normally arrives
    first or within milliseconds). ``incident_window_s`` — anomalies of the same job and
    generation within this many seconds of the first belong to one incident.
    ``history_window_s`` — how far back cross-job history counts (24 h). Thresholds: see the
    module docstring."""

    symptom_hold_s: float = 1.0
    incident_window_s: float = 60.0
    history_window_s: float = 86400.0
    causal_window_s: float = 60.0
    cause_lead_s: float = 0.25
    node_repeat_jobs: int = 2
    app_repeat_nodes: int = 2
    app_xid_pids: int = 3
    max_evidence: int = 40
    #: one signature from this many nodes of this many jobs within this window is a shared
    #: cause (``attributor.shared``)
    #: (env ``TG_SHARED_CAUSE_NODES``: the node count, 0 turns the rule off)
    shared_window_s: float = 60.0
    shared_min_nodes: int = field(
        default_factory=lambda: int(os.environ.get("TG_SHARED_CAUSE_NODES", "4") or 0))
    shared_min_jobs: int = 2


@dataclass
class History:
    """Cross-job facts for the culprits of an incident, read from the state store.

    ``node_jobs`` — node -> jobs (other than this one too) that had a non-application fault on
    it within the window; ``signature_nodes`` — nodes of *this* job that saw the root's
    signature; ``gpu_app_xid_pids`` — GPU id -> pids that hit an application XID on it."""

    job: str = ""
    node_jobs: dict[str, set[str]] = field(default_factory=dict)
    signature_nodes: set[str] = field(default_factory=set)
    gpu_app_xid_pids: dict[str, set[int]] = field(default_factory=dict)
    #: node → jobs that reported the root's signature within ``shared_window_s`` (any job)
    recent_nodes: dict[str, set[str]] = field(default_factory=dict)
    #: node → attributes (``NodeTelemetry.attributes``), read when a shared cause is likely
    node_attrs: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class VerdictSpec:
    """The verdict fields (``schemas.Verdict`` minus the envelope and the advisory action)."""

    fault_class: str
    layer: str
    ranks: list[int]
    nodes: list[str]
    gpus: list[str]
    confidence: str
    score: float
    evidence: list[str]
    anomaly_ids: list[str]
    first_ts: int
    generation: int | None
    detail: dict[str, Any]
    signature: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: fault_class, layer, culprit {ranks, nodes, gpus}, confidence, score,
        evidence, first_ts, generation, detail."""
        return {"fault_class": self.fault_class, "layer": self.layer,
                "culprit": {"ranks": self.ranks, "nodes": self.nodes, "gpus": self.gpus},
                "confidence": self.confidence,
                "score": round(self.score, 3), "evidence": self.evidence,
                "first_ts": self.first_ts, "generation": self.generation,
                "detail": self.detail}


def _hint(a: Anomaly, key: str, default: Any) -> Any:
    v = a.detail.get(key)
    return default if v is None else v


def choose_root(anomalies: list[Anomaly], config: AttributorConfig | None = None) -> Anomaly:
    """The root cause among ``anomalies`` (non-empty); see module docstring."""
    cfg = config or AttributorConfig()
    return ev.choose_root(anomalies, cfg.causal_window_s, cfg.cause_lead_s)


def _watchdog_behind(symptoms: Iterable[Anomaly]) -> tuple[list[int], str] | None:
    """Among watchdog-timeout symptoms, the rank(s) reporting the lowest sequence number."""
    seqs: dict[int, int] = {}
    for s in symptoms:
        seq = s.detail.get("seq")
        if s.fault_class == "hang" and seq is not None and s.culprit.ranks:
            for r in s.culprit.ranks:
                seqs[r] = min(int(seq), seqs.get(r, 1 << 62))
    if len(set(seqs.values())) < 2:
        return None
    low = min(seqs.values())
    ranks = sorted(r for r, v in seqs.items() if v == low)
    return ranks, (f"rank(s) {ranks} time out at collective {low}, behind the others "
                   f"({sorted(set(seqs.values()))}); sequence numbers of different process "
                   f"groups are not comparable, so this is weak")


def decide(anomalies: list[Anomaly], history: History | None = None,
           config: AttributorConfig | None = None) -> VerdictSpec:
    """One verdict for the anomalies of one incident. Raises ValueError on an empty list."""
    if not anomalies:
        raise ValueError("decide() needs at least one anomaly")
    cfg = config or AttributorConfig()
    hist = history or History()
    ordered = sorted(enumerate(anomalies), key=lambda ia: (ev.onset_ns(ia[1]), ia[0]))
    ordered_a = [a for _, a in ordered]
    root = choose_root(ordered_a, cfg)
    victim_of = ev.victims(ordered_a, cfg.causal_window_s, cfg.cause_lead_s)
    is_victim = [i in victim_of for i in range(len(ordered_a))]
    roots = [a for a, v in zip(ordered_a, is_victim) if not a.symptom and not v]
    symptom_only = not roots
    fault_class = root.fault_class
    layer = str(_hint(root, "layer", default_layer(root.fault_class)))
    notes: list[str] = []
    facts: dict[str, Any] = {}
    reread = _reread(root, ordered_a)
    if reread:
        fault_class, layer, why = reread
        notes.append(why)
    elif layer == Layer.UNKNOWN:
        by_ranks = _shared_by_ranks(root, ordered_a)
        if by_ranks:
            layer, why = by_ranks
            notes.append(why)

    # culprit: the root's, plus other root-cause anomalies of the same class (several XIDs,
    # several OOM-killed ranks); symptoms and victims never add culprits.
    ranks, nodes, gpus = list(root.culprit.ranks), list(root.culprit.nodes), list(root.culprit.gpus)
    for a in roots:
        if a is not root and a.fault_class == root.fault_class:
            ranks += [r for r in a.culprit.ranks if r not in ranks]
            nodes += [n for n in a.culprit.nodes if n not in nodes]
            gpus += [g for g in a.culprit.gpus if g not in gpus]

    symptoms = [a for a, v in zip(ordered_a, is_victim) if a.symptom or v]
    supporting = [a for a, v in zip(ordered_a, is_victim) if a is not root and (
        v or a.fault_class == root.fault_class or (not symptom_only and ev.related(a, root)))]
    if symptom_only:
        supporting = list(ordered_a)
        notes.append("only symptoms were seen; the strongest is attributed on its own")
        behind = _watchdog_behind(symptoms) if root.fault_class == "hang" else None
        if behind:
            ranks, why = behind
            notes.append(why)
        elif root.fault_class == "hang":
            ranks = []  # every reporter is a blocked victim; the hung peer is not among them
        elif root.fault_class == "network":
            # "connection reset/closed by peer" names the reporter, a victim of its peer: with
            # no root cause seen the culprit is unknown (the remediator re-forms the group in
            # place for a network fault without a culprit; a rank or node that is really gone
            # shows up as a crash or node loss, which outranks this)
            ranks, nodes, gpus = [], [], []
            notes.append("the reporters of a connection reset are its victims: culprit unknown")
    elif symptoms:
        hit = sorted({r for s in symptoms for r in s.culprit.ranks} - set(ranks))
        demoted = [a for a, v in zip(ordered_a, is_victim) if v and not a.symptom]
        notes.append(f"{len(symptoms)} symptom(s) folded into the root cause"
                     + (f"; ranks {hit} were victims of the cascade" if hit else ""))
        if demoted:
            notes.append(f"{len(demoted)} error(s) reported by peers after the death "
                         f"({', '.join(sorted({a.fault_class for a in demoted}))}) are its "
                         f"symptoms, whatever their class")
    others = [a for a in roots if a is not root and a.fault_class != root.fault_class
              and not ev.related(a, root)]
    if others:
        notes.append("a later fault elsewhere, not explained by the first: " + "; ".join(
            f"{a.fault_class} on {_who(a)}" for a in others[:3]))

    # application XIDs recurring on one GPU across processes -> suspect hardware
    if root.kind == "gpu_fault" or any(a.kind == "gpu_fault" for a in roots):
        for g, pids in hist.gpu_app_xid_pids.items():
            if len(pids) >= cfg.app_xid_pids and (not gpus or g in gpus):
                fault_class, layer = FaultClass.GPU_XID.value, Layer.HARDWARE.value
                gpus = gpus if g in gpus else gpus + [g]
                facts["suspect_gpu"] = g
                notes.append(f"application XIDs {APP_XIDS} on GPU {g} from {len(pids)} "
                             f"different processes: the GPU, not the program, is suspect")
                break

    sig = signature(root)
    # a node failing across different jobs -> node fault
    program = _program(root.fault_class)
    if layer != Layer.APPLICATION or not program:
        for n in nodes:
            jobs = hist.node_jobs.get(n, set()) | ({hist.job} if hist.job else set())
            if len(jobs) >= cfg.node_repeat_jobs:
                facts["repeat_offender"] = [n]
                if layer in (Layer.UNKNOWN, Layer.APPLICATION):
                    # what the evidence alone said: the history records that, not this
                    # conclusion drawn from the history itself (else one node fault and a
                    # user's SIGKILL in another job would make every later crash there one)
                    facts["evidence_layer"] = str(layer)
                    layer = Layer.HARDWARE.value
                notes.append(f"node {n} had faults in {len(jobs)} different jobs "
                             f"({', '.join(sorted(jobs)[:5])}): a node fault")
                break
    # the same failure on different nodes of one job -> application fault
    if root.fault_class in SYSTEMATIC_CLASSES and not symptom_only:
        sig_nodes = set(hist.signature_nodes) | {n for a in roots if signature(a) == sig
                                                 for n in a.culprit.nodes}
        if len(sig_nodes) >= cfg.app_repeat_nodes:
            layer = Layer.APPLICATION.value
            facts["systematic"] = sorted(sig_nodes)
            facts["systematic_error"] = first_error_line(root.evidence[0]) if root.evidence \
                else sig
            notes.append(f"the same failure happened on {len(sig_nodes)} different "
                         f"nodes of this job ({', '.join(sorted(sig_nodes)[:5])}): "
                         f"an application fault, a restart would repeat it")

    # one signature from many nodes of many jobs at once -> the layer they share (rule 7)
    if root.severity == "error" and not symptom_only and cfg.shared_min_nodes > 0:
        recent = {n: set(js) for n, js in hist.recent_nodes.items()}
        for n in nodes:
            recent.setdefault(n, set()).add(hist.job)
        cause = shared.shared_cause(fault_class, sig, recent, hist.node_attrs,
                                    cfg.shared_window_s, cfg.shared_min_nodes,
                                    cfg.shared_min_jobs)
        if cause is not None:
            facts["shared_cause"] = cause
            facts.pop("repeat_offender", None)  # not this node's fault after all
            facts.setdefault("evidence_layer", str(layer))
            layer = cause["layer"]
            said = ", ".join(f"{k}={v}" for k, v in cause["common"].items())
            notes.append(f"the same failure from {cause['count']} nodes of {cause['jobs']} "
                         f"jobs within {cause['window_s']:g} s: a shared cause "
                         f"({layer}{'; in common: ' + said if said else ''}), not each node")

    evidence: list[str] = []
    for a, vic in zip(ordered_a, is_victim):
        tag = ("symptom" if a.symptom or vic else "root" if a is root else "fault")
        for line in a.evidence[:3]:
            evidence.append(f"[{tag} {a.kind} {_who(a)}] {line}")
    if len(evidence) > cfg.max_evidence:
        evidence = evidence[:cfg.max_evidence - 1] + [f"… {len(evidence) - cfg.max_evidence + 1}"
                                                      f" more lines"]
    sources = ev.agreeing_sources(root, supporting, facts)
    score = ev.score_of(len(sources), symptom_only)
    # the fault's time and its detection: of the errors when the root is one — a warning flag
    # (a straggler on a loaded host) that joined a crash's incident is no part of the crash
    timed = ([a for a in ordered_a if a.severity != "warning"]
             if root.severity != "warning" else []) or ordered_a
    first_ts = min((a.first_ts or a.ts) for a in timed)
    gens = [a.generation for a in ordered_a if a.generation is not None]
    detail = {"root_kind": root.kind, "root_anomaly": root.event_id,
              "pattern": root.detail.get("pattern") or root.detail.get("rule"),
              "symptoms": len(symptoms), "notes": notes, "symptom_only": symptom_only,
              "sources": sources, "severity": root.severity,
              # the first anomaly's publication: the decision's ``detected_ts`` (the remediator
              # reads it), so "detected" is fault → anomaly, not fault → verdict
              "detected_ts": min(a.ts for a in timed), **facts}
    victims = sorted({r for a, v in zip(ordered_a, is_victim) if v for r in a.culprit.ranks}
                     - set(ranks))
    if victims:
        detail["victims"] = victims
    for k in ROOT_DETAIL_KEYS:
        if root.detail.get(k) is not None:
            detail[k] = root.detail[k]
    if detail.get("step") is None:
        # one fault, two reports: the launcher relays the traceback as the rank prints it (it
        # knows no step) and the rank's own report follows with its step (trainguard.rank.hooks
        # .finish, the shim): the step is the rank's, whichever came first (the remediator's
        # loop check compares it with the last fault's)
        step = next((a.detail["step"] for a in ordered_a if a is not root
                     and isinstance(a.detail.get("step"), int)
                     and a.fault_class == root.fault_class and a.generation == root.generation
                     and a.culprit.ranks == root.culprit.ranks), None)
        if step is not None:
            detail["step"] = step
    return VerdictSpec(
        fault_class=fault_class, layer=layer, ranks=sorted(set(ranks)),
        nodes=nodes, gpus=gpus, confidence=ev.confidence(score), score=score, evidence=evidence,
        anomaly_ids=[a.event_id for a in ordered_a], first_ts=first_ts,
        generation=root.generation if root.generation is not None else (max(gens) if gens
                                                                        else None),
        detail=detail, signature=sig)


#: A root whose class its row only infers (``evidence.is_guess``), read again by what else the
#: incident shows: (root's pattern, another anomaly's pattern, fault class, layer, why).
REREADINGS: tuple[tuple[str, str, str, str, str], ...] = (
    ("sigkill", "rank_sigterm", FaultClass.CRASH.value, Layer.SYSTEM_SOFTWARE.value,
     "a rank was SIGKILLed while ranks were sent SIGTERM: its launcher, process manager, "
     "scheduler or an operator tore the job down (Slurm and torchrun send SIGTERM, then "
     "SIGKILL to what is left); the kernel's OOM killer sends SIGKILL alone, to the process "
     "it picks (mm/oom_kill.c)"),
    ("sigkill", "slurm_memory_limit_hit", FaultClass.OOM_HOST.value, Layer.APPLICATION.value,
     "the rank was SIGKILLed after slurmstepd reported the step over its memory limit: the "
     "job's own memory use against its allocation (the cgroup's OOM kill), not a guess"),
)


#: Rows whose fault names no layer on one rank but the program's when several ranks print it:
#: pattern -> why. A kernel's illegal access on every rank running the same code is the code's
#: (a faulty GPU or driver hits the ranks on it, not all of them at once).
PROGRAM_WHEN_SHARED: dict[str, str] = {
    "cuda_illegal_access": "the same CUDA memory fault on several ranks at once: the kernel's "
                           "code (the program or its framework), not one GPU",
}


def _shared_by_ranks(root: Anomaly, anomalies: list[Anomaly]) -> tuple[str, str] | None:
    """(layer, why) when ``root``'s pattern is in ``PROGRAM_WHEN_SHARED`` and at least two
    distinct ranks printed it; None otherwise."""
    pattern = root.detail.get("pattern")
    if pattern not in PROGRAM_WHEN_SHARED:
        return None
    ranks = {r for a in anomalies if a.detail.get("pattern") == pattern for r in a.culprit.ranks}
    return (Layer.APPLICATION.value, PROGRAM_WHEN_SHARED[pattern]) if len(ranks) >= 2 else None


def _reread(root: Anomaly, anomalies: list[Anomaly]) -> tuple[str, str, str] | None:
    """The first ``REREADINGS`` row that applies to ``root``: (fault class, layer, why)."""
    if not ev.is_guess(root):
        return None
    pattern = root.detail.get("pattern")
    for root_pattern, witness, fault_class, layer, why in REREADINGS:
        if pattern == root_pattern and any(a is not root and a.detail.get("pattern") == witness
                                           for a in anomalies):
            return fault_class, layer, why
    return None


def _who(a: Anomaly) -> str:
    return (f"rank {','.join(map(str, a.culprit.ranks))}" if a.culprit.ranks
            else f"node {','.join(a.culprit.nodes)}" if a.culprit.nodes else "job")


def _program(fault_class: str) -> bool:
    """Whether a history rule may call ``fault_class`` an application fault (the vocabulary's
    ``program``; a class outside the vocabulary may be)."""
    s = spec(fault_class)
    return s.program if s else True


#: Keys of the root anomaly's detail a verdict's detail carries on as they came.
ROOT_DETAIL_KEYS = ("xid", "signal", "step", "seq", "op", "in_compute", "blocked",
                    "launcher_lost", "last_beat_ns", "last_progress_ts")

#: The facts in a verdict's detail that say more than its fault class and layer: a later verdict
#: of an incident is published when its conclusion (fault class, layer, facts) changed.
FACTS = ("repeat_offender", "systematic", "suspect_gpu")

#: Fault classes whose signature carries the program's own error, so that the same signature on
#: different nodes of a job means the same bug (the ``systematic`` fact, which stops the job). Not
#: a crash or hang (a signal or silence says nothing about the code: two SIGKILLs on two nodes
#: are two incidents), not NaN loss (every rank of a data-parallel step sees the same NaN, and a
#: restore from a valid checkpoint often gets past it), not infrastructure classes.
SYSTEMATIC_CLASSES = (FaultClass.APP_EXCEPTION.value, FaultClass.OOM_GPU.value)


def conclusion(v: VerdictSpec) -> tuple:
    """What a verdict concludes, for "did a later verdict of the incident change anything":
    fault class, layer and the facts of ``FACTS``."""
    return (v.fault_class, v.layer, *(repr(v.detail.get(k)) for k in FACTS))


#: Layers whose faults count against a node in cross-job history.
NODE_LAYERS = (Layer.HARDWARE, Layer.SYSTEM_SOFTWARE, Layer.INFRASTRUCTURE)


def history_from_records(job: str, node_records: dict[str, list[dict]],
                         signature_pairs: list[tuple[str, str]], current_gpu_pids:
                         dict[str, set[int]] | None = None, since_ns: int = 0,
                         recent_pairs: list[tuple[str, str]] | None = None,
                         node_attrs: dict[str, dict[str, str]] | None = None) -> History:
    """Build a ``History`` from ``StateStore.node_history`` records (per culprit node) and
    ``signature_history`` pairs ``[(job, node)]`` of the root's signature. Records are dicts
    with at least ``job``, ``layer``, ``ts`` and optionally ``xid``, ``gpu``, ``pid``."""
    h = History(job=job)
    for node, recs in node_records.items():
        for r in recs:
            if r.get("ts", 0) < since_ns:
                continue
            # only faults attributed to the node's hardware/software count against it: an
            # application fault or an unexplained crash (layer unknown) says nothing of the node
            if r.get("layer") in NODE_LAYERS:
                h.node_jobs.setdefault(node, set()).add(str(r.get("job")))
            if r.get("xid") in APP_XIDS and r.get("gpu") and r.get("pid") is not None:
                h.gpu_app_xid_pids.setdefault(str(r["gpu"]), set()).add(int(r["pid"]))
    h.signature_nodes = {n for j, n in signature_pairs if j == job and n}
    for j, n in recent_pairs or ():
        if n:
            h.recent_nodes.setdefault(n, set()).add(j)
    h.node_attrs = {n: dict(a) for n, a in (node_attrs or {}).items()}
    for g, pids in (current_gpu_pids or {}).items():
        h.gpu_app_xid_pids.setdefault(g, set()).update(pids)
    return h

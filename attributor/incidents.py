"""The attributor as a reducer: anomalies in, one verdict per incident out. Pure.

``step(state, input, now) -> (state, effects)`` (``trainguard.core.reducer``); ``now`` is the service
clock in seconds, wall-clock fields come from the inputs' ``wall_ns`` (Unix ns).

* An incident is (job, generation); a new one starts when the first anomaly of the current one
  is older than ``AttributorConfig.incident_window_s``. An anomaly without a generation joins
  the newest generation seen for its job.
* A root-cause anomaly (``symptom=False``) is attributed at once. A symptom is held for
  ``symptom_hold_s`` waiting for a root cause; when one comes the symptom is folded into its
  verdict, otherwise a ``Tick`` past the hold attributes the held symptoms on their own. A peer
  report (``evidence.is_peer_report``: a connection reset, an IB/NCCL completion error, a
  timeout, a c10d store error) is held the same way while the incident has no root-cause
  verdict yet, even when its row is a root cause: the death it may be a symptom of can reach
  the bus after it (an exit seen by another host's launcher, a node found lost after seconds of
  silence), and a verdict published first would blame the survivor. A real network fault is
  attributed when the hold ends, ``symptom_hold_s`` later. An exit with a non-zero code
  (``evidence.is_exit_report``) is held the same way, for the traceback that names its
  exception.
* Attribution first reads the cross-job history: ``Call("state", "fault_history", (nodes,
  signature, since_ns))``, the records of every culprit node and the pairs of the root's
  signature in one round trip of the state store (read one after the other they were a round
  trip per node and one more on the fault → decision path); its reply completes the
  attribution (``decide.decide``). A failed read attributes without the history (a ``Log``
  says so), as the service always did.
* A later verdict of an incident is published only when its conclusion changes
  (``decide.conclusion``); otherwise the anomaly is folded into the verdict already published.
* A verdict whose root is a warning (severity other than ``error``: a straggler, a throttled
  GPU, a failed save) does not settle the incident: symptoms that follow still wait.
* Each published verdict is written to the cross-job history: ``Call("state", "record_fault",
  …)`` per culprit node and per XID anomaly, without a reply (a failed write is logged by the
  reducer base; the verdict stands).
* A ``Tick`` drops incidents older than twice the window; a job keeps at most
  ``MAX_JOB_INCIDENTS`` at once (a new generation past it drops the job's oldest).
* An anomaly already in its incident (same ``event_id``: redelivered after a restart, replayed
  in a takeover, published again by a restarted detector) changes nothing.
* A verdict's ``event_id`` is derived from (job, generation, conclusion), so the same
  conclusion reached again — by a restarted or taking-over replica — is the same verdict, which
  the stream and the remediator's claims keep once.
* ``Released(job)`` drops the job's incidents (another replica serves it now).

Reply tag: ``("history", seq)``, where ``seq`` numbers the attribution in flight
(``AttributorState.reading``).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard import schemas
from trainguard.core.reducer import (Call, Effect, Input, Log, Publish, Received, Released, Reply,
                                Tick, store)
from trainguard.schemas import subjects

from trainguard.attributor.decide import (APP_XIDS, ROOT_DETAIL_KEYS, AttributorConfig, VerdictSpec, choose_root,
                     conclusion, decide, history_from_records, signature)
from trainguard.attributor.evidence import LAG_KEYS, SOURCES, is_exit_report, is_peer_report

Key = tuple[str, int]  # (job, generation)


@dataclass(frozen=True)
class Incident:
    """One (job, generation) incident. ``started``/``hold_until``: service clock, s;
    ``concluded``: the ``decide.conclusion`` of the last verdict published (None: none yet);
    ``settled``: a verdict with a root-cause fault (severity ``error``) was published;
    ``dropped``: anomalies past ``MAX_INCIDENT_ANOMALIES``, counted and not kept."""

    job: str
    generation: int
    started: float
    anomalies: tuple[schemas.Anomaly, ...] = ()
    hold_until: float | None = None
    concluded: tuple | None = None
    settled: bool = False
    verdicts: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class Reading:
    """An attribution waiting for its history read. ``nodes``: the culprit nodes read;
    ``since_ns``: Unix ns, the start of the history window; ``wall_ns``: Unix ns of the input
    that started it."""

    key: Key
    nodes: tuple[str, ...]
    since_ns: int = 0
    wall_ns: int = 0


@dataclass(frozen=True)
class AttributorState:
    """``incidents`` by (job, generation); ``latest_gen``: job → newest generation seen;
    ``reading``: attributions in flight by sequence number; ``published``: verdicts so far."""

    config: AttributorConfig = field(default_factory=AttributorConfig)
    incidents: dict[Key, Incident] = field(default_factory=dict)
    latest_gen: dict[str, int] = field(default_factory=dict)
    reading: dict[int, Reading] = field(default_factory=dict)
    seq: int = 0
    published: int = 0
    #: node → the attributes last written to the store (``_on_telemetry``)
    node_attrs: dict[str, dict[str, str]] = field(default_factory=dict)


def step(state: AttributorState, inp: Input, now: float) -> tuple[AttributorState, list[Effect]]:
    """One input: an anomaly (``Received``), a ``Tick`` or a history read's ``Reply``."""
    if isinstance(inp, Received):
        if isinstance(inp.event, schemas.Anomaly):
            return _on_anomaly(state, inp.subject, inp.event, now, inp.wall_ns)
        if isinstance(inp.event, schemas.NodeTelemetry):
            return _on_telemetry(state, inp.event)
        return state, []
    if isinstance(inp, Tick):
        return _on_tick(state, now, inp.wall_ns)
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple) and inp.tag:
        if inp.tag[0] == "history":
            return _on_history(state, inp, now)
    if isinstance(inp, Released):
        return _forget_job(state, inp.key), []
    return state, []


#: nodes whose last attributes are remembered (past it, forgotten: written again)
MAX_NODE_ATTRS = 100_000


def _on_telemetry(state: AttributorState, ev: schemas.NodeTelemetry
                  ) -> tuple[AttributorState, list[Effect]]:
    """A node's attributes (driver, image, rack …) go to the store when they change, where
    every replica reads them for a shared cause (``attributor.shared``)."""
    if not ev.node or not ev.attributes or state.node_attrs.get(ev.node) == ev.attributes:
        return state, []
    known = state.node_attrs if len(state.node_attrs) < MAX_NODE_ATTRS else {}
    return (replace(state, node_attrs={**known, ev.node: dict(ev.attributes)}),
            [store("set_node_attrs", ev.node, dict(ev.attributes), wait=False)])


def _forget_job(state: AttributorState, job: str) -> AttributorState:
    keys = {k for k in state.incidents if k[0] == job}
    return replace(state, incidents={k: v for k, v in state.incidents.items() if k not in keys},
                   latest_gen={k: v for k, v in state.latest_gen.items() if k != job},
                   reading={s: r for s, r in state.reading.items() if r.key not in keys})


# ---- anomalies and ticks ----------------------------------------------------------------------
def _on_anomaly(state: AttributorState, subject: str, ev: schemas.Anomaly, now: float,
                wall_ns: int) -> tuple[AttributorState, list[Effect]]:
    ac = state.config
    job = ev.job or subjects.untoken(subject.split(".")[2])  # the name, dots included
    subjects.token(job)  # raises before state keys it
    latest = state.latest_gen.get(job, 0)
    gen = ev.generation if ev.generation is not None else latest
    if state.latest_gen.get(job) != max(gen, latest):  # a copy only when it changes
        state = replace(state, latest_gen={**state.latest_gen, job: max(gen, latest)})
    key = (job, gen)
    inc = state.incidents.get(key)
    if inc is not None and any(a.event_id == ev.event_id for a in inc.anomalies):
        return state, []  # the same anomaly again: already in its incident
    if inc is None or now - inc.started > ac.incident_window_s:
        inc = Incident(job, gen, now)
        state = _room_for(state, key)
    if len(inc.anomalies) >= MAX_INCIDENT_ANOMALIES and (
            ev.symptom or is_peer_report(ev) or len(inc.anomalies) >= 2 * MAX_INCIDENT_ANOMALIES):
        # a flood into one incident: counted, not kept (its earlier anomalies decide it)
        return _put(state, key, replace(inc, dropped=inc.dropped + 1)), []
    inc = replace(inc, anomalies=inc.anomalies + (_kept(ev),))
    if ev.symptom or ((is_peer_report(ev) or is_exit_report(ev)) and not inc.settled):
        # a flag (a warning, e.g. a straggler) does not settle an incident: symptoms that
        # follow still wait for their root cause
        if not inc.settled and inc.hold_until is None:
            inc = replace(inc, hold_until=now + ac.symptom_hold_s)
        return _put(state, key, inc), []
    return _attribute(_put(state, key, inc), key, wall_ns)


#: Anomalies one incident keeps: every rank of a 2,048-rank job reporting the same fault; past
#: it further symptoms and peer reports are counted (``Incident.dropped``), root causes kept up
#: to twice as many. Bounds the memory and the attribution time of a flood into one incident.
MAX_INCIDENT_ANOMALIES = 2048
#: Evidence lines of an anomaly an incident keeps, and their length (characters): attribution
#: reads the first three (``decide``: ``a.evidence[:3]``, the first error line).
KEPT_EVIDENCE_LINES = 8
KEPT_EVIDENCE_CHARS = 4096
#: Source event ids of an anomaly an incident keeps: attribution never reads them (the detector
#: names one or two), and a hostile anomaly may list 32,768 (``schemas.LIMITS``).
KEPT_SOURCE_IDS = 8


#: Incidents (generations) one job keeps at once: the default retry budget
#: (``remediator.policy_table.Policy.default_retry_budget``, 10 recoveries, each a new generation)
#: and its first generation fit, with room to spare. A new generation past it drops the job's
#: oldest incident (its verdict, if any, was published): a late anomaly of that generation opens
#: it again, and a verdict reached again has the same ``event_id`` (derived from job,
#: generation and conclusion), which the stream and the remediator's claims keep once. Bounds
#: what a flood of distinct generations into one job keeps within the 2 × window expiry.
MAX_JOB_INCIDENTS = 16


def _room_for(state: AttributorState, key: Key) -> AttributorState:
    """``state`` with room for incident ``key`` of its job: past ``MAX_JOB_INCIDENTS`` the
    job's oldest started other incidents are dropped (and their history reads forgotten)."""
    mine = [(inc.started, k) for k, inc in state.incidents.items()
            if k[0] == key[0] and k != key]
    if len(mine) < MAX_JOB_INCIDENTS:
        return state
    gone = {k for _, k in sorted(mine)[:len(mine) - MAX_JOB_INCIDENTS + 1]}
    return replace(state, incidents={k: v for k, v in state.incidents.items() if k not in gone},
                   reading={s: r for s, r in state.reading.items() if r.key not in gone})


#: Bounds of what an incident keeps of an anomaly's ``detail``: entries of one map, items of
#: one list, nesting below the top. The detector's details hold a dozen scalar facts and a few
#: lists of ranks or nodes (a 2,048-rank job's fits); a hostile anomaly may carry maps of
#: 16,384 entries and lists of 32,768 items (``schemas.LIMITS``), kept for the incident's
#: 2 × 60 s window otherwise.
KEPT_DETAIL_ENTRIES = 64
KEPT_DETAIL_ITEMS = 4096
KEPT_DETAIL_DEPTH = 4


def _bounded(v, depth: int = 0):
    """``v`` (a decoded MessagePack value) within the ``KEPT_DETAIL_*`` bounds and strings
    within ``KEPT_EVIDENCE_CHARS``; ``v`` itself when it already is."""
    if isinstance(v, str):
        return v if len(v) <= KEPT_EVIDENCE_CHARS else v[:KEPT_EVIDENCE_CHARS]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v[:KEPT_EVIDENCE_CHARS])
    if isinstance(v, dict):
        if depth >= KEPT_DETAIL_DEPTH:
            return {}
        items = list(v.items())[:KEPT_DETAIL_ENTRIES]
        out = {k: _bounded(x, depth + 1) for k, x in items}
        return v if len(out) == len(v) and all(out[k] is x for k, x in items) else out
    if isinstance(v, (list, tuple)):
        if depth >= KEPT_DETAIL_DEPTH:
            return []
        out = [_bounded(x, depth + 1) for x in v[:KEPT_DETAIL_ITEMS]]
        return v if len(out) == len(v) and all(a is b for a, b in zip(out, v)) else out
    return v


#: The keys of an anomaly's ``detail`` attribution reads, and all an incident keeps of it:
#: ``layer`` (``decide``: the layer a detector rule gave), ``pattern``/``rule`` (the verdict's
#: pattern, the systematic check), ``ROOT_DETAIL_KEYS`` (carried on into the verdict),
#: ``evidence.LAG_KEYS`` (onset), the ``evidence.SOURCES`` conditions (``xid``, ``slurm``,
#: ``stream``), ``exit_code`` (``is_exit_report``), ``weight`` (root strength, ``is_guess``),
#: ``pid`` (an application XID's process, the cross-job history). A detector's detail holds a
#: few more facts for people (a rule's thresholds, a log line's offset): they stay on the
#: anomaly in the stream, not in the incident's memory for its 2 × 60 s window, where a flood
#: of valid anomalies with details of made-up keys grew the attributor's memory past its bound
#: (``bench/fuzz.py``: 4-10 KiB kept of each such anomaly, 1 KiB now).
READ_DETAIL_KEYS = frozenset({
    "layer", "pattern", "rule", "exit_code", "weight", "pid", "stream", *ROOT_DETAIL_KEYS,
    *LAG_KEYS, *(cond for _, cond, _ in SOURCES if cond and not cond.startswith("stream="))})


def _kept(ev: schemas.Anomaly) -> schemas.Anomaly:
    """``ev`` as an incident keeps it: its evidence cut to what attribution reads, its
    ``source_event_ids`` to ``KEPT_SOURCE_IDS``, its ``detail`` to the ``READ_DETAIL_KEYS``,
    each value within ``KEPT_DETAIL_*``."""
    read = ev.detail if ev.detail.keys() <= READ_DETAIL_KEYS else {
        k: v for k, v in ev.detail.items() if k in READ_DETAIL_KEYS}
    detail = _bounded(read)
    if len(ev.source_event_ids) <= KEPT_SOURCE_IDS and len(ev.evidence) <= KEPT_EVIDENCE_LINES \
            and all(len(x) <= KEPT_EVIDENCE_CHARS for x in ev.evidence) and detail is ev.detail:
        return ev
    return ev.model_copy(update={"evidence": [x[:KEPT_EVIDENCE_CHARS] for x in
                                              ev.evidence[:KEPT_EVIDENCE_LINES]],
                                 "source_event_ids": ev.source_event_ids[:KEPT_SOURCE_IDS],
                                 "detail": detail})


def _on_tick(state: AttributorState, now: float, wall_ns: int
             ) -> tuple[AttributorState, list[Effect]]:
    effects: list[Effect] = []
    expired = []
    for key, inc in list(state.incidents.items()):
        if not inc.settled and inc.hold_until is not None and now >= inc.hold_until:
            state, more = _attribute(replace(state, incidents={
                **state.incidents, key: replace(inc, hold_until=None)}), key, wall_ns)
            effects += more
        elif now - inc.started > 2 * state.config.incident_window_s:
            expired.append(key)
    if expired:  # one copy of the table for all of them (a flood expires thousands at once)
        gone = set(expired)
        state = replace(state, incidents={k: v for k, v in state.incidents.items()
                                          if k not in gone})
    return state, effects


def _put(state: AttributorState, key: Key, inc: Incident) -> AttributorState:
    return replace(state, incidents={**state.incidents, key: inc})


# ---- attribution: history reads, then decide ----------------------------------------------------
def _attribute(state: AttributorState, key: Key, wall_ns: int
               ) -> tuple[AttributorState, list[Effect]]:
    """Start the history read of incident ``key`` (see the module docstring)."""
    inc = state.incidents[key]
    nodes = tuple(sorted({n for a in inc.anomalies for n in a.culprit.nodes}))
    since = wall_ns - int(state.config.history_window_s * 1e9)
    seq = state.seq + 1
    r = Reading(key, nodes, since, wall_ns)
    state = replace(state, seq=seq, reading={**state.reading, seq: r})
    root = choose_root(list(inc.anomalies), state.config)
    cfg = state.config
    recent = wall_ns - int(cfg.shared_window_s * 1e9)
    return state, [store("fault_history", nodes, signature(root), since, recent_since_ns=recent,
                         attrs_at=max(1, cfg.shared_min_nodes - len(nodes)),
                         reply=("history", seq))]


def _on_history(state: AttributorState, inp: Reply, now: float
                ) -> tuple[AttributorState, list[Effect]]:
    seq = inp.tag[1]
    if seq not in state.reading:
        return state, []
    if inp.error:
        return _complete(state, seq, {}, [], [_no_history(inp.error)])
    records, pairs, *shared = inp.value or ({}, [])
    recent, attrs = (shared + [[], {}])[:2] if shared else ([], {})
    return _complete(state, seq, {n: list(rs) for n, rs in dict(records).items()},
                     [tuple(p) for p in pairs], [],
                     recent=[tuple(p) for p in recent or ()], attrs=dict(attrs or {}))


def _no_history(error: str) -> Log:
    return Log(logging.WARNING, f"cross-job history unavailable ({error}): attributing "
                                f"without it")


def _complete(state: AttributorState, seq: int, records: dict[str, list[dict]], pairs: list,
              effects: list[Effect], recent: list | None = None,
              attrs: dict[str, dict[str, str]] | None = None
              ) -> tuple[AttributorState, list[Effect]]:
    """Decide with the history read; publish unless the conclusion is the one published."""
    r = state.reading[seq]
    state = replace(state, reading={k: v for k, v in state.reading.items() if k != seq})
    inc = state.incidents.get(r.key)
    if inc is None:
        return state, effects
    anomalies = list(inc.anomalies)
    current: dict[str, set[int]] = {}
    for a in anomalies:
        xid, pid = a.detail.get("xid"), a.detail.get("pid")
        if xid in APP_XIDS and pid is not None and a.culprit.gpus:
            current.setdefault(a.culprit.gpus[0], set()).add(int(pid))
    hist = history_from_records(inc.job, records, pairs, current, r.since_ns,
                                recent_pairs=recent, node_attrs=attrs)
    spec = decide(anomalies, hist, state.config)
    if inc.concluded is not None and conclusion(spec) == inc.concluded:
        return state, effects  # folded into the verdict already published
    root = choose_root(anomalies, state.config)
    verdict = _verdict(inc, spec, root, r.wall_ns)
    inc2 = replace(inc, concluded=conclusion(spec), settled=inc.settled or root.severity == "error",
                   hold_until=None, verdicts=inc.verdicts + 1)
    state = replace(_put(state, r.key, inc2), published=state.published + 1)
    # a flag (a warning root: CPU saturation, a straggler) is no fault of the node: kept out of
    # the cross-job history, where it would make the node a repeat offender at its next fault
    history = _record(inc, spec, r.wall_ns) if root.severity == "error" else []
    return state, effects + [Publish(subjects.job(inc.job, "verdict"), verdict), *history]


def _verdict(inc: Incident, spec: VerdictSpec, root: schemas.Anomaly, wall_ns: int
             ) -> schemas.Verdict:
    """The verdict event; ``ts`` is ``wall_ns`` (Unix ns) when the input gave one."""
    vid = hashlib.blake2b(repr((inc.job, inc.generation, conclusion(spec))).encode(),
                          digest_size=16).hexdigest()
    return schemas.Verdict(
        event_id=vid, job=inc.job, node=spec.nodes[0] if spec.nodes else None,
        rank=spec.ranks[0] if len(spec.ranks) == 1 else None,
        fault_class=spec.fault_class, layer=spec.layer,
        culprit=schemas.Culprit(ranks=spec.ranks, nodes=spec.nodes, gpus=spec.gpus),
        confidence=spec.confidence, score=round(spec.score, 3),
        evidence=spec.evidence, anomaly_ids=spec.anomaly_ids, first_ts=spec.first_ts,
        generation=inc.generation, detail={**spec.detail, "signature": spec.signature,
                                           "revision": inc.verdicts},
        trace=root.child_trace(), **({"ts": wall_ns} if wall_ns else {}))


#: Root kinds whose verdict says nothing of the node in cross-job history (recorded with layer
#: ``unknown``, so they never make the node a repeat offender): a launcher silent while its
#: node's agent beats was stopped from outside — a pod deleted, a container killed, a user's
#: SIGTERM or Ctrl-C of ``trainguard launch`` — and the node is fine. Counted as an
#: infrastructure fault, one stopped job made every later crash on that node a hardware fault
#: for a day (``bench/dropin.py``: three jobs stopped after the first launch was ended).
NOT_THE_NODES = ("launcher_lost",)


def _record(inc: Incident, spec: VerdictSpec, wall_ns: int) -> list[Call]:
    """``record_fault`` writes of a published verdict: per culprit node (its signature, and the
    layer its evidence gave: ``detail["evidence_layer"]`` when the history made it hardware) and
    per XID anomaly (``xid|<n>``, with GPU and pid); ``ts_ns`` is the input's Unix ns (the
    store's clock when 0)."""
    ts: dict[str, Any] = {"ts_ns": wall_ns} if wall_ns else {}
    layer = spec.detail.get("evidence_layer", spec.layer)
    if spec.detail.get("root_kind") in NOT_THE_NODES:
        layer = "unknown"
    calls = [store("record_fault", n, inc.job, spec.signature,
                   {"fault_class": spec.fault_class,
                    "layer": layer,
                    "generation": inc.generation}, **ts) for n in spec.nodes]
    for a in inc.anomalies:
        xid = a.detail.get("xid")
        if xid is not None and a.culprit.nodes:
            calls.append(store("record_fault", a.culprit.nodes[0], inc.job, f"xid|{xid}", {
                "fault_class": a.fault_class, "layer": a.detail.get("layer"), "xid": xid,
                "pid": a.detail.get("pid"), "gpu": a.culprit.gpus[0] if a.culprit.gpus else ""},
                **ts))
    return calls

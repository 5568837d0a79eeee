"""How the detector's reducer turns a finding into an anomaly (``emit``, ``emit_node``: the
incident key, dedup, a hang's fault time at the rank's last progress) and finds the job, rank and
node an input names (``job_state``, ``node_state``, ``job_of``, ``node_of``, ``node_timeout``).
Pure, like the reducer (``detector.reducer``) whose helpers these are."""
from __future__ import annotations

import hashlib

from trainguard import schemas
from trainguard.core.reducer import Effect, Publish, Received
from trainguard.schemas import JobRecord, subjects

from trainguard.detector.core import Finding
from trainguard.detector.progress import JobState
from trainguard.detector.signals import NodeState
from trainguard.detector.state import DetectorState

__all__ = ["anomaly_id", "emit", "emit_node", "job_state", "node_state", "job_of", "node_of",
           "node_timeout"]


def anomaly_id(key: tuple, source: schemas.Event | None, wall_ns: int, ttl_s: float) -> str:
    """The event id of the anomaly of incident ``key``: 32 hex characters of blake2b over the
    key and the source event's id (or the ``ttl_s`` period of ``wall_ns``, Unix ns)."""
    anchor = source.event_id if source is not None else str(int(wall_ns // (ttl_s * 1e9)))
    return hashlib.blake2b(repr((key, anchor)).encode(), digest_size=16).hexdigest()


# ---- publication ---------------------------------------------------------------------------------
def emit(state: DetectorState, out: list[Effect], job: str | None, f: Finding, now: float,
         wall_ns: int, source: schemas.Event | None = None,
         node_scope: str | None = None) -> bool:
    """Append the ``Publish`` of ``f`` unless its incident key was published less than
    ``dedup_ttl_s`` ago; returns False when deduplicated."""
    key = f.dedup_key(job or f"node:{node_scope}")
    seen = state.emitted.get(key)
    if seen is not None and now - seen < state.config.dedup_ttl_s:
        return False
    state.emitted[key] = now
    _at_last_progress(f, wall_ns)
    extra = {"ts": wall_ns} if wall_ns else {}
    a = schemas.Anomaly(
        event_id=anomaly_id(key, source, wall_ns, state.config.dedup_ttl_s),
        job=job, node=(f.nodes[0] if f.nodes else node_scope),
        rank=f.ranks[0] if len(f.ranks) == 1 else None, kind=f.kind,
        fault_class=f.fault_class,
        culprit=schemas.Culprit(ranks=f.ranks, nodes=f.nodes, gpus=f.gpus),
        symptom=f.symptom, severity=f.severity, first_ts=f.ts or wall_ns,
        evidence=f.evidence, detail=f.detail,
        source_event_ids=[source.event_id] if source is not None else [],
        generation=f.generation,
        trace=source.child_trace() if source is not None else {}, **extra)
    subject = (subjects.job(job, "anomaly") if job
               else subjects.node(node_scope or "unknown", "anomaly"))
    out.append(Publish(subject, a))
    state.anomalies += 1
    return True


def _at_last_progress(f: Finding, wall_ns: int) -> None:
    """A hang's fault time is the rank's last progress, not the tick that found it: a finding
    with ``detail["since_progress_s"]`` (``silence_rule``, ``stall_rule``) gets
    ``detail["last_progress_ts"]`` = the tick's ``wall_ns`` less that many seconds (Unix ns, the
    detector's clock, as the detection time is), and the same as its ``ts`` (the anomaly's
    ``first_ts``), so that everything timed from the fault (the verdict's ``first_ts``, the
    decision's ``fault_ts``, the goodput ledger, the report, the console) counts the silence
    before detection."""
    lag = f.detail.get("since_progress_s")
    if (not f.ts and wall_ns and isinstance(lag, (int, float)) and not isinstance(lag, bool)
            and lag >= 0):
        f.ts = f.detail["last_progress_ts"] = wall_ns - int(lag * 1e9)


def emit_node(state: DetectorState, out: list[Effect], node: str, f: Finding, now: float,
              wall_ns: int, source: schemas.Event | None = None,
              unread: tuple[str, ...] = ()) -> None:
    """A node finding: on the node's subject and on every job with members on ``node``
    (culprit ranks: those members; for a GPU finding, the members whose local rank is the GPU's
    index when any is), each with its job's generation. The node's own subject only when this
    replica serves the node. ``unread``: jobs the source says are on the node whose record
    this replica has not read yet (served by it): they get the finding too, without ranks or
    generation (the attributor files it under the job's newest)."""
    if state.serves(f"node:{node}"):
        emit(state, out, None, f, now, wall_ns, source, node_scope=node)
    gpu_index = f.detail.get("gpu_index")
    jobs = set(state.node_jobs.get(node, ()))
    jobs |= {j for j in unread if j not in state.records and state.serves(j)}
    for job in sorted(jobs):
        jc = state.records.get(job) or JobRecord()
        on_node = [m for m in jc.members if m.get("node") == node]
        if gpu_index is not None and any(m.get("local_rank") == gpu_index for m in on_node):
            on_node = [m for m in on_node if m.get("local_rank") == gpu_index]
        jf = Finding(f.kind, f.fault_class, ranks=sorted(int(m["rank"]) for m in on_node
                                                         if "rank" in m),
                     nodes=list(f.nodes), gpus=list(f.gpus), symptom=f.symptom,
                     severity=f.severity, evidence=list(f.evidence), detail=dict(f.detail),
                     ts=f.ts, generation=jc.generation if job in state.records else None)
        emit(state, out, job, jf, now, wall_ns, source)


# ---- memory ------------------------------------------------------------------------------------
def job_state(state: DetectorState, name: str, now: float) -> JobState:
    js = state.jobs.get(name)
    if js is None:
        js = state.jobs[name] = JobState(name, state.config.rules.step_window)
        state.job_seen[name] = now
        state.due.add(name)  # learn its record at the next tick
    return js


def node_state(state: DetectorState, name: str) -> NodeState:
    ns = state.nodes.get(name)
    if ns is None:
        ns = state.nodes[name] = NodeState(name)
    return ns


def _named(given: str | None, subject: str) -> str:
    """The job or node an input concerns, as its name (dots included:
    ``ip-10-0-1-2.ec2.internal``, what job members and culprits name): the event's own, else its
    subject's (``subjects.parse``, decoded). Raises ValueError for a name that cannot be a
    subject token (``subjects.token``) before any state is keyed by it."""
    name = given or subjects.parse(subject)["name"]
    subjects.token(name)
    return name


def job_of(inp: Received) -> str:
    return _named(inp.event.job, inp.subject)


def node_of(inp: Received) -> str:
    return _named(inp.event.node, inp.subject)


def node_timeout(state: DetectorState, node: str) -> float:
    """Seconds of silence after which ``node`` is lost: the smallest ``node_timeout_s`` of the
    records of the jobs with members on it, else ``DetectorConfig.node_timeout_s``. Kept in
    ``state.node_timeouts`` until a record naming the node changes (``memory.index``)."""
    t = state.node_timeouts.get(node)
    if t is None:
        ts = [state.records[j].node_timeout_s for j in state.node_jobs.get(node, ())
              if j in state.records and state.records[j].node_timeout_s]
        t = state.node_timeouts[node] = min(ts) if ts else state.config.rules.node_timeout_s
    return t

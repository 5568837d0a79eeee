"""The detector as a reducer: ``step(state, input, now) -> (state, effects)``.

Everything that decides what the detector publishes is here, pure (``trainguard.reducer`` for
the inputs and effects): the service (``detector.service``) only subscribes, ticks and carries
the effects out, and a table test or an offline replay drives ``step`` through ``run_offline``.

``now`` is the service clock in seconds (monotonic live, virtual offline); the windows and the
dedup memory are kept in it. Wall-clock times come from the input's ``wall_ns`` (Unix ns), never
from a clock read here: an anomaly's ``ts`` is the input's, and its ``first_ts`` the finding's
(the event's own time) or, for a finding without one, the input's — for the periodic rules
(node lost, launcher lost, straggler, throughput, missing member) the ``Tick``'s; for a hang
(silence, stall) the rank's last progress, ``detail["last_progress_ts"]`` (``_at_last_progress``).

What ``step`` decides, by input:

* ``Received`` — the event is folded into its job's or node's windows (``detector.progress``,
  ``detector.signals``; a node heartbeat is the agent's on ``tg.node.<node>.heartbeat``, where
  launchers of earlier releases beat too, or a launcher's on ``tg.node.<node>.launcher.<job>``,
  refused unless it agrees with its subject: ``launcher_beat``) and the one-off rules run:
  crash, log line, failed save, a restore whose loss check failed (``recovery.verified`` with
  ``ok`` False), NaN loss, XID, telemetry (GPU counters, and the host and link rules of
  ``detector.telemetry``), the Slurm watcher's node and job events (``detector.scheduler``: a
  node Slurm marks DOWN or not responding is a node loss for the jobs on it — those of the
  records' members, and those the event names whose record is not read yet; a node already out
  of a job's members is none of its business; a drain set by trainguard itself is nothing). A
  job first seen is read from the job record at the next tick. Event types the detector does
  not consume produce nothing.
* ``Tick`` — silence, node lost and launcher lost (a job's launcher and its ranks on a node
  silent while the node's agent beats: ``signals.launcher_lost_rule``, published to that job
  only) on every tick; stall, missing member, straggler and
  throughput every ``eval_s``; the job records re-read every ``job_refresh_s`` (one
  ``Call("state", "job_records", (names,), reply=("jobs", ((name, seq), …)), wait=False)``
  per tick for the jobs due, none for a job whose previous read is still out, unless it is
  ``refresh_timeout_s`` old); memory
  collected every ``gc_s``.
* ``Reply`` to a record read — the record replaces the last one (members, per-job timeouts,
  generation) and re-indexes node → jobs; a record whose ``runs`` grew resets that job's
  windows (a new launch: the old run's ranks and step times are not this run's); a failed read
  keeps the last record (a ``Log`` warning says so).

Publication: one anomaly per incident key (``Finding.dedup_key``: job, subject, kind, pattern,
generation) per ``dedup_ttl_s``, on ``tg.job.<job>.anomaly``. A node finding (node lost, XID,
thermal, ECC counters) goes to ``tg.node.<node>.anomaly`` and to every job with members on that
node, its culprit ranks those members — for a GPU finding, the member whose local rank is the
GPU's index when one is.

Replicas: every replica steps every node event (node windows are small and a takeover then
needs no node history); a replica publishes the node-scoped anomaly of a node only when it
serves ``node:<node>`` (``DetectorState.serves``), and a node finding reaches only the jobs it
serves (it reads only their records). ``Released(job)`` forgets a job's windows and record.
An anomaly's ``event_id`` is derived from its incident key and its source event (or, for a
periodic rule, the ``dedup_ttl_s`` period it fell in), so the same incident found again — a
redelivered event, a restarted or taking-over replica — carries the same id, which the stream
and the attributor keep once.

The state object is the reducer's own: ``step`` changes it in place and returns it. Input
events are never changed.
"""
from __future__ import annotations

import hashlib
import logging
import math

from trainguard import schemas
from trainguard.reducer import (BusDown, BusUp, Call, Effect, Input, Log, Publish, Received,
                                Released, Reply, Tick)
from trainguard.schemas import JobRecord, subjects
from trainguard.schemas.job import ENDED_STATUSES

from . import scheduler
from .core import Finding
from .memory import bus_back, forget_job, gc, index
from .progress import (JobState, missing_member_rule, nan_loss_rule, observe_heartbeat,
                       silence_rule, stall_rule, straggler_rule, throughput_rule)
from .signals import (NodeState, crash_rule, launcher_lost_rule, log_rule, node_lost_rule,
                      observe_node_heartbeat, recovery_check_finding, save_failed_finding,
                      telemetry_rule, xid_rule)
from .state import DetectorServiceConfig, DetectorState  # re-exported: the reducer's types
from .telemetry import cpu_context, host_rules, link_rules

__all__ = ["DetectorServiceConfig", "DetectorState", "step", "refresh_calls", "node_timeout",
           "launcher_beat", "TOPICS"]

#: The subjects the detector consumes.
TOPICS = ("tg.job.*.rank.*.hb", "tg.job.*.worker", "tg.job.*.log", "tg.job.*.ckpt",
          "tg.job.*.recovery", "tg.node.*.heartbeat", subjects.ALL_LAUNCHERS, "tg.node.*.xid",
          "tg.node.*.telemetry", "tg.node.*.kernel", "tg.node.*.slurm", "tg.job.*.slurm")

#: Fault classes a node's kernel log shows for the whole node (a NIC link down, an NFS server
#: gone, a machine-check, a GPU off the bus): such a finding goes to every job with members on
#: the node. Any other kernel line (an OOM kill, a segfault, a hung task) names one process the
#: kernel does not tie to a job: it is published for the node only (its history), and the rank's
#: own exit (``worker.exited``, ``oom_killed``) is what its job hears.
NODE_WIDE_KERNEL_CLASSES = frozenset({"gpu_xid", "ecc", "nvlink", "network", "filesystem",
                                      "thermal", "node_lost"})


# ---- the step ----------------------------------------------------------------------------------
def step(state: DetectorState, inp: Input, now: float) -> tuple[DetectorState, list[Effect]]:
    """Fold ``inp`` into ``state`` at service time ``now`` (seconds); returns the state (the
    same object, changed in place) and the effects to carry out, in order. See the module
    docstring for what each input does."""
    if isinstance(inp, Received):
        handler = _HANDLERS.get(type(inp.event))
        if handler is None:
            return state, []
        full = capacity(state, inp)
        if full is not None:
            return state, _refuse(state, full, inp.subject, now)
        return state, handler(state, inp, now)
    if isinstance(inp, Tick):
        return state, _tick(state, inp.wall_ns, now)
    if isinstance(inp, Reply):
        return state, _reply(state, inp, now)
    if isinstance(inp, Released):
        forget_job(state, inp.key)
    elif isinstance(inp, BusDown):
        state.blind = True
    elif isinstance(inp, BusUp):
        bus_back(state, now, inp.gap_s)
    return state, []


def capacity(state: DetectorState, inp: Received) -> str | None:
    """Which bound (``jobs``, ``ranks``, ``nodes``; ``DetectorServiceConfig``) ``inp`` would
    pass by tracking a job, rank or node not tracked yet; None when it passes none. Names
    that cannot be subject tokens are left to the handlers (they refuse them)."""
    dc = state.config
    jobs_full, ranks_full = len(state.jobs) >= dc.max_jobs, state.ranks >= dc.max_ranks
    if not (jobs_full or ranks_full or len(state.nodes) >= dc.max_nodes):
        return None  # the hot path: one comparison per bound
    ev = inp.event
    try:
        if inp.subject.startswith("tg.job."):
            job = _job_of(inp)
            js = state.jobs.get(job)
            if js is None and jobs_full:
                return "jobs"
            if isinstance(ev, schemas.RankHeartbeat) and ranks_full:
                rank = ev.rank if ev.rank is not None else int(inp.subject.split(".")[4])
                if js is None or rank not in js.ranks:
                    return "ranks"
        elif inp.subject.startswith("tg.node.") and len(state.nodes) >= dc.max_nodes:
            if _node_of(inp) not in state.nodes:
                return "nodes"
    except (ValueError, IndexError):
        return None
    return None


def _refuse(state: DetectorState, bound: str, subject: str, now: float) -> list[Effect]:
    state.refused[bound] = state.refused.get(bound, 0) + 1
    if now - state.refused_logged < state.config.refused_log_s:
        return []
    state.refused_logged = now
    dc = state.config
    limits = {"jobs": dc.max_jobs, "ranks": dc.max_ranks, "nodes": dc.max_nodes}
    return [Log(logging.WARNING,
                f"tracking {limits[bound]} {bound} already (the detector's bound): an event on "
                f"{subject[:200]} that would track one more is refused ({state.refused} refused "
                f"so far; what is tracked is kept, and what falls silent for forget_after_s "
                f"frees room)")]


def anomaly_id(key: tuple, source: schemas.Event | None, wall_ns: int, ttl_s: float) -> str:
    """The event id of the anomaly of incident ``key``: 32 hex characters of blake2b over the
    key and the source event's id (or the ``ttl_s`` period of ``wall_ns``, Unix ns)."""
    anchor = source.event_id if source is not None else str(int(wall_ns // (ttl_s * 1e9)))
    return hashlib.blake2b(repr((key, anchor)).encode(), digest_size=16).hexdigest()


# ---- publication ---------------------------------------------------------------------------------
def _emit(state: DetectorState, out: list[Effect], job: str | None, f: Finding, now: float,
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


def _emit_node(state: DetectorState, out: list[Effect], node: str, f: Finding, now: float,
               wall_ns: int, source: schemas.Event | None = None,
               unread: tuple[str, ...] = ()) -> None:
    """A node finding: on the node's subject and on every job with members on ``node``
    (culprit ranks: those members; for a GPU finding, the members whose local rank is the GPU's
    index when any is), each with its job's generation. The node's own subject only when this
    replica serves the node. ``unread``: jobs the source says are on the node whose record
    this replica has not read yet (served by it): they get the finding too, without ranks or
    generation (the attributor files it under the job's newest)."""
    if state.serves(f"node:{node}"):
        _emit(state, out, None, f, now, wall_ns, source, node_scope=node)
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
        _emit(state, out, job, jf, now, wall_ns, source)


# ---- memory ------------------------------------------------------------------------------------
def _job(state: DetectorState, name: str, now: float) -> JobState:
    js = state.jobs.get(name)
    if js is None:
        js = state.jobs[name] = JobState(name, state.config.rules.step_window)
        state.job_seen[name] = now
        state.due.add(name)  # learn its record at the next tick
    return js


def _node(state: DetectorState, name: str) -> NodeState:
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


def _job_of(inp: Received) -> str:
    return _named(inp.event.job, inp.subject)


def _node_of(inp: Received) -> str:
    return _named(inp.event.node, inp.subject)


# ---- received events -----------------------------------------------------------------------------
def _on_heartbeat(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    job = _job_of(inp)
    rank = ev.rank if ev.rank is not None else int(inp.subject.split(".")[4])
    js = state.jobs.get(job) or _job(state, job, now)
    if rank not in js.ranks:
        state.ranks += 1  # counted exactly again at each collection (``memory.gc``)
    observe_heartbeat(js, rank, ev.node, ev.local_rank, ev.generation, ev.step,
                      ev.collective_seq, ev.phase, ev.step_time_s, now, state.config.rules,
                      ev.interval_s, ev.compute_s, ev.collectives_completed)
    if ev.loss is None or math.isfinite(ev.loss):
        return []
    out: list[Effect] = []
    f = nan_loss_rule(ev.loss, rank, ev.node, ev.step, ev.generation, ev.ts)
    if f is not None:
        _emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_worker_exited(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    job = _job_of(inp)
    js = _job(state, job, now)
    if ev.rank is not None and ev.rank in js.ranks:
        js.ranks[ev.rank].exited = True
    out: list[Effect] = []
    f = crash_rule(ev.rank, ev.node, ev.exit_code, ev.signal, ev.oom_killed, ev.expected,
                   ev.generation, ev.ts, ev.pid)
    if f is not None:
        _emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_worker_started(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    js = _job(state, _job_of(inp), now)
    rs = js.ranks.get(ev.rank) if ev.rank is not None else None
    if rs is not None:
        rs.exited = False
        rs.last_hb = rs.last_advance = now
        rs.phase = "startup"
    return []


def _on_log(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    if ev.job is None and inp.subject.startswith("tg.node."):
        return _on_kernel_line(state, inp, now)
    job = _job_of(inp)
    _job(state, job, now)
    f = log_rule(ev.line, ev.stream, ev.rank, ev.node, ev.generation, ev.ts, ev.step)
    if f is None:
        return []
    if f.symptom and ev.source == "launcher":
        # a rank's stderr as the launcher relays it carries no reliable generation: a peer's
        # collective error printed during a recovery would open a new incident. The shim
        # reports those itself, with its generation; relayed lines count for root causes only
        # (a CUDA error or segfault printed as a process dies)
        return []
    f.detail["stream"] = ev.stream
    out: list[Effect] = []
    _emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_kernel_line(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """A line of a node's kernel log (``tg.node.<node>.kernel``, forwarded by the node agent)."""
    ev = inp.event
    node = _node_of(inp)
    f = log_rule(ev.line, "kernel", None, node, None, ev.ts)
    if f is None:
        return []
    f.nodes = [node]
    f.ranks = []
    f.detail["stream"] = "kernel"
    out: list[Effect] = []
    if f.fault_class in NODE_WIDE_KERNEL_CLASSES:
        _emit_node(state, out, node, f, now, inp.wall_ns, ev)
    elif state.serves(f"node:{node}"):
        _emit(state, out, None, f, now, inp.wall_ns, ev, node_scope=node)
    return out


def _on_save_failed(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    if ev.error.startswith("skipped:"):
        return []  # overlap_policy="skip" did what it was asked to: nothing failed
    out: list[Effect] = []
    f = save_failed_finding(ev.rank, ev.node, ev.step, ev.error, ev.errno, ev.generation, ev.ts)
    _emit(state, out, _job_of(inp), f, now, inp.wall_ns, ev)
    return out


def _on_recovery_verified(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    if ev.ok:
        return []
    out: list[Effect] = []
    f = recovery_check_finding(ev.rank, ev.node, ev.restored_step, ev.loss_at_save,
                               ev.loss_after, ev.tolerance, ev.generation, ev.ts)
    _emit(state, out, _job_of(inp), f, now, inp.wall_ns, ev)
    return out


def launcher_beat(subject: str, ev: schemas.NodeHeartbeat) -> tuple[str, str]:
    """``(node, job)`` of a launcher's beat on ``tg.node.<node>.launcher.<job>``
    (``subjects.launcher``), both from the subject: what the server checked against the
    publisher's rights (a job's own user may publish its own job's launcher subject only, on
    any node), where the event's fields are the publisher's word. Raises ValueError, saying
    why, for a subject of another form, a name that is no subject token, or an event that
    disagrees with its subject: a ``job`` or ``node`` other than the subject's, or a role
    other than ``launcher`` (a job's user beating as a node agent would vouch for the node, and
    keep every job's lost launcher there unseen: ``signals.launcher_lost_rule``). Such an event
    changes nothing; the bus counts it with the other events a handler refused
    (``BusStats.handler_errors``)."""
    parts = subjects.parse(subject)
    job = parts.get("job")
    if parts["scope"] != "node" or parts["kind"] != subjects.LAUNCHER or job is None:
        raise ValueError(f"{subject[:200]!r} is no launcher heartbeat subject "
                         f"(tg.node.<node>.launcher.<job>)")
    node = parts["name"]
    subjects.token(node), subjects.token(job)
    for what, given, want in (("job", ev.job, job), ("node", ev.node, node)):
        if given and given != want:
            raise ValueError(f"a launcher heartbeat on {subject[:200]} names {what} "
                             f"{given[:200]!r}, its subject {want!r}: refused")
    if ev.role != "launcher":
        raise ValueError(f"a heartbeat on launcher subject {subject[:200]} has role "
                         f"{ev.role[:50]!r}, not 'launcher': refused")
    return node, job


def _on_node_heartbeat(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """A node heartbeat: the node agent's on ``tg.node.<node>.heartbeat`` (there too a
    launcher of an earlier release, role ``launcher`` and its job in the event), a launcher's
    on ``tg.node.<node>.launcher.<job>`` (``launcher_beat``: refused unless it agrees with its
    subject)."""
    ev = inp.event
    if inp.subject.split(".", 4)[3:4] == [subjects.LAUNCHER]:
        (node, job), role = launcher_beat(inp.subject, ev), "launcher"
    else:
        node, role, job = _node_of(inp), ev.role, ev.job
    ns = _node(state, node)
    observe_node_heartbeat(ns, role, now, job, ending=bool(ev.ending))
    # its deadline may be nearer than the last look's earliest (a node first heard, a lost one
    # back, a launcher to watch)
    due = now if ns.launchers else now + node_timeout(state, ns.name)
    if due < state.nodes_due:
        state.nodes_due = due
    return []


def _on_xid(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    node = _node_of(inp)
    f = xid_rule(ev.xid, node, ev.pci, ev.gpu_index, ev.pid, ev.raw, ev.ts, ev.message)
    if f is None:
        return []
    if ev.gpu_uuid:
        f.gpus.append(ev.gpu_uuid)
    out: list[Effect] = []
    _emit_node(state, out, node, f, now, inp.wall_ns, ev)
    return out


def _on_telemetry(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    node = _node_of(inp)
    ns, cfg = _node(state, node), state.config.rules
    found = host_rules(ns.host, node, ev.cpu_percent, ev.mem_used_bytes, ev.mem_total_bytes,
                       ev.net_latency_s, now, cfg, ev.ts)
    if ev.gpus:
        gpus = [g.model_dump() for g in ev.gpus]
        found += telemetry_rule(ns, gpus, cfg, ev.ts) + link_rules(ns.host, node, gpus, now,
                                                                   cfg, ev.ts)
    out: list[Effect] = []
    for f in found:
        _emit_node(state, out, node, f, now, inp.wall_ns, ev)
    return out


def _on_slurm_node(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """The Slurm watcher's word on a node (``detector.scheduler.ROWS``)."""
    ev = inp.event
    node = _node_of(inp)
    f = scheduler.node_finding(ev, node)
    if f is None:
        return []
    unread = tuple(j for j in ev.jobs if j not in state.records)
    for j in unread:
        if state.serves(j):
            _job(state, j, now)  # read its record at the next tick
    out: list[Effect] = []
    _emit_node(state, out, node, f, now, inp.wall_ns, ev, unread)
    return out


def _on_slurm_job(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """The Slurm watcher's word on a job: the nodes it lost, each a node loss of this job alone
    (its members on that node; none when the node is out of its members already)."""
    ev = inp.event
    job = _job_of(inp)
    _job(state, job, now)
    jc = state.records.get(job)
    out: list[Effect] = []
    for f in scheduler.job_findings(ev):
        node = f.nodes[0]
        if jc is not None:
            ranks = sorted(int(m["rank"]) for m in jc.members
                           if m.get("node") == node and "rank" in m)
            if not ranks:
                continue  # excluded already (or a spare): no loss of this job
            f.ranks, f.generation = ranks, jc.generation
        _emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


#: event type -> handler; any other type is not the detector's and produces nothing
_HANDLERS = {
    schemas.RankHeartbeat: _on_heartbeat,
    schemas.WorkerExited: _on_worker_exited,
    schemas.WorkerStarted: _on_worker_started,
    schemas.LogLine: _on_log,
    schemas.CheckpointSaveFailed: _on_save_failed,
    schemas.RecoveryVerified: _on_recovery_verified,
    schemas.NodeHeartbeat: _on_node_heartbeat,
    schemas.XidEvent: _on_xid,
    schemas.NodeTelemetry: _on_telemetry,
    schemas.SlurmNodeEvent: _on_slurm_node,
    schemas.SlurmJobEvent: _on_slurm_job,
}


# ---- ticks ---------------------------------------------------------------------------------------
def _tick(state: DetectorState, wall_ns: int, now: float) -> list[Effect]:
    dc, cfg = state.config, state.config.rules
    out: list[Effect] = []
    if state.blind:  # silence is the bus's, not the ranks': judge nothing by it
        return out
    for name, js in state.jobs.items():
        if now < js.silence_due:  # no rank of it can be silent yet (``silence_rule``)
            continue
        for f in silence_rule(js, now, cfg, state.records.get(name)):
            _emit(state, out, name, f, now, wall_ns)
    if now >= state.nodes_due:
        _look_at_nodes(state, out, now, wall_ns)
    if now - state.last_eval >= dc.eval_s:
        state.last_eval = now
        _evaluate(state, out, now, wall_ns)
    if now - state.last_refresh >= dc.job_refresh_s:
        state.last_refresh = now
        out += refresh_calls(state, now)
    elif state.due:
        out += refresh_calls(state, now, sorted(state.due))
    if now - state.last_gc >= dc.gc_s:
        state.last_gc = now
        gc(state, now)
    return out


def _look_at_nodes(state: DetectorState, out: list[Effect], now: float, wall_ns: int) -> None:
    """Node lost and launcher lost for every node; ``state.nodes_due`` becomes the earliest
    moment a node still beating could be lost (its newest heartbeat plus its node timeout), or
    the next tick while a node has a launcher (``launcher_lost_rule`` weighs its ranks' silence
    too). Skipping the look until then spares the 1,250 nodes of bench/scale.py's 10,000 ranks
    a look per tick (20 a second) when a node heartbeat comes every second."""
    due = math.inf
    for ns in state.nodes.values():
        timeout = node_timeout(state, ns.name)
        f = node_lost_rule(ns, now, timeout)
        if f is not None:
            _emit_node(state, out, ns.name, f, now, wall_ns)
        if ns.launchers:
            due = now
            for job in sorted(ns.launchers):
                _launcher_lost(state, out, ns, job, now, wall_ns)
        elif ns.last and not ns.lost:
            newest = max(ns.last.values())
            if newest + timeout < due:
                due = newest + timeout
    state.nodes_due = due


def _launcher_lost(state: DetectorState, out: list[Effect], ns: NodeState, job: str,
                   now: float, wall_ns: int) -> None:
    """``launcher_lost_rule`` for ``job``'s launcher on ``ns``, for a job this replica serves
    (its record read): culprits are the record's members on the node (none: the node is out of
    the job, nothing is lost), live ranks those the detector has not seen exit or finish."""
    jc, js = state.records.get(job), state.jobs.get(job)
    if jc is None or js is None or ns.lost or jc.status in ENDED_STATUSES:
        return  # a run that is over (revoked, stopped, finished): its launcher's silence is no loss
    ranks = sorted(int(m["rank"]) for m in jc.members if m.get("node") == ns.name and "rank" in m)
    live = [rs.last_hb for rs in js.ranks.values()
            if rs.node == ns.name and not rs.exited and rs.phase != "done" and rs.last_hb > 0.0
            and rs.generation >= js.gen]
    f = launcher_lost_rule(ns, job, ranks, live, now, node_timeout(state, ns.name))
    if f is not None:
        # the launcher's last beat, Unix ns: a replacement pod or container is newer
        f.generation = jc.generation
        f.detail["last_beat_ns"] = wall_ns - int(f.detail["silent_s"] * 1e9)
        _emit(state, out, job, f, now, wall_ns)


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


def _evaluate(state: DetectorState, out: list[Effect], now: float, wall_ns: int) -> None:
    cfg = state.config.rules
    for name, js in state.jobs.items():
        jc = state.records.get(name)
        found = stall_rule(js, now, cfg, jc)
        if jc is not None:
            found += missing_member_rule(js, jc, state.job_seen.get(name, now), now, cfg)
        if js.dirty:
            js.dirty = False
            found += straggler_rule(js, cfg)
        f = throughput_rule(js, now, cfg)
        if f is not None:
            found.append(f)
        for f in found:
            if f.fault_class == "straggler":
                cpu_context(f, _job_hosts(state, js), cfg)
            _emit(state, out, name, f, now, wall_ns)


def _job_hosts(state: DetectorState, js) -> dict:
    """node → ``HostWindow`` of the nodes ``js``'s ranks run on (those with telemetry)."""
    nodes = {rs.node for rs in js.ranks.values() if rs.node}
    return {n: state.nodes[n].host for n in sorted(nodes) if n in state.nodes}


def refresh_calls(state: DetectorState, now: float, names: list[str] | None = None,
                  wait: bool = False, force: bool = False) -> list[Call]:
    """The record reads of ``names`` (default: every known job): at most one ``Call`` on the
    state store, ``job_records`` of the jobs to read (one round trip), with reply tag
    ``("jobs", ((name, seq), …))``. A job whose previous read is still out is skipped unless
    that read is ``refresh_timeout_s`` old or ``force`` is set; past ``max_reads_in_flight``
    reads out, the rest stay ``due`` for a later tick (unless ``force``); a reply to a read
    superseded by a newer one is dropped."""
    live = sum(1 for _, t in state.reads.values() if now - t < state.config.refresh_timeout_s)
    read: list[tuple[str, int]] = []
    for name in (list(state.jobs) if names is None else names):
        if name not in state.jobs:
            continue
        pending = state.reads.get(name)
        if (pending is not None and not force
                and now - pending[1] < state.config.refresh_timeout_s):
            state.due.discard(name)
            continue
        if not force and live >= state.config.max_reads_in_flight:
            state.due.add(name)  # read at a later tick, when fewer are out
            continue
        state.due.discard(name)
        live += 1
        state.read_seq += 1
        state.reads[name] = (state.read_seq, now)
        read.append((name, state.read_seq))
    if not read:
        return []
    return [Call("state", "job_records", ([n for n, _ in read],), reply=("jobs", tuple(read)),
                 wait=wait)]


# ---- replies -------------------------------------------------------------------------------------
def _reply(state: DetectorState, inp: Reply, now: float) -> list[Effect]:
    tag = inp.tag
    if not (isinstance(tag, tuple) and len(tag) == 2 and tag[0] == "jobs"
            and isinstance(tag[1], tuple)):
        return []
    values = inp.value if isinstance(inp.value, dict) else {}
    out: list[Effect] = []
    for name, seq in tag[1]:
        if inp.error is not None:
            value: object = inp.error
        else:
            value = values.get(name, f"no reply for {name!r}")
        out += _record(state, name, seq, value, now)
    return out


def _record(state: DetectorState, name: str, seq: int, value: object,
            now: float) -> list[Effect]:
    """One job's record read back (``value``: the record, or why it could not be read)."""
    pending = state.reads.get(name)
    if pending is None or pending[0] != seq or name not in state.jobs:
        return []  # superseded by a newer read, or the job was forgotten meanwhile
    del state.reads[name]
    if not isinstance(value, JobRecord):
        why = value if isinstance(value, str) else f"not a job record: {type(value).__name__}"
        kept = "keeping the last one" if name in state.records else "none read yet"
        return [Log(logging.WARNING, f"job {name}: cannot read its record ({why}); {kept}")]
    jc = value
    old = state.records.get(name)
    if old is not None and jc.runs > old.runs:
        # the job was launched again: the old run's ranks, progress and step times are not
        # this run's (a finished rank would otherwise be judged stalled)
        state.jobs[name] = JobState(name, state.config.rules.step_window)
        state.job_seen[name] = now
    state.records[name] = jc
    index(state, name, old, jc)
    if old is None or jc.hang_timeout_s != old.hang_timeout_s:
        state.jobs[name].silence_due = -math.inf  # judge it again with the new timeout
    return []

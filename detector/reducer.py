"""The detector as a reducer: ``step(state, input, now) -> (state, effects)``.

Three modules: this one (``step``, the periodic evaluation and record refreshes),
``detector.handlers`` (one handler per received event type) and ``detector.emit`` (a finding
made an anomaly, and the job, rank and node an input names); the state is ``detector.state``'s.

Everything that decides what the detector publishes is here, pure (``trainguard.core.reducer`` for
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
  ``detector.signals``; a node heartbeat is the agent's on ``tg.node.<node>.heartbeat`` (no
  other role there), or a launcher's on ``tg.node.<node>.launcher.<job>``, refused unless it
  agrees with its subject: ``launcher_beat``) and the one-off rules run:
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

import logging
import math

from trainguard import schemas
from trainguard.core.reducer import (BusDown, BusUp, Call, Effect, Input, Log, Received, Released,
                                Reply, Tick)
from trainguard.schemas import JobRecord, subjects
from trainguard.schemas.job import ENDED_STATUSES

from trainguard.detector.emit import emit, emit_node, job_of, node_of, node_timeout
from trainguard.detector.handlers import HANDLERS
from trainguard.detector.memory import bus_back, forget_job, gc, index
from trainguard.detector.progress import (JobState, missing_member_rule, silence_rule, stall_rule, straggler_rule,
                       throughput_rule)
from trainguard.detector.signals import NodeState, launcher_lost_rule, node_lost_rule
from trainguard.detector.state import DetectorServiceConfig, DetectorState
from trainguard.detector.telemetry import cpu_context

__all__ = ["step", "refresh_calls", "node_timeout", "TOPICS"]

#: The subjects the detector consumes.
TOPICS = ("tg.job.*.rank.*.hb", "tg.job.*.worker", "tg.job.*.log", "tg.job.*.ckpt",
          "tg.job.*.recovery", "tg.node.*.heartbeat", subjects.ALL_LAUNCHERS, "tg.node.*.xid",
          "tg.node.*.telemetry", "tg.node.*.kernel", "tg.node.*.slurm", "tg.job.*.slurm")


# ---- the step ----------------------------------------------------------------------------------
def step(state: DetectorState, inp: Input, now: float) -> tuple[DetectorState, list[Effect]]:
    """Fold ``inp`` into ``state`` at service time ``now`` (seconds); returns the state (the
    same object, changed in place) and the effects to carry out, in order. See the module
    docstring for what each input does."""
    if isinstance(inp, Received):
        handler = HANDLERS.get(type(inp.event))
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
            job = job_of(inp)
            js = state.jobs.get(job)
            if js is None and jobs_full:
                return "jobs"
            if isinstance(ev, schemas.RankHeartbeat) and ranks_full:
                rank = ev.rank if ev.rank is not None else int(inp.subject.split(".")[4])
                if js is None or rank not in js.ranks:
                    return "ranks"
        elif inp.subject.startswith("tg.node.") and len(state.nodes) >= dc.max_nodes:
            if node_of(inp) not in state.nodes:
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
            emit(state, out, name, f, now, wall_ns)
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
            emit_node(state, out, ns.name, f, now, wall_ns)
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
        emit(state, out, job, f, now, wall_ns)


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
            emit(state, out, name, f, now, wall_ns)


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

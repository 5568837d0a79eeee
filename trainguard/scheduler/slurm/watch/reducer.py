"""The Slurm watcher as a reducer: ``step(state, input, now) -> (state, effects)``. Pure.

The watcher's input is an ``Observation``: one ``squeue --json`` and one ``sinfo --json``
snapshot (``trainguard.scheduler.slurm.watch.snapshot``), either of which may have failed (its error
instead). ``step`` diffs it against the previous one and returns the effects
(``trainguard.core.reducer``): ``Publish`` of ``schemas.slurm`` events, ``Call("state",
"register_slurm_job", …)`` writes of the job record, ``Log`` lines. The service
(``slurm_watch.service``) only runs the two commands every ``poll_s`` and carries the effects
out; a table test drives ``step`` with captured real outputs, no server.

What ``step`` decides:

* **Opt-in.** A job is watched when its comment holds a directive
  (``schemas.slurm.parse_directive``); a comment that names trainguard but is invalid is
  watched too, in observe mode, and reported once (``JobChange.DIRECTIVE_INVALID`` and a
  warning). A job first seen already ended is not watched (nothing to do for it); a comment
  without a directive is not parsed again until it changes.
* **Registration.** A watched job's record (``StateStore.register_slurm_job``: Slurm id,
  state, allocation, partition, restart count, directive) is written when first seen and
  again whenever its state, nodes or restart count change; a failed write (Valkey away) is
  tried again at the next observation, one write per job in flight.
* **Job changes** (``job_changes``, the table ``JOB_TRANSITIONS``): registered, started,
  nodes lost (a running ``--no-kill`` job whose allocation shrank), NODE_FAIL, requeued
  (restart count up, or back to pending), cancelled, ended — each a ``SlurmJobEvent`` on
  ``tg.job.<job>.slurm``.
* **Node changes** (``node_changes``): a node of a watched job's allocation — now or in the
  previous snapshot, so that a node Slurm took out of a job in the same moment still counts —
  that became DOWN, NOT_RESPONDING or DRAIN, or left all three: a ``SlurmNodeEvent`` on
  ``tg.node.<node>.slurm`` naming those jobs. Nodes of no watched job are tracked silently.
* **Errors.** A failed command (slurmctld out of reach, a timeout, text that is not its JSON)
  is logged once as an error when it starts or changes, once as information when the command
  answers again; the state it would have updated is kept, and watching goes on.

Event ids are derived from what they report (blake2b of the Slurm id or node, the change and
the state it was seen in), so two watchers, or one restarted within the bus's two-minute
duplicate window, publish one copy.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from trainguard.core.reducer import Call, Effect, Log, Publish, Reply
from trainguard.schemas import subjects
from trainguard.schemas.slurm import (TRAINGUARD_REASON, JobChange, NodeChange, SlurmJobEvent,
                                      SlurmNodeEvent, default_job_name, directive_or_default)

from trainguard.scheduler.slurm.watch.snapshot import ACTIVE_STATES, ENDED_STATES, REQUEUE_STATES, SlurmJob, SlurmNode

__all__ = ["Observation", "Watched", "WatchState", "step", "job_changes", "node_changes",
           "JOB_TRANSITIONS"]


@dataclass(frozen=True)
class Observation:
    """One poll: ``jobs`` (``squeue``) and ``nodes`` (``sinfo``), each None when its command
    failed (``jobs_error`` / ``nodes_error`` say why); ``wall_ns``: Unix ns of the poll."""

    jobs: tuple[SlurmJob, ...] | None = None
    nodes: tuple[SlurmNode, ...] | None = None
    jobs_error: str = ""
    nodes_error: str = ""
    wall_ns: int = 0


@dataclass
class Watched:
    """A watched job: its trainguard name, its last ``squeue`` row, its directive's fields
    (``SlurmDirective.given``) or why it is invalid; ``written`` — the ``(state, nodes,
    restarts)`` last stored in its record; ``writing`` — the one being stored (None: none)."""

    job: str
    slurm: SlurmJob
    directive: dict
    error: str = ""
    written: tuple | None = None
    writing: tuple | None = None


@dataclass
class WatchState:
    """``jobs``: watched jobs by Slurm id; ``nodes``: every node's last ``sinfo`` row;
    ``ignored``: Slurm id → the comment found to hold no directive; ``errors``: command →
    the error last logged (absent: it answers); ``polls``, ``events``: counters."""

    jobs: dict[str, Watched] = field(default_factory=dict)
    nodes: dict[str, SlurmNode] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    polls: int = 0
    events: int = 0


def step(state: WatchState, inp, now: float) -> tuple[WatchState, list[Effect]]:
    """One input: an ``Observation`` or the ``Reply`` of a record write (tag
    ``("registered", slurm_id, key)``); anything else changes nothing. The state is changed in
    place and returned."""
    if isinstance(inp, Observation):
        return state, _observe(state, inp)
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple) and inp.tag[:1] == ("registered",):
        return state, _written(state, inp)
    return state, []


# ---- the table of job transitions -----------------------------------------------------------
#: (change, when, why) in order; ``job_changes`` returns every row that holds. ``prev``/``cur``
#: are the previous and the current ``SlurmJob``.
JOB_TRANSITIONS: tuple[tuple[JobChange, str, str], ...] = (
    (JobChange.REQUEUED, "restart count up, or active → PENDING / REQUEUED*",
     "scontrol requeue, or NODE_FAIL of a --requeue job: Slurm raises restart_cnt and the job "
     "waits for a new allocation (squeue(1) REQUEUED; restart_cnt of squeue --json)"),
    (JobChange.NODE_FAIL, "→ NODE_FAIL", "the job ended because a node of it failed"),
    (JobChange.CANCELLED, "→ CANCELLED", "scancel by its user, an operator or trainguard's stop"),
    (JobChange.ENDED, "→ any other ended state", "COMPLETED, FAILED, TIMEOUT, …"),
    (JobChange.STARTED, "not active → RUNNING", "an allocation: its launchers start a run"),
    (JobChange.NODES_LOST, "RUNNING → RUNNING on fewer nodes",
     "a --no-kill job keeps running when Slurm takes a failed node out of its allocation "
     "(sbatch(1) --no-kill)"),
)


def job_changes(prev: SlurmJob, cur: SlurmJob) -> list[JobChange]:
    """The rows of ``JOB_TRANSITIONS`` that hold from ``prev`` to ``cur``."""
    out = []
    was_active = prev.state in ACTIVE_STATES
    if cur.restarts > prev.restarts or (
            cur.state in REQUEUE_STATES and prev.state not in REQUEUE_STATES) or (
            was_active and cur.state == "PENDING"):
        out.append(JobChange.REQUEUED)
    if cur.state != prev.state:
        if cur.state == "NODE_FAIL":
            out.append(JobChange.NODE_FAIL)
        elif cur.state == "CANCELLED":
            out.append(JobChange.CANCELLED)
        elif cur.state in ENDED_STATES and prev.state not in ENDED_STATES:
            out.append(JobChange.ENDED)
        elif cur.state == "RUNNING" and not was_active:
            out.append(JobChange.STARTED)
    if prev.state == cur.state == "RUNNING" and set(cur.nodes) < set(prev.nodes):
        out.append(JobChange.NODES_LOST)
    return out


def _conditions(n: SlurmNode | None) -> set[NodeChange]:
    if n is None:
        return set()
    return {c for c, on in ((NodeChange.DOWN, n.down),
                            (NodeChange.NOT_RESPONDING, n.not_responding),
                            (NodeChange.DRAIN, n.drained)) if on}


def node_changes(prev: SlurmNode | None, cur: SlurmNode) -> list[NodeChange]:
    """What became true of the node (DOWN, NOT_RESPONDING, DRAIN, in that order), or
    ``RESUMED`` when it had any of them and now has none."""
    was, now = _conditions(prev), _conditions(cur)
    out = [c for c in (NodeChange.DOWN, NodeChange.NOT_RESPONDING, NodeChange.DRAIN)
           if c in now and c not in was]
    if was and not now:
        out.append(NodeChange.RESUMED)
    return out


# ---- observation ------------------------------------------------------------------------------
def _event_id(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _errors(state: WatchState, command: str, error: str, ok: bool) -> list[Effect]:
    if not ok:
        if state.errors.get(command) != error:
            state.errors[command] = error
            return [Log(logging.ERROR, f"{command} --json failed: {error}; the Slurm watcher "
                                       f"goes on and polls again (is slurmctld up, and "
                                       f"SLURM_CONF right?)")]
        return []
    if command in state.errors:
        del state.errors[command]
        return [Log(logging.INFO, f"{command} --json answers again")]
    return []


def _observe(state: WatchState, obs: Observation) -> list[Effect]:
    state.polls += 1
    out = _errors(state, "squeue", obs.jobs_error, obs.jobs is not None)
    out += _errors(state, "sinfo", obs.nodes_error, obs.nodes is not None)
    # allocations of the previous snapshot: a node Slurm took out of a job now still counts
    before = {sid: w.slurm.nodes for sid, w in state.jobs.items()
              if w.slurm.state in ACTIVE_STATES}
    nodes_now = {n.name: n for n in obs.nodes} if obs.nodes is not None else state.nodes
    if obs.jobs is not None:
        seen = set()
        for sj in obs.jobs:
            seen.add(sj.job_id)
            out += _job(state, sj, nodes_now, obs.wall_ns)
        for sid in [s for s in state.jobs if s not in seen]:
            w = state.jobs.pop(sid)
            out.append(Log(logging.INFO, f"Slurm job {sid} ({w.job}) is gone from squeue: "
                                         f"no longer watched"))
        state.ignored = {s: c for s, c in state.ignored.items() if s in seen}
    if obs.nodes is not None:
        out += _nodes(state, obs.nodes, before, obs.wall_ns)
    return out


def _job(state: WatchState, sj: SlurmJob, nodes: dict[str, SlurmNode], wall_ns: int
         ) -> list[Effect]:
    w = state.jobs.get(sj.job_id)
    out: list[Effect] = []
    if w is None:
        if state.ignored.get(sj.job_id) == sj.comment:
            return out
        directive, error = directive_or_default(sj.comment)
        if directive is None or sj.state in ENDED_STATES:
            state.ignored[sj.job_id] = sj.comment  # no directive, or ended before it was seen
            return out
        w = state.jobs[sj.job_id] = Watched(directive.job or default_job_name(sj.job_id), sj,
                                           directive.given(), error)
        out.append(_job_event(state, w, JobChange.REGISTERED, None, [], wall_ns))
        if error:
            out.append(Log(logging.WARNING, f"Slurm job {sj.job_id} ({w.job}): {error}; it "
                                            f"stays in observe mode"))
            out.append(_job_event(state, w, JobChange.DIRECTIVE_INVALID, None, [], wall_ns))
    else:
        prev, w.slurm = w.slurm, sj
        for change in job_changes(prev, sj):
            lost: list[str] = []
            if change is JobChange.NODES_LOST:
                lost = sorted(set(prev.nodes) - set(sj.nodes))
            elif change is JobChange.NODE_FAIL:
                # Slurm does not say which node failed: those of its allocation now DOWN or
                # not responding (none known: empty; the node's own event names it)
                lost = sorted(n for n in (prev.nodes or sj.nodes)
                              if n in nodes and _conditions(nodes[n]) - {NodeChange.DRAIN})
            out.append(_job_event(state, w, change, prev, lost, wall_ns))
    out += _write(w)
    return out


def _job_event(state: WatchState, w: Watched, change: JobChange, prev: SlurmJob | None,
               lost: list[str], wall_ns: int) -> Publish:
    sj = w.slurm
    state.events += 1
    ev = SlurmJobEvent(
        event_id=_event_id("slurm.job", sj.job_id, change.value, sj.state, sj.restarts,
                           sj.nodes),
        job=w.job, change=change, slurm_job_id=sj.job_id, state=sj.state,
        previous_state=prev.state if prev else "", nodes=list(sj.nodes), lost_nodes=lost,
        restarts=sj.restarts, reason=sj.reason, directive=dict(w.directive), error=w.error,
        **({"ts": wall_ns} if wall_ns else {}))
    return Publish(subjects.job(w.job, "slurm"), ev)


def _write(w: Watched) -> list[Effect]:
    sj = w.slurm
    key = (sj.state, sj.nodes, sj.restarts)
    if key == w.written or key == w.writing:
        return []
    w.writing = key
    return [Call("state", "register_slurm_job", (w.job, sj.job_id),
                 {"state": sj.state, "nodes": list(sj.nodes), "partition": sj.partition,
                  "restarts": sj.restarts, "directive": dict(w.directive),
                  "directive_error": w.error},
                 reply=("registered", sj.job_id, key), wait=False)]


def _written(state: WatchState, inp: Reply) -> list[Effect]:
    _, sid, key = inp.tag
    w = state.jobs.get(sid)
    if w is None or w.writing != key:
        return []
    w.writing = None
    if inp.error is not None:
        return [Log(logging.WARNING, f"Slurm job {sid} ({w.job}): its record was not written "
                                     f"({inp.error}); tried again at the next poll")]
    w.written = key
    return []


def _nodes(state: WatchState, nodes: tuple[SlurmNode, ...], before: dict[str, tuple],
           wall_ns: int) -> list[Effect]:
    holders: dict[str, list[Watched]] = {}
    for sid, w in sorted(state.jobs.items()):
        alloc = set(before.get(sid, ()))
        if w.slurm.state in ACTIVE_STATES:
            alloc |= set(w.slurm.nodes)
        for n in alloc:
            holders.setdefault(n, []).append(w)
    out: list[Effect] = []
    for n in nodes:
        prev = state.nodes.get(n.name)
        state.nodes[n.name] = n
        watched = holders.get(n.name)
        if not watched:
            continue
        for change in node_changes(prev, n):
            state.events += 1
            ev = SlurmNodeEvent(
                event_id=_event_id("slurm.node", n.name, change.value, n.reason, n.reason_ts),
                node=n.name, change=change, state=n.state, flags=list(n.flags),
                reason=n.reason, reason_by=n.reason_by, reason_ts=n.reason_ts,
                by_trainguard=n.reason.startswith(TRAINGUARD_REASON),
                jobs=[w.job for w in watched], slurm_jobs=[w.slurm.job_id for w in watched],
                **({"ts": wall_ns} if wall_ns else {}))
            out.append(Publish(subjects.node(n.name, "slurm"), ev))
    return out


"""The detector reducer's memory upkeep (``detector.reducer``; the state is ``detector.state``'s): the node → jobs index, forgetting
a job another replica serves now, restarting the clocks after a bus outage, and the periodic
collection of ranks, nodes, jobs and incident keys. Pure: each function changes the state in
place and returns nothing."""
from __future__ import annotations

import math
from trainguard.schemas import JobRecord

from trainguard.detector.state import DetectorState


def bus_back(state: DetectorState, now: float, gap_s: float) -> None:
    """The bus answers again after ``gap_s`` seconds: nothing could be heard meanwhile, so every
    silence clock restarts now and every progress clock moves on by the gap (a rank that
    stepped through the outage is not a hung one, nor its node a lost one)."""
    state.blind = False
    state.nodes_due = -math.inf
    for js in state.jobs.values():
        for rs in js.ranks.values():
            if rs.last_hb:
                rs.last_hb = max(rs.last_hb, now)
            if rs.last_advance:
                rs.last_advance += gap_s
    for ns in state.nodes.values():
        for role in ns.last:
            ns.last[role] = max(ns.last[role], now)
        for job in ns.launchers:
            ns.launchers[job] = max(ns.launchers[job], now)


def index(state: DetectorState, name: str, old: JobRecord | None,
          new: JobRecord | None) -> None:
    """Move job ``name`` in ``node_jobs`` from the nodes of ``old``'s members to ``new``'s, and
    drop the cached ``node_timeouts`` of those nodes when the nodes or the job's node timeout
    changed (a record read again unchanged, every ``job_refresh_s``, costs a comparison)."""
    before = {str(m["node"]) for m in (old.members if old is not None else ()) if m.get("node")}
    after = {str(m["node"]) for m in (new.members if new is not None else ()) if m.get("node")}
    if before == after and old is not None and new is not None and \
            old.node_timeout_s == new.node_timeout_s:
        return
    for node in before:
        jobs = state.node_jobs.get(node)
        if jobs is not None:
            jobs.discard(name)
            if not jobs:
                del state.node_jobs[node]
    for node in after:
        state.node_jobs.setdefault(node, set()).add(name)
    for node in before | after:
        state.node_timeouts.pop(node, None)
    state.nodes_due = -math.inf  # a node timeout may be shorter now: look at the nodes again


def forget_job(state: DetectorState, name: str) -> None:
    """Drop job ``name``'s windows, record and reads (another replica serves it now); its
    incident keys stay, so an incident published here is not published again if it returns."""
    state.jobs.pop(name, None)
    state.job_seen.pop(name, None)
    state.reads.pop(name, None)
    state.due.discard(name)
    index(state, name, state.records.pop(name, None), None)


def gc(state: DetectorState, now: float) -> None:
    """Forget ranks and nodes silent for ``forget_after_s``, jobs with no rank left first seen
    that long ago, and incident keys older than ``dedup_ttl_s``."""
    dc = state.config
    horizon = now - dc.forget_after_s
    for name, js in list(state.jobs.items()):
        for r, rs in list(js.ranks.items()):
            if rs.last_hb and rs.last_hb < horizon:
                del js.ranks[r]
        if not js.ranks and state.job_seen.get(name, now) < horizon:
            del state.jobs[name]
            state.job_seen.pop(name, None)
            state.reads.pop(name, None)
            state.due.discard(name)
            index(state, name, state.records.pop(name, None), None)
    for n, ns in list(state.nodes.items()):
        if ns.last and max(ns.last.values()) < horizon:
            del state.nodes[n]
            state.node_timeouts.pop(n, None)
            continue
        for job, t in list(ns.launchers.items()):  # a launcher silent that long: forgotten
            if t < horizon:
                del ns.launchers[job]
                ns.launchers_lost.discard(job)
    state.ranks = sum(len(js.ranks) for js in state.jobs.values())
    old = now - dc.dedup_ttl_s
    for k, t in list(state.emitted.items()):
        if t <= old:
            del state.emitted[k]

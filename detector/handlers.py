"""The detector reducer's input handlers: one per event type (``HANDLERS``), each folding one
received event into the state and returning the anomalies it finds (``detector.reducer.step``
dispatches to them). Pure."""
from __future__ import annotations

import math

from trainguard import schemas
from trainguard.core.reducer import Effect, Received
from trainguard.schemas import subjects

from trainguard.detector import scheduler
from trainguard.detector.emit import emit, emit_node, job_of, job_state, node_of, node_state, node_timeout
from trainguard.detector.progress import nan_loss_rule, observe_heartbeat
from trainguard.detector.signals import (crash_rule, log_rule, observe_node_heartbeat, recovery_check_finding,
                      save_failed_finding, telemetry_rule, xid_rule)
from trainguard.detector.state import DetectorState
from trainguard.detector.telemetry import host_rules, link_rules

__all__ = ["HANDLERS", "NODE_WIDE_KERNEL_CLASSES", "launcher_beat"]

#: Fault classes a node's kernel log shows for the whole node (a NIC link down, an NFS server
#: gone, a machine-check, a GPU off the bus): such a finding goes to every job with members on
#: the node. Any other kernel line (an OOM kill, a segfault, a hung task) names one process the
#: kernel does not tie to a job: it is published for the node only (its history), and the rank's
#: own exit (``worker.exited``, ``oom_killed``) is what its job hears.
NODE_WIDE_KERNEL_CLASSES = frozenset({"gpu_xid", "ecc", "nvlink", "network", "filesystem",
                                      "thermal", "node_lost"})


# ---- received events -----------------------------------------------------------------------------
def _on_heartbeat(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    job = job_of(inp)
    rank = ev.rank if ev.rank is not None else int(inp.subject.split(".")[4])
    js = state.jobs.get(job) or job_state(state, job, now)
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
        emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_worker_exited(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    job = job_of(inp)
    js = job_state(state, job, now)
    if ev.rank is not None and ev.rank in js.ranks:
        js.ranks[ev.rank].exited = True
    out: list[Effect] = []
    f = crash_rule(ev.rank, ev.node, ev.exit_code, ev.signal, ev.oom_killed, ev.expected,
                   ev.generation, ev.ts, ev.pid)
    if f is not None:
        emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_worker_started(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    js = job_state(state, job_of(inp), now)
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
    job = job_of(inp)
    job_state(state, job, now)
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
    emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


def _on_kernel_line(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """A line of a node's kernel log (``tg.node.<node>.kernel``, forwarded by the node agent)."""
    ev = inp.event
    node = node_of(inp)
    f = log_rule(ev.line, "kernel", None, node, None, ev.ts)
    if f is None:
        return []
    f.nodes = [node]
    f.ranks = []
    f.detail["stream"] = "kernel"
    out: list[Effect] = []
    if f.fault_class in NODE_WIDE_KERNEL_CLASSES:
        emit_node(state, out, node, f, now, inp.wall_ns, ev)
    elif state.serves(f"node:{node}"):
        emit(state, out, None, f, now, inp.wall_ns, ev, node_scope=node)
    return out


def _on_save_failed(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    if ev.error.startswith("skipped:"):
        return []  # overlap_policy="skip" did what it was asked to: nothing failed
    out: list[Effect] = []
    f = save_failed_finding(ev.rank, ev.node, ev.step, ev.error, ev.errno, ev.generation, ev.ts)
    emit(state, out, job_of(inp), f, now, inp.wall_ns, ev)
    return out


def _on_recovery_verified(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    if ev.ok:
        return []
    out: list[Effect] = []
    f = recovery_check_finding(ev.rank, ev.node, ev.restored_step, ev.loss_at_save,
                               ev.loss_after, ev.tolerance, ev.generation, ev.ts)
    emit(state, out, job_of(inp), f, now, inp.wall_ns, ev)
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
    """A node heartbeat: the node agent's on ``tg.node.<node>.heartbeat`` (role ``agent``;
    another role there is refused with ValueError: only the agent vouches for its node), a
    launcher's on ``tg.node.<node>.launcher.<job>`` (``launcher_beat``: refused unless it
    agrees with its subject)."""
    ev = inp.event
    if inp.subject.split(".", 4)[3:4] == [subjects.LAUNCHER]:
        (node, job), role = launcher_beat(inp.subject, ev), "launcher"
    else:
        if ev.role != "agent":
            raise ValueError(f"a heartbeat on the node agent's subject {inp.subject[:200]} has "
                             f"role {ev.role[:50]!r}, not 'agent': refused (a launcher beats on "
                             f"tg.node.<node>.launcher.<job>)")
        node, role, job = node_of(inp), "agent", None
    ns = node_state(state, node)
    observe_node_heartbeat(ns, role, now, job, ending=bool(ev.ending))
    # its deadline may be nearer than the last look's earliest (a node first heard, a lost one
    # back, a launcher to watch)
    due = now if ns.launchers else now + node_timeout(state, ns.name)
    if due < state.nodes_due:
        state.nodes_due = due
    return []


def _on_xid(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    node = node_of(inp)
    f = xid_rule(ev.xid, node, ev.pci, ev.gpu_index, ev.pid, ev.raw, ev.ts, ev.message)
    if f is None:
        return []
    if ev.gpu_uuid:
        f.gpus.append(ev.gpu_uuid)
    out: list[Effect] = []
    emit_node(state, out, node, f, now, inp.wall_ns, ev)
    return out


def _on_telemetry(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    ev = inp.event
    node = node_of(inp)
    ns, cfg = node_state(state, node), state.config.rules
    found = host_rules(ns.host, node, ev.cpu_percent, ev.mem_used_bytes, ev.mem_total_bytes,
                       ev.net_latency_s, now, cfg, ev.ts)
    if ev.gpus:
        gpus = [g.model_dump() for g in ev.gpus]
        found += telemetry_rule(ns, gpus, cfg, ev.ts) + link_rules(ns.host, node, gpus, now,
                                                                   cfg, ev.ts)
    out: list[Effect] = []
    for f in found:
        emit_node(state, out, node, f, now, inp.wall_ns, ev)
    return out


def _on_slurm_node(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """The Slurm watcher's word on a node (``detector.scheduler.ROWS``)."""
    ev = inp.event
    node = node_of(inp)
    f = scheduler.node_finding(ev, node)
    if f is None:
        return []
    unread = tuple(j for j in ev.jobs if j not in state.records)
    for j in unread:
        if state.serves(j):
            job_state(state, j, now)  # read its record at the next tick
    out: list[Effect] = []
    emit_node(state, out, node, f, now, inp.wall_ns, ev, unread)
    return out


def _on_slurm_job(state: DetectorState, inp: Received, now: float) -> list[Effect]:
    """The Slurm watcher's word on a job: the nodes it lost, each a node loss of this job alone
    (its members on that node; none when the node is out of its members already)."""
    ev = inp.event
    job = job_of(inp)
    job_state(state, job, now)
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
        emit(state, out, job, f, now, inp.wall_ns, ev)
    return out


#: event type -> handler; any other type is not the detector's and produces nothing
HANDLERS = {
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

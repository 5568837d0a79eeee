"""Rules over one-off signals: a worker's exit (crash), a log line (XID parser + the pattern
table of ``detector.patterns``), a failed checkpoint save, a GPU XID, GPU telemetry (thermal,
ECC / row-remap / PCIe-replay counters), and node heartbeats (node lost, launcher lost).

Pure: nothing here does I/O or reads a clock; callers pass ``now`` (seconds on a monotonic
clock) where a rule needs one, and event timestamps (Unix ns) as ``ts``. Each rule returns
``Finding`` objects (``detector.core``).
"""
from __future__ import annotations

import re

from trainguard.schemas.vocabulary import FaultClass, Layer
from trainguard.core.xid import XidMatch, parse_xid_line, xid_info

from trainguard.detector import patterns as pat
from trainguard.detector.core import DetectorConfig, Finding
from trainguard.detector.telemetry import HostWindow

# ---------------------------------------------------------------------------------------------
# crash


#: signal number -> (fault class, layer, name). SIGKILL with oom_killed is oom_host. SIGBUS is
#: infrastructure: in a training process it is nearly always /dev/shm too small (patterns.py).
SIGNALS: dict[int, tuple[FaultClass, Layer, str]] = {
    9: (FaultClass.CRASH, Layer.UNKNOWN, "SIGKILL"),
    11: (FaultClass.CRASH, Layer.UNKNOWN, "SIGSEGV"),
    7: (FaultClass.CRASH, Layer.INFRASTRUCTURE, "SIGBUS"),
    6: (FaultClass.CRASH, Layer.UNKNOWN, "SIGABRT"),
    15: (FaultClass.CRASH, Layer.UNKNOWN, "SIGTERM"),
    4: (FaultClass.CRASH, Layer.UNKNOWN, "SIGILL"),
    8: (FaultClass.CRASH, Layer.APPLICATION, "SIGFPE"),
}


def crash_rule(rank: int | None, node: str | None, exit_code: int | None, signal: int | None,
               oom_killed: bool, expected: bool, generation: int, ts: int,
               pid: int = 0) -> Finding | None:
    """``worker.exited`` that was not expected: killed by a signal or a non-zero exit code.
    Exit codes above 128 are read as 128 + signal (shell convention)."""
    if expected:
        return None
    sig = signal
    if sig is None and exit_code is not None and 128 < exit_code < 160:
        sig = exit_code - 128
    if sig is None and (exit_code is None or exit_code == 0):
        return None
    ranks = [rank] if rank is not None else []
    nodes = [node] if node else []
    if sig == 9 and oom_killed:
        return Finding("crash", "oom_host", ranks=ranks, nodes=nodes,
                       evidence=[f"rank {rank} (pid {pid}) on {node} killed by the kernel OOM "
                                 f"killer (SIGKILL)"],
                       detail={"signal": 9, "oom_killed": True, "layer": "application",
                               "weight": 0.95},
                       ts=ts, generation=generation)
    if sig is not None:
        fc, layer, name = SIGNALS.get(sig, (FaultClass.CRASH, Layer.UNKNOWN, f"signal {sig}"))
        why = f"rank {rank} (pid {pid}) on {node} killed by {name}"
    else:
        fc, layer = FaultClass.CRASH, Layer.UNKNOWN
        why = f"rank {rank} (pid {pid}) on {node} exited with code {exit_code}"
    return Finding("crash", fc, ranks=ranks, nodes=nodes, evidence=[why],
                   detail={"signal": sig, "exit_code": exit_code, "layer": layer.value,
                           "weight": 0.8},
                   ts=ts, generation=generation)


# ---------------------------------------------------------------------------------------------
# nodes: lost, XID, telemetry


class NodeState:
    """Liveness and GPU counters of one node. ``last`` maps heartbeat role -> monotonic s;
    ``launchers`` maps job -> monotonic s of its launcher's last heartbeat on this node, and
    ``launchers_lost`` holds the jobs whose launcher here was found lost (until it beats
    again); ``host``: the recent host and link samples (``telemetry.HostWindow``)."""

    __slots__ = ("name", "last", "lost", "launchers", "launchers_lost", "gpu_prev",
                 "thermal_run", "host")

    def __init__(self, name: str):
        self.name = name
        self.last: dict[str, float] = {}
        self.lost = False
        self.launchers: dict[str, float] = {}
        self.launchers_lost: set[str] = set()
        self.gpu_prev: dict[int, dict] = {}
        self.thermal_run: dict[int, int] = {}
        self.host = HostWindow()


#: The roles whose node heartbeats the detector keeps (``NodeHeartbeat.role``): the agent and a
#: job's launcher. A beat of another role is ignored: the node-lost rule would wait for it, and
#: a hostile sender naming a new role in each beat would grow the node's state without end.
NODE_ROLES = frozenset({"agent", "launcher"})


def observe_node_heartbeat(ns: NodeState, role: str, now: float, job: str | None = None,
                           ending: bool = False) -> None:
    """A heartbeat of ``role`` (agent, launcher) at ``now``; a launcher's names its ``job``.
    ``ending``: the launcher's last beat as it ends on purpose (its job finished, was stopped or
    failed there): the node forgets that launcher, so its silence is never a lost launcher (a
    job stopped by a decision, its ranks killed by their launcher, would otherwise count as an
    infrastructure fault of the node in cross-job history)."""
    if role not in NODE_ROLES:
        return  # no rule reads it; kept, each new name would be kept for as long as the node
    ns.last[role] = now
    ns.lost = False
    if role == "launcher" and job:
        if ending:
            ns.launchers.pop(job, None)
        else:
            ns.launchers[job] = now
        ns.launchers_lost.discard(job)


def launcher_lost_rule(ns: NodeState, job: str, ranks: list[int], live_hb: list[float],
                       now: float, timeout: float) -> Finding | None:
    """The launcher of ``job`` on this node is gone while the node itself is alive: its
    heartbeat has been silent for longer than ``timeout`` seconds, the node's agent went on
    beating for longer than ``timeout`` after it (so a node powered off or cut off, whose agent
    and launcher stop within a beat of each other, is never this rule's but
    ``node_lost_rule``'s) and beat within ``timeout`` of ``now``, and the job's ranks here that
    the detector has not seen end (``live_hb``: their last heartbeats, monotonic s; at least
    one) are all silent that long too — a launcher and its ranks stopping together while the
    node answers is their pod or process tree lost (a container killed, a pod deleted or
    wedged), not the node. ``ranks``: the job's members on this node (the culprits). Fires
    once until that launcher beats again.

    Fault class ``crash`` (the launcher process is gone, its ranks with it; a crash explains a
    hang of the same ranks), layer ``infrastructure``; ``detail["launcher_lost"]`` names the
    node (the reducer adds ``detail["last_beat_ns"]``, the launcher's last beat in Unix ns: a
    pod or container newer than it is a replacement). A node whose agent is silent too is
    ``node_lost_rule``'s."""
    last = ns.launchers.get(job)
    agent = ns.last.get("agent")
    if (last is None or job in ns.launchers_lost or agent is None or not ranks or not live_hb
            or now - agent > timeout):
        return None
    silent = now - last
    if (silent <= timeout or agent - last <= timeout
            or any(now - hb <= timeout for hb in live_hb)):
        return None
    ns.launchers_lost.add(job)
    return Finding("launcher_lost", FaultClass.CRASH, ranks=sorted(ranks), nodes=[ns.name],
                   evidence=[f"node {ns.name}: the launcher of job {job} and its ranks "
                             f"{', '.join(map(str, sorted(ranks)))} sent no heartbeat for "
                             f"{silent:.2f} s (timeout {timeout:.2f} s) while the node's agent "
                             f"went on beating ({now - agent:.2f} s ago): the launcher's pod "
                             f"or process tree is lost, the node is alive"],
                   detail={"rule": "launcher_lost", "launcher_lost": [ns.name],
                           "silent_s": round(silent, 3), "timeout_s": timeout,
                           "layer": Layer.INFRASTRUCTURE.value, "weight": 0.85})


def node_lost_rule(ns: NodeState, now: float, timeout: float) -> Finding | None:
    """A node whose every heartbeat role (agent and launcher) has been silent for longer than
    ``timeout`` seconds. Fires once until a heartbeat returns."""
    if ns.lost or not ns.last:
        return None
    newest = max(ns.last.values())
    silent = now - newest
    if silent <= timeout:
        return None
    ns.lost = True
    roles = ", ".join(sorted(ns.last))
    return Finding("node_lost", "node_lost", nodes=[ns.name],
                   evidence=[f"node {ns.name}: no heartbeat from {roles} for {silent:.2f} s "
                             f"(timeout {timeout:.2f} s)"],
                   detail={"silent_s": round(silent, 3), "timeout_s": timeout,
                           "layer": "infrastructure", "weight": 0.9})


def xid_rule(xid: int, node: str | None, pci: str, gpu_index: int | None, pid: int | None,
             raw: str, ts: int, message: str = "") -> Finding | None:
    """A GPU XID: fault class and layer from the XID table. Informational XIDs
    (severity ``info``, e.g. 63 row-remap event) become warnings, not faults."""
    info = xid_info(xid)
    gpu = f"{node}:{gpu_index}" if gpu_index is not None and node else (pci or "")
    sev = "warning" if info.severity == "info" else "error"
    evidence = [raw or f"XID {xid} on {node} {pci}: {message}",
                f"XID {xid} {info.mnemonic}: {info.description} ({info.source})"]
    detail = {"xid": xid, "pci": pci, "gpu_index": gpu_index, "pid": pid,
              "mnemonic": info.mnemonic, "layer": info.layer, "xid_severity": info.severity,
              "weight": 0.95 if info.layer != "unknown" else 0.5}
    fault_class = info.fault_class
    cause = _cause_xid(xid, message)
    if cause is not None:
        # a cleanup XID that names the error it cleans up after: that error is the fault
        ci = xid_info(cause)
        fault_class, sev = ci.fault_class, "error"
        detail.update(caused_by_xid=cause, layer=ci.layer,
                      weight=0.95 if ci.layer != "unknown" else 0.5)
        evidence.append(f"caused by XID {cause} {ci.mnemonic}: {ci.description}")
    return Finding(
        "gpu_fault", fault_class, nodes=[node] if node else [], gpus=[gpu] if gpu else [],
        severity=sev, evidence=evidence, detail=detail, ts=ts)


#: The driver's "caused by previous Xid N" on a cleanup XID (45, preemptive channel removal).
_CAUSED_BY = re.compile(r"caused by previous Xid (?P<xid>\d+)", re.IGNORECASE)


def _cause_xid(xid: int, message: str) -> int | None:
    """The XID that the message of an informational XID names as its cause (``Ch 00000001
    caused by previous Xid 149`` on an XID 45: the driver removed the channels of a process
    after an NVLink5 error), when that XID is a fault of its own; else None. Sources: NVIDIA's
    XID catalog (XID 45, "Preemptive cleanup, due to previous errors") and the NVRM line that
    names the previous XID (NVIDIA/open-gpu-kernel-modules#1150: XID 45 after XIDs 145 / 149,
    a dev case of ``bench/corpus/real_logs.jsonl``)."""
    m = _CAUSED_BY.search(message or "")
    if m is None or xid_info(xid).severity != "info":
        return None
    cause = int(m.group("xid"))
    ci = xid_info(cause)
    return cause if cause != xid and ci.severity != "info" and ci.layer != "unknown" else None


def xid_finding_from_match(m: XidMatch, node: str | None, ts: int = 0,
                           gpu_index: int | None = None) -> Finding | None:
    return xid_rule(m.xid, node, m.pci, gpu_index, m.pid, m.raw, ts, m.message)


#: NVML clock-event reason bits that mean thermal slowdown (nvml.h: nvmlClocksEventReason*).
THERMAL_REASON_BITS = {0x08: "HwSlowdown", 0x20: "SwThermalSlowdown", 0x40: "HwThermalSlowdown"}
THERMAL_NAME_WORDS = ("thermal", "hwslowdown", "hw_slowdown")

#: GPU counters whose rise is a fault: field -> (kind, fault class, severity). All hardware.
#: A corrected ECC error is not one: its *rate* is a warning (``telemetry.RULES``,
#: ``ecc_corrected_rate``); a correctable row remap is a repair the GPU made, flagged.
COUNTER_RULES: dict[str, tuple[str, FaultClass, str]] = {
    "ecc_volatile_uncorrected": ("ecc", FaultClass.ECC, "error"),
    "ecc_aggregate_uncorrected": ("ecc", FaultClass.ECC, "error"),
    "retired_pages_dbe": ("ecc", FaultClass.ECC, "error"),
    "remapped_rows_uncorrectable": ("ecc", FaultClass.ECC, "error"),
    "remapped_rows_correctable": ("ecc_corrected", FaultClass.ECC, "warning"),
    "pcie_replay_counter": ("pcie_replay", FaultClass.GPU_XID, "warning"),
}
#: GPU flags whose becoming True is a fault: field -> (kind, fault class, severity). Hardware.
FLAG_RULES: dict[str, tuple[str, FaultClass, str]] = {
    "remapped_rows_failure": ("ecc", FaultClass.ECC, "error"),
    "retired_pages_pending": ("ecc", FaultClass.ECC, "warning"),
    "remapped_rows_pending": ("ecc", FaultClass.ECC, "warning"),
}


def telemetry_rule(ns: NodeState, gpus: list[dict], cfg: DetectorConfig, ts: int = 0
                   ) -> list[Finding]:
    """Thermal slowdown from clock-event reasons, and ECC / row-remap / PCIe-replay counters
    rising between two samples of the same GPU. ``gpus`` are ``GpuSample`` dicts. The node
    keeps the counters and thermal runs of the GPUs of this sample only: a GPU index a sample no
    longer names (a hostile one, 2^62) is not kept."""
    out = []
    seen = {int(g.get("index", 0)) for g in gpus}
    for kept in (ns.gpu_prev, ns.thermal_run):
        for idx in [i for i in kept if i not in seen]:
            del kept[idx]
    for g in gpus:
        idx = int(g.get("index", 0))
        gid = f"{ns.name}:{idx}"
        reasons = g.get("clock_event_reasons") or 0
        names = [str(n) for n in g.get("clock_event_names") or []]
        hot = [THERMAL_REASON_BITS[b] for b in THERMAL_REASON_BITS if reasons & b]
        hot += [n for n in names if any(w in n.lower() for w in THERMAL_NAME_WORDS)]
        if hot:
            run = ns.thermal_run.get(idx, 0) + 1
            ns.thermal_run[idx] = run
            if run == cfg.thermal_samples:
                out.append(Finding(
                    "thermal", "thermal", nodes=[ns.name], gpus=[gid], severity="warning",
                    evidence=[f"GPU {gid} clock-event reasons {sorted(set(hot))} for {run} "
                              f"samples, temperature {g.get('temperature_c')} °C"],
                    detail={"gpu_index": idx, "reasons": sorted(set(hot)),
                            "temperature_c": g.get("temperature_c"), "layer": "hardware",
                            "weight": 0.8},
                    ts=ts))
        else:
            ns.thermal_run[idx] = 0
        prev = ns.gpu_prev.get(idx)
        if prev is not None:
            for fld, (kind, fc, sev) in COUNTER_RULES.items():
                a, b = prev.get(fld), g.get(fld)
                if a is not None and b is not None and b > a:
                    out.append(Finding(
                        kind, fc, nodes=[ns.name], gpus=[gid], severity=sev,
                        evidence=[f"GPU {gid} {fld} rose {a} -> {b}"],
                        detail={"gpu_index": idx, "counter": fld, "before": a, "after": b,
                                "layer": "hardware", "weight": 0.9 if sev == "error" else 0.4},
                        ts=ts))
            for fld, (kind, fc, sev) in FLAG_RULES.items():
                if g.get(fld) and not prev.get(fld):
                    out.append(Finding(
                        kind, fc, nodes=[ns.name], gpus=[gid], severity=sev,
                        evidence=[f"GPU {gid} {fld} became true"],
                        detail={"gpu_index": idx, "flag": fld, "layer": "hardware",
                                "weight": 0.85},
                        ts=ts))
        ns.gpu_prev[idx] = {k: g.get(k) for k in (*COUNTER_RULES, *FLAG_RULES)}
    return out


# ---------------------------------------------------------------------------------------------
# log lines


#: What one log message may cost the pattern table: its last 200 lines, each cut to 4 KiB (a
#: 1 MB line took 1 s of matching and a flood of them left the detector minutes behind,
#: bench/fuzz.py). Real lines are far shorter, and a traceback ends with its exception.
MAX_LOG_LINES = 200
MAX_LOG_LINE_CHARS = 4096
#: Highest rank a Horovod stall line may name (one past the largest world trainguard plans for).
MAX_STALL_RANKS = 65536


def log_rule(line: str, stream: str, rank: int | None, node: str | None,
             generation: int | None, ts: int, step: int | None = None) -> Finding | None:
    """A log line through the XID parser and the pattern table. A line from
    ``stream == "exception"`` (a traceback the shim caught) that matches no specific row is an
    application exception of the rank that sent it. For a multi-line traceback the last
    matching line decides (Python prints the exception last). Only the last ``MAX_LOG_LINES``
    lines, each cut to ``MAX_LOG_LINE_CHARS``, are matched."""
    tail = line.rsplit("\n", MAX_LOG_LINES)[-MAX_LOG_LINES:]  # never splits all of a flood
    lines = [ln[:MAX_LOG_LINE_CHARS] for part in tail for ln in part.splitlines()
             if ln.strip()][-MAX_LOG_LINES:] or [line[:MAX_LOG_LINE_CHARS]]
    found: pat.PatternMatch | None = None
    hit = ""
    for ln in lines:
        x = pat_xid(ln, node, ts)
        if x is not None:
            x.ranks = [rank] if rank is not None else []
            x.generation = generation
            return x
        m = pat.match_line(ln)
        if m is not None and (found is None or _better(m, found)):
            found, hit = m, ln.strip()
    if found is None:
        if stream != "exception":
            return None
        last = lines[-1].strip()
        return Finding("log_pattern", "app_exception", ranks=[rank] if rank is not None else [],
                       nodes=[node] if node else [], evidence=[last[:500]],
                       detail={"pattern": "exception", "layer": "application", "weight": 0.6,
                               "step": step},
                       ts=ts, generation=generation)
    p = found.pattern
    r = rank if rank is not None else pat.line_rank(hit)
    g = found.groups
    detail = {"pattern": p.name, "layer": p.layer.value, "weight": p.weight,
              "why": p.why, "step": step, **{k: v for k, v in g.items()}}
    nodes = [node] if node else []
    if "peer_host" in g and p.fault_class == "node_lost":
        nodes = [g["peer_host"]]
        detail["reporter_node"] = node
        detail["reporter_rank"] = r
    ranks = [r] if r is not None and p.fault_class != "node_lost" else []
    if p.name == "store_barrier_timeout" and int(g.get("joined", 0)) > int(g.get("world", 1 << 62)):
        # more workers joined the store-based barrier than the world size: the launch started
        # more processes than it declared — the job's own launch configuration
        detail["layer"] = Layer.APPLICATION.value
    if p.name == "horovod_stall" and "ready" in g:
        ready = sorted({int(x) for x in g["ready"].replace(" ", "").split(",") if x})
        # the missing ranks lie below the highest ready one; a rank past any real world
        # ("ready ranks: 0, 30000000" took 7 s and 1.2 GB, bench/fuzz.py) names none
        seen = set(ready)
        ranks = ([x for x in range(max(ready) + 1) if x not in seen]
                 if ready and max(ready) < MAX_STALL_RANKS else [])
        detail["ready_ranks"] = ready[:MAX_STALL_RANKS]
    return Finding("log_pattern", p.fault_class, ranks=ranks, nodes=nodes,
                   symptom=p.symptom, evidence=[hit[:500]], detail=detail, ts=ts,
                   generation=generation)


def _better(a: pat.PatternMatch, b: pat.PatternMatch) -> bool:
    """Within one multi-line message: a root-cause row beats a symptom row, then weight."""
    if a.pattern.symptom != b.pattern.symptom:
        return not a.pattern.symptom
    return a.pattern.weight > b.pattern.weight


def pat_xid(line: str, node: str | None, ts: int) -> Finding | None:
    """The XID finding of a kernel-log line, or None when it is not an XID line."""
    m = parse_xid_line(line)
    return xid_finding_from_match(m, node, ts) if m else None


def save_failed_finding(rank: int | None, node: str | None, step: int, error: str,
                        errno: int | None, generation: int | None, ts: int) -> Finding:
    """A checkpoint save that failed (schema ``ckpt.save_failed``). Its own fault class,
    ``checkpoint_save``: the Checkpointer keeps training going and the last valid checkpoint in
    place, so the policy flags it (policy table) instead of stopping the job the way the
    ``filesystem`` class does for a rank that crashed on a full disk. A warning, like the other
    flags: it does not settle an incident whose root cause is still to come. One anomaly per rank
    and generation (the dedup key)."""
    return Finding("log_pattern", "checkpoint_save", ranks=[rank] if rank is not None else [],
                   nodes=[node] if node else [],
                   evidence=[f"checkpoint save at step {step} failed: {error}"[:500]],
                   severity="warning",
                   detail={"pattern": "checkpoint_save_failed", "layer": "infrastructure",
                           "weight": 0.8, "errno": errno, "step": step},
                   ts=ts, generation=generation)


def recovery_check_finding(rank: int | None, node: str | None, restored_step: int,
                           loss_at_save: float | None, loss_after: float | None,
                           tolerance: float, generation: int | None, ts: int) -> Finding:
    """A restore whose state failed the post-recovery loss check (schema ``recovery.verified``
    with ``ok`` False: the loss of the first step after the restore is off the loss recorded at
    save time by more than ``tolerance × max(1, |loss_at_save|)``, or not finite;
    ``trainguard.checkpoint.restorer.loss_matches``). The checkpoint read back whole (it
    passed validation and the restore's checks), but its state is not the one the job saved
    with that loss: fault class ``checkpoint_corrupt``, layer hint ``application`` (what the
    program put into the checkpoint, not the storage, is wrong). One anomaly per rank and
    generation; ``detail["step"]`` is the restored step (loop detection)."""
    return Finding("recovery_check", "checkpoint_corrupt",
                   ranks=[rank] if rank is not None else [], nodes=[node] if node else [],
                   evidence=[f"the loss after restoring step {restored_step} is {loss_after!r}, "
                             f"{loss_at_save!r} at save time: beyond the tolerance "
                             f"{tolerance:g} × max(1, |loss at save|)"],
                   detail={"pattern": "recovery_loss_check", "layer": "application",
                           "weight": 0.9, "step": restored_step,
                           "restored_step": restored_step, "loss_at_save": loss_at_save,
                           "loss_after": loss_after, "tolerance": tolerance},
                   ts=ts, generation=generation)


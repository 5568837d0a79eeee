"""Rules over the node agent's host and link telemetry: host memory pressure (near exhaustion,
or trending towards an OOM kill), CPU saturation, latency to peers, NVLink and PCIe error rates.

Pure: nothing here does I/O or reads a clock; callers pass ``now`` (seconds on a monotonic
clock) and the sample's Unix ns as ``ts``. Each rule returns ``Finding`` objects
(``detector.core``) for the node; the reducer publishes them to the node and to every job with
members on it. Every finding is a *warning*: the evidence says a node is unhealthy, not that a
rank failed, so the remediator's policy flags it (a warning acts only where its policy row
replaces a measured slow rank with a spare); the decisive events — the OOM kill itself, an
NVLink XID, a lost node — come from their own rules. Thresholds and their sources:
``core.TelemetryConfig``.

``RULES`` is the table: one row per rule, its kind (also the dedup pattern), fault class,
layer hint and the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.schemas.vocabulary import FaultClass, Layer

from trainguard.detector.core import DetectorConfig, Finding, TelemetryConfig


@dataclass(frozen=True)
class TelemetryRule:
    """One row of ``RULES``: ``kind`` names the finding and its dedup pattern; ``why`` is the
    reason and the source of its threshold."""

    kind: str
    fault_class: FaultClass
    layer: Layer
    why: str
    #: True: the rule records a node condition that explains another rule's finding (see
    #: ``cpu_context``) and publishes nothing by itself
    context: bool = False


F, L = FaultClass, Layer
RULES: dict[str, TelemetryRule] = {r.kind: r for r in (
    TelemetryRule("host_memory_exhausted", F.OOM_HOST, L.APPLICATION,
                  "memory in use (total − available) at or above mem_critical_ratio of the "
                  "total: the kernel's OOM killer is next (linux mm/oom_kill.c; MemAvailable, "
                  "proc(5))"),
    TelemetryRule("host_memory_trend", F.OOM_HOST, L.APPLICATION,
                  "a least-squares fit of memory in use over mem_trend_window_s reaches the "
                  "total within mem_horizon_s: a leak or a growing cache heading for an OOM "
                  "kill"),
    TelemetryRule("cpu_saturated", F.STRAGGLER, L.SYSTEM_SOFTWARE,
                  "no idle CPU for cpu_samples samples: every rank on the host slows down "
                  "(oversubscribed cores stall each gloo collective: shared/findings.md). "
                  "Context, never a verdict alone: a job that keeps every core busy is using "
                  "its host, not failing; it becomes evidence of a straggler or throughput "
                  "verdict whose slow rank is on the node (cpu_context)", context=True),
    TelemetryRule("peer_latency", F.NETWORK, L.INFRASTRUCTURE,
                  "TCP connect round trip to a peer at or above latency_warn_s for "
                  "latency_samples samples (a data-centre LAN answers in well under 1 ms)"),
    TelemetryRule("peer_unreachable", F.NETWORK, L.INFRASTRUCTURE,
                  "a peer refused or timed out every probe for latency_samples samples"),
    TelemetryRule("nvlink_errors", F.NVLINK, L.HARDWARE,
                  "an NVLink replay or recovery counter rose by more than nvlink_error_limit "
                  "between samples (DCGM_LIMIT_MAX_LWLINK_ERROR, dcgm_gpu_hardware_limits.h)"),
    TelemetryRule("nvlink_crc_rate", F.NVLINK, L.HARDWARE,
                  "NVLink CRC errors at nvlink_crc_per_s per second or more: below that rate "
                  "the link's replay corrects them (DCGM_LIMIT_MAX_LWLINK_CRC_ERROR)"),
    TelemetryRule("pcie_replay_rate", F.GPU_XID, L.HARDWARE,
                  "PCIe replays at pcie_replays_per_min per minute or more "
                  "(DCGM_LIMIT_MAX_PCIREPLAY_RATE: 8 per minute, 'the maximum recommended')"),
    TelemetryRule("ecc_corrected_rate", F.ECC, L.HARDWARE,
                  "corrected (single-bit) ECC errors at ecc_corrected_per_min per minute or "
                  "more: the memory is degrading before it fails (DCGM_LIMIT_MAX_SBE_RATE 10, "
                  "dcgm_gpu_hardware_limits.h; the driver's own report of it is XID 92 "
                  "EXCESSIVE_SBE_INTERRUPTS, 'High single-bit ECC error rate', NVIDIA XID "
                  "catalog). Repeated corrected errors at one address retire the page or remap "
                  "the row; an uncorrectable error there ends the process (XID 48/94/95)"),
)}
del F, L


class HostWindow:
    """Recent host and link samples of one node: ``mem`` — (now, used, total) in bytes;
    ``cpu_run`` — consecutive saturated CPU samples; ``lat_runs`` — peer → consecutive slow
    (or unreachable) samples, for the peers of the last sample that have one; ``gpu_prev`` —
    GPU index → (now, nvlink counters, PCIe replays, corrected ECC count) of the previous
    sample, for the GPUs of the last sample."""

    __slots__ = ("mem", "cpu_run", "cpu_last", "lat_runs", "gpu_prev")

    def __init__(self) -> None:
        self.mem: list[tuple[float, int, int]] = []
        self.cpu_run = 0
        self.cpu_last = 0.0
        self.lat_runs: dict[str, int] = {}
        self.gpu_prev: dict[int, tuple[float, dict[str, int], int | None, int | None]] = {}


def _finding(kind: str, node: str, evidence: str, ts: int, gpus: list[str] | None = None,
             **detail) -> Finding:
    r = RULES[kind]
    return Finding(kind, r.fault_class, nodes=[node], gpus=gpus or [], severity="warning",
                   evidence=[evidence],
                   detail={"pattern": kind, "layer": r.layer.value, "why": r.why,
                           "source": "telemetry", "weight": 0.5, **detail}, ts=ts)


def cpu_context(f: Finding, windows: dict[str, HostWindow],
                cfg: DetectorConfig | TelemetryConfig) -> Finding:
    """``f`` (a straggler or throughput finding) with the CPU saturation of its nodes as
    evidence: ``windows`` maps node → its ``HostWindow``. A finding that names nodes gets
    ``detail["cpu_saturated"]`` (those of its nodes whose CPU had no idle time for
    ``cpu_samples`` samples) and the ``system_software`` layer hint when every one of them is
    saturated; a finding with no culprit gets the saturated nodes as evidence only when not
    every node is saturated (one busy host among idle ones is a lead; all busy, none is).
    Returns ``f`` itself, changed in place, or unchanged when no node is saturated."""
    tc = cfg.telemetry if isinstance(cfg, DetectorConfig) else cfg
    busy = sorted(n for n, w in windows.items() if w.cpu_run >= tc.cpu_samples)
    if not busy:
        return f
    row = RULES["cpu_saturated"]
    if f.nodes:
        hit = [n for n in f.nodes if n in busy]
        if not hit:
            return f
        f.detail["cpu_saturated"] = hit
        if len(hit) == len(f.nodes) and f.detail.get("layer", "unknown") == "unknown":
            f.detail["layer"] = row.layer.value
    elif len(busy) < len(windows):
        f.detail["cpu_saturated"] = busy
    else:
        return f
    for n in f.detail["cpu_saturated"]:
        f.evidence.append(f"node {n}: CPU {windows[n].cpu_last:.0f}% busy for "
                          f"{windows[n].cpu_run} samples ({row.kind}: {row.why.split('. ')[0]})")
    return f


def mem_slope(points: list[tuple[float, int, int]]) -> float:
    """Least-squares slope (bytes per second) of memory in use over ``points``; 0.0 when the
    points span no time."""
    n = len(points)
    mt = sum(p[0] for p in points) / n
    mu = sum(p[1] for p in points) / n
    var = sum((p[0] - mt) ** 2 for p in points)
    if var <= 0:
        return 0.0
    return sum((p[0] - mt) * (p[1] - mu) for p in points) / var


def host_rules(win: HostWindow, node: str, cpu_percent: float, mem_used: int, mem_total: int,
               latency: dict[str, float], now: float, cfg: DetectorConfig | TelemetryConfig,
               ts: int = 0) -> list[Finding]:
    """Memory, CPU and latency rules over one host sample (bytes, percent, seconds; a latency
    of ``math.inf`` is an unreachable peer). Each fires once per run of bad samples."""
    tc = cfg.telemetry if isinstance(cfg, DetectorConfig) else cfg
    out: list[Finding] = []
    if mem_total > 0:
        win.mem = [p for p in win.mem if now - p[0] <= tc.mem_trend_window_s]
        win.mem.append((now, int(mem_used), int(mem_total)))
        ratio = mem_used / mem_total
        if ratio >= tc.mem_critical_ratio:
            out.append(_finding("host_memory_exhausted", node,
                                f"node {node}: {ratio:.1%} of host memory in use "
                                f"({mem_used / 2**30:.1f} of {mem_total / 2**30:.1f} GiB)", ts,
                                used_bytes=int(mem_used), total_bytes=int(mem_total)))
        elif ratio >= tc.mem_trend_floor_ratio and len(win.mem) >= tc.mem_trend_min_samples:
            slope = mem_slope(win.mem)
            left = (mem_total - mem_used) / slope if slope > 0 else math.inf
            if left <= tc.mem_horizon_s:
                out.append(_finding("host_memory_trend", node,
                                    f"node {node}: host memory in use grows "
                                    f"{slope / 2**20:.0f} MiB/s, {ratio:.1%} used: exhausted "
                                    f"in ≈ {left:.0f} s at this rate", ts,
                                    slope_bytes_per_s=round(slope), seconds_left=round(left, 1),
                                    used_bytes=int(mem_used), total_bytes=int(mem_total)))
    # CPU saturation is context (RULES["cpu_saturated"]): kept in the window, read by cpu_context
    win.cpu_last = float(cpu_percent)
    win.cpu_run = win.cpu_run + 1 if cpu_percent >= tc.cpu_saturated_percent else 0
    runs: dict[str, int] = {}  # only peers of this sample with a run: a peer once named (a
    # hostile sample names new ones each time) is not kept past the sample that clears it
    for peer, rtt in sorted(latency.items()):
        bad = not math.isfinite(rtt) or rtt >= tc.latency_warn_s
        run = win.lat_runs.get(peer, 0) + 1 if bad else 0
        if run:
            runs[peer] = run
        if run == tc.latency_samples:
            if math.isfinite(rtt):
                out.append(_finding("peer_latency", node,
                                    f"node {node}: TCP round trip to {peer} {rtt * 1e3:.1f} ms "
                                    f"for {run} samples", ts, peer=peer, rtt_s=rtt))
            else:
                out.append(_finding("peer_unreachable", node,
                                    f"node {node}: {peer} unreachable for {run} samples", ts,
                                    peer=peer))
    win.lat_runs = runs
    return out


def link_rules(win: HostWindow, node: str, gpus: list[dict], now: float,
               cfg: DetectorConfig | TelemetryConfig, ts: int = 0) -> list[Finding]:
    """NVLink, PCIe and corrected-ECC error rates between two samples of the same GPU
    (``GpuSample`` dicts: ``nvlink_errors`` ``{"<link>.<counter>": n}``,
    ``pcie_replay_counter``, ``ecc_volatile_corrected`` — else ``ecc_aggregate_corrected``).
    A counter that went down (a driver reload resets the volatile counts) starts again."""
    tc = cfg.telemetry if isinstance(cfg, DetectorConfig) else cfg
    out: list[Finding] = []
    seen = {int(g.get("index", 0)) for g in gpus}
    for idx in [i for i in win.gpu_prev if i not in seen]:
        del win.gpu_prev[idx]  # a GPU this sample does not name (a hostile index) is not kept
    for g in gpus:
        idx = int(g.get("index", 0))
        gid = f"{node}:{idx}"
        links = {str(k): int(v) for k, v in (g.get("nvlink_errors") or {}).items()}
        replay = g.get("pcie_replay_counter")
        sbe = g.get("ecc_volatile_corrected")
        if sbe is None:
            sbe = g.get("ecc_aggregate_corrected")
        prev = win.gpu_prev.get(idx)
        win.gpu_prev[idx] = (now, links, replay, sbe)
        if prev is None or now <= prev[0]:
            continue
        dt = now - prev[0]
        rises = {k: v - prev[1][k] for k, v in links.items() if k in prev[1] and v > prev[1][k]}
        errs = {k: d for k, d in rises.items() if k.split(".")[-1] in ("replay", "recovery")
                and d > tc.nvlink_error_limit}
        if errs:
            out.append(_finding("nvlink_errors", node,
                                f"GPU {gid} NVLink errors rose by {errs} in {dt:.1f} s", ts,
                                gpus=[gid], gpu_index=idx, rises=errs))
        crc = sum(d for k, d in rises.items() if k.split(".")[-1].startswith("crc"))
        if crc / dt >= tc.nvlink_crc_per_s:
            out.append(_finding("nvlink_crc_rate", node,
                                f"GPU {gid} NVLink CRC errors at {crc / dt:.0f}/s", ts,
                                gpus=[gid], gpu_index=idx, per_s=round(crc / dt, 1)))
        for kind, what, now_n, then_n, limit in (
                ("pcie_replay_rate", "PCIe replays", replay, prev[2], tc.pcie_replays_per_min),
                ("ecc_corrected_rate", "corrected ECC errors", sbe, prev[3],
                 tc.ecc_corrected_per_min)):
            if now_n is None or then_n is None or now_n <= then_n:
                continue
            per_min = (now_n - then_n) * 60.0 / dt
            if per_min >= limit:
                out.append(_finding(kind, node, f"GPU {gid} {what} at {per_min:.0f}/min "
                                                f"({then_n} -> {now_n} in {dt:.1f} s)", ts,
                                    gpus=[gid], gpu_index=idx, per_min=round(per_min, 1),
                                    **({"before": then_n, "after": now_n}
                                       if kind == "ecc_corrected_rate" else {})))
    return out

"""One shared cause blamed once. Pure.

When the root's failure signature (an XID, an NCCL error, a file system error, a driver
mismatch …) came from ``shared_min_nodes`` (4) or more different nodes of ``shared_min_jobs``
(2) or more jobs within ``shared_window_s`` (60 s), the fault is not those nodes' own: a driver
rollout, a bad health rule, a switch, a shared file system or a configuration broke them all.
The verdict then blames the shared layer (``detail["shared_cause"]``), names what the nodes have
in common that the other nodes lack where their telemetry says (``NodeTelemetry.attributes``:
driver, image, rack, switch, mount …), and the remediator takes no node out for it
(``remediator.holds``).

Why these numbers: independent hardware faults come a few nodes an hour in a large fleet (Meta
research clusters, Llama 3: 419 interruptions in 54 days on 16k GPUs, ≈ 1 per 3 h), so four
nodes with one signature within a minute, in different jobs, is far past chance; one job's own
nodes failing alike is the application rule's (``detail["systematic"]``), not this one.

The layer: the attribute the nodes share says it (``ATTRIBUTE_LAYERS``: a driver or image is
system software, a switch, rack or mount infrastructure); without one, the fault class does
(``CLASS_LAYERS``), else system software.
"""
from __future__ import annotations

from typing import Any

from trainguard.schemas.vocabulary import FaultClass, Layer

__all__ = ["shared_cause", "common_attributes", "ATTRIBUTE_LAYERS", "CLASS_LAYERS"]

#: attribute key → the layer a fault shared by the nodes with one value of it lives in
ATTRIBUTE_LAYERS: dict[str, str] = {
    "driver": Layer.SYSTEM_SOFTWARE, "cuda": Layer.SYSTEM_SOFTWARE,
    "firmware": Layer.SYSTEM_SOFTWARE, "kernel": Layer.SYSTEM_SOFTWARE,
    "image": Layer.SYSTEM_SOFTWARE, "nccl": Layer.SYSTEM_SOFTWARE,
    "config": Layer.SYSTEM_SOFTWARE,
    "switch": Layer.INFRASTRUCTURE, "rack": Layer.INFRASTRUCTURE,
    "mount": Layer.INFRASTRUCTURE, "fs": Layer.INFRASTRUCTURE,
    "zone": Layer.INFRASTRUCTURE, "pdu": Layer.INFRASTRUCTURE,
}

#: fault class → the shared layer when no attribute names one
CLASS_LAYERS: dict[str, str] = {
    FaultClass.NETWORK: Layer.INFRASTRUCTURE, FaultClass.FILESYSTEM: Layer.INFRASTRUCTURE,
    FaultClass.NODE_LOST: Layer.INFRASTRUCTURE, FaultClass.RENDEZVOUS: Layer.INFRASTRUCTURE,
    FaultClass.CHECKPOINT_CORRUPT: Layer.INFRASTRUCTURE,
}


def common_attributes(affected: set[str], attrs: dict[str, dict[str, str]]
                      ) -> dict[str, str]:
    """The ``key: value`` pairs every affected node that reports ``key`` has, which some
    other node reporting ``key`` lacks (a value the whole fleet shares explains nothing).
    Keys no affected node reports are left out; so is a key only one affected node reports."""
    out: dict[str, str] = {}
    keys = {k for n in affected for k in attrs.get(n, {})}
    for k in sorted(keys):
        values = {attrs[n][k] for n in affected if k in attrs.get(n, {})}
        reporting = sum(1 for n in affected if k in attrs.get(n, {}))
        if len(values) != 1 or reporting < 2:
            continue
        v = next(iter(values))
        others = [attrs[n][k] for n in attrs if n not in affected and k in attrs[n]]
        if others and all(o == v for o in others):
            continue
        out[k] = v
    return out


def shared_cause(fault_class: str, signature: str, recent: dict[str, set[str]],
                 attrs: dict[str, dict[str, str]], window_s: float, min_nodes: int,
                 min_jobs: int) -> dict[str, Any] | None:
    """The shared cause of ``signature``, or None.

    ``recent`` — node → jobs that reported the signature within ``window_s`` (this incident
    included); ``attrs`` — node → attributes (every node known, for the contrast). Returns
    ``{layer, count, jobs, nodes (first 16), signature, window_s, common}``."""
    jobs = {j for js in recent.values() for j in js}
    if len(recent) < min_nodes or len(jobs) < min_jobs:
        return None
    common = common_attributes(set(recent), attrs)
    layer = next((ATTRIBUTE_LAYERS[k] for k in common if k in ATTRIBUTE_LAYERS), None)
    layer = layer or CLASS_LAYERS.get(fault_class, Layer.SYSTEM_SOFTWARE)
    return {"layer": str(layer), "count": len(recent), "jobs": len(jobs),
            "nodes": sorted(recent)[:16], "signature": signature, "window_s": window_s,
            "common": common}

"""Node-level telemetry events published by the node agent (``agents/``)."""
from __future__ import annotations

from pydantic import BaseModel, Field

from trainguard.schemas.base import Entries, Event, Items


class GpuSample(BaseModel):
    """One GPU's NVML reading. Units: bytes, °C, watts, percent; counters are cumulative."""

    index: int
    uuid: str = ""
    pci_bus_id: str = ""
    name: str = ""
    util_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_volatile_corrected: int | None = None
    ecc_volatile_uncorrected: int | None = None
    ecc_aggregate_corrected: int | None = None
    ecc_aggregate_uncorrected: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    clock_event_reasons: int | None = None
    clock_event_names: Items[str] = Field(default_factory=list)
    nvlink_errors: Entries[int] = Field(default_factory=dict)
    pcie_replay_counter: int | None = None


class NodeTelemetry(Event):
    """Host (psutil) and GPU (NVML) metrics of one node. Subject ``tg.node.<node>.telemetry``.

    ``nvml`` is False when NVML is unavailable (no GPU / no driver); ``gpus`` is then empty.
    ``net_latency_s`` maps a peer or ``"bus"`` to a round-trip time in seconds.
    ``attributes`` — what the node has that others may not: ``driver`` (version), ``image``,
    ``rack``, ``switch``, ``mount`` … (the agent's ``TG_NODE_ATTRS``, ``k=v,k=v``); the
    attributor names the ones a shared cause's nodes have in common.
    """

    SCHEMA = "node.telemetry"
    cpu_percent: float
    mem_used_bytes: int
    mem_total_bytes: int
    load1: float = 0.0
    net_latency_s: Entries[float] = Field(default_factory=dict)
    nvml: bool = False
    gpus: Items[GpuSample] = Field(default_factory=list)
    attributes: Entries[str] = Field(default_factory=dict)


class NodeHeartbeat(Event):
    """Liveness of a node-side process. Subject ``tg.node.<node>.heartbeat`` for the node
    agent (role ``agent``), ``tg.node.<node>.launcher.<job>`` for a job's launcher (role
    ``launcher``, ``job`` that of the subject; ``subjects.launcher``: a subject a job's own
    user may publish, the agent's it may not). Any other role on the agent's subject is
    refused (``detector.handlers``).

    ``role`` is ``"agent"`` or ``"launcher"``; ``seq`` increments by one per beat;
    ``interval_s`` is the sender's beat period (seconds); ``ending`` marks a sender's last beat
    as it ends on purpose (a launcher whose job finished, stopped or failed here): its silence
    from then on is no loss.
    """

    SCHEMA = "node.heartbeat"
    role: str = "agent"
    seq: int = 0
    pid: int = 0
    interval_s: float = 1.0
    ending: bool = False


class XidEvent(Event):
    """A GPU XID error. Subject ``tg.node.<node>.xid``.

    ``xid`` is the XID number (NVIDIA XID catalog); ``pci`` the PCI address as printed by the
    driver (``""`` when the line had none); ``gpu_index``/``gpu_uuid`` when NVML maps it;
    ``source`` is ``kmsg``, ``journal``, ``file`` or ``nvml``; ``raw`` the original line.
    """

    SCHEMA = "node.xid"
    xid: int
    pci: str = ""
    gpu_index: int | None = None
    gpu_uuid: str = ""
    pid: int | None = None
    process_name: str = ""
    message: str = ""
    raw: str = ""
    source: str = "kmsg"

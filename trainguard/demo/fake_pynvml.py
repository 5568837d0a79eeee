"""A stand-in for the ``pynvml`` module on machines without an NVIDIA driver: the tests' GPUs and
the simulated GPUs of the demo's nodes (``for_node``, loaded by the agent with
``--nvml-module trainguard.demo.fake_pynvml:for_node``).

Only the library calls are replaced. Everything else is the real ``pynvml``: the ``NVML_*`` and
``nvmlEventType*`` / ``nvmlClocks*`` constants, the ``NVMLError_*`` exception classes (raised
with the codes the real library returns), and the ctypes structures returned
(``c_nvmlUtilization_t``, ``c_nvmlMemory_t``, ``nvmlPciInfo_t`` with ``bytes`` fields,
``c_nvmlEventData_t``), and device / event-set handles are real ``c_nvmlDevice_t`` /
``c_nvmlEventSet_t`` pointers. Getters decorated with ``convertStrBytes`` in pynvml (UUID,
name) return ``str``, as they do there.

Behaviour follows the NVML API reference: calls before ``nvmlInit`` raise
``NVMLError_Uninitialized``; a reading a GPU lacks raises ``NVMLError_NotSupported``; an NVLink
index past the device's links raises ``NVMLError_InvalidArgument``; ``nvmlEventSetWait_v2``
raises ``NVMLError_Timeout`` when nothing arrived within the timeout.
"""
from __future__ import annotations

import ctypes
import json
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

_EXPORT_PREFIXES = ("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks", "c_nvml", "nvmlPciInfo")


@dataclass
class FakeGpu:
    """One simulated GPU. ``None`` for a reading means the GPU does not support it
    (``NVMLError_NotSupported``); ``errors`` maps a function name to an NVML error code to raise
    instead (e.g. ``{"nvmlDeviceGetPowerUsage": NVML_ERROR_GPU_IS_LOST}``)."""

    uuid: str
    name: str
    bus_id: str  # as nvmlPciInfo_t.busId holds it: "00000000:3B:00.0"
    util_gpu: int | None = 0
    util_mem: int = 0
    mem_total: int | None = 0
    mem_used: int = 0
    temperature: int | None = 30
    power_mw: int | None = 60000
    ecc: dict[tuple[int, int], int] | None = None  # (error type, counter type) -> count
    retired: dict[int, list[int]] | None = None  # cause -> page addresses
    retired_pending: int | None = None
    remapped: tuple[int, int, int, int] | None = None
    clock_reasons: int | None = 0
    has_event_reasons_entry: bool = True  # False: driver older than r535
    nvlinks: dict[int, dict[int, int]] | None = None  # link -> {counter const: value}
    nvlink_active: dict[int, int] = field(default_factory=dict)
    pcie_replay: int | None = 0
    xid_events: bool = True
    errors: dict[str, int] = field(default_factory=dict)


class FakePynvml:
    """Module-like object: ``FakePynvml([FakeGpu(...), ...], init_error=None)``.

    ``init_error`` is an NVML code ``nvmlInit`` fails with (e.g. ``NVML_ERROR_LIBRARY_NOT_FOUND``).
    ``inject_xid(index, xid)`` delivers an XID critical-error event to every event set the GPU
    is registered with. ``calls`` counts calls per function name.
    """

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None):
        for name in dir(_real):
            if name.startswith(_EXPORT_PREFIXES):
                setattr(self, name, getattr(_real, name))
        self.gpus = gpus
        self.init_error = init_error
        self.initialised = 0
        self.calls: dict[str, int] = {}
        self._structs = [_real.struct_c_nvmlDevice_t() for _ in gpus]
        self._handles = [_real.c_nvmlDevice_t(s) for s in self._structs]
        self._sets: dict[int, tuple[Any, queue.Queue, dict[int, int]]] = {}

    # ---- helpers --------------------------------------------------------------------------
    def _enter(self, fn: str, handle: Any = None) -> FakeGpu | None:
        self.calls[fn] = self.calls.get(fn, 0) + 1
        if fn not in ("nvmlInit", "nvmlInitWithFlags") and not self.initialised:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = self._gpu(handle)
        code = gpu.errors.get(fn)
        if code is not None:
            raise _real.NVMLError(code)
        return gpu

    def _gpu(self, handle: Any) -> FakeGpu:
        addr = ctypes.addressof(handle.contents)
        for g, s in zip(self.gpus, self._structs):
            if ctypes.addressof(s) == addr:
                return g
        raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)

    @staticmethod
    def _supported(value: Any) -> Any:
        if value is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return value

    # ---- session --------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise _real.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._handles[index]

    # ---- identity -------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._enter("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        return self._enter("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        g = self._enter("nvmlDeviceGetPciInfo", h)
        dom, bus, rest = g.bus_id.split(":")
        dev = rest.split(".")[0]
        info = _real.nvmlPciInfo_t()
        info.busId = g.bus_id.encode()
        info.busIdLegacy = f"{int(dom, 16):04X}:{bus}:{rest}".encode()
        info.domain, info.bus, info.device = int(dom, 16), int(bus, 16), int(dev, 16)
        return info

    # ---- readings -------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        g = self._enter("nvmlDeviceGetUtilizationRates", h)
        self._supported(g.util_gpu)
        return _real.c_nvmlUtilization_t(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        g = self._enter("nvmlDeviceGetMemoryInfo", h)
        self._supported(g.mem_total)
        return _real.c_nvmlMemory_t(total=g.mem_total, free=g.mem_total - g.mem_used,
                                    used=g.mem_used)

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        g = self._enter("nvmlDeviceGetTemperature", h)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._supported(g.temperature)

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._supported(self._enter("nvmlDeviceGetPowerUsage", h).power_mw)

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        g = self._enter("nvmlDeviceGetTotalEccErrors", h)
        return self._supported(g.ecc)[(error_type, counter_type)]

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        g = self._enter("nvmlDeviceGetRetiredPages", h)
        return list(self._supported(g.retired).get(cause, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int:
        g = self._enter("nvmlDeviceGetRetiredPagesPendingStatus", h)
        return int(self._supported(g.retired_pending))

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, int, int]:
        return self._supported(self._enter("nvmlDeviceGetRemappedRows", h).remapped)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        g = self._enter("nvmlDeviceGetCurrentClocksEventReasons", h)
        if not g.has_event_reasons_entry:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._supported(g.clock_reasons)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:
        g = self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        return self._supported(g.clock_reasons)

    def _link(self, g: FakeGpu, link: int) -> dict[int, int]:
        links = self._supported(g.nvlinks)
        if link not in links:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        g = self._enter("nvmlDeviceGetNvLinkState", h)
        self._link(g, link)
        return g.nvlink_active.get(link, _real.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        g = self._enter("nvmlDeviceGetNvLinkErrorCounter", h)
        return self._link(g, link).get(counter, 0)

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._supported(self._enter("nvmlDeviceGetPcieReplayCounter", h).pcie_replay)

    # ---- events ---------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        st = _real.struct_c_nvmlEventSet_t()
        handle = _real.c_nvmlEventSet_t(st)
        self._sets[ctypes.addressof(st)] = (st, queue.Queue(), {})
        return handle

    def _set(self, handle: Any) -> tuple[Any, queue.Queue, dict[int, int]]:
        try:
            return self._sets[ctypes.addressof(handle.contents)]
        except KeyError:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT) from None

    def nvmlDeviceRegisterEvents(self, h: Any, event_types: int, event_set: Any) -> None:
        g = self._enter("nvmlDeviceRegisterEvents", h)
        if not g.xid_events:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        _, _, registered = self._set(event_set)
        registered[self.gpus.index(g)] = int(event_types)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait_v2")
        _, q, _ = self._set(event_set)
        try:
            return q.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._enter("nvmlEventSetFree")
        self._sets.pop(ctypes.addressof(event_set.contents), None)

    def inject_xid(self, index: int, xid: int, gpu_instance: int = 0xFFFFFFFF) -> int:
        """Deliver XID ``xid`` of GPU ``index`` to each event set it is registered with for
        XID events; returns how many sets got it."""
        n = 0
        for _, q, registered in self._sets.values():
            if registered.get(index, 0) & _real.nvmlEventTypeXidCriticalError:
                q.put(_real.c_nvmlEventData_t(
                    device=self._handles[index], eventType=_real.nvmlEventTypeXidCriticalError,
                    eventData=xid, gpuInstanceId=gpu_instance, computeInstanceId=0xFFFFFFFF))
                n += 1
        return n


# ---- GPUs with the readings real parts give ------------------------------------------------
MiB = 1024 * 1024


def h100(bus_id: str = "00000000:3B:00.0", uuid: str = "GPU-5f3c1b2e-8a4d-4c6e-9f10-2b7d3e4a5c61"
         ) -> FakeGpu:
    """An H100 SXM: ECC on, rows remapped instead of pages retired (retired pages
    NotSupported), 18 NVLinks, clock events: SW power cap + HW thermal slowdown."""
    ecc = {(_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_VOLATILE_ECC): 2,
           (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_VOLATILE_ECC): 0,
           (_real.NVML_MEMORY_ERROR_TYPE_CORRECTED, _real.NVML_AGGREGATE_ECC): 17,
           (_real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _real.NVML_AGGREGATE_ECC): 1}
    links = {i: {} for i in range(18)}
    links[3] = {_real.NVML_NVLINK_ERROR_DL_REPLAY: 5, _real.NVML_NVLINK_ERROR_DL_RECOVERY: 1,
                _real.NVML_NVLINK_ERROR_DL_CRC_FLIT: 12, _real.NVML_NVLINK_ERROR_DL_CRC_DATA: 0}
    return FakeGpu(uuid=uuid, name="NVIDIA H100 80GB HBM3", bus_id=bus_id, util_gpu=97,
                   util_mem=41, mem_total=81559 * MiB, mem_used=72011 * MiB, temperature=84,
                   power_mw=689123, ecc=ecc, retired=None, retired_pending=None,
                   remapped=(3, 1, 1, 0), clock_reasons=0x44, nvlinks=links, pcie_replay=0)


def t4(bus_id: str = "00000000:AF:00.0", uuid: str = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
       ) -> FakeGpu:
    """A T4: ECC on, pages retired (no row remapping), no NVLink, idle."""
    ecc = {(t, c): 0 for t in (0, 1) for c in (0, 1)}
    return FakeGpu(uuid=uuid, name="Tesla T4", bus_id=bus_id, util_gpu=0, util_mem=0,
                   mem_total=15360 * MiB, mem_used=0, temperature=31, power_mw=9874, ecc=ecc,
                   retired={_real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
                            [0x3F2A1000, 0x3F2A2000],
                            _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1B004000]},
                   retired_pending=_real.NVML_FEATURE_ENABLED, remapped=None,
                   clock_reasons=0x1, nvlinks=None, pcie_replay=7)


def geforce(bus_id: str = "00000000:01:00.0",
            uuid: str = "GPU-77e0c1d2-0b3a-4f5e-8d6c-112233445566") -> FakeGpu:
    """A consumer card: no ECC, no retired pages, no remapped rows, no NVLink, no PCIe replay
    counter, no XID events; an older driver without the clocks-event entry point."""
    return FakeGpu(uuid=uuid, name="NVIDIA GeForce RTX 3090", bus_id=bus_id, util_gpu=12,
                   mem_total=24576 * MiB, mem_used=1024 * MiB, temperature=45, power_mw=31000,
                   ecc=None, retired=None, retired_pending=None, remapped=None,
                   clock_reasons=0x4, has_event_reasons_entry=False, nvlinks=None,
                   pcie_replay=None, xid_events=False)


def healthy_h100(index: int = 0) -> FakeGpu:
    """An H100 at work and healthy: no clock events but power capping, no errors, nothing
    remapped, its NVLinks clean (the demo's simulated nodes have one each)."""
    g = h100(bus_id=f"00000000:{0x3B + index:02X}:00.0",
             uuid=f"GPU-5f3c1b2e-8a4d-4c6e-9f10-2b7d3e4a5c{index:02x}")
    g.temperature, g.clock_reasons, g.remapped = 62, 0x4, (0, 0, 0, 0)
    g.ecc = {k: 0 for k in g.ecc}
    g.nvlinks = {i: {} for i in range(18)}
    return g


# ---- the demo's simulated GPUs: their state in a file the harness writes -------------------
#: Environment of the agent process: the directory of the state files (``nvml-<node>.json``).
STATE_DIR_ENV = "TG_DEMO_NVML_DIR"


def state_path(state_dir: str, node: str) -> str:
    return os.path.join(state_dir, f"nvml-{node}.json")


class StateFilePynvml(FakePynvml):
    """``FakePynvml`` over the GPUs of one simulated node whose degradation follows a JSON file
    (``state_path``), re-read when it changes: ``{"<gpu index>": {"ecc_corrected": n,
    "ecc_corrected_per_s": r, "since": unix_s}}`` — the corrected ECC count of that GPU is
    ``n + r × (now − since)`` (volatile and aggregate alike): a memory that is wearing out. No
    file: every GPU stays healthy."""

    def __init__(self, gpus: list[FakeGpu], path: str):
        super().__init__(gpus)
        self.path = path
        self._mtime: float | None = None
        self._state: dict[str, dict] = {}

    def _load(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            self._state, self._mtime = {}, None
            return
        if mtime != self._mtime:
            try:
                with open(self.path) as fh:
                    self._state = json.load(fh)
                self._mtime = mtime
            except (OSError, ValueError):  # half written: the next read has it
                pass

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        n = super().nvmlDeviceGetTotalEccErrors(h, error_type, counter_type)
        if error_type != _real.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return n
        self._load()
        st = self._state.get(str(self.gpus.index(self._gpu(h))))
        return n + (corrected_count(st) if st else 0)


def corrected_count(st: dict, now: float | None = None) -> int:
    """The corrected ECC errors a state entry (``StateFilePynvml``) adds at ``now`` (Unix s)."""
    now = time.time() if now is None else now
    rate = float(st.get("ecc_corrected_per_s", 0.0))
    return int(st.get("ecc_corrected", 0) + rate * max(0.0, now - float(st.get("since", now))))


def set_ecc_rate(state_dir: str, node: str, per_s: float, index: int = 0) -> None:
    """From now on, GPU ``index`` of ``node`` counts ``per_s`` more corrected ECC errors per
    second (0: the count stops rising; it never goes back). Written atomically."""
    path = state_path(state_dir, node)
    try:
        with open(path) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        state = {}
    now = time.time()
    old = state.get(str(index))
    state[str(index)] = {"ecc_corrected": corrected_count(old, now) if old else 0,
                         "ecc_corrected_per_s": float(per_s), "since": now}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, path)


def for_node(node: str) -> StateFilePynvml:
    """The simulated GPUs of demo node ``node`` (``load_module`` factory): one healthy H100
    whose state follows ``<$TG_DEMO_NVML_DIR>/nvml-<node>.json``.

    Raises ValueError when ``TG_DEMO_NVML_DIR`` is not set."""
    state_dir = os.environ.get(STATE_DIR_ENV, "")
    if not state_dir:
        raise ValueError(f"{STATE_DIR_ENV} names no directory for the simulated GPUs' state")
    return StateFilePynvml([healthy_h100(0)], state_path(state_dir, node))

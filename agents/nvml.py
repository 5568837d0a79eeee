"""GPU telemetry and XID events through NVML (the ``pynvml`` module of ``nvidia-ml-py``).

``NvmlSampler`` wraps one NVML session:

* ``open()`` initialises NVML and discovers the devices. Without a driver (``nvmlInit`` raises
  ``NVMLError_LibraryNotFound`` or ``NVMLError_DriverNotLoaded``) it returns False and sets
  ``reason``; that is the normal state of a CPU-only host, not an error.
* ``sample()`` reads every device into ``schemas.GpuSample`` objects. Every counter a device does
  not support (``NVMLError_NotSupported`` and the other "not available here" codes in
  ``UNAVAILABLE_CODES``) is ``None``; no NVML error escapes ``sample()``.
* ``start_xid_watch(callback)`` registers every device for ``nvmlEventTypeXidCriticalError`` in
  one event set and waits on it (``nvmlEventSetWait_v2``) in a daemon thread; each event calls
  ``callback(NvmlXid)``.
* ``lookup_pci(address)`` maps a PCI address in any of the spellings the driver and NVML use to
  ``(gpu_index, gpu_uuid)``.

The module is injectable (``NvmlSampler(module=...)``; across a process boundary
``load_module(spec, node)``, the agent's ``--nvml-module``) so tests and the demo's simulated nodes
can stand in for the NVIDIA library at the ``pynvml`` seam. Units: bytes, °C, watts (NVML reports
milliwatts), percent.
Sources: NVML API reference (docs.nvidia.com/deploy/nvml-api) and the constants of
``pynvml.py`` in nvidia-ml-py.
"""
from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from trainguard.schemas import GpuSample

log = logging.getLogger("trainguard.agent.nvml")

#: Clock-event ("throttle") reason bits: (bit, name published, NVML constant it comes from).
#: Values from nvml.h ``nvmlClocksEventReason*`` (same bits as the older
#: ``nvmlClocksThrottleReason*``); ``tests/test_agent_nvml.py`` checks them against pynvml.
CLOCK_EVENT_REASONS: tuple[tuple[int, str, str], ...] = (
    (0x0000000000000001, "gpu_idle", "nvmlClocksEventReasonGpuIdle"),
    (0x0000000000000002, "applications_clocks_setting",
     "nvmlClocksEventReasonApplicationsClocksSetting"),
    (0x0000000000000004, "sw_power_cap", "nvmlClocksEventReasonSwPowerCap"),
    (0x0000000000000008, "hw_slowdown", "nvmlClocksEventReasonHwSlowdown"),
    (0x0000000000000010, "sync_boost", "nvmlClocksEventReasonSyncBoost"),
    (0x0000000000000020, "sw_thermal", "nvmlClocksEventReasonSwThermalSlowdown"),
    (0x0000000000000040, "hw_thermal", "nvmlClocksEventReasonHwThermalSlowdown"),
    (0x0000000000000080, "hw_power_brake", "nvmlClocksEventReasonHwPowerBrakeSlowdown"),
    (0x0000000000000100, "display_clocks_setting", "nvmlClocksEventReasonDisplayClockSetting"),
)

#: NVLink error counters read per link: (name in ``GpuSample.nvlink_errors`` keys, pynvml
#: constant of ``nvmlNvLinkErrorCounter_t``). Keys are ``"<link>.<name>"``, e.g. ``"3.crc_flit"``.
NVLINK_COUNTERS: tuple[tuple[str, str], ...] = (
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
)

#: NVML return codes meaning "this device / driver does not offer that reading": the counter is
#: reported as ``None`` without a log line. (nvml.h ``nvmlReturn_t``.)
UNAVAILABLE_CODES: frozenset[int] = frozenset({
    2,   # NVML_ERROR_INVALID_ARGUMENT (e.g. an NVLink index the device does not have)
    3,   # NVML_ERROR_NOT_SUPPORTED
    4,   # NVML_ERROR_NO_PERMISSION
    6,   # NVML_ERROR_NOT_FOUND
    13,  # NVML_ERROR_FUNCTION_NOT_FOUND (older driver without that entry point)
    21,  # NVML_ERROR_NO_DATA
})

#: Why ``nvmlInit`` failed → (is it simply "no GPU here", what to tell the operator).
#: Codes from nvml.h ``nvmlReturn_t``; anything else is reported with NVML's own message.
INIT_FAILURES: dict[int, tuple[bool, str]] = {
    12: (True, "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver on this host; "
               "publishing host metrics only"),
    9: (True, "NVIDIA kernel driver not loaded: publishing host metrics only "
              "(load the nvidia module if this host has GPUs)"),
    18: (False, "NVML and kernel driver versions differ: reboot or reload the nvidia kernel "
                "module; publishing host metrics only"),
    4: (False, "no permission to use NVML: run the agent as a user allowed to open "
               "/dev/nvidia*; publishing host metrics only"),
}

#: nvml.h ``NVML_ERROR_FUNCTION_NOT_FOUND``: the driver lacks that entry point.
FUNCTION_NOT_FOUND = 13

#: ``nvmlEventData_t.gpuInstanceId`` when the device is not a MIG instance.
NO_GPU_INSTANCE = 0xFFFFFFFF

_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$")


def load_module(spec: str, node: str) -> Any:
    """The NVML module named by ``spec``: ``"pkg.mod"`` — a module with pynvml's API, used as
    it is; ``"pkg.mod:factory"`` — ``factory(node)`` returns an object with that API (e.g. the
    simulated GPUs of one demo node: ``trainguard.demo.fake_pynvml:for_node``).

    Raises ValueError saying what could not be loaded (a missing module or attribute, or a
    factory that failed)."""
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"NVML module {spec!r}: cannot import {mod_name!r}: {exc}") from None
    if not attr:
        return mod
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ValueError(f"NVML module {spec!r}: {mod_name} has no callable {attr!r}")
    try:
        return factory(node)
    except Exception as exc:  # noqa: BLE001 - said in the error, the agent exits with it
        raise ValueError(f"NVML module {spec!r}: {attr}({node!r}) failed: {exc}") from None


def normalise_pci(address: str) -> str:
    """Canonical PCI address ``dddd:bb:dd`` (lowercase hex, 4-digit domain, no function).

    Accepts the driver's ``0000:3b:00`` / ``PCI:0000:3b:00`` and NVML's ``00000000:3B:00.0``
    (``nvmlPciInfo_t.busId``); both become ``0000:3b:00``. Returns ``""`` for a string that is
    not a PCI address.
    """
    s = address.strip()
    if s.upper().startswith("PCI:"):
        s = s[4:]
    m = _PCI.match(s)
    if not m:
        return ""
    domain = int(m.group("domain") or "0", 16)
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clock-event reason mask, in ``CLOCK_EVENT_REASONS``
    order; a bit not in the table is named ``bit_0x<hex>``. ``0`` → ``[]``."""
    names = [name for bit, name, _ in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _, _ in CLOCK_EVENT_REASONS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return names


def _text(value: Any) -> str:
    """pynvml returns ``str`` from decorated getters but ``bytes`` from struct fields."""
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


@dataclass
class NvmlConfig:
    """Settings of the NVML sampler.

    ``enabled`` — use NVML at all (False: host metrics only, no probing).
    ``xid_events`` — watch the XID event set (``start_xid_watch`` does nothing when False).
    ``event_wait_ms`` — timeout of one ``nvmlEventSetWait_v2`` call in milliseconds; bounds how
    long ``close()`` waits for the watcher thread. Default 500 ms.
    ``max_nvlinks`` — NVLink indices probed per device at ``open()`` (default 18, the NVLink 4
    maximum of an H100; pynvml's ``NVML_NVLINK_MAX_LINKS`` is an upper bound for later parts).
    ``module`` — ``load_module`` spec of a module with pynvml's API to use instead of pynvml
    ("" : pynvml).
    """

    enabled: bool = True
    xid_events: bool = True
    event_wait_ms: int = 500
    max_nvlinks: int = 18
    module: str = ""


@dataclass
class NvmlXid:
    """One XID delivered by the NVML event set: ``xid`` number, ``gpu_index``/``gpu_uuid``
    (None/"" when the handle is not one of ours), canonical ``pci``, MIG ``gpu_instance`` (None
    on a whole GPU)."""

    xid: int
    gpu_index: int | None
    gpu_uuid: str
    pci: str
    gpu_instance: int | None = None


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    pci: str = ""
    nvlinks: list[int] = field(default_factory=list)


class NvmlSampler:
    """One NVML session over ``module`` (default: ``import pynvml``).

    Attributes after ``open()``: ``available`` (bool), ``reason`` (why not, "" when available),
    ``devices`` (discovered GPUs). ``errors`` counts unexpected NVML errors per
    ``"<gpu>:<reading>:<error class>"`` (each is logged once).
    """

    def __init__(self, config: NvmlConfig | None = None, module: ModuleType | Any = None):
        self.config = config or NvmlConfig()
        self._module = module
        self.nv: Any = None
        self.available = False
        self.reason = ""
        self.devices: list[_Device] = []
        self.errors: dict[str, int] = {}
        self._by_pci: dict[str, _Device] = {}
        self._by_uuid: dict[str, _Device] = {}
        self._event_set: Any = None
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.xid_count = 0

    # ---- session ------------------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML and discover devices. Returns ``available``; never raises.

        When unavailable, ``reason`` says why and what to do; the caller reports it once.
        """
        if not self.config.enabled:
            self.reason = "NVML disabled in the agent configuration: publishing host metrics only"
            return False
        nv = self._module
        if nv is None:
            try:
                import pynvml as nv  # type: ignore[no-redef]
            except ImportError:
                self.reason = ("nvidia-ml-py is not installed (`pip install nvidia-ml-py`): "
                               "publishing host metrics only")
                return False
        self.nv = nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            _, text = INIT_FAILURES.get(getattr(exc, "value", -1),
                                        (False, f"nvmlInit failed ({exc}): publishing host "
                                                f"metrics only"))
            self.reason = text
            return False
        try:
            count = nv.nvmlDeviceGetCount()
            for i in range(count):
                self.devices.append(self._discover(i))
        except nv.NVMLError as exc:
            self.reason = f"NVML device discovery failed ({exc}): publishing host metrics only"
            self.devices.clear()
            self._shutdown_quietly()
            return False
        self._by_pci = {d.pci: d for d in self.devices if d.pci}
        self._by_uuid = {d.uuid: d for d in self.devices if d.uuid}
        self.available = True
        self.reason = ""
        return True

    def _discover(self, index: int) -> _Device:
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        d = _Device(index=index, handle=h)
        d.uuid = _text(self._read(d, "uuid", nv.nvmlDeviceGetUUID, h) or "")
        d.name = _text(self._read(d, "name", nv.nvmlDeviceGetName, h) or "")
        pci = self._read(d, "pci", nv.nvmlDeviceGetPciInfo, h)
        if pci is not None:
            d.pci = normalise_pci(_text(pci.busId))
        for link in range(self.config.max_nvlinks):
            try:
                nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError:
                continue  # no such link on this device (or no NVLink at all)
            d.nvlinks.append(link)
        return d

    def close(self) -> None:
        """Stop the XID watcher, free the event set, shut NVML down. Idempotent."""
        self._stop.set()
        if self._watch is not None:
            self._watch.join(self.config.event_wait_ms / 1000.0 + 2.0)
            self._watch = None
        if self._event_set is not None and self.nv is not None:
            try:
                self.nv.nvmlEventSetFree(self._event_set)
            except self.nv.NVMLError:
                pass
            self._event_set = None
        if self.available:
            self._shutdown_quietly()
            self.available = False

    def _shutdown_quietly(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass

    # ---- readings -----------------------------------------------------------------------------
    def _read(self, dev: _Device, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None on any NVML error (unexpected ones are counted, logged once)."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            return self._failed(dev, what, exc)

    def _failed(self, dev: _Device, what: str, exc: Exception) -> None:
        """Account for a failed reading: silent for ``UNAVAILABLE_CODES``, else counted in
        ``errors`` and logged the first time per device, reading and error class."""
        if getattr(exc, "value", None) in UNAVAILABLE_CODES:
            return None
        key = f"{dev.index}:{what}:{type(exc).__name__}"
        with self._lock:
            n = self.errors.get(key, 0)
            self.errors[key] = n + 1
        if n == 0:
            log.warning("GPU %d (%s): reading %s failed: %s", dev.index, dev.pci, what, exc)
        return None

    def sample(self) -> list[GpuSample]:
        """One ``GpuSample`` per device; ``[]`` when NVML is unavailable. Never raises NVML
        errors: unsupported readings are None, others are counted in ``errors``."""
        if not self.available:
            return []
        return [self._sample(d) for d in self.devices]

    def _sample(self, d: _Device) -> GpuSample:
        nv, h, r = self.nv, d.handle, self._read
        s = GpuSample(index=d.index, uuid=d.uuid, pci_bus_id=d.pci, name=d.name)
        util = r(d, "utilization", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            s.util_percent = float(util.gpu)
        mem = r(d, "memory", nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            s.mem_used_bytes, s.mem_total_bytes = int(mem.used), int(mem.total)
        temp = r(d, "temperature", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            s.temperature_c = float(temp)
        mw = r(d, "power", nv.nvmlDeviceGetPowerUsage, h)
        if mw is not None:
            s.power_w = mw / 1000.0
        for attr, etype, ctype in (
            ("ecc_volatile_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_volatile_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
             nv.NVML_VOLATILE_ECC),
            ("ecc_aggregate_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
             nv.NVML_AGGREGATE_ECC),
            ("ecc_aggregate_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
             nv.NVML_AGGREGATE_ECC),
        ):
            v = r(d, attr, nv.nvmlDeviceGetTotalEccErrors, h, etype, ctype)
            setattr(s, attr, None if v is None else int(v))
        sbe = r(d, "retired_pages_sbe", nv.nvmlDeviceGetRetiredPages, h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        s.retired_pages_sbe = None if sbe is None else len(sbe)
        dbe = r(d, "retired_pages_dbe", nv.nvmlDeviceGetRetiredPages, h,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        s.retired_pages_dbe = None if dbe is None else len(dbe)
        pending = r(d, "retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        s.retired_pages_pending = None if pending is None else pending == nv.NVML_FEATURE_ENABLED
        rows = r(d, "remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            corr, unc, pend, fail = rows
            s.remapped_rows_correctable, s.remapped_rows_uncorrectable = int(corr), int(unc)
            s.remapped_rows_pending, s.remapped_rows_failure = bool(pend), bool(fail)
        reasons = self._clock_reasons(d)
        if reasons is not None:
            s.clock_event_reasons = int(reasons)
            s.clock_event_names = decode_clock_event_reasons(int(reasons))
        for link in d.nvlinks:
            for name, const in NVLINK_COUNTERS:
                v = r(d, f"nvlink{link}.{name}", nv.nvmlDeviceGetNvLinkErrorCounter, h, link,
                      getattr(nv, const))
                if v is not None:
                    s.nvlink_errors[f"{link}.{name}"] = int(v)
        replay = r(d, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)
        s.pcie_replay_counter = None if replay is None else int(replay)
        return s

    def _clock_reasons(self, d: _Device) -> int | None:
        """``nvmlDeviceGetCurrentClocksEventReasons``; drivers before r535 only have the
        older ``...ClocksThrottleReasons`` entry point, with the same bits."""
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if fn is not None:
            try:
                return fn(d.handle)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != FUNCTION_NOT_FOUND:
                    return self._failed(d, "clock_events", exc)
        return self._read(d, "clock_events", nv.nvmlDeviceGetCurrentClocksThrottleReasons,
                          d.handle)

    # ---- PCI mapping --------------------------------------------------------------------------
    def lookup_pci(self, address: str) -> tuple[int, str] | None:
        """``(gpu_index, gpu_uuid)`` of the device at ``address`` (any spelling accepted by
        ``normalise_pci``), or None when NVML does not know it."""
        d = self._by_pci.get(normalise_pci(address))
        return (d.index, d.uuid) if d else None

    # ---- XID events ---------------------------------------------------------------------------
    def start_xid_watch(self, callback: Callable[[NvmlXid], None]) -> bool:
        """Register every device for XID critical-error events and wait on them in a daemon
        thread, calling ``callback(NvmlXid)`` per event (from that thread). Returns True when
        at least one device is registered. Devices that cannot deliver XID events (NVML
        ``NotSupported``, e.g. some vGPU / MIG set-ups) are skipped and logged once."""
        if not (self.available and self.config.xid_events) or self._watch is not None:
            return False
        nv = self.nv
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            log.warning("NVML event set not available (%s): XIDs come from the kernel log only",
                        exc)
            return False
        registered = 0
        for d in self.devices:
            try:
                nv.nvmlDeviceRegisterEvents(d.handle, nv.nvmlEventTypeXidCriticalError,
                                            self._event_set)
                registered += 1
            except nv.NVMLError as exc:
                log.warning("GPU %d (%s) cannot deliver NVML XID events (%s): its XIDs come "
                            "from the kernel log only", d.index, d.pci, exc)
        if not registered:
            return False
        self._stop.clear()
        self._watch = threading.Thread(target=self._watch_loop, args=(callback,),
                                       name="tg-nvml-xid", daemon=True)
        self._watch.start()
        return True

    def _watch_loop(self, callback: Callable[[NvmlXid], None]) -> None:
        nv = self.nv
        timeout_code = getattr(nv, "NVML_ERROR_TIMEOUT", 10)
        failures = 0
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, self.config.event_wait_ms)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == timeout_code:
                    continue
                failures += 1
                if failures == 1:
                    log.warning("waiting for NVML events failed (%s); retrying", exc)
                self._stop.wait(min(5.0, 0.1 * failures))
                continue
            failures = 0
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            self.xid_count += 1
            try:
                callback(self._xid_of(data))
            except Exception:  # noqa: BLE001 - a callback error must not end the watcher
                log.exception("XID event callback failed")

    def _xid_of(self, data: Any) -> NvmlXid:
        """Turn an ``nvmlEventData_t`` into ``NvmlXid`` (device found by its UUID)."""
        dev: _Device | None = None
        try:
            dev = self._by_uuid.get(_text(self.nv.nvmlDeviceGetUUID(data.device)))
        except self.nv.NVMLError:
            dev = None
        gi = int(getattr(data, "gpuInstanceId", NO_GPU_INSTANCE))
        return NvmlXid(xid=int(data.eventData), gpu_index=dev.index if dev else None,
                       gpu_uuid=dev.uuid if dev else "", pci=dev.pci if dev else "",
                       gpu_instance=None if gi == NO_GPU_INSTANCE else gi)

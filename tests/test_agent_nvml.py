"""NVML sampler at the pynvml seam: real constants, structures and exceptions, simulated GPUs."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pynvml
import pytest

from trainguard.agents.nvml import (
    CLOCK_EVENT_REASONS,
    NVLINK_COUNTERS,
    NvmlConfig,
    NvmlSampler,
    decode_clock_event_reasons,
    normalise_pci,
)

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "agent"))
import fake_pynvml as fk  # noqa: E402

MiB = 1024 * 1024


def test_clock_event_table_matches_pynvml_constants():
    for bit, _name, const in CLOCK_EVENT_REASONS:
        assert getattr(pynvml, const) == bit, const
        # the pre-r535 "throttle" names carry the same bits
        assert getattr(pynvml, const.replace("ClocksEvent", "ClocksThrottle")) == bit
    for _name, const in NVLINK_COUNTERS:
        assert isinstance(getattr(pynvml, const), int)


def test_decode_clock_event_reasons():
    thermal = (pynvml.nvmlClocksEventReasonSwThermalSlowdown
               | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    assert decode_clock_event_reasons(thermal) == ["sw_thermal", "hw_thermal"]
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
                                      | 0x400) == ["hw_power_brake", "bit_0x400"]


@pytest.mark.parametrize("given,want", [
    ("00000000:3B:00.0", "0000:3b:00"),   # NVML busId
    ("0000:3B:00.0", "0000:3b:00"),       # NVML busIdLegacy
    ("0000:3b:00", "0000:3b:00"),         # driver, XID line
    ("PCI:0000:3b:00", "0000:3b:00"),
    ("3b:00.0", "0000:3b:00"),            # no domain
    ("00000001:DB:00.0", "0001:db:00"),
    ("not a pci address", ""),
])
def test_normalise_pci(given, want):
    assert normalise_pci(given) == want


@pytest.mark.parametrize("code,words", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "not found"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot"),
])
def test_init_failure_is_reported_not_raised(code, words):
    fake = fk.FakePynvml([fk.h100()], init_error=code)
    s = NvmlSampler(module=fake)
    assert s.open() is False
    assert words in s.reason.lower() and "host metrics only" in s.reason
    assert s.sample() == []
    assert s.start_xid_watch(lambda x: None) is False
    s.close()


def test_real_pynvml_without_driver():
    """On a host without the NVIDIA library the real module fails in nvmlInit; the sampler
    reports that and stays usable."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU host: nothing to check here
        pynvml.nvmlShutdown()
        pytest.skip("this host has a working NVML")
    s = NvmlSampler()
    assert s.open() is False and s.reason
    assert s.sample() == []


def test_disabled_sampler_does_not_touch_nvml():
    fake = fk.FakePynvml([fk.h100()])
    s = NvmlSampler(NvmlConfig(enabled=False), module=fake)
    assert s.open() is False and "disabled" in s.reason
    assert fake.calls == {}


def test_sample_reads_every_counter_with_units():
    fake = fk.FakePynvml([fk.h100(), fk.t4(), fk.geforce()])
    s = NvmlSampler(module=fake)
    assert s.open()
    h, t, g = s.sample()

    assert (h.index, h.name, h.pci_bus_id) == (0, "NVIDIA H100 80GB HBM3", "0000:3b:00")
    assert h.uuid == "GPU-5f3c1b2e-8a4d-4c6e-9f10-2b7d3e4a5c61"
    assert h.util_percent == 97.0
    assert (h.mem_used_bytes, h.mem_total_bytes) == (72011 * MiB, 81559 * MiB)
    assert h.temperature_c == 84.0
    assert h.power_w == pytest.approx(689.123)  # NVML milliwatts → W
    assert (h.ecc_volatile_corrected, h.ecc_volatile_uncorrected,
            h.ecc_aggregate_corrected, h.ecc_aggregate_uncorrected) == (2, 0, 17, 1)
    assert (h.retired_pages_sbe, h.retired_pages_dbe, h.retired_pages_pending) == (
        None, None, None)  # H100 remaps rows instead
    assert (h.remapped_rows_correctable, h.remapped_rows_uncorrectable,
            h.remapped_rows_pending, h.remapped_rows_failure) == (3, 1, True, False)
    assert h.clock_event_reasons == 0x44
    assert h.clock_event_names == ["sw_power_cap", "hw_thermal"]
    assert len(h.nvlink_errors) == 18 * 4
    assert {k: v for k, v in h.nvlink_errors.items() if k.startswith("3.")} == {
        "3.replay": 5, "3.recovery": 1, "3.crc_flit": 12, "3.crc_data": 0}
    assert h.pcie_replay_counter == 0

    assert (t.retired_pages_sbe, t.retired_pages_dbe, t.retired_pages_pending) == (2, 1, True)
    assert t.remapped_rows_correctable is None and t.remapped_rows_failure is None
    assert t.nvlink_errors == {} and t.pcie_replay_counter == 7
    assert t.clock_event_names == ["gpu_idle"]

    # consumer card: everything it lacks is None, nothing raised
    assert g.ecc_volatile_corrected is None and g.ecc_aggregate_uncorrected is None
    assert g.remapped_rows_pending is None and g.pcie_replay_counter is None
    assert g.nvlink_errors == {}
    # older driver: clocks-event entry point missing → throttle-reasons entry point
    assert g.clock_event_names == ["sw_power_cap"]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1
    assert s.errors == {}  # NotSupported is not an error
    s.close()
    assert fake.initialised == 0


def test_unexpected_nvml_error_is_none_counted_and_logged_once(caplog):
    gpu = fk.h100()
    gpu.errors["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_GPU_IS_LOST
    s = NvmlSampler(module=fk.FakePynvml([gpu]))
    assert s.open()
    with caplog.at_level("WARNING", logger="trainguard.agent.nvml"):
        first, second = s.sample()[0], s.sample()[0]
    assert first.power_w is None and second.power_w is None
    assert first.temperature_c == 84.0  # the other readings go on
    assert s.errors == {"0:power:NVMLError_GpuIsLost": 2}
    assert len([r for r in caplog.records if "power" in r.getMessage()]) == 1


def test_lookup_pci_accepts_driver_and_nvml_spellings():
    s = NvmlSampler(module=fk.FakePynvml([fk.h100(), fk.t4()]))
    assert s.open()
    uuid_t4 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    assert s.lookup_pci("0000:af:00") == (1, uuid_t4)
    assert s.lookup_pci("PCI:0000:AF:00") == (1, uuid_t4)
    assert s.lookup_pci("00000000:AF:00.0") == (1, uuid_t4)
    assert s.lookup_pci("0000:3b:00")[0] == 0
    assert s.lookup_pci("0000:18:00") is None


def test_xid_event_set_delivers_xid_with_device():
    fake = fk.FakePynvml([fk.h100(), fk.t4(), fk.geforce()])
    s = NvmlSampler(NvmlConfig(event_wait_ms=50), module=fake)
    assert s.open()
    got, arrived = [], threading.Event()

    def cb(x):
        got.append(x)
        arrived.set()

    assert s.start_xid_watch(cb)
    # the GeForce cannot deliver XID events: it was skipped, the others registered
    assert fake.inject_xid(2, 13) == 0
    assert fake.inject_xid(1, 79) == 1
    assert arrived.wait(5.0)
    x = got[0]
    assert (x.xid, x.gpu_index, x.pci, x.gpu_instance) == (79, 1, "0000:af:00", None)
    assert x.gpu_uuid == "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    arrived.clear()
    fake.inject_xid(0, 94, gpu_instance=3)  # a MIG instance
    assert arrived.wait(5.0)
    assert (got[1].xid, got[1].gpu_index, got[1].gpu_instance) == (94, 0, 3)
    assert fake.calls["nvmlEventSetWait_v2"] >= 2
    s.close()
    assert fake._sets == {}  # event set freed
    assert s.xid_count == 2

"""Host and link telemetry rules (``detector.telemetry``) as tables, on samples in the agent's
format (``schemas.NodeTelemetry`` / ``GpuSample``), and through the detector's reducer."""
from __future__ import annotations

import math

import pytest

from trainguard import schemas
from trainguard.detector import telemetry as tel
from trainguard.detector.core import DetectorConfig, Finding
from trainguard.detector.reducer import step
from trainguard.detector.state import DetectorState
from trainguard.core.reducer import Publish, Received
from trainguard.schemas import JobRecord, subjects

CFG = DetectorConfig()
GiB = 2**30


def host(samples, latency=None):
    """Feed ``samples`` [(now, cpu %, used GiB)] of a 64 GiB host; every finding's kind."""
    win, kinds = tel.HostWindow(), []
    for now, cpu, used in samples:
        lat = latency(now) if latency else {}
        kinds += [f.kind for f in tel.host_rules(win, "n1", cpu, int(used * GiB), 64 * GiB, lat,
                                                 now, CFG, ts=int(now * 1e9))]
    return kinds


@pytest.mark.parametrize("samples,latency,expected", [
    # 63 of 64 GiB in use: the OOM killer is next
    ([(0, 10, 63.0)], None, ["host_memory_exhausted"]),
    # +0.25 GiB/s from 52 GiB: 64 GiB reached in ≈ 40 s, within the 120 s horizon
    ([(t, 10, 52 + 0.25 * t) for t in range(6)], None, ["host_memory_trend"]),
    # the same slope from 20 GiB is no pressure yet; a flat 55 GiB is no trend
    ([(t, 10, 20 + 0.25 * t) for t in range(6)], None, []),
    ([(t, 10, 55.0) for t in range(10)], None, []),
    # a slow leak (1 MiB/s at 55 GiB: 2.5 h left) is past the horizon
    ([(t, 10, 55 + t / 1024) for t in range(10)], None, []),
    # CPU saturation alone publishes nothing: it is context for a slow rank (cpu_context)
    ([(t, 99, 8.0) for t in range(8)], None, []),
    # a peer slow for 3 samples, another unreachable; the bus fine
    ([(t, 10, 8.0) for t in range(4)],
     lambda t: {"n2:29500": 0.2, "n3:29500": math.inf, "bus": 0.0004},
     ["peer_latency", "peer_unreachable"]),
    ([(t, 10, 8.0) for t in range(4)], lambda t: {"n2:29500": 0.2 if t != 1 else 0.001}, []),
])
def test_host_rules(samples, latency, expected):
    assert sorted(set(host(samples, latency))) == sorted(expected)


def gpu(links=None, replay=None, index=0, sbe=None, sbe_aggregate=None):
    return schemas.GpuSample(index=index, nvlink_errors=links or {},
                             pcie_replay_counter=replay, ecc_volatile_corrected=sbe,
                             ecc_aggregate_corrected=sbe_aggregate).model_dump()


@pytest.mark.parametrize("a,b,dt,expected", [
    (gpu({"0.replay": 10, "0.recovery": 0}), gpu({"0.replay": 13, "0.recovery": 0}), 1.0,
     ["nvlink_errors"]),
    (gpu({"0.replay": 10}), gpu({"0.replay": 11}), 1.0, []),           # within the limit
    (gpu({"3.crc_flit": 0, "3.crc_data": 0}), gpu({"3.crc_flit": 150, "3.crc_data": 60}), 1.0,
     ["nvlink_crc_rate"]),
    (gpu({"3.crc_flit": 0}), gpu({"3.crc_flit": 50}), 1.0, []),        # 50/s: replay fixes it
    (gpu(replay=100), gpu(replay=102), 10.0, ["pcie_replay_rate"]),    # 12 per minute
    (gpu(replay=100), gpu(replay=101), 10.0, []),                      # 6 per minute
    # corrected ECC errors: 30 per minute is a degrading memory, 6 per minute is not yet
    (gpu(sbe=40), gpu(sbe=45), 10.0, ["ecc_corrected_rate"]),
    (gpu(sbe=40), gpu(sbe=41), 10.0, []),
    (gpu(sbe=40), gpu(sbe=0), 10.0, []),                                # a driver reload
    (gpu(sbe_aggregate=7), gpu(sbe_aggregate=9), 1.0, ["ecc_corrected_rate"]),  # no volatile
])
def test_link_rate_rules(a, b, dt, expected):
    win = tel.HostWindow()
    assert tel.link_rules(win, "n1", [a], 100.0, CFG) == []           # the first sample
    found = tel.link_rules(win, "n1", [b], 100.0 + dt, CFG)
    assert [f.kind for f in found] == expected
    for f in found:
        row = tel.RULES[f.kind]
        assert f.severity == "warning" and f.fault_class == row.fault_class
        assert f.gpus == ["n1:0"] and f.detail["why"] == row.why


def test_every_rule_row_has_a_reason_and_is_a_warning():
    assert set(tel.RULES) == {"host_memory_exhausted", "host_memory_trend", "cpu_saturated",
                              "peer_latency", "peer_unreachable", "nvlink_errors",
                              "nvlink_crc_rate", "pcie_replay_rate", "ecc_corrected_rate"}
    for r in tel.RULES.values():
        assert r.why and r.layer and r.fault_class
    win = tel.HostWindow()
    [f] = tel.host_rules(win, "n1", 10, 63 * GiB, 64 * GiB, {}, 0.0, CFG)
    assert f.severity == "warning" and f.nodes == ["n1"] and f.detail["source"] == "telemetry"


def _busy(samples):
    win = tel.HostWindow()
    for t, cpu in enumerate(samples):
        tel.host_rules(win, "n", cpu, GiB, 64 * GiB, {}, float(t), CFG)
    return win


def test_cpu_saturation_runs_and_resets():
    assert _busy([99] * 5).cpu_run == 5
    assert _busy([99, 99, 99, 50, 99]).cpu_run == 1  # a dip resets the run


@pytest.mark.parametrize("nodes,busy,saturated,layer", [
    (["n1"], {"n1"}, ["n1"], "system_software"),     # the slow rank's host has no idle CPU
    (["n1"], {"n2"}, None, "unknown"),               # another host's CPU explains nothing
    (["n1"], {"n1", "n2"}, ["n1"], "system_software"),
    ([], {"n2"}, ["n2"], "unknown"),                  # no culprit: one busy host is a lead
    ([], {"n1", "n2"}, None, "unknown"),             # every host busy (one machine): no lead
    (["n1"], set(), None, "unknown"),
])
def test_cpu_context_explains_a_slow_rank(nodes, busy, saturated, layer):
    wins = {n: _busy([99 if n in busy else 10] * 6) for n in ("n1", "n2")}
    f = Finding("throughput_drop", "straggler", ranks=[1] if nodes else [], nodes=list(nodes),
                severity="warning", evidence=["slow"], detail={"layer": "unknown"})
    tel.cpu_context(f, wins, CFG)
    assert f.detail.get("cpu_saturated") == saturated
    assert f.detail["layer"] == layer
    assert len(f.evidence) == 1 + len(saturated or [])
    if saturated:
        assert "99% busy for 6 samples" in f.evidence[1]


def test_a_saturated_cpu_alone_publishes_no_anomaly():
    st = DetectorState()
    st.records["j"] = JobRecord(members=[{"rank": 0, "node": "n1", "local_rank": 0}])
    st.node_jobs = {"n1": {"j"}}
    for t in range(10):
        ev = schemas.NodeTelemetry(node="n1", cpu_percent=100.0, mem_used_bytes=GiB,
                                   mem_total_bytes=64 * GiB)
        _, eff = step(st, Received(subjects.node("n1", "telemetry"), ev, 10**18 + t), float(t))
        assert not [e for e in eff if isinstance(e, Publish)]


def test_the_reducer_publishes_host_findings_to_the_jobs_on_the_node():
    st = DetectorState()
    st.records["j"] = JobRecord(members=[{"rank": 0, "node": "n1", "local_rank": 0},
                                         {"rank": 1, "node": "n2", "local_rank": 0}])
    st.node_jobs = {"n1": {"j"}, "n2": {"j"}}
    ev = schemas.NodeTelemetry(node="n1", cpu_percent=12.0, mem_used_bytes=63 * GiB,
                               mem_total_bytes=64 * GiB, net_latency_s={"n2:29500": 0.0003})
    _, eff = step(st, Received(subjects.node("n1", "telemetry"), ev, 10**18), 1.0)
    pubs = [e for e in eff if isinstance(e, Publish)]
    assert [p.subject for p in pubs] == ["tg.node.n1.anomaly", "tg.job.j.anomaly"]
    a = pubs[1].event
    assert (a.kind, a.fault_class, a.severity, a.culprit.ranks) == (
        "host_memory_exhausted", "oom_host", "warning", [0])

"""What the detector keeps per node, rank and job is bounded by what its rules read, whatever a
sender names: hostile roles, peers and GPU indices are not kept, and a ring of step times grows
only with the steps reported (bench/fuzz.py's hostile senders)."""
from __future__ import annotations

import math

import pytest

from trainguard.detector import telemetry as tel
from trainguard.detector.rules import (DetectorConfig, JobState, NodeState, RankState,
                                       observe_heartbeat, telemetry_rule)
from trainguard.detector.signals import NODE_ROLES, observe_node_heartbeat

CFG = DetectorConfig()
GiB = 2**30


@pytest.mark.parametrize("role,kept", [("agent", True), ("launcher", True), ("", False),
                                        ("é☃𝄞", False), ("a" * 300, False), ("Agent", False)])
def test_node_keeps_only_the_roles_its_rules_read(role, kept):
    ns = NodeState("n1")
    observe_node_heartbeat(ns, role, 1.0)
    assert (role in ns.last) is kept
    assert set(ns.last) <= NODE_ROLES


def test_a_stream_of_new_role_names_keeps_nothing():
    ns = NodeState("n1")
    observe_node_heartbeat(ns, "agent", 1.0)
    for i in range(1000):
        observe_node_heartbeat(ns, f"role-{i}", 2.0 + i)
    assert ns.last == {"agent": 1.0}


def test_peer_latency_runs_are_kept_for_slow_peers_of_the_last_sample():
    win = tel.HostWindow()
    for i in range(50):  # a sender naming new peers in each sample
        tel.host_rules(win, "n1", 1.0, GiB, 64 * GiB, {f"p{i}": 0.001, f"q{i}": 0.001}, i, CFG)
    assert win.lat_runs == {}
    found = []
    for i in range(3):
        found += tel.host_rules(win, "n1", 1.0, GiB, 64 * GiB, {"slow": 0.5, "gone": math.inf,
                                                                 "fine": 0.001}, 100 + i, CFG)
    assert win.lat_runs == {"slow": 3, "gone": 3}
    assert sorted(f.kind for f in found) == ["peer_latency", "peer_unreachable"]
    tel.host_rules(win, "n1", 1.0, GiB, 64 * GiB, {"slow": 0.001}, 200, CFG)
    assert win.lat_runs == {}


def test_gpu_counters_are_kept_for_the_gpus_of_the_last_sample():
    win, ns = tel.HostWindow(), NodeState("n1")
    for i in range(20):
        gpus = [{"index": 0, "pcie_replay_counter": 1}, {"index": 2**62 - i, "xid": 1}]
        tel.link_rules(win, "n1", gpus, float(i), CFG)
        telemetry_rule(ns, gpus, CFG)
    assert set(win.gpu_prev) == {0, 2**62 - 19}
    assert set(ns.gpu_prev) == {0, 2**62 - 19}
    assert set(ns.thermal_run) <= {0, 2**62 - 19}


def test_counter_rise_between_two_samples_still_found():
    win = tel.HostWindow()
    a = {"index": 0, "nvlink_errors": {"0.replay": 0}}
    b = {"index": 0, "nvlink_errors": {"0.replay": 10}}
    assert tel.link_rules(win, "n1", [a], 1.0, CFG) == []
    assert [f.kind for f in tel.link_rules(win, "n1", [b], 2.0, CFG)] == ["nvlink_errors"]


def test_step_time_rings_grow_with_the_steps_reported():
    job = JobState("j", window=8)
    assert len(job.times) == 0
    rs = observe_heartbeat(job, 0, "n1", 0, 0, -1, 0, "startup", None, 1.0, CFG)
    assert len(rs.times) == 0 and len(job.times) == 0  # no step yet: nothing kept
    for i in range(20):
        job.add_time(float(i))
        rs.add_time(float(i))
    assert list(job.times) == [16.0, 17.0, 18.0, 19.0, 12.0, 13.0, 14.0, 15.0]
    assert job.n_times == 20
    assert rs.recent(3) == [19.0, 18.0, 17.0]
    small = RankState(1, ring=16)
    small.add_time(0.5)
    small.add_time(0.25)
    assert small.recent(5) == [0.25, 0.5]

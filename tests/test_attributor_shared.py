"""One shared cause blamed once (``attributor.shared``, rule 7 of ``attributor.decide``): the
same signature from many nodes of many jobs within a minute is the layer they share; what
they have in common that the others lack is named; the remediator takes no node out. Pure."""
from __future__ import annotations

import pytest

from trainguard import schemas
from trainguard.attributor import shared
from trainguard.attributor.decide import AttributorConfig, decide, history_from_records
from trainguard.remediator import policy as pol
from trainguard.schemas import JobRecord

ATTRS = {**{f"n{i}": {"driver": "550.54", "rack": f"r{i % 4}", "image": "img-7"}
            for i in range(6)},
         **{f"n{i}": {"driver": "535.10", "rack": f"r{i % 4}", "image": "img-7"}
            for i in range(6, 10)}}


@pytest.mark.parametrize("affected,expected", [
    ({"n0", "n1", "n2", "n3"}, {"driver": "550.54"}),     # image is everyone's; racks differ
    ({"n0", "n4"}, {"driver": "550.54", "rack": "r0"}),   # n8 in r0 too, but 535: rack stays
    ({"n0", "n6"}, {}),                                   # nothing in common but the image
    ({"n0"}, {}),                                          # one node says nothing shared
])
def test_common_attributes(affected, expected):
    assert shared.common_attributes(affected, ATTRS) == expected


@pytest.mark.parametrize("recent,expected_layer", [
    ({"n0": {"a"}, "n1": {"b"}, "n2": {"a"}, "n3": {"c"}}, "system_software"),  # driver
    ({"n0": {"a"}, "n1": {"a"}, "n2": {"a"}, "n3": {"a"}}, None),   # one job: its own
    ({"n0": {"a"}, "n1": {"b"}, "n2": {"a"}}, None),                 # three nodes: chance
])
def test_shared_cause_needs_many_nodes_of_many_jobs(recent, expected_layer):
    got = shared.shared_cause("gpu_xid", "gpu_xid|gpu_fault|xid=79", recent, ATTRS, 60, 4, 2)
    assert (got["layer"] if got else None) == expected_layer
    if got:
        assert got["common"] == {"driver": "550.54"} and got["count"] == 4 and got["jobs"] == 3


def test_without_a_naming_attribute_the_fault_class_says_the_layer():
    recent = {"m0": {"a"}, "m1": {"b"}, "m2": {"a"}, "m3": {"b"}}
    got = shared.shared_cause("filesystem", "fs", recent, {}, 60, 4, 2)
    assert got["layer"] == "infrastructure" and got["common"] == {}


def xid_anomaly(node: str, job: str = "j") -> schemas.Anomaly:
    return schemas.Anomaly(job=job, kind="gpu_fault", fault_class="gpu_xid", first_ts=100,
                           culprit=schemas.Culprit(nodes=[node]), detail={"xid": 79},
                           evidence=[f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen "
                                     f"off the bus"], generation=0)


def test_a_shared_xid_is_blamed_on_the_driver_and_takes_no_node_out():
    a = xid_anomaly("n3")
    sig = schemas.vocabulary.signature(a)
    recent = [("j", "n0"), ("k", "n1"), ("l", "n2")]
    hist = history_from_records("j", {}, [], None, 0, recent_pairs=recent, node_attrs=ATTRS)
    spec = decide([a], hist, AttributorConfig())
    cause = spec.detail["shared_cause"]
    assert spec.layer == "system_software" and cause["common"] == {"driver": "550.54"}
    assert cause["nodes"] == ["n0", "n1", "n2", "n3"] and cause["signature"] == sig
    assert any("shared cause" in n for n in spec.detail["notes"])
    v = schemas.Verdict(job="j", **{k: spec.to_dict()[k] for k in (
        "fault_class", "layer", "culprit", "detail", "first_ts", "generation")})
    rec = JobRecord(mode="action", world_size=2, members=[
        {"rank": 0, "node": "n3", "local_rank": 0}, {"rank": 1, "node": "n9", "local_rank": 0}])
    d = pol.decide(v, rec)
    assert d.action == "restart_workers" and d.ranks == [0] and d.members == []
    assert d.held["by"] == "shared_cause" and d.held["action"] == "exclude_node_and_requeue"
    assert "driver=550.54" in d.reason


def test_one_node_alone_is_still_its_own_fault():
    spec = decide([xid_anomaly("n3")], history_from_records("j", {}, [], None, 0,
                                                             recent_pairs=[("k", "n1")]))
    assert "shared_cause" not in spec.detail and spec.layer == "hardware"

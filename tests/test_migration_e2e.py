"""End to end on the embedded stack: a node that is degrading — its GPU's corrected ECC count
rising, its memory being filled by a real process — has its ranks moved to a registered spare
node in a planned migration, before any rank dies, with nothing rolled back.

The nodes are simulated on one machine (``Stack(sim_dir=...)``): each agent reads its GPU through
the demo's simulated NVML (the lowest seam: a ``pynvml`` stand-in whose corrected ECC counter
the test makes rise), and its memory as a share of the host (``agents.host.NodeMemory``: the
anonymous resident memory of the processes started for the node, real ``/proc`` readings,
against the node's budget). The fill is a real process (``trainguard.demo.fill``) started for
node1 that allocates and touches what the node's budget leaves (a quarter of it, at most
384 MiB) and exits by itself.
"""
from __future__ import annotations

import pytest

from test_recovery_e2e import _tried

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator", "checkpoint_validator"),
               agent_nodes=("node0", "node1"), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs), sim_dir=str(tmp_path_factory.mktemp("sim")))
    st.start(timeout=120)
    yield st
    st.stop()


def _migrated(rep, root_kinds):
    """The fault's row, checked to be a planned migration of node1 to the spare node that
    lost nothing: every rank trained on from the step it held."""
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["verdict"]["culprit_nodes"] == ["node1"], f["verdict"]
    d = f["decision"]
    assert d["action"] == "exclude_node_and_requeue" and d["nodes"] == ["node1"], d
    assert d["ranks"] == [2, 3] and d["world_size"] == 4, d  # the spare took both ranks
    assert d["reason"].startswith("planned migration"), d["reason"]
    assert any(k in d["reason"] for k in root_kinds), d["reason"]
    # before any rank died: the migration is the job's first recovery, not a reply to a crash
    recoveries = [x for x in rep["decisions"] if x["action"] != "none"]
    assert recoveries[0]["reason"] == d["reason"], recoveries
    # the surviving ranks handed their state over: nothing rolled back, nothing reloaded
    assert f["path"] == "peer" and f["steps_rolled_back"] == 0, f
    assert f["resumed_step"] == f["restored_step"] + 1, f
    assert rep["accuracy"] is not None
    assert abs(rep["accuracy"] - rep["baseline_accuracy"]) <= 0.01
    return f


def test_a_gpu_whose_corrected_ecc_count_rises_moves_its_node_to_the_spare(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-ecc-migrate",
                 [{"id": 1, "kind": "ecc_degrading", "node": 1, "step": 40, "per_s": 5}],
                 steps=200, spare_nodes=1)
    f = _migrated(rep, ["ecc_corrected_rate"])
    assert f["verdict"]["fault_class"] == "ecc" and f["verdict"]["layer"] == "hardware"


def test_a_process_filling_a_nodes_memory_moves_the_node_to_the_spare(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-mem-migrate",
                 [{"id": 1, "kind": "memory_fill", "node": 1, "step": 40, "rate": 64}],
                 steps=400, spare_nodes=1)
    f = _migrated(rep, ["host_memory_trend", "host_memory_exhausted"])
    assert f["verdict"]["fault_class"] == "oom_host", f["verdict"]
    # the node's own processes were measured (its ranks and warm spare), and the fill had to
    # add memory before anything fired: the budget began below the trend rule's floor
    assert f["used_mib"] > 100 and f["used_mib"] / f["budget_mib"] < 0.8, f

"""Node failover on a real cluster on one machine (``trainguard.cluster``): every node its own
network and UTS namespace on a private bridge, the control plane on the host side, ranks of
different nodes talking over the bridge; faults are real — a node powered off (every process
SIGKILLed, link down), a node cut off (its veth down) and healed.

Needs CAP_NET_ADMIN (root here); elsewhere these tests skip and say why. Each one starts a job
of 2 nodes × 2 ranks with a spare node, so it takes tens of seconds on 2 cores.
"""
from __future__ import annotations

import ipaddress
import os
import re
import time
import warnings

import pytest
from cluster_helpers import audit, wait_for

from trainguard.cluster import net as cnet

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    cnet.unavailable_reason() is not None,
    reason=f"no network namespaces here: {cnet.unavailable_reason()}")]

CKPT_EVERY = 5
STEPS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainguard.cluster import Cluster, ClusterConfig

    # logs, step records and checkpoints stay in pytest's temporary directory (kept for the
    # last runs) to look at after a failure
    c = Cluster(ClusterConfig(nodes=3, run_dir=str(tmp_path_factory.mktemp("cluster")))).start()
    try:
        yield c
    finally:
        c.stop()
        left = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
        assert not [n for n in left if c.net.tag in n]


def _args(c, job):
    return ["--records", c.records_dir(job), "--steps", str(STEPS), "--ckpt-every",
            str(CKPT_EVERY), "--step-sleep", "0.05"]




def _exclusion(c, job):
    return next((r for r in audit(c, job) if r.get("type") == "decision"
                 and r.get("action") == "exclude_node_and_requeue"), None)


def _schedule(tmp_path, text):
    from trainguard.core import fault_schedule

    path = tmp_path / "faults.yaml"
    path.write_text(text)
    return fault_schedule.load(str(path))


def _check_resumed(recs, fault_s, again, lost_node):
    """Every rank of the new generation started at the step after one that every old rank had
    completed — a checkpoint's, or the one the survivors still held (recovery from healthy
    peers: nothing rolled back) — and the lost node trained no more.

    "Completed" is read from the old generation's records, not from those stamped before
    ``fault_s``: the fault's time is taken just before the link goes down, as soon as the
    trigger rank's record of its step is seen, and the other ranks record the same step (whose
    collectives completed before the fault) a few ms later — a partitioned node's ranks are
    alive and write on. Comparing with ``fault_s`` failed the partition trial whenever a rank's
    record of the trigger step landed after it: a resume after that step, which every rank had
    completed, was taken for one from beyond the common step."""
    old = [r for r in recs if r["gen"] < again["gen"]]
    last_common = min(max(r["step"] for r in old if r["rank"] == k)
                      for k in {r["rank"] for r in old})
    resumed = [r for r in recs if r["gen"] == again["gen"]]
    starts = {k: min(r["step"] for r in resumed if r["rank"] == k) for k in range(again["world"])}
    assert len(set(starts.values())) == 1, starts  # every rank at the same step
    held = min(max(r["step"] for r in old if r["rank"] == k)
               for k in {r["rank"] for r in old if r["host"] != lost_node})
    s0 = again["first_step"]
    assert ((s0 - 1) % CKPT_EVERY == 0 or s0 - 1 == held) and s0 - 1 <= last_common, (
        s0, last_common, held)
    assert s0 - 1 >= last_common - 2 * CKPT_EVERY, (s0, last_common)
    assert not [r for r in recs if r["host"] == lost_node and r["t"] > fault_s + 0.5]


def test_power_off_moves_the_ranks_to_the_spare_node(cluster, tmp_path):
    """Tried once more (a new job) when the first try fails, as tests/test_recovery_e2e.py's
    ``_tried``: the first failure is reported as a warning with every launcher's log, and two
    failures in a row fail the test (seen once in CI on a loaded machine: no rank trained
    again within 60 s, with only node0's log kept to say why)."""
    try:
        _power_off_trial(cluster, tmp_path / "try1", "c-off")
    except AssertionError as first:
        warnings.warn(f"c-off: first try failed, retrying: {str(first)[-12000:]}")
        _power_off_trial(cluster, tmp_path / "try2", "c-off-2")


def _logs(c, job):
    return "\n".join(f"--- {n} ---\n{c.launcher_log(job, n)[-3000:]}"
                     for n in ("node0", "node1", "node2"))


def _power_off_trial(c, tmp_path, job):
    from trainguard.cluster import FaultRunner, training_again

    tmp_path.mkdir(parents=True, exist_ok=True)
    faults = _schedule(tmp_path, "faults:\n  - {kind: power-off, node: node1, step: 10, "
                                 "rank: 3}\n")
    t0 = time.time()
    procs = c.launch(job, ["node0", "node1"], ["node2"], 2, script_args=_args(c, job))
    ok = False
    runner = FaultRunner(c, job, faults)
    runner.start()
    try:
        assert wait_for(lambda: runner.fired, 150, 0.05), _logs(c, job)
        fault_s = runner.fired[0]["ts"]
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again, _logs(c, job)
        print(f"power-off: launch → fault {fault_s - t0:.1f} s, fault → every rank training "
              f"again {again['t'] - fault_s:.2f} s")
        # the spare node took node1's ranks: the world kept its size
        assert again["world"] == 4 and again["hosts"] == ["node0", "node2"], again
        recs = c.steps(job)
        _check_resumed(recs, fault_s, again, "node1")
        excl = _exclusion(c, job)
        assert excl and excl["nodes"] == ["node1"], audit(c, job)
        # ranks talked over the bridge, never loopback: every peer is on the bridge's subnet
        subnet = ipaddress.ip_network(c.net.subnet)
        peers = [p for r in recs for p in r.get("peers", [])]
        assert peers and all(ipaddress.ip_address(p.split(":")[0]) in subnet for p in peers)
        assert {r["host"] for r in recs} == {"node0", "node1", "node2"}
        assert wait_for(lambda: os.path.exists(os.path.join(c.records_dir(job), "done.json")), 60)
        ok = True
    finally:
        runner.cancel()
        if not ok:  # a failed try leaves no launcher behind for the next
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        c.net.power_on("node1")  # an empty node again, for the next test
        c.start_agent("node1")


def test_partition_excludes_the_node_and_fences_its_ranks(cluster, tmp_path):
    from trainguard.cluster import FaultRunner, training_again

    c, job = cluster, "c-part"
    heal = 14.0  # longer than the launcher's lease (10 s): by then it has fenced itself
    faults = _schedule(tmp_path, f"- {{kind: partition, node: 1, step: 10, rank: 3, "
                                 f"heal_after_s: {heal}}}\n")
    t0 = time.time()
    procs = c.launch(job, ["node0", "node1"], ["node2"], 2, script_args=_args(c, job))
    runner = FaultRunner(c, job, faults)
    runner.start()
    try:
        assert wait_for(lambda: runner.fired, 150, 0.05), c.launcher_log(job, "node0")[-3000:]
        fault_s = runner.fired[0]["ts"]
        again = wait_for(lambda: training_again(c.steps(job), fault_s), 60)
        assert again and again["hosts"] == ["node0", "node2"], again
        print(f"partition: launch → fault {fault_s - t0:.1f} s, fault → every rank training "
              f"again {again['t'] - fault_s:.2f} s")
        excl = _exclusion(c, job)
        assert excl and excl["nodes"] == ["node1"], audit(c, job)
        excluded_s = excl["ts"] / 1e9
        # cut off, node1's launcher cannot renew its lease: it stops its ranks and exits
        assert procs["node1"].wait(30) == 1
        assert "fenced" in c.launcher_log(job, "node1")
        assert wait_for(lambda: runner.fired[0]["end"], heal + 10), runner.fired
        time.sleep(2.0)  # healed: anything left of the old ranks would act now
        left = [p for p in c.net.pids("node1")
                if p not in (c.net.node("node1").init.pid, c.agents["node1"].pid)]
        assert not left, [open(f"/proc/{p}/cmdline").read() for p in left]
        recs = c.steps(job)
        _check_resumed(recs, fault_s, again, "node1")
        # nothing of the old generation was written into the checkpoint directory after the
        # exclusion (the new generation's checkpoints are named _g<generation>)
        late = []
        for root, _, files in os.walk(c.ckpt_dir(job)):
            for f in files:
                p = os.path.join(root, f)
                gen = re.search(r"step_\d+_g(\d+)", p)
                if os.path.getmtime(p) > excluded_s and (gen is None
                                                         or int(gen.group(1)) < again["gen"]):
                    late.append(p)
        assert not late, late
        assert wait_for(lambda: os.path.exists(os.path.join(c.records_dir(job), "done.json")), 60)
    finally:
        runner.cancel()
        c.net.heal("node1")

"""End to end: a training pod lost on a healthy node is replaced, not its node cordoned.

A real stack (NATS, Valkey, rendezvous store, an agent on each of the dotted nodes
``ip-10-0-1-2.ec2.internal`` and ``ip-10-0-1-3.ec2.internal``, detector, attributor, remediator
with ``TG_NODE_CONTROLLER=kubernetes`` and a kubeconfig for the API emulator), and a real
2-node ``trainguard launch`` of a gloo job (``tests/fixtures/k8s/train_drain.py``), one launcher
per node as one pod per node would run it. The test freezes the second pod (SIGSTOP of its
launcher and rank: a wedged pod; its node's agent goes on) and asserts, on what happened:

* the remediator decided ``restart_workers`` for that pod's rank and node, and the node
  controller deleted that one pod through the API (the emulator received the DELETE) without
  cordoning, labelling or evicting anything;
* when the deletion lands, the test does what the kubelet and the JobSet's Job do (kill the
  old pod's processes, start a new pod's ``trainguard launch`` on the node), and both ranks
  train again in the decision's generation.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from k8s_fixtures.emulator import cluster
from k8s_fixtures.jobs import events as _events
from k8s_fixtures.jobs import launch
from k8s_fixtures.jobs import records as _records

pytestmark = pytest.mark.slow

NODES = ("ip-10-0-1-2.ec2.internal", "ip-10-0-1-3.ec2.internal")


def _pod(stack, job: str, tmp: Path, node_rank: int, name: str):
    """The training pod of node ``NODES[node_rank]``: 2 nodes × 1 rank."""
    return launch(stack, job, tmp, name, NODES[node_rank], nnodes=2, nproc_per_node=1,
                  node_rank=node_rank)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def test_a_wedged_pod_is_deleted_and_replaced_and_its_node_stays_in_service(tmp_path):
    from trainguard.stack.local import Stack

    job = f"pod-{uuid.uuid4().hex[:6]}"
    rec = tmp_path / "rec"
    procs: list[subprocess.Popen] = []
    seen: dict = {}
    logs = tmp_path / "stack-logs"
    logs.mkdir()

    async def scenario() -> None:
        async with cluster() as c:
            for n in NODES:
                c.add_node(n)
            c.add_pod(f"{job}-workers-0-0", NODES[0], job, created="2020-01-01T00:00:00Z")
            c.add_pod(f"{job}-workers-0-1", NODES[1], job, created="2020-01-01T00:00:00Z")
            kc = c.kubeconfig(tmp_path / "kubeconfig")
            st = Stack(services=("agent", "detector", "attributor", "remediator"),
                       agent_nodes=NODES, rendezvous=True, log_dir=str(logs),
                       kernel_log_dir=str(logs),
                       env={"TG_NODE_CONTROLLER": "kubernetes", "KUBECONFIG": str(kc)})
            seen["stack"] = st
            # started from this thread: its children die with the thread that spawned them
            # (PR_SET_PDEATHSIG), and the emulator needs not answer while they start
            st.start(timeout=120)
            p0, log0 = _pod(st, job, tmp_path, 0, "pod0")
            p1, log1 = _pod(st, job, tmp_path, 1, "pod1")
            procs.extend([p0, p1])
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # both ranks training
                if {r["rank"] for r in _records(rec) if r["step"] >= 10} == {0, 1}:
                    break
                assert p0.poll() is None and p1.poll() is None, (
                    log0.read_text()[-2000:] + log1.read_text()[-2000:])
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the job did not train:\n" + log0.read_text()[-2000:]
                            + log1.read_text()[-2000:])
            seen["fault_ns"] = time.time_ns()
            _signal(p1, signal.SIGSTOP)  # the pod is wedged: launcher, rank and spare
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and not c.requests("DELETE"):
                await asyncio.sleep(0.05)
            seen["delete_ns"] = time.time_ns()
            seen["deletes"] = [r.url.path for r in c.requests("DELETE")]
            assert seen["deletes"], "no pod was deleted:\n" + log0.read_text()[-3000:]
            # the kubelet kills the old pod's processes, the Job starts a new pod on the node
            _signal(p1, signal.SIGKILL)
            _signal(p1, signal.SIGCONT)
            p1.wait(10)
            c.add_pod(f"{job}-workers-0-1-b", NODES[1], job, created="2030-01-01T00:00:00Z")
            p2, log2 = _pod(st, job, tmp_path, 1, "pod1-new")
            procs.append(p2)
            t1 = time.monotonic()
            while time.monotonic() - t1 < 120:  # both ranks training again
                later = [r for r in _records(rec) if r["t_ns"] > seen["delete_ns"]]
                if {r["rank"] for r in later} == {0, 1}:
                    break
                assert p0.poll() is None and p2.poll() is None, (
                    log0.read_text()[-2000:] + log2.read_text()[-2000:])
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the job did not train again:\n" + log0.read_text()[-2000:]
                            + log2.read_text()[-2000:])
            seen["resumed_ns"] = time.time_ns()
            seen["patches"] = [r.url.path for r in c.requests("PATCH")]
            seen["evictions"] = list(c.evictions)
            seen["pods"] = [c.pod_exists("train", f"{job}-workers-0-0"),
                            c.pod_exists("train", f"{job}-workers-0-1-b")]

    try:
        asyncio.run(scenario())
        st = seen["stack"]
        assert seen["deletes"] == [f"/api/v1/namespaces/train/pods/{job}-workers-0-1"]
        assert seen["patches"] == [] and seen["evictions"] == []  # no cordon, label, eviction
        assert seen["pods"] == [True, True]                       # the others are untouched
        ds = [d for d in _events(st, job, "decision") if d["execute"]]
        assert ds and ds[0]["action"] == "restart_workers", ds
        assert ds[0]["nodes"] == [NODES[1]] and ds[0]["ranks"] == [1], ds[0]
        assert "launcher_lost" in ds[0]["reason"] and "JobSet" in ds[0]["reason"]
        assert not [d for d in ds if d["action"] == "exclude_node_and_requeue"], ds
        ars = [a for a in _events(st, job, "action")
               if a.get("executor") == "controller:kubernetes"]
        assert ars and ars[0]["ok"] and ars[0]["node"] == NODES[1], ars
        f = seen["fault_ns"]
        print(f"pod restart: wedge -> pod deleted {(seen['delete_ns'] - f) / 1e9:.2f} s, "
              f"-> both ranks training again {(seen['resumed_ns'] - f) / 1e9:.2f} s "
              f"(the new pod's launcher waits out the old lease, at most 10 s)")
    finally:
        for p in procs:
            _signal(p, signal.SIGKILL)
            _signal(p, signal.SIGCONT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if "stack" in seen:
            seen["stack"].stop()

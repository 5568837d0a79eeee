"""A process that builds a cluster (``trainguard.cluster``, as ``bench/cluster.py`` does) and is
stopped by SIGTERM or SIGINT leaves nothing on the host: no network namespace, veth or bridge of
its own, and none of the processes it started (nats-server, valkey, the services, slurmctld,
the slurmds, the nodes' processes) alive.

Needs CAP_NET_ADMIN, iproute2 and Slurm (root here); elsewhere it skips and says why.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from trainguard.cluster import net as cnet

WHY = cnet.unavailable_reason() or (None if shutil.which("slurmctld") and shutil.which("slurmd")
                                    else "Slurm (slurmctld, slurmd) is not installed")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"cannot build "
                                                   f"the cluster here: {WHY}")]

# The child: a cluster (with Slurm when its argument says so), a process of its own on node1,
# then it waits to be stopped.
CHILD = r"""
import json, sys, time
from trainguard.cluster import Cluster, ClusterConfig
from trainguard.cluster.harness import stop_on_signals
stop_on_signals()
c = Cluster(ClusterConfig(nodes=2, slurm=sys.argv[1] == "slurm", services=("detector",)))
with c:
    c.net.popen("node1", ["sleep", "1000"])
    print(json.dumps({"tag": c.net.tag}), flush=True)
    while True:
        time.sleep(0.2)
"""


def _tree(root: int) -> dict[int, str]:
    """``root``'s descendants (pid → process name, with its start time to tell a reused pid)."""
    kids: dict[int, list[int]] = {}
    info: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append(int(d))
        info[int(d)] = f"{name}@{rest[19]}"
    out, todo = {}, [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out[k] = info[k]
            todo.append(k)
    return out


def _alive(procs: dict[int, str]) -> dict[int, str]:
    now = {}
    for pid, ident in procs.items():
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        if f"{stat[stat.index('(') + 1:stat.rindex(')')]}@{rest[19]}" == ident \
                and rest[0] != "Z":
            now[pid] = ident
    return now


def _ours(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [x for x in ns.split() if tag in x] + [
        ln.split(":")[1].strip() for ln in links.splitlines() if tag in ln]


@pytest.mark.parametrize("sig, slurm", [(signal.SIGTERM, True), (signal.SIGINT, False)])
def test_a_signal_mid_run_leaves_nothing(sig, slurm, tmp_path):
    p = subprocess.Popen([sys.executable, "-c", CHILD, "slurm" if slurm else "-"],
                         stdout=subprocess.PIPE,
                         stderr=open(tmp_path / "child.err", "wb"), text=True)
    try:
        line = p.stdout.readline()
        assert line, f"the cluster did not start: {open(tmp_path / 'child.err').read()[-2000:]}"
        tag = json.loads(line)["tag"]
        procs = _tree(p.pid)
        names = {v.split("@")[0] for v in procs.values()}
        # what must be stopped is there to stop (else the test could not fail)
        assert {"nats-server", "sleep"} <= names, names
        assert not slurm or {"slurmctld", "slurmd"} <= names, names
        assert any(n.startswith("valkey") for n in names), names
        assert len(_ours(tag)) >= 5  # 2 namespaces, 2 veths, the bridge
        p.send_signal(sig)
        rc = p.wait(120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 128 + sig
    deadline = time.monotonic() + 10  # SIGTERMed children may take a moment to go
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(procs) == {}
    assert _ours(tag) == []

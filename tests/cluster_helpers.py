"""Helpers the cluster end-to-end tests share (tests/test_cluster_e2e.py, test_cluster_slurm.py)."""
from __future__ import annotations

import asyncio
import time

import pytest


def wait_for(fn, timeout: float, every: float = 0.1):
    """``fn()`` once it is truthy, polling every ``every`` s for ``timeout`` s; else its last
    value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    return fn()


def audit(c, job: str) -> list[dict]:
    """The audit trail of ``job`` in the cluster ``c``'s state store."""
    from trainguard.clients.store import StateStore

    async def _q():
        st = StateStore(c.stack.redis_url)
        try:
            return await st.audit_trail(job)
        finally:
            await st.close()

    return asyncio.run(_q())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A 2-node Slurm (slurmctld + a slurmd per namespaced node) for one test module."""
    from trainguard.cluster.net import ClusterNet
    from trainguard.cluster.slurm import SlurmCluster

    net = ClusterNet(2).start()
    s = None
    try:
        s = SlurmCluster(net, str(tmp_path_factory.mktemp("slurm"))).start()
        yield s
    finally:
        if s is not None:
            s.stop()
        net.stop()

"""Readmission of a drained node against a real Slurm (``trainguard.cluster.slurm``: slurmctld
on the host, a slurmd in each of 2 node namespaces) and a real Valkey: the canary program runs
on the node through ``srun`` inside trainguard's reservation; a compute fault injected on that
node keeps it drained with the canary's evidence as the reason; a passing canary returns it (on
probation); excluded again while on probation it is a repeat offender, kept drained without a
canary, the evidence in the drain reason and the state store; a readmit interrupted inside the
canary window is picked up by the next; an operator's drain is left alone; the decayed score of
a month later lets the canary decide again.

Skips, saying why, without CAP_NET_ADMIN or without Slurm. About 30 s (three canaries).
"""
from __future__ import annotations

import time

import pytest

from trainguard.cluster import net as cnet
from trainguard.cluster.slurm import slurm_unavailable_reason

from cluster_helpers import slurm  # noqa: F401 - the module's Slurm cluster fixture

pytestmark = [pytest.mark.skipif(cnet.unavailable_reason() is not None,
                                 reason=f"no network namespaces: {cnet.unavailable_reason()}"),
              pytest.mark.skipif(slurm_unavailable_reason() is not None,
                                 reason=str(slurm_unavailable_reason()))]


def _state(slurm, node: str) -> str:
    """sinfo's state without its flags (``*``: not responding for a moment after a resume)."""
    return slurm.node_states()[node].rstrip("*~#")


def _reservations(slurm) -> str:
    return slurm.run("scontrol", "show", "reservation", check=False)


async def test_a_drained_node_returns_only_after_its_canary_passes(slurm, redis_db,
                                                                    monkeypatch):
    from trainguard.scheduler.base import LOCAL_CANARY
    from trainguard.schemas import JobSettings
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TG_CANARY_FAIL", raising=False)
    st = StateStore(redis_db)
    for job in ("ja", "jb"):
        await st.register_settings(job, JobSettings(mode="action"))
    ctl = SlurmController(st, SlurmConfig(canary_cmd=[*LOCAL_CANARY, "--timeout", "40"],
                                          canary_timeout_s=120))

    assert (await ctl.exclude("node1", "ja", "xid 79 on node1")).ok
    assert _state(slurm, "node1") == "drained"
    # the canary runs on node1 itself (srun), where a compute fault is injected
    monkeypatch.setenv("TG_CANARY_FAIL", "compute@node1")
    t0 = time.monotonic()
    failed = await ctl.readmit("node1")
    took = time.monotonic() - t0
    assert not failed.ok and "canary failed" in failed.detail, failed
    assert "compute" in failed.detail and "relative error" in failed.detail
    assert _state(slurm, "node1") == "drained"
    assert slurm.reasons()["node1"].startswith("trainguard: canary failed: srun on node1"), \
        slurm.reasons()
    assert "No reservations" in _reservations(slurm)
    rep = await st.reputation("node1")
    assert rep.status == "drained" and not rep.canary["ok"] and rep.offences == 2

    # the fault is elsewhere now: node1's canary passes and it returns, on probation
    monkeypatch.setenv("TG_CANARY_FAIL", "compute@node0")
    ok = await ctl.readmit("node1")
    assert ok.ok and "canary passed" in ok.detail and "allreduce" in ok.detail, ok
    assert _state(slurm, "node1") == "idle"
    assert "No reservations" in _reservations(slurm)
    rep = await st.reputation("node1")
    assert rep.status == "probation" and rep.canary["ok"]
    assert (await st.node("node1"))["status"] == "healthy"
    assert (await ctl.readmit("node1")).detail.startswith("in_service")  # idempotent

    # excluded again while on probation (another job): a repeat offender, and a readmit that
    # was killed inside the canary window (reserved, resumed) is carried on by the next one
    assert (await ctl.exclude("node1", "jb", "ecc uncorrectable on node1")).ok
    slurm.run("scontrol", "create", "reservation", "reservationname=tg-canary-node1",
              "nodes=node1", "starttime=now", "duration=UNLIMITED", "users=root",
              "flags=maint,ignore_jobs")
    slurm.run("scontrol", "update", "nodename=node1", "state=resume")
    t1 = time.monotonic()
    held = await ctl.readmit("node1")
    assert time.monotonic() - t1 < took / 2  # no canary ran
    assert not held.ok and "repeat offender" in held.detail, held
    reason = slurm.reasons()["node1"]
    assert reason.startswith("trainguard: repeat offender: score ") and "jb: ecc" in reason, reason
    assert _state(slurm, "node1") == "drained"
    assert "No reservations" in _reservations(slurm)
    rep = await st.reputation("node1")
    assert rep.status == "held" and rep.evidence[-1]["job"] == "jb"
    assert rep.evidence[-1]["why"] == "excluded again while on probation"

    # an operator's drain is not trainguard's to undo
    slurm.run("scontrol", "update", "nodename=node0", "state=drain", "reason=bios update")
    left = await ctl.readmit("node0")
    assert not left.ok and "not by trainguard" in left.detail
    assert slurm.reasons()["node0"] == "bios update"
    slurm.run("scontrol", "update", "nodename=node0", "state=resume")

    # a month later the score decayed below the threshold: the canary decides again
    monkeypatch.delenv("TG_CANARY_FAIL")
    later = await ctl.readmit("node1", now_ns=time.time_ns() + 30 * 86400 * 10**9)
    assert later.ok and "canary passed" in later.detail, later
    assert _state(slurm, "node1") == "idle"
    await st.close()


async def test_a_canary_srun_could_not_start_counts_no_offence(slurm, redis_db, monkeypatch):
    """``srun`` runs, but the canary program never starts on the node (here: not at that path
    there). That is the launcher's failure, not the node's: the node stays drained, the reason
    says the canary could not run, its score is what it was; the real canary then returns it."""
    from trainguard.scheduler.base import LOCAL_CANARY
    from trainguard.schemas import JobSettings
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    for k, v in slurm.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TG_CANARY_FAIL", raising=False)
    st = StateStore(redis_db)
    await st.register_settings("jc", JobSettings(mode="action"))
    bad = SlurmController(st, SlurmConfig(canary_cmd=["/nonexistent/trainguard-canary"],
                                          canary_timeout_s=60))
    assert (await bad.exclude("node0", "jc", "nccl timeout on node0")).ok
    before = await st.reputation("node0")
    res = await bad.readmit("node0")
    assert not res.ok and "canary could not run" in res.detail, res
    assert "srun did not start the canary" in res.detail, res
    assert _state(slurm, "node0") == "drained"
    assert slurm.reasons()["node0"].startswith("trainguard: canary could not run"), \
        slurm.reasons()
    assert "No reservations" in _reservations(slurm)
    after = await st.reputation("node0")
    assert (after.offences, after.score) == (before.offences, before.score) and \
        after.status == "drained", after
    good = SlurmController(st, SlurmConfig(canary_cmd=[*LOCAL_CANARY, "--timeout", "40"],
                                           canary_timeout_s=120))
    ok = await good.readmit("node0")
    assert ok.ok and "canary passed" in ok.detail, ok
    assert _state(slurm, "node0") == "idle"
    await st.close()

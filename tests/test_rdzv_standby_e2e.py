"""End to end: the rendezvous store's host dies under a running job, and the job can still
re-form. A real stack with a standby store (``Stack(rdzv_standby=True)``: ``TG_RDZV_ENDPOINT``
is ``primary,standby``), an unmodified DDP script under ``trainguard launch`` (2 ranks, action
mode); the primary store is SIGKILLed mid-run, then a rank: the group restarts, its new ranks
meet on the standby through the launcher's relay, resume from the script's snapshot and finish.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from test_dropin_e2e import FAULT_EPOCH, Run, _job, assert_resumed, decisions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator"),
               agent_nodes=("node0",), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs), rdzv_standby=True)
    st.start(timeout=120)
    yield st
    st.stop()


def test_a_job_re_forms_on_the_standby_after_the_stores_host_died(stack, tmp_path):
    primary, standby = stack.rdzv_endpoint.split(",")
    assert primary != standby and {"rendezvous", "rendezvous-standby"} <= set(stack.procs)
    run = Run(tmp_path, _job("standby"))
    try:
        node0 = run.launch(stack, ["--nnodes", "1", "--nproc-per-node", "2", "--mode",
                                   "action", "--node", "node0"], "node0")
        run.wait_epoch(2, FAULT_EPOCH, 150)
        stack.kill_service("rendezvous")  # SIGKILL: the primary store and its keys are gone
        assert stack.procs["rendezvous"].poll() is not None
        time.sleep(0.5)  # the job trains on: its groups no longer need the store
        before = run.last_before(time.time_ns())
        t_fault = time.time_ns()
        os.kill(before[1]["pid"], signal.SIGKILL)
        assert node0.wait(150) == 0, run.tails()
        first = assert_resumed(run, 2, run.last_before(t_fault), t_fault)
        # trained on between the store's death and the rank's: nothing waited on the store
        assert all(r["epoch"] >= before[r["rank"]]["epoch"] for r in first.values())
        ds = [d for d in decisions(stack, run.job) if d["execute"]]
        assert len(ds) == 1 and ds[0]["action"] == "restart_workers" and 1 in ds[0]["ranks"], ds
        log = node0.text()
        assert "using the standby at " + standby in log, run.tails()
    finally:
        run.close()


def test_a_trainguard_run_job_re_forms_in_process_on_the_standby(stack, tmp_path):
    """The demo's 1 × 2 job (``trainguard.run``): the primary store dies as rank 1 reaches step
    40, then rank 1 raises at step 60 — the ranks restart in process, their old store
    connection fails at the next generation's barrier, and they meet again on the standby."""
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo

    if stack.procs["rendezvous"].poll() is not None:  # killed by the test before
        stack.restart_service("rendezvous")  # empty again on its port, as a restarted host
    primary, standby = stack.rdzv_endpoint.split(",")

    class StoreLoss(Demo):
        def inject(self, f):
            if f.get("store_lost_at_step") is not None:
                hb = self.wait_step(f["rank"], f["store_lost_at_step"], 240)
                assert hb is not None, "the job never reached the step of the store's loss"
                self.stack.kill_service("rendezvous")
            return super().inject(f)

    cfg = DemoConfig(mode="action", job="standby-run", steps=120, nnodes=1, nproc_per_node=2,
                     faults=[{"id": 1, "kind": "exception", "rank": 1, "step": 60,
                              "store_lost_at_step": 40}],
                     run_dir=str(tmp_path), ckpt_every=10, step_sleep_s=0.01,
                     recovery_timeout_s=60, quiet=True)
    rep = StoreLoss(cfg, stack=stack).run()
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["decision"]["action"] == "restart_in_process", f
    assert stack.procs["rendezvous"].poll() is not None  # it stayed dead: the standby served
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path).rglob("*.log"))
    assert "connecting again" in logs and "using the standby at " + standby in logs, \
        sorted(str(p) for p in tmp_path.rglob("*.log"))
    # the reconnect is the recovery, not another fault: one decision, no second generation
    assert "(executing) generation 2" not in logs, logs[-4000:]

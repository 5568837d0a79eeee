"""End to end on the embedded stack: a real 4-rank gloo DDP job (2 simulated nodes × 2 ranks)
under ``trainguard launch`` in action mode recovers from injected faults without help.

These are the slow tests (tens of seconds each on 2 cores): they start real services, real
launchers with warm spares, and real training processes, and assert on what happened — the step
training resumed at, the checkpoint it restored, the verdict and decision on the bus.
"""
from __future__ import annotations

import asyncio
import os
import warnings

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator", "checkpoint_validator"),
               agent_nodes=("node0", "node1"), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs))
    st.start(timeout=120)
    yield st
    st.stop()


def _demo(stack, tmp_path, job, faults, mode="action", steps=160, **kw):
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo

    cfg = DemoConfig(mode=mode, job=job, steps=steps, faults=faults, run_dir=str(tmp_path),
                     ckpt_every=10, step_sleep_s=0.01, recovery_timeout_s=60, quiet=True, **kw)
    return Demo(cfg, stack=stack).run()


def _tried(stack, tmp_path, job, faults, ok=None, **kw):
    """Run a scenario; run it once more (new job) when ``ok(report)`` is False.

    The race that once made about 1 in 10 recoveries stall here is root-caused and fixed: a
    gloo process group whose last reference was dropped with the GIL held deadlocked the
    process (pytorch/pytorch#56297; see ``trainguard.rendezvous.store.destroy_groups``), and a save
    of an ended generation could hold the next one for the commit timeout
    (``abandon_inflight``). After the fix: 0 stalls in 60+ stressed recoveries. The second try
    stays as a guard against the shared CI machine's load; it is reported as a warning, so a
    recurrence is visible, and two failures in a row fail the test."""
    ok = ok or (lambda rep: all(f["recovered"] for f in rep["faults"]))
    rep = _demo(stack, tmp_path / "try1", job, faults, **kw)
    if ok(rep):
        return rep
    warnings.warn(f"{job}: first try failed, retrying: {rep['faults']}")
    for name in stack.dead():  # e.g. the agent of a node the first try "lost"
        stack.restart_service(name)
    return _demo(stack, tmp_path / "try2", f"{job}-2", faults, **kw)


def _checkpoints(stack, job):
    from trainguard.clients.store import StateStore

    async def _q():
        st = StateStore(stack.redis_url)
        try:
            return await st.checkpoints(job)
        finally:
            await st.close()

    return asyncio.run(_q())


def test_sigkill_resumes_from_the_survivors_state(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-kill", [{"id": 1, "kind": "sigkill", "rank": 1, "step": 60}])
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["verdict"]["culprit_ranks"] == [1]
    assert f["decision"]["action"] == "restart_workers" and f["decision"]["executed"]
    assert f["injected_ns"] < f["detected_ns"] <= f["decided_ns"] < f["resumed_ns"]
    # the survivors held the state of the step they completed and sent it to the new rank 1:
    # no checkpoint loaded, at most one step done again (tests/test_peer_recovery_e2e.py has
    # the fall-back to the validated checkpoint)
    assert f["path"] == "peer" and f["steps_rolled_back"] <= 1, f
    restored = f["restored_step"]
    assert 60 <= restored <= 90
    assert f["resumed_step"] == restored + 1  # the step after the one held, on every rank
    # the checkpoints saved meanwhile were validated
    assert any(c["status"] == "valid" for c in _checkpoints(stack, rep["job"]))
    # training finished with an accuracy close to the fault-free run of the same seed
    assert rep["accuracy"] is not None
    assert abs(rep["accuracy"] - rep["baseline_accuracy"]) <= 0.01


def test_exception_restarts_in_process(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-exc", [{"id": 1, "kind": "exception", "rank": 2,
                                              "step": 50}])
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["verdict"]["culprit_ranks"] == [2]
    assert f["verdict"]["layer"] == "application"
    assert f["decision"]["action"] == "restart_in_process"
    assert abs(rep["accuracy"] - rep["baseline_accuracy"]) <= 0.01


def test_hang_kills_the_stopped_rank_not_a_blocked_one(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-hang", [{"id": 1, "kind": "hang", "rank": 3, "step": 50}])
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["verdict"]["culprit_ranks"] == [3]
    assert f["decision"]["action"] == "restart_workers" and f["decision"]["ranks"] == [3]
    # the ranks blocked in the stopped rank's collective held the step before it: the new rank 3
    # took their state, nothing went back to the checkpoint
    assert f["path"] == "peer" and f["steps_rolled_back"] <= 1, f
    assert f["resumed_step"] == f["restored_step"] + 1, f


def test_observe_mode_executes_nothing(stack, tmp_path):
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo

    cfg = DemoConfig(mode="observe", job="e2e-observe", steps=100, run_dir=str(tmp_path),
                     faults=[], ckpt_every=10, quiet=True)
    demo = Demo(cfg, stack=stack)
    # run the job by hand: kill rank 1 and check that nobody acts on the decision
    import signal
    import time

    from trainguard import schemas
    from trainguard.demo.recorder import Recorder

    demo.log_dir = str(tmp_path)
    demo.rec = Recorder(stack.nats_url, cfg.job)
    demo.start_launchers()
    try:
        hb = demo.wait_step(1, 30, 120)
        assert hb is not None
        t0 = time.time_ns()
        os.kill(hb.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while time.time() < deadline and not demo.rec.of(schemas.Decision, t0):
            time.sleep(0.05)
        (d,) = demo.rec.of(schemas.Decision, t0)[:1]
        assert d.execute is False and d.mode == "observe"
        for p in demo.launchers:
            p.wait(30)
        # no rank was started again after the fault, and the launchers gave up
        assert not [e for e in demo.rec.of(schemas.WorkerStarted, t0)]
        assert not demo.rec.of(schemas.ActionResult, t0)
        assert any(p.returncode != 0 for p in demo.launchers)
    finally:
        demo.stop_launchers()
        demo.rec.close()


def test_xid79_on_one_node_excludes_that_node(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-xid", [{"id": 1, "kind": "xid", "xid": 79, "node": 1,
                                              "step": 50}])
    (f,) = rep["faults"]
    assert f["recovered"], f
    assert f["verdict"]["layer"] == "hardware"
    d = f["decision"]
    assert d["action"] == "exclude_node_and_requeue" and d["nodes"] == ["node1"]
    assert d["world_size"] == 2
    # training went on on node0 alone, from a checkpoint resharded onto 2 ranks
    assert f["resumed_step"] == f["restored_step"] + 1
    assert rep["accuracy"] is not None


def test_straggler_is_flagged_and_named(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-slow", [{"id": 1, "kind": "straggler", "rank": 2,
                                               "step": 40, "factor": 3}], steps=200)
    (f,) = rep["faults"]
    assert f["recovered"], f  # here: a verdict naming the slowed rank
    assert f["verdict"]["fault_class"] == "straggler"
    assert f["verdict"]["culprit_ranks"] == [2]


def test_straggler_with_a_spare_node_is_excluded_and_replaced(stack, tmp_path):
    rep = _tried(stack, tmp_path, "e2e-slow-spare", [{"id": 1, "kind": "straggler", "rank": 2,
                                                     "step": 40, "factor": 3}],
                 steps=200, spare_nodes=1)
    (f,) = rep["faults"]
    assert f["recovered"], f
    # the verdict names the slowed rank (with the throughput rule, possibly its peers too: a
    # straggler slows every rank's step); the decision excludes the slowed rank's node only
    assert f["verdict"]["fault_class"] == "straggler" and 2 in f["verdict"]["culprit_ranks"]
    d = f["decision"]
    assert d["action"] == "exclude_node_and_requeue" and d["nodes"] == ["node1"], d
    assert d["world_size"] == 4  # the spare node took the slow node's ranks
    assert f["resumed_step"] == f["restored_step"] + 1
    assert rep["accuracy"] is not None


def test_a_job_launched_again_under_its_name_is_a_new_run(stack, tmp_path):
    """Resuming by launching the same job again: the new run meets at a fresh generation (the
    first run's rendezvous keys stay in the store) and trains to the end."""
    from trainguard.clients.store import StateStore

    async def _job():
        st = StateStore(stack.redis_url)
        try:
            return await st.job("e2e-again")
        finally:
            await st.close()

    first = _demo(stack, tmp_path / "a", "e2e-again", [], steps=12)
    gen1 = asyncio.run(_job()).generation
    second = _demo(stack, tmp_path / "b", "e2e-again", [], steps=12)
    job = asyncio.run(_job())
    assert first["accuracy"] is not None and second["accuracy"] is not None
    assert job.generation == gen1 + 1 and job.status == "finished"


def test_exception_repeating_at_the_same_step_stops_the_job(stack, tmp_path):
    def stopped_by_loop(rep):
        return bool(rep["decisions"]) and "stop_job_notify_user" in rep["decisions"][-1]["action"] \
            and "watchdog" not in rep["decisions"][-1]["reason"]

    rep = _tried(stack, tmp_path, "e2e-loop", [{"id": 1, "kind": "exception", "rank": 2,
                                               "step": 45, "repeat": True}], ok=stopped_by_loop)
    # the recovery decisions (a straggler flag on a loaded machine is decision `none`: no action)
    actions = [d["action"] for d in rep["decisions"] if d["action"] != "none"]
    assert actions[0] == "restart_in_process", [(d["action"], d.get("reason")) for d in rep["decisions"]]
    assert actions[-1] == "stop_job_notify_user", rep["decisions"]
    assert "loop" in rep["decisions"][-1]["reason"] or "same" in rep["decisions"][-1]["reason"]
    assert rep["accuracy"] is None  # it did not train on in a loop


def test_node_loss_continues_on_the_remaining_node(stack, tmp_path):
    try:
        rep = _tried(stack, tmp_path, "e2e-node", [{"id": 1, "kind": "node_loss", "node": 1,
                                                   "step": 50}])
    finally:
        stack.restart_service("agent-node1")  # the simulated node comes back for later tests
    (f,) = rep["faults"]
    assert f["recovered"], f
    d = f["decision"]
    assert d["action"] == "exclude_node_and_requeue" and d["nodes"] == ["node1"]
    assert d["world_size"] == 2
    assert f["resumed_step"] == f["restored_step"] + 1
    assert rep["accuracy"] is not None
    assert abs(rep["accuracy"] - rep["baseline_accuracy"]) <= 0.01


def test_node_loss_moves_the_ranks_to_a_registered_spare_node(stack, tmp_path):
    try:
        rep = _tried(stack, tmp_path, "e2e-spare", [{"id": 1, "kind": "node_loss", "node": 1,
                                                    "step": 50}], spare_nodes=1)
    finally:
        stack.restart_service("agent-node1")
    (f,) = rep["faults"]
    assert f["recovered"], f
    d = f["decision"]
    assert d["action"] == "exclude_node_and_requeue" and d["nodes"] == ["node1"]
    assert d["world_size"] == 4  # node2 took node1's ranks: the world did not shrink
    assert f["resumed_step"] == f["restored_step"] + 1
    assert abs(rep["accuracy"] - rep["baseline_accuracy"]) <= 0.01


_STARTUP_SCRIPT = '''
import time, torch, trainguard

def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = ctx.checkpointer(model, opt)
    start = ckpt.restore()
    net = ctx.ddp(model)
    for step in range(start, 60):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.progress(step, loss=float(loss))
        time.sleep(0.02)
    if ctx.rank == 0:
        print(f"finished at step {step} generation {ctx.generation}", flush=True)

trainguard.run(train)
'''


def test_rank_killed_while_starting_recovers(stack, tmp_path):
    """SIGKILL of rank 1 while its process is still starting (the spare importing torch): the
    decision that moves the job to generation 1 is published before rank 0 listens; rank 0
    learns it from the stream and meets the replacement there, and the job finishes (it used
    to wait at generation 0 until the watchdog stopped the job)."""
    import re
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "train.py"
    script.write_text(_STARTUP_SCRIPT)
    out = tmp_path / "launch.out"
    cmd = [sys.executable, "-m", "trainguard.cli", "launch", "--nproc-per-node", "2",
           "--job", "e2e-startkill", "--mode", "action", "--nats-url", stack.nats_url,
           "--redis-url", stack.redis_url, "--rdzv-endpoint", stack.rdzv_endpoint,
           "--ckpt-dir", str(tmp_path / "ckpt"), str(script)]
    with open(out, "w") as fh:
        launcher = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        pid = None
        for _ in range(600):
            m = re.search(r"rank 1 \(local 1\) started as pid (\d+)", out.read_text())
            if m:
                pid = int(m.group(1))
                break
            time.sleep(0.05)
        assert pid is not None, out.read_text()[-3000:]
        time.sleep(1.0)  # still warming: spares take several seconds to import torch here
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(240) == 0, out.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = out.read_text()
    assert "decision restart_workers (executing) generation 1" in text, text[-3000:]
    assert re.search(r"finished at step 59 generation [1-9]", text), text[-3000:]


_WRONG_CHECKPOINT_SCRIPT = '''
import os, time, torch, trainguard

MARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "raised")

def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # from the newest valid checkpoint only (no state from peers), so that the restore reads
    # the checkpoint this test makes wrong
    ckpt = ctx.checkpointer(model, opt, peer_recovery=False)
    start = ckpt.restore()
    print(f"restored step {ckpt.restored_step} generation {ctx.generation}", flush=True)
    net = ctx.ddp(model)
    for step in range(start, 60):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.progress(step, loss=float(loss))
        if step % 10 == 0 and step:
            if step == 20:  # a valid checkpoint of a wrong state, with the right loss
                keep = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(30.0)
                ckpt.save(step, loss=float(loss))  # staged: a copy of the state as it is now
                with torch.no_grad():
                    for p, k in zip(model.parameters(), keep):
                        p.copy_(k)
            else:
                ckpt.save(step, loss=float(loss))
        if step == 25 and ctx.rank == 1 and not os.path.exists(MARK):
            ckpt.wait(30)
            time.sleep(1.0)  # the validator marks step 20 valid (a tiny state: milliseconds)
            open(MARK, "w").close()
            raise RuntimeError("injected at step 25")
        time.sleep(0.02)
    print(f"finished at step {step} generation {ctx.generation}", flush=True)

trainguard.run(train)
'''


def test_a_restored_state_whose_loss_jumps_fails_its_check_and_stops_the_job(stack, tmp_path):
    """A valid checkpoint of a wrong state (step 20's parameters ×30, saved with the loss of
    the right ones): the exception at step 25 restarts in process, the restore takes step 20,
    the loss after it is far off the saved one → ``recovery.verified`` not ok → the detector's
    ``checkpoint_corrupt`` anomaly (layer application) → the remediator stops the job (every
    replica holds the wrong state now), and the validator marks step 20 invalid, so the
    newest valid checkpoint is step 10 again: what a new launch resumes from."""
    import subprocess
    import sys

    from trainguard.clients.store import StateStore

    job = "e2e-wrong-ckpt"
    script = tmp_path / "train.py"
    script.write_text(_WRONG_CHECKPOINT_SCRIPT)
    out = tmp_path / "launch.out"
    cmd = [sys.executable, "-m", "trainguard.cli", "launch", "--nproc-per-node", "2",
           "--spares", "1", "--job", job, "--mode", "action", "--nats-url", stack.nats_url,
           "--redis-url", stack.redis_url, "--rdzv-endpoint", stack.rdzv_endpoint,
           "--ckpt-dir", str(tmp_path / "ckpt"), str(script)]
    with open(out, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path,
                            timeout=240).returncode
    text = out.read_text()
    assert "decision restart_in_process" in text, text[-3000:]
    assert "restored step 20 generation 1" in text, text[-3000:]
    assert "decision stop_job_notify_user" in text, text[-3000:]
    assert "finished at step" not in text and rc == 3, (rc, text[-3000:])

    async def read():
        s = StateStore(stack.redis_url)
        try:
            return await s.checkpoints(job), await s.audit_trail(job)
        finally:
            await s.close()
    ckpts, audit = asyncio.run(read())
    by_step = {c["step"]: c for c in ckpts}
    assert by_step[20]["status"] == "invalid", ckpts
    assert "loss check failed" in by_step[20]["reasons"][0], by_step[20]
    assert max(c["step"] for c in ckpts if c["status"] == "valid") == 10, ckpts
    stop = [a for a in audit if a.get("type") == "decision"
            and a["action"] == "stop_job_notify_user"]
    assert stop and stop[0]["fault_class"] == "checkpoint_corrupt", audit

"""End to end: the checkpoint-aware drain handshake with a real trainguard job.

A real stack (NATS, Valkey, rendezvous store, an agent on the dotted node
``ip-10-0-1-2.ec2.internal``, detector, attributor, remediator, checkpoint validator), a real
``trainguard launch`` of a 2-rank gloo job (``tests/fixtures/k8s/train_drain.py``, trainguard
checkpointer) on that node, the drain service (``trainguard.scheduler.k8s.drain``) running as the
remediator role, and the Kubernetes API emulator holding the node and the job's pod. The test
annotates the node ``trainguard.io/drain-requested`` and asserts, on what happened:

* the ranks saved one checkpoint at a step they agreed on, the validator found it valid, and
  only then the node was annotated ``trainguard.io/drain-ready`` and the eviction requested
  (request order and event times);
* no rank completed a step past the checkpoint before the eviction (0 steps lost);
* when the eviction lands (the test then stops the launcher with SIGTERM, as the kubelet does),
  a new launch of the job resumes at the step after the checkpoint.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from k8s_fixtures.emulator import NODES, cluster
from k8s_fixtures.jobs import events as _events
from k8s_fixtures.jobs import launch
from k8s_fixtures.jobs import records as _records
from trainguard.scheduler.k8s.api import DRAIN_READY, DRAIN_REQUESTED, KubeConfig
from trainguard.scheduler.k8s.drain import DrainConfig, DrainService
from trainguard.services.base import ServiceConfig

pytestmark = pytest.mark.slow

NODE = "ip-10-0-1-2.ec2.internal"


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator",
                         "checkpoint_validator"),
               agent_nodes=(NODE,), rendezvous=True, log_dir=str(logs), kernel_log_dir=str(logs))
    st.start(timeout=120)
    yield st
    st.stop()


def test_drain_checkpoints_first_then_evicts_and_loses_no_step(stack, tmp_path):
    job = f"drain-{uuid.uuid4().hex[:6]}"
    rec = tmp_path / "rec"
    procs: list[subprocess.Popen] = []
    seen: dict = {}

    async def scenario() -> None:
        async with cluster() as c:
            c.add_node(NODE)
            c.add_pod(f"{job}-workers-0-0", NODE, job)
            launcher, log = launch(stack, job, tmp_path, "launch1", NODE)
            procs.append(launcher)

            def on_evict(ns, name):  # the kubelet's part: stop the pod's container (SIGTERM)
                seen["evict_ns"] = time.time_ns()
                seen["records_at_evict"] = _records(rec)
                seen["requests_before"] = [(str(r.method), r.url.path, r.data) for r in c.km]
                launcher.send_signal(signal.SIGTERM)

            c.on_evict = on_evict
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:  # both ranks training
                rs = _records(rec)
                if {r["rank"] for r in rs if r["step"] >= 10} == {0, 1}:
                    break
                assert launcher.poll() is None, log.read_text()[-3000:]
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the job did not train:\n" + log.read_text()[-3000:])
            nats, redis = stack.urls("remediator")
            svc = DrainService(ServiceConfig(nats_url=nats, redis_url=redis, tick_s=0.05),
                               DrainConfig(poll_s=0.2, hold_s=60.0, resend_s=2.0,
                                           lookahead_s=3.0, attempts=5, deadline_s=90.0),
                               KubeConfig(host=c.url, evict_backoff_s=0.05))
            task = asyncio.create_task(svc.run())
            try:
                seen["annotated_ns"] = time.time_ns()
                c.km.objects[NODES, None, NODE].patch(
                    {"metadata": {"annotations": {DRAIN_REQUESTED: "kernel-upgrade"}}})
                t0 = time.monotonic()
                while "evict_ns" not in seen and time.monotonic() - t0 < 95:
                    await asyncio.sleep(0.05)
                seen["evict_wait_s"] = time.monotonic() - t0
                await asyncio.sleep(0.5)
                seen["node"] = c.node(NODE)
                seen["evictions"] = list(c.evictions)
            finally:
                svc.stop()
                await asyncio.wait_for(task, 10)
            assert "evict_ns" in seen, "no eviction was requested:\n" + log.read_text()[-4000:]
            seen["log"] = log.read_text()[-3000:]
            assert launcher.wait(30) == 143, log.read_text()[-3000:]

    try:
        asyncio.run(scenario())
        ready = seen["node"]["metadata"]["annotations"][DRAIN_READY]
        if not ready.startswith(f"{job}@"):
            pytest.fail(f"drain-ready {ready!r}; status "
                        f"{seen['node']['metadata']['annotations'].get('trainguard.io/drain-status')!r}"
                        f"\n{seen.get('log', '')}")
        step = int(ready.split("@")[1])
        assert seen["node"]["spec"]["unschedulable"] is True
        assert seen["evictions"] == [("train", f"{job}-workers-0-0", 201)]
        # the checkpoint was committed and found valid before the eviction was requested
        valid = [e for e in _events(stack, job, "ckpt") if e["schema"] == "ckpt.validated"
                 and e["step"] == step]
        assert valid and valid[0]["ts"] < seen["evict_ns"], valid
        done = [e for e in _events(stack, job, "action") if e["schema"] == "ckpt.request_done"]
        assert done and done[-1]["ok"] and done[-1]["step"] == step
        assert seen["annotated_ns"] < done[-1]["ts"] < valid[0]["ts"] < seen["evict_ns"]
        # drain-ready was written before the eviction (the order the API server received them)
        before = seen["requests_before"]
        ready_at = [i for i, (m, p, d) in enumerate(before) if m.endswith("PATCH") and
                    DRAIN_READY in json.dumps(d or {})]
        evict_at = [i for i, (m, p, d) in enumerate(before) if p.endswith("/eviction")]
        assert ready_at and evict_at and ready_at[0] < evict_at[0]
        # 0 steps lost: no rank went past the checkpoint before the eviction
        at_evict = seen["records_at_evict"]
        assert max(r["step"] for r in at_evict) == step, [r["step"] for r in at_evict[-6:]]
        assert {r["rank"] for r in at_evict if r["step"] == step} == {0, 1}
        # the job's next run resumes right after the checkpoint
        p2, log2 = launch(stack, job, tmp_path, "launch2", NODE)
        procs.append(p2)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:  # ≈ 10 s here; start-up slows a lot under load
            later = [r for r in _records(rec) if r["t_ns"] > seen["evict_ns"]]
            if {r["rank"] for r in later} == {0, 1}:
                break
            assert p2.poll() is None, log2.read_text()[-3000:]
            time.sleep(0.1)
        else:
            pytest.fail("the relaunch did not train:\n" + log2.read_text()[-3000:])
        first = {r["rank"]: r for r in reversed(later)}
        assert all(r["step"] == step + 1 and r["restored"] == step for r in first.values()), first
        a = seen["annotated_ns"]
        print(f"drain: annotation -> checkpoint committed {(done[-1]['ts'] - a) / 1e9:.2f} s "
              f"({len(done)} answer(s)), -> valid {(valid[0]['ts'] - a) / 1e9:.2f} s, "
              f"-> eviction {(seen['evict_ns'] - a) / 1e9:.2f} s")
        print(f"drain: annotation -> eviction {seen['evict_wait_s']:.2f} s, checkpoint step "
              f"{step}, steps lost 0, relaunch -> first step {time.monotonic() - t0:.2f} s")
    finally:
        for p in procs:
            _stop(p)

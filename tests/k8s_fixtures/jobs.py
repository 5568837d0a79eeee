"""Helpers of the Kubernetes end-to-end tests: a real ``trainguard launch`` of
``fixtures/k8s/train_drain.py`` as a training pod would run it, its per-step records, and the
events the stack stored for the job."""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "fixtures" / "k8s" / "train_drain.py"
BIN = Path(sys.executable).parent


def records(d: Path) -> list[dict]:
    """Every rank's per-step records (``rank*.jsonl`` in ``d``), oldest first (``t_ns``)."""
    out = []
    for f in sorted(d.glob("rank*.jsonl")):
        out += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return sorted(out, key=lambda r: r["t_ns"])


def launch(stack, job: str, tmp: Path, name: str, node: str, *, nnodes: int = 1,
           nproc_per_node: int = 2, node_rank: int = 0) -> tuple[subprocess.Popen, Path]:
    """Start one launcher of ``job`` on Kubernetes node ``node`` (the worker role's URLs, the
    environment of a pod: no inherited bus, store, rendezvous or node settings), its output in
    ``tmp/<name>.log``, its ranks' records in ``tmp/rec``, checkpoints in ``tmp/ckpt``; in
    its own session, so that a test can signal the whole pod."""
    nats, redis = stack.urls("worker")
    env = {k: v for k, v in os.environ.items()
           if k not in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_NODE", "KUBECONFIG")}
    env["PYTHONUNBUFFERED"] = "1"
    log = tmp / f"{name}.log"
    cmd = [str(BIN / "trainguard"), "launch", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node_rank),
           "--node", node, "--job", job, "--mode", "action", "--spares", "1",
           "--nats-url", nats, "--redis-url", redis, "--rdzv-endpoint", stack.rdzv_endpoint,
           "--ckpt-dir", str(tmp / "ckpt"), str(SCRIPT), "--record-dir", str(tmp / "rec"),
           "--sleep", "0.05"]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True), log


def events(stack, job: str, kind: str) -> list[dict]:
    """The events the stack's streams hold on ``tg.job.<job>.<kind>``, oldest first."""
    from trainguard.tools.replay import history

    buf = io.StringIO()
    asyncio.run(history(stack.nats_url, buf, subject=f"tg.job.{job}.{kind}"))
    return [json.loads(x)["event"] for x in buf.getvalue().splitlines() if x.strip()]

"""``trainguard demo``: the main job. Starts the embedded stack, trains the digits MLP with DDP
over gloo on 2 simulated nodes × 2 ranks, injects a deterministic fault schedule (SIGKILL of one
rank, a Python exception in another rank's step, a hang by SIGSTOP of a third), lets trainguard
recover from each, and reports per fault: kind, rank, step, seconds from injection to detection,
to decision, to training again (every rank completed a new step), steps rolled back and the
path the state came back by (``peer``: from healthy peers; ``checkpoint``); then the final test
accuracy next to a fault-free run with the same seed.

``--mode observe`` runs the same schedule with decisions published but never executed: after
each fault the demo does what a scheduler alone would (kill the whole job, start it again from
the last valid checkpoint) and reports the decisions that would have been taken.

Faults of a degrading node (``SIM_FAULTS``; they need a stack with ``sim_dir``, which the demo's
own stack has when the schedule holds one): ``ecc_degrading`` — the simulated GPU of ``node``
counts ``per_s`` corrected ECC errors per second from the fault's step on
(``fake_pynvml.set_ecc_rate``); ``memory_fill`` — the node is given a memory budget of which
what its processes use now is ``start_ratio`` (0.75: below the trend rule's floor of 0.8, so
nothing fires until the fill has added memory), and a real process started for that node
(``trainguard.demo.fill``) fills what is left, at most ``max_mb`` (384) MiB, at ``rate`` MiB/s,
holds it a while and exits by itself. With a spare node each is recovered when the node's ranks
train on the spare.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from trainguard import schemas
from trainguard.demo.config import DEFAULT_FAULTS, NODE_FAULTS, SIM_FAULTS, DemoConfig
from trainguard.demo.faults import FaultInjection
from trainguard.demo.measure import RecoveryTiming
from trainguard.demo.recorder import Recorder
from trainguard.demo.report import fault_line, print_report
from trainguard.security.credentials import redact


class Demo(FaultInjection, RecoveryTiming):
    """One demo run. ``stack``: an already started ``trainguard.stack.local.Stack`` to use (tests and
    benchmarks reuse one across runs; give each run its own ``job`` name); None starts and stops
    its own. Its steps are the fault injection (``trainguard.demo.faults``) and the timing of
    each recovery (``trainguard.demo.measure``); a subclass may wrap ``inject`` or ``timeline``."""

    def __init__(self, cfg: DemoConfig, stack=None):
        self.cfg = cfg
        self.stack = stack
        self._own_stack = stack is None
        self.launchers: list[subprocess.Popen] = []
        self.rec: Recorder | None = None
        self.log_dir = ""
        self.fills: list[tuple[subprocess.Popen, str]] = []  # (fill process, its node)
        self.degraded: list[str] = []  # nodes whose simulated GPU was made to degrade

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # ---- processes ----------------------------------------------------------------------------
    def start_stack(self) -> None:
        from trainguard.stack.local import Stack

        nodes = tuple(f"node{i}" for i in range(self.cfg.nnodes))
        sim = any(f["kind"] in SIM_FAULTS for f in self.cfg.faults)
        self.stack = Stack(agent_nodes=nodes, rendezvous=True,
                           log_dir=os.path.join(self.cfg.run_dir, "logs"),
                           kernel_log_dir=self.cfg.run_dir,
                           sim_dir=os.path.join(self.cfg.run_dir, "sim") if sim else None)
        self.stack.start()
        self.say(f"stack up: NATS {redact(self.stack.nats_url)}, "
                 f"Valkey {redact(self.stack.redis_url)}, "
                 f"rendezvous {self.stack.rdzv_endpoint}")

    def start_launchers(self) -> None:
        cfg = self.cfg
        script = os.path.join(os.path.dirname(__file__), "train.py")
        exc_faults = [f for f in cfg.faults if f["kind"] == "exception"]
        self.launchers = []
        # launchers and their ranks connect as the worker role, as a user's launchers do
        nats_url, redis_url = self.stack.urls("worker")
        for nr in range(cfg.nnodes + cfg.spare_nodes):
            # nodes past nnodes are registered spares: they start warm processes and wait to
            # replace an excluded node
            # (a trainguard.run job rejoins in process: one warm spare per node is enough)
            spare = ["--spare-node", "--spares", str(cfg.nproc_per_node)] \
                if nr >= cfg.nnodes else ["--spares", "1"]
            cmd = [sys.executable, "-m", "trainguard.cli", "launch", *spare,
                   "--nnodes", str(cfg.nnodes),
                   "--nproc-per-node", str(cfg.nproc_per_node), "--node-rank", str(nr),
                   "--node", f"node{nr}", "--job", cfg.job, "--mode", cfg.mode,
                   "--nats-url", nats_url, "--redis-url", redis_url,
                   "--rdzv-endpoint", self.stack.rdzv_endpoint,
                   "--ckpt-dir", os.path.join(cfg.run_dir, "checkpoints"),
                   "--hang-timeout", str(cfg.hang_timeout_s),
                   "--node-timeout", str(cfg.node_timeout_s),
                   "--warm-import", "sklearn.datasets,trainguard.demo.model",
                   *(["--retry-budget", str(cfg.retry_budget)] if cfg.retry_budget else []),
                   script, "--steps", str(cfg.steps), "--seed", str(cfg.seed),
                   "--ckpt-every", str(cfg.ckpt_every), "--step-sleep", str(cfg.step_sleep_s),
                   "--run-dir", cfg.run_dir, "--faults", json.dumps(exc_faults),
                   "--dropout", str(cfg.dropout), *(["--loss-log"] if cfg.loss_log else [])]
            log = open(os.path.join(self.log_dir, f"launcher-node{nr}.log"), "a")
            self.launchers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def stop_launchers(self) -> None:
        for p in [p for p in self.launchers if p.poll() is None]:
            p.terminate()
        for p in self.launchers:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def full_restart(self) -> None:
        """What a scheduler alone does: stop every process of the job, start it again."""
        from trainguard.clients.store import StateStore

        self.stop_launchers()
        for pid in [hb.pid for hb in list(self.rec.hb.values())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        async def _bump() -> None:
            st = StateStore(self.stack.redis_url)
            job = await st.job(self.cfg.job)
            await st.bump_generation(self.cfg.job, job.generation)
            await st.close()

        asyncio.run(_bump())
        self.start_launchers()

    # ---- main ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="trainguard-demo-")
        self.log_dir = os.path.join(cfg.run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        t_start = time.monotonic()
        self.say(f"run directory {cfg.run_dir} (logs in {self.log_dir}); mode {cfg.mode}")
        results: list[dict[str, Any]] = []
        decisions: list[dict[str, Any]] = []
        try:
            if self.stack is None:
                self.start_stack()
            self.rec = Recorder(self.stack.nats_url, cfg.job)
            self.start_launchers()
            self.say(f"job {cfg.job!r}: {cfg.nnodes} nodes × {cfg.nproc_per_node} ranks, "
                     f"{cfg.steps} steps, DDP over gloo; waiting for the ranks to start")
            stop_progress = threading.Event()
            threading.Thread(target=self._progress, args=(stop_progress,), daemon=True).start()
            for f in cfg.faults:
                if f["kind"] in NODE_FAULTS:
                    f.setdefault("rank", f["node"] * cfg.nproc_per_node)
                if f["kind"] != "exception":
                    self.say(f"will inject {f['kind']} into rank {f['rank']} at step {f['step']}")
                injected = self.inject(f)
                if injected is None:
                    self.say(f"could not inject {f['kind']} (job ended or stalled)")
                    results.append(self.timeline(f, None, wait=False))
                    continue
                self.say(f"injected {f['kind']} into rank {f['rank']} at step {f['step']}")
                r = self.timeline(f, injected)
                results.append(r)
                self.say(fault_line(r))
            deadline = time.monotonic() + 600
            result_path = os.path.join(cfg.run_dir, "result.json")
            done_at = None
            while any(p.poll() is None for p in self.launchers) and time.monotonic() < deadline:
                if done_at is None and os.path.exists(result_path):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() - done_at > 10:
                    break  # trained to the end; an unused spare node has nothing left to do
                time.sleep(0.1)
            stop_progress.set()
            decisions = [{"action": d.action, "generation": d.generation, "ts": d.ts,
                          "executed": d.execute, "reason": d.reason}
                         for d in self.rec.of(schemas.Decision)]
        finally:
            self.stop_launchers()
            if self.stack is not None:
                self.clear_degradation()
            if self.rec is not None:
                self.rec.close()
            if self.stack is not None and self._own_stack:
                self.stack.stop()
        result_path = os.path.join(cfg.run_dir, "result.json")
        acc = json.load(open(result_path))["accuracy"] if os.path.exists(result_path) else None
        from trainguard.demo.model import train_reference

        baseline = train_reference(cfg.steps, cfg.seed)
        report = {"mode": cfg.mode, "job": cfg.job, "steps": cfg.steps, "seed": cfg.seed,
                  "world_size": cfg.world_size, "accuracy": acc, "baseline_accuracy": baseline,
                  "faults": results, "decisions": decisions, "wall_s": round(time.monotonic() - t_start, 2),
                  "run_dir": cfg.run_dir}
        print_report(report)
        if cfg.report:
            with open(cfg.report, "w") as fh:
                json.dump(report, fh, indent=2)
            self.say(f"report written to {cfg.report}")
        return report

    def _progress(self, stop: threading.Event) -> None:
        last = None
        while not stop.wait(1.0):
            hb = self.rec.heartbeat(0) if self.rec else None
            if hb is None or hb.step < 0:
                continue
            line = (f"step {hb.step + 1}/{self.cfg.steps}  generation {hb.generation}  "
                    f"world {hb.world_size}  loss {hb.loss:.4f}" if hb.loss is not None else
                    f"step {hb.step + 1}/{self.cfg.steps}")
            if line != last:
                self.say(line)
            last = line


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainguard demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("action", "observe"), default="action")
    p.add_argument("--report", default="", help="write the report as JSON to this path")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="", help="checkpoints and logs (default: a temp dir)")
    p.add_argument("--hang-timeout", type=float, default=2.0)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    last = max(f["step"] for f in DEFAULT_FAULTS)
    if a.steps <= last + 20:
        p.error(f"--steps must be more than {last + 20}: the faults are injected at steps "
                f"{', '.join(str(f['step']) for f in DEFAULT_FAULTS)} and training must go on "
                f"after the last one (got {a.steps})")
    if a.hang_timeout <= 0:
        p.error(f"--hang-timeout must be > 0 seconds, got {a.hang_timeout}")
    if a.seed < 0:
        p.error(f"--seed must be ≥ 0, got {a.seed}")
    if a.run_dir and os.path.exists(a.run_dir) and not os.path.isdir(a.run_dir):
        p.error(f"--run-dir {a.run_dir!r} is a file: give a directory (created if missing)")
    if a.report:
        parent = os.path.dirname(os.path.abspath(a.report))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            p.error(f"--report {a.report!r}: {parent} is not a writable directory")
    cfg = DemoConfig(mode=a.mode, steps=a.steps, seed=a.seed, run_dir=a.run_dir,
                     report=a.report, hang_timeout_s=a.hang_timeout, quiet=a.quiet)
    rep = Demo(cfg).run()
    ok = all(f["recovered"] for f in rep["faults"]) and rep["accuracy"] is not None
    return 0 if ok or cfg.mode == "observe" else 1

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
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard import schemas
from trainguard.security.credentials import redact

#: The default fault schedule: (id, kind, global rank, step).
DEFAULT_FAULTS: tuple[dict[str, Any], ...] = (
    {"id": 1, "kind": "sigkill", "rank": 1, "step": 150},
    {"id": 2, "kind": "exception", "rank": 2, "step": 300},
    {"id": 3, "kind": "hang", "rank": 3, "step": 450},
)

#: Fault kinds of a degrading node: injected into the simulated node's hardware (``sim_dir``).
SIM_FAULTS = ("ecc_degrading", "memory_fill")
#: Fault kinds named by a node (their rank is the node's first).
NODE_FAULTS = ("node_loss", "xid", *SIM_FAULTS)


@dataclass
class DemoConfig:
    """Settings of the demo (defaults in brackets).

    ``steps`` [600] training steps; ``step_sleep_s`` [0.01] pause per step so faults land where
    scheduled; ``hang_timeout_s`` [2.0] job hang timeout; ``node_timeout_s`` [3.0];
    ``recovery_timeout_s`` [90] how long a fault may take to recover before it counts as not
    recovered; ``dropout`` [0], ``loss_log`` [False]: the script's ``--dropout``, ``--loss-log``;
    ``retry_budget`` [None: the launcher's default, 10] recoveries the remediator grants the job
    before it stops it (a long chaos run of many faults needs more).
    """

    mode: str = "action"
    job: str = "demo"
    steps: int = 600
    seed: int = 0
    nnodes: int = 2
    nproc_per_node: int = 2
    ckpt_every: int = 20
    step_sleep_s: float = 0.01
    hang_timeout_s: float = 2.0
    node_timeout_s: float = 3.0
    recovery_timeout_s: float = 90.0
    faults: list[dict[str, Any]] = field(default_factory=lambda: [dict(f) for f in DEFAULT_FAULTS])
    spare_nodes: int = 0
    run_dir: str = ""
    report: str = ""
    quiet: bool = False
    dropout: float = 0.0
    loss_log: bool = False
    retry_budget: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def __post_init__(self) -> None:
        for i, f in enumerate(self.faults):
            f.setdefault("id", i + 1)  # names the marker file of an in-rank fault


class Recorder:
    """Collects the job's events from the bus (a ``ThreadedBus`` subscription to
    ``tg.job.<job>.>``) with the latest heartbeat of each rank."""

    def __init__(self, nats_url: str, job: str):
        from trainguard.clients.bus import ThreadedBus

        self.job = job
        self.lock = threading.Lock()
        self.events: list[schemas.Event] = []
        self.hb: dict[int, schemas.RankHeartbeat] = {}
        self.bus = ThreadedBus(nats_url, f"demo-recorder-{job}")
        self.bus.subscribe(f"tg.job.{job}.>", self._on)
        self.bus.start()
        self.bus.wait_connected(10)

    def _on(self, subject: str, ev: schemas.Event) -> None:
        with self.lock:
            if isinstance(ev, schemas.RankHeartbeat):
                if ev.rank is not None:
                    prev = self.hb.get(ev.rank)
                    if prev is None or ev.ts >= prev.ts:
                        self.hb[ev.rank] = ev
            else:
                self.events.append(ev)

    def of(self, cls: type, since_ns: int = 0) -> list[Any]:
        with self.lock:
            return [e for e in self.events if isinstance(e, cls) and e.ts >= since_ns]

    def heartbeat(self, rank: int) -> schemas.RankHeartbeat | None:
        return self.hb.get(rank)  # one dict read: atomic under the GIL

    def close(self) -> None:
        self.bus.close(timeout=1.0)


class Demo:
    """One demo run. ``stack``: an already started ``trainguard.stack.local.Stack`` to use (tests and
    benchmarks reuse one across runs; give each run its own ``job`` name); None starts and stops
    its own."""

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

    # ---- fault schedule -------------------------------------------------------------------------
    def wait_step(self, rank: int, step: int, timeout: float) -> schemas.RankHeartbeat | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = self.rec.heartbeat(rank)
            if hb is not None and hb.step >= step and hb.phase == "train":
                return hb
            if all(p.poll() is not None for p in self.launchers):
                return None
            time.sleep(0.005)
        return None

    def inject(self, f: dict[str, Any]) -> int | None:
        """Inject fault ``f``; returns the Unix ns of injection (None if it could not be)."""
        cfg = self.cfg
        if f["kind"] == "exception":
            marker = os.path.join(cfg.run_dir, f"fault-{f['id']}.injected")
            deadline = time.monotonic() + cfg.recovery_timeout_s + 240
            while time.monotonic() < deadline and not os.path.exists(marker):
                if all(p.poll() is not None for p in self.launchers):
                    break
                time.sleep(0.005)
            if not os.path.exists(marker):
                return None
            time.sleep(0.01)
            return int(open(marker).read().strip())
        # the first fault also waits for the job to start (slow on a loaded host)
        hb = self.wait_step(f["rank"], f["step"], cfg.recovery_timeout_s + 240)
        if hb is None:
            return None
        if f["kind"] == "node_loss":
            # the node's launcher (its ranks and spares die with it) and its agent
            ts = time.time_ns()
            self.launchers[f["node"]].kill()
            self.stack.kill_service(f"agent-node{f['node']}")
            return ts
        if f["kind"] == "xid":
            # a real-format driver line in the node's kernel log, as the agent reads it
            node = f.get("node", f["rank"] // cfg.nproc_per_node)
            xid = int(f.get("xid", 79))
            ts = time.time_ns()
            with open(self.stack.kernel_log_path(f"node{node}"), "a") as fh:
                fh.write(f"[{time.monotonic():12.6f}] NVRM: Xid (PCI:0000:3b:00): {xid}, "
                         f"pid={hb.pid}, name=python, GPU has fallen off the bus.\n")
            return ts
        if f["kind"] in SIM_FAULTS:
            return self.inject_degradation(f)
        if f["kind"] == "straggler":
            node, local = f["rank"] // cfg.nproc_per_node, f["rank"] % cfg.nproc_per_node
            path = os.path.join(cfg.run_dir, f"slow-node{node}-{local}")
            with open(path, "w") as fh:
                fh.write(str(f.get("factor", 3)))
            return time.time_ns()
        sig = signal.SIGKILL if f["kind"] == "sigkill" else signal.SIGSTOP
        ts = time.time_ns()
        os.kill(hb.pid, sig)
        return ts

    def inject_degradation(self, f: dict[str, Any]) -> int:
        """A fault of ``SIM_FAULTS`` into simulated node ``node<f["node"]>``; the Unix ns it
        began. Raises ValueError when the stack has no simulated hardware (``sim_dir``)."""
        sim = getattr(self.stack, "sim_dir", None)
        if sim is None:
            raise ValueError(f"a {f['kind']} fault needs a stack with simulated node hardware "
                             f"(Stack(sim_dir=...))")
        node = f"node{f['node']}"
        if f["kind"] == "ecc_degrading":
            from trainguard.demo.fake_pynvml import set_ecc_rate

            ts = time.time_ns()
            set_ecc_rate(str(sim), node, float(f.get("per_s", 5.0)))
            self.degraded.append(node)
            return ts
        from trainguard.agents.host import NodeMemory

        budget = self.stack.memory_budget_path(node)
        used = NodeMemory(node, str(budget)).used_bytes()
        total = int(used / float(f.get("start_ratio", 0.75)))
        mb = max(1, min(int(f.get("max_mb", 384)), (total - used) // 2**20))
        f.update(used_mib=round(used / 2**20), budget_mib=round(total / 2**20), fill_mib=mb)
        ts = time.time_ns()
        budget.write_text(str(total))
        log = open(os.path.join(self.log_dir, f"fill-{node}.log"), "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.demo.fill", "--mb", str(mb),
             "--rate", str(f.get("rate", 32.0)), "--hold", str(f.get("hold_s", 20.0)),
             "--max-s", str(f.get("max_s", 60.0))],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TG_NODE": node})
        self.fills.append((proc, node))
        self.say(f"{node}: budget {f['budget_mib']} MiB ({f['used_mib']} in use), filling "
                 f"{mb} MiB (pid {proc.pid})")
        return ts

    def clear_degradation(self) -> None:
        """End what ``inject_degradation`` began: the fill processes stopped, the budgets
        removed, the ECC counts no longer rising (a stack shared by later runs is healthy)."""
        for proc, node in self.fills:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(FileNotFoundError):
                self.stack.memory_budget_path(node).unlink()
        self.fills = []
        if self.degraded:
            from trainguard.demo.fake_pynvml import set_ecc_rate

            for node in self.degraded:
                set_ecc_rate(str(self.stack.sim_dir), node, 0.0)
        self.degraded = []

    def timeline(self, f: dict[str, Any], injected: int | None, wait: bool = True) -> dict:
        """Wait for detection, decision and resumption after a fault injected at ``injected``
        (``wait=False``: the empty row of a fault that could not be injected)."""
        cfg = self.cfg
        out = {**dict.fromkeys(("detected_ns", "decided_ns", "resumed_ns", "steps_rolled_back",
                                "restored_step", "resumed_step", "path", "decision", "verdict")),
               "kind": f["kind"], "rank": f["rank"], "step": f["step"],
               "node": f"node{f.get('node', f['rank'] // cfg.nproc_per_node)}",
               "injected_ns": injected, "recovered": False, "path_reason": "",
               **{k: f[k] for k in ("used_mib", "budget_mib", "fill_mib") if k in f}}
        if not wait:
            return out
        deadline = time.monotonic() + cfg.recovery_timeout_s
        decision = None
        full_restart_done = False
        while time.monotonic() < deadline:
            anomalies = self.rec.of(schemas.Anomaly, injected)
            if anomalies and out["detected_ns"] is None:
                out["detected_ns"] = min(a.ts for a in anomalies)
            verdicts = self.rec.of(schemas.Verdict, injected)
            if verdicts:
                # the verdict behind the newest decision (else the first one)
                v = next((x for x in verdicts if decision is not None
                          and x.event_id == decision.verdict_id), None) or verdicts[0]
                out["verdict"] = {"fault_class": v.fault_class, "layer": v.layer,
                                  "culprit_ranks": v.culprit.ranks,
                                  "culprit_nodes": v.culprit.nodes}
            decisions = self.rec.of(schemas.Decision, injected)
            if decisions and (decision is None or decisions[-1].generation > decision.generation):
                # the newest decision is the one recovery follows (a node loss is first seen as
                # its ranks falling silent, then excluded when the node's heartbeats are gone)
                decision = max(decisions, key=lambda d: (d.generation, d.ts))
                out["decided_ns"] = decision.ts
                out["decision"] = {"action": decision.action, "ranks": decision.ranks,
                                   "nodes": decision.nodes, "generation": decision.generation,
                                   "world_size": decision.world_size,
                                   "executed": decision.execute, "reason": decision.reason}
                out["decisions"] = [d.action for d in decisions]
            if decision is not None and decision.action == "stop_job_notify_user":
                out["stopped"] = True  # the job was stopped on purpose: nothing to resume
                break
            if cfg.mode == "observe" and not full_restart_done and (
                    decision is not None or all(p.poll() is not None for p in self.launchers)):
                self.say(f"observe mode: decision would be "
                         f"{decision.action if decision else '(none yet)'}; restarting the whole "
                         f"job from its last checkpoint, as a scheduler would")
                self.full_restart()
                full_restart_done = True
                since = time.time_ns()
            if cfg.mode == "action" and decision is not None:
                resumed = [r for r in self.rec.of(schemas.TrainingResumed, injected)
                           if r.generation >= decision.generation]
            elif cfg.mode == "observe" and full_restart_done:
                resumed = self.rec.of(schemas.TrainingResumed, since)
            else:
                resumed = []
            replaceable = cfg.spare_nodes > 0 and cfg.mode == "action"
            if f["kind"] == "straggler" and not replaceable:
                # a straggler is flagged (replaced only where a spare node exists): the figure
                # is the time to the verdict naming it; then the rank is made fast again.
                # With a spare node it is timed like a node loss: until the job trains again
                # on the spare (the slow rank's node excluded).
                named = [v for v in verdicts if f["rank"] in v.culprit.ranks]
                if named or time.monotonic() > deadline - 1:
                    out["recovered"] = bool(named)
                    node, local = f["rank"] // cfg.nproc_per_node, f["rank"] % cfg.nproc_per_node
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(cfg.run_dir, f"slow-node{node}-{local}"))
                    break
                time.sleep(0.01)
                continue
            world = decision.world_size if decision is not None and decision.world_size else \
                cfg.world_size
            ranks = {r.rank for r in resumed}
            if len(ranks) >= world:
                out["resumed_ns"] = max(r.ts for r in resumed)
                # the ranks' own count, and at least the fault's step minus the restored one
                # (a rank replaced from a spare cannot know the step its predecessor reached)
                out["steps_rolled_back"] = max(
                    [max(0, f["step"] - min(r.restored_step for r in resumed))] +
                    [r.steps_rolled_back for r in resumed if cfg.mode == "action"])
                out["restored_step"] = min(r.restored_step for r in resumed)
                out["resumed_step"] = min(r.resumed_step for r in resumed)
                paths = sorted({r.path for r in resumed})  # "checkpoint", "peer" or both
                out["path"] = "+".join(paths)
                out["path_reason"] = next((r.reason for r in resumed if r.rank == 0), "")
                out["recovered"] = True
                break
            time.sleep(0.01)
        if injected:
            from trainguard.core import timeline

            out["timeline"] = timeline.build(
                injected, self.rec.of(schemas.Event, injected),
                decision_id=decision.event_id if decision is not None else "").to_dict()
        return out

    def full_restart(self) -> None:
        """What a scheduler alone does: stop every process of the job, start it again."""
        import asyncio

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
                self.say(self._fault_line(r))
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
        self.print_report(report)
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

    @staticmethod
    def _s(a: int | None, b: int | None) -> str:
        return f"{(b - a) / 1e9:7.3f}" if a and b else "      -"

    def _fault_line(self, r: dict[str, Any]) -> str:
        d = r.get("decision") or {}
        return (f"{r['kind']} rank {r['rank']}: detected +{self._s(r['injected_ns'], r['detected_ns']).strip()}s, "
                f"decided +{self._s(r['injected_ns'], r['decided_ns']).strip()}s "
                f"({d.get('action', '-')}{'' if d.get('executed', True) else ', not executed'}), "
                f"training again +{self._s(r['injected_ns'], r['resumed_ns']).strip()}s, "
                f"rolled back {r['steps_rolled_back']} steps ({r.get('path') or '-'} path)")

    def print_report(self, rep: dict[str, Any]) -> None:
        print()
        print(f"trainguard demo — mode {rep['mode']}, {rep['world_size']} ranks, "
              f"{rep['steps']} steps, {rep['wall_s']} s")
        hdr = (f"{'fault':<10} {'rank':>4} {'node':<6} {'step':>5} {'detect s':>9} "
               f"{'decide s':>9} {'resume s':>9} {'rolled back':>11} {'path':<10} "
               f"{'decision':<28} recovered")
        print(hdr)
        print("-" * len(hdr))
        for r in rep["faults"]:
            d = r.get("decision") or {}
            act = d.get("action", "-")
            if d.get("action") == "none":
                act += " (flagged)"
            elif not d.get("executed", True):
                act += " (observe)"
            print(f"{r['kind']:<10} {r['rank']:>4} {r['node']:<6} {r['step']:>5} "
                  f"{self._s(r['injected_ns'], r['detected_ns']):>9} "
                  f"{self._s(r['injected_ns'], r['decided_ns']):>9} "
                  f"{self._s(r['injected_ns'], r['resumed_ns']):>9} "
                  f"{str(r['steps_rolled_back']):>11} {str(r.get('path') or '-'):<10} "
                  f"{act:<28} {r['recovered']}")
        acc, base = rep["accuracy"], rep["baseline_accuracy"]
        acc_s = f"{acc * 100:.2f} %" if acc is not None else "n/a (training did not finish)"
        print(f"\ntest accuracy {acc_s}; fault-free run with the same seed {base * 100:.2f} %"
              + (f" (difference {abs(acc - base) * 100:.2f} pp)" if acc is not None else ""))


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

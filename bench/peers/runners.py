"""Runners of the recovery benchmark: start the same job under one system, inject one fault
schedule with real signals, wait for the end, and leave behind the run's progress file (see
``common.py``) from which ``bench/recovery.py`` computes every figure the same way for every
system.

Systems (``RUNNERS``):

* ``torchrun``: ``python -m torch.distributed.run`` once per simulated node (``--nnodes 2``, or
  ``1:2`` for the node-loss fault so the survivor may continue alone), c10d rendezvous on loopback,
  ``--max-restarts``, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it torch 2.13's gloo
  restarts hang: ../shared/findings.md, pytorch issue 135712).
* ``full_restart``: what a scheduler alone does. The runner starts every rank itself; on any
  non-zero exit, or when no rank completed a step for ``hang_timeout_s`` (a progress heartbeat
  timeout, the same length as trainguard's hang timeout), it kills every process and starts a new
  job that loads the last checkpoint. Detection polls every 50 ms (optimistic for a real
  scheduler, which needs seconds).
* ``nvrx``: NVIDIA Resiliency Extension's ``ft_launcher`` (a torchrun with rank heartbeats),
  when it imports.
* ``torchft``: torchft's per-step quorum with one replica group per rank, each kept alive by its
  own torchrun, when it imports (``train_torchft.py``).
* ``trainguard``: the trainguard demo harness (``trainguard.demo.harness.Demo``) in a child
  process (``run_trainguard.py``).

Every time is Unix ns from ``time.time_ns()`` on this machine.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from common import parse_line  # noqa: E402


@dataclass
class JobConfig:
    """One job's settings. ``steps`` training steps, ``step_sleep_s`` pause per step (s),
    ``ckpt_every`` steps between checkpoints, ``hang_timeout_s`` (s) trainguard's hang timeout and
    the full-restart baseline's progress timeout, ``pg_timeout_s`` (s) the peers' collective
    timeout (torch's default is 1800 s: with it, no peer would ever see a hang end),
    ``node_timeout_s`` (s) trainguard's node heartbeat timeout, ``deadline_s`` (s) wall limit of
    one job, ``max_restarts`` torchrun/ft_launcher restarts."""

    steps: int = 300
    seed: int = 0
    nnodes: int = 2
    nproc_per_node: int = 2
    ckpt_every: int = 20
    step_sleep_s: float = 0.02
    hang_timeout_s: float = 2.0
    node_timeout_s: float = 3.0
    pg_timeout_s: float = 10.0
    deadline_s: float = 240.0
    max_restarts: int = 10

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass
class RunOutcome:
    """What a runner hands back: the progress file, the faults injected by the runner
    (``{"kind", "ranks", "step", "t_ns"}``; the ranks' own markers are in the progress file), the
    culprit ranks the system named per fault (None where it names none), whether the job
    finished, and notes."""

    progress: str
    launched_ns: int
    ended_ns: int = 0
    injected: list[dict[str, Any]] = field(default_factory=list)
    culprits: list[list[int] | None] | None = None
    finished: bool = False
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProgressTail:
    """Follows a progress file: latest record per rank, every record seen so far."""

    def __init__(self, path: str):
        self.path = path
        self.pos = 0
        self.buf = b""
        self.latest: dict[int, tuple] = {}
        self.last_ns = 0
        self.count = 0

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            rec = parse_line(raw.decode(errors="replace"))
            if rec and rec[0] == "step":
                self.latest[rec[1]] = rec
                self.last_ns = max(self.last_ns, rec[3])
                self.count += 1

    def max_step(self) -> int:
        return max((r[2] for r in self.latest.values()), default=-1)


def mark_fault(progress: str, kind: str, rank: int, step: int, t_ns: int) -> None:
    with open(progress, "a") as fh:
        fh.write(f"#fault {kind} {rank} {step} {t_ns}\n")


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and every descendant at once (collected first, then signalled)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def node_of_ranks(tail: ProgressTail, launcher_pid: int) -> list[int]:
    """The global ranks whose latest record comes from a descendant of ``launcher_pid``."""
    try:
        pids = {c.pid for c in psutil.Process(launcher_pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return []
    return sorted(r for r, rec in tail.latest.items() if rec[4] in pids)


class Runner:
    """Base: subclasses start processes (``start``), tell whether the job is over (``done``:
    None while running, True when it finished, False when it failed for good), kill a node
    (``kill_node``) and stop everything (``stop``)."""

    name = "?"

    def __init__(self, cfg: JobConfig, run_dir: str, faults: list[dict[str, Any]]):
        self.cfg = cfg
        self.run_dir = run_dir
        self.faults = faults
        self.progress = os.path.join(run_dir, "progress.log")
        self.ckpt_dir = os.path.join(run_dir, "ckpt")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        open(self.progress, "a").close()
        self.tail = ProgressTail(self.progress)
        self.outcome = RunOutcome(progress=self.progress, launched_ns=time.time_ns())
        self.hung_pids: set[int] = set()

    # -- to implement --
    def start(self) -> None: ...
    def done(self) -> bool | None: ...
    def kill_node(self, node: int) -> list[int]: ...
    def stop(self) -> None: ...
    def tick(self) -> None:
        """Called every loop iteration (supervision for the full-restart baseline)."""

    def script_args(self) -> list[str]:
        c = self.cfg
        in_script = [f for f in self.faults if f["kind"] in ("exception", "straggler")]
        return ["--steps", str(c.steps), "--seed", str(c.seed), "--ckpt-every", str(c.ckpt_every),
                "--ckpt-dir", self.ckpt_dir, "--step-sleep", str(c.step_sleep_s),
                "--pg-timeout", str(c.pg_timeout_s), "--faults", json.dumps(in_script)]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"BENCH_PROGRESS": self.progress, "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        return env

    def log(self, name: str):
        return open(os.path.join(self.run_dir, name), "ab")

    # -- the driver --
    def run(self) -> RunOutcome:
        deadline = time.monotonic() + self.cfg.deadline_s
        pending = sorted((f for f in self.faults if f["kind"] in ("sigkill", "hang", "node_loss")),
                         key=lambda f: f["step"])
        self.outcome.launched_ns = time.time_ns()
        self.start()
        try:
            while time.monotonic() < deadline:
                self.tail.poll()
                self.tick()
                if pending:
                    self._maybe_inject(pending)
                state = self.done()
                if state is not None:
                    self.outcome.finished = bool(state)
                    break
                time.sleep(0.005)
            else:
                self.outcome.notes.append(f"job did not finish within {self.cfg.deadline_s:.0f} s")
        finally:
            self.outcome.ended_ns = time.time_ns()
            self.stop()
        if pending:
            self.outcome.notes.append(f"{len(pending)} fault(s) not injected")
        return self.outcome

    def _maybe_inject(self, pending: list[dict[str, Any]]) -> None:
        f = pending[0]
        if f["kind"] == "node_loss":
            if self.tail.max_step() < f["step"]:
                return
            ts = time.time_ns()
            ranks = self.kill_node(f["node"])
            step = self.tail.max_step()
        else:
            rec = self.tail.latest.get(f["rank"])
            if rec is None or rec[2] < f["step"]:
                return
            ts = time.time_ns()
            try:
                os.kill(rec[4], signal.SIGKILL if f["kind"] == "sigkill" else signal.SIGSTOP)
            except ProcessLookupError:
                return
            if f["kind"] == "hang":
                self.hung_pids.add(rec[4])
            ranks, step = [f["rank"]], rec[2]
        pending.pop(0)
        for r in ranks or [-1]:
            mark_fault(self.progress, f["kind"], r, step, ts)
        self.outcome.injected.append({"kind": f["kind"], "ranks": ranks, "step": step, "t_ns": ts})


# ---------------------------------------------------------------------------------------------
class TorchrunRunner(Runner):
    """One ``torch.distributed.run`` per simulated node; ``--nnodes 1:2`` for node loss."""

    name = "torchrun"
    module = "torch.distributed.run"

    def launcher_cmd(self, node: int, port: int) -> list[str]:
        c = self.cfg
        elastic = any(f["kind"] == "node_loss" for f in self.faults)
        cmd = [sys.executable, "-m", self.module,
               "--nnodes", f"1:{c.nnodes}" if elastic else str(c.nnodes),
               "--nproc-per-node", str(c.nproc_per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "bench", "--max-restarts", str(c.max_restarts),
               "--monitor-interval", "0.1"]
        if elastic:
            # torch's default last call is 30 s: the survivor would wait that long for the lost
            # node before forming the smaller world.
            cmd += ["--rdzv-conf", "last_call_timeout=5"]
        return cmd + [os.path.join(HERE, "train_plain.py"), *self.script_args()]

    def start(self) -> None:
        port = free_port()
        self.launchers: list[subprocess.Popen] = []
        for node in range(self.cfg.nnodes):
            self.launchers.append(subprocess.Popen(
                self.launcher_cmd(node, port), env=self.env(), cwd=self.run_dir,
                stdout=self.log(f"{self.name}-node{node}.log"), stderr=subprocess.STDOUT,
                start_new_session=True))
            if node == 0:
                time.sleep(0.5)  # node 0 hosts the c10d store; node 1 is the one we kill

    def done(self) -> bool | None:
        codes = [p.poll() for p in self.launchers]
        alive = [c for c in codes if c is None]
        ok = [c for c in codes if c == 0]
        if not alive:
            return bool(ok)
        if ok and len(alive) < len(codes) and self.tail.max_step() >= self.cfg.steps - 1:
            return None  # the others are finishing
        return None

    def kill_node(self, node: int) -> list[int]:
        p = self.launchers[node]
        ranks = node_of_ranks(self.tail, p.pid)
        kill_tree(p.pid)
        return ranks

    def stop(self) -> None:
        for p in self.launchers:
            if p.poll() is None:
                kill_tree(p.pid)
        for p in self.launchers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        for rec in self.tail.latest.values():
            try:
                os.kill(rec[4], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class NvrxRunner(TorchrunRunner):
    """NVRx ``ft_launcher`` per node, ranks send heartbeats through ``RankMonitorClient``."""

    name = "nvrx"

    def launcher_cmd(self, node: int, port: int) -> list[str]:
        cmd = super().launcher_cmd(node, port)
        launcher = os.path.join(os.path.dirname(sys.executable), "ft_launcher")
        i = cmd.index(self.module)
        hb = self.cfg.hang_timeout_s
        cmd = [launcher] + cmd[i + 1:]
        j = cmd.index(os.path.join(HERE, "train_plain.py"))
        ft = ["--ft-param-initial_rank_heartbeat_timeout", "60",
              "--ft-param-rank_heartbeat_timeout", str(hb)]
        return cmd[:j] + ft + cmd[j:] + ["--nvrx"]


# ---------------------------------------------------------------------------------------------
class FullRestartRunner(Runner):
    """The scheduler-alone baseline: every rank started by the runner, whole-job restarts."""

    name = "full_restart"

    def start(self) -> None:
        self.attempt = -1
        self.procs: list[subprocess.Popen] = []
        self.restart_reasons: list[str] = []
        self._launch()

    def _launch(self) -> None:
        self.attempt += 1
        self.attempt_ns = time.time_ns()
        self.seen_at_attempt = self.tail.count
        port = free_port()
        logf = self.log("full_restart.log")
        self.procs = []
        for rank in range(self.cfg.world_size):
            env = self.env()
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank % self.cfg.nproc_per_node),
                        "WORLD_SIZE": str(self.cfg.world_size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "BENCH_INCARNATION": f"a{self.attempt}"})
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "train_plain.py"), *self.script_args()],
                env=env, cwd=self.run_dir, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True))

    def tick(self) -> None:
        codes = [p.poll() for p in self.procs]
        reason = None
        if any(c not in (None, 0) for c in codes):
            reason = f"exit codes {codes}"
        elif self.tail.count > self.seen_at_attempt and \
                self.tail.max_step() < self.cfg.steps - 1:  # training, and not finishing
            if time.time_ns() - self.tail.last_ns > self.cfg.hang_timeout_s * 1e9 and \
                    any(c is None for c in codes):
                reason = f"no progress for {self.cfg.hang_timeout_s} s"
        if reason is None or self.attempt >= self.cfg.max_restarts:
            return
        self.restart_reasons.append(reason)
        for p in self.procs:
            kill_tree(p.pid)
        for p in self.procs:
            p.wait()
        self._launch()

    def done(self) -> bool | None:
        codes = [p.poll() for p in self.procs]
        if all(c == 0 for c in codes):
            return True
        if self.attempt >= self.cfg.max_restarts and any(c not in (None, 0) for c in codes):
            return False
        return None

    def kill_node(self, node: int) -> list[int]:
        n = self.cfg.nproc_per_node
        ranks = list(range(node * n, (node + 1) * n))
        for r in ranks:
            self.procs[r].kill()
        return ranks

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
        for p in self.procs:
            p.wait()
        self.outcome.extra["restart_reasons"] = self.restart_reasons


# ---------------------------------------------------------------------------------------------
class TorchftRunner(Runner):
    """torchft: a lighthouse, one replica group per rank (each its own torchrun with restarts),
    per-step quorum, live recovery of a restarted replica from a healthy peer."""

    name = "torchft"

    def start(self) -> None:
        c = self.cfg
        self.lost: set[int] = set()
        self.lh_port = free_port()
        lh = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        self.lighthouse = subprocess.Popen(
            [lh, "--min_replicas", "2", "--quorum_tick_ms", "100", "--join_timeout_ms", "5000",
             "--bind", f"127.0.0.1:{self.lh_port}"],
            stdout=self.log("lighthouse.log"), stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(0.3)
        self.launchers: list[subprocess.Popen] = []
        for g in range(c.world_size):
            env = self.env()
            # torchft's Manager needs the launcher's TCPStore shared with the workers (it connects
            # to MASTER_ADDR:MASTER_PORT), so the torchrun store fix is not applied here.
            env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
            env.update({"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.lh_port}",
                        "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(c.world_size)})
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"g{g}",
                   "--max-restarts", str(c.max_restarts), "--monitor-interval", "0.1",
                   os.path.join(HERE, "train_torchft.py"), *self.script_args()]
            self.launchers.append(subprocess.Popen(
                cmd, env=env, cwd=self.run_dir, stdout=self.log(f"torchft-g{g}.log"),
                stderr=subprocess.STDOUT, start_new_session=True))

    def done(self) -> bool | None:
        # Replica groups lost with their node, or holding a hung (stopped) process, are not
        # waited for: torchft trains on without them and nothing in it ends them.
        live = []
        for g, p in enumerate(self.launchers):
            if g in self.lost:
                continue
            if p.poll() is None:
                try:
                    kids = {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
                except psutil.NoSuchProcess:
                    kids = set()
                if kids & self.hung_pids:
                    continue
                return None
            live.append(p.returncode)
        return bool(live) and all(c == 0 for c in live)

    def kill_node(self, node: int) -> list[int]:
        n = self.cfg.nproc_per_node
        ranks = list(range(node * n, (node + 1) * n))
        for r in ranks:
            kill_tree(self.launchers[r].pid)
            self.lost.add(r)
        return ranks

    def stop(self) -> None:
        for p in [*self.launchers, self.lighthouse]:
            if p.poll() is None:
                kill_tree(p.pid)
        for p in [*self.launchers, self.lighthouse]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for rec in self.tail.latest.values():
            try:
                os.kill(rec[4], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# ---------------------------------------------------------------------------------------------
class TrainguardRunner(Runner):
    """trainguard through its demo harness, in a child process (``run_trainguard.py``). The
    harness injects the faults itself and reports each one's timeline and verdict; the progress
    file comes from ``tg_hook/sitecustomize.py`` wrapping ``Context.progress``."""

    name = "trainguard"

    def run(self) -> RunOutcome:
        c = self.cfg
        report = os.path.join(self.run_dir, "report.json")
        faults = []
        spare_nodes = 0
        for i, f in enumerate(self.faults, 1):
            g = dict(f, id=i)
            # a benchmark fault may be a harness fault under another name, with a spare node
            g["kind"] = g.pop("harness_kind", g["kind"])
            spare_nodes = max(spare_nodes, int(g.pop("spare_nodes", 0)))
            if "node" in g:
                g.setdefault("rank", g["node"] * c.nproc_per_node)
            faults.append(g)
        conf = {"steps": c.steps, "seed": c.seed, "nnodes": c.nnodes,
                "nproc_per_node": c.nproc_per_node, "ckpt_every": c.ckpt_every,
                "step_sleep_s": c.step_sleep_s, "hang_timeout_s": c.hang_timeout_s,
                "node_timeout_s": c.node_timeout_s, "faults": faults,
                "run_dir": os.path.join(self.run_dir, "tg"), "report": report, "quiet": True,
                "spare_nodes": spare_nodes,
                "recovery_timeout_s": min(90.0, c.deadline_s / 2)}
        env = self.env()
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(HERE, "tg_hook"), ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.outcome.launched_ns = time.time_ns()
        logf = self.log("trainguard.log")
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "run_trainguard.py"),
                              json.dumps(conf)], env=env, cwd=ROOT, stdout=logf,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(c.deadline_s + 60)
        except subprocess.TimeoutExpired:
            rc = None
            self.outcome.notes.append(f"harness did not finish within {c.deadline_s + 60:.0f} s")
        finally:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
            # Whatever the harness left behind (it normally stops all of it).
            self.tail.poll()
            for rec in self.tail.latest.values():
                try:
                    os.kill(rec[4], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.outcome.ended_ns = time.time_ns()
        if not os.path.exists(report):
            self.outcome.notes.append(f"harness wrote no report (exit {rc}); see "
                                      f"{os.path.join(self.run_dir, 'trainguard.log')}")
            return self.outcome
        rep = json.load(open(report))
        self.outcome.extra["report"] = rep
        self.outcome.finished = rep.get("accuracy") is not None
        culprits = []
        for f, orig, r in zip(faults, self.faults, rep.get("faults", [])):
            kind = orig["kind"]  # the benchmark's name of the fault
            v = r.get("verdict") or {}
            culprits.append(v.get("culprit_ranks"))
            if r.get("injected_ns"):
                ranks = r.get("ranks") or [r.get("rank", f.get("rank", -1))]
                if "node" in f and not r.get("ranks"):
                    n = c.nproc_per_node
                    ranks = list(range(f["node"] * n, (f["node"] + 1) * n))
                for rk in ranks:
                    mark_fault(self.progress, kind, rk, r.get("step", f["step"]),
                               r["injected_ns"])
                self.outcome.injected.append({"kind": kind, "ranks": ranks,
                                              "step": f["step"], "t_ns": r["injected_ns"],
                                              "harness": r})
            else:
                self.outcome.notes.append(f"{f['kind']}: the harness could not inject it")
        self.outcome.culprits = culprits
        return self.outcome


RUNNERS: dict[str, type[Runner]] = {
    "trainguard": TrainguardRunner, "torchrun": TorchrunRunner,
    "full_restart": FullRestartRunner, "torchft": TorchftRunner, "nvrx": NvrxRunner,
}


def available(system: str) -> str | None:
    """None when ``system`` can run here, else the reason it cannot."""
    try:
        if system == "torchft":
            import torchft  # noqa: F401

            if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")):
                return "torchft installed without its torchft_lighthouse binary"
        elif system == "nvrx":
            import nvidia_resiliency_ext.fault_tolerance  # noqa: F401

            if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ft_launcher")):
                return "nvidia-resiliency-ext installed without ft_launcher"
        elif system == "trainguard":
            import trainguard.demo.harness  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None

"""A real cluster on one machine, shared by the tests, ``bench/cluster.py`` and users.

``Cluster(ClusterConfig(nodes=3))`` builds the nodes (``trainguard.cluster.net``: a network and
UTS namespace each, an address on a private bridge), starts the control plane on the host side
of the bridge — NATS, Valkey, the rendezvous store and the services (``trainguard.stack.local.Stack``
bound to the bridge's address) — a node agent inside each node, and, with ``slurm=True``, a real
Slurm (``trainguard.cluster.slurm``). ``launch`` starts one ``trainguard launch`` per node inside
the node; the ranks of different nodes talk over the bridge. ``FaultRunner`` carries out the
node faults of a fault schedule (``trainguard.core.fault_schedule``: power-off, partition, slow link)
at their step or time; the rank faults of the same file go to the launchers (``--faults``).
``stop()`` leaves nothing behind (processes, namespaces, veths, bridge, Slurm daemons, temporary
directories it made), also after a failure; ``start`` first removes the leftovers of harnesses
that died.

    with Cluster(ClusterConfig(nodes=3)) as c:
        c.launch("job1", nodes=["node0", "node1"], spare_nodes=["node2"], nproc_per_node=2)
        FaultRunner(c, "job1", fault_schedule.load("faults.yaml")).start()
        …   c.steps("job1")  # the ranks' per-step records

Step records (``trainguard/cluster/train.py``): ``<run_dir>/<job>/steps.jsonl``;
``training_again`` reads from them when every rank trained again after a fault.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from trainguard.core.fault_schedule import Fault

from trainguard.cluster.net import ClusterNet

__all__ = ["Cluster", "ClusterConfig", "FaultRunner", "training_again", "TRAIN_SCRIPT",
           "stop_on_signals"]

TRAIN_SCRIPT = os.path.join(os.path.dirname(__file__), "train.py")

#: Clusters started and not yet stopped (what ``stop_on_signals`` and atexit stop).
_LIVE: list["Cluster"] = []
#: How many ``Cluster.stop`` calls are under way, and the signal that came meanwhile: a stop is
#: never cut short by SIGTERM or SIGINT; the signal takes effect once it is done.
_stopping = 0
_deferred: list[int] = []


def _stop_all() -> None:
    _deferred.clear()
    for c in list(_LIVE):
        try:
            c.stop()
        except Exception:  # noqa: BLE001 - at exit: stop the others anyway
            pass


atexit.register(_stop_all)


def _on_signal(signum: int, frame: Any) -> None:
    if _stopping:
        _deferred.append(signum)
        return
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGINT end this process through ``SystemExit(128 + signal)``, so that
    every ``with Cluster(...)`` block unwinds and stops its cluster; a signal that arrives while
    a cluster is being stopped waits until that is done; atexit stops any cluster still live.
    For commands that build clusters (benches): call once from the main thread. A SIGKILL
    cannot be caught: the next ``Cluster.start`` removes what it left (``cleanup_leftovers``)."""
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


@dataclass
class ClusterConfig:
    """``nodes`` [3] (named ``node0`` …); ``run_dir`` [a new temporary directory, removed by
    ``stop`` unless ``keep``]; ``services`` the control plane's services (the agents run in the
    nodes); ``node_timeout_s`` [3] what launches register; ``slurm`` [False] start Slurm too
    (the remediator then excludes through it: ``TG_NODE_CONTROLLER=slurm``);
    ``slurmd_timeout_s`` [10] Slurm's ``SlurmdTimeout``; ``env``: extra environment of the
    services."""

    nodes: int = 3
    run_dir: str = ""
    keep: bool = False
    services: tuple[str, ...] = ("detector", "attributor", "remediator", "checkpoint_validator")
    node_timeout_s: float = 3.0
    slurm: bool = False
    slurmd_timeout_s: int = 10
    env: dict[str, str] = field(default_factory=dict)


class Cluster:
    """See the module docstring. Attributes once started: ``net``, ``stack``, ``slurm`` (or
    None), ``launchers`` (job → node → Popen), ``run_dir``."""

    def __init__(self, cfg: ClusterConfig | None = None):
        self.cfg = cfg or ClusterConfig()
        self.net = ClusterNet(self.cfg.nodes)
        self.stack = None
        self.slurm = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.launchers: dict[str, dict[str, subprocess.Popen]] = {}
        self.run_dir = ""
        self._own_dir = False

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> "Cluster":
        from trainguard.stack.local import Stack

        cfg = self.cfg
        self.run_dir = cfg.run_dir or tempfile.mkdtemp(prefix="trainguard-cluster-")
        self._own_dir = not cfg.run_dir and not cfg.keep
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        _LIVE.append(self)
        try:
            self.net.start()
            env = dict(cfg.env)
            if cfg.slurm:
                from trainguard.cluster.slurm import SlurmCluster

                self.slurm = SlurmCluster(self.net, os.path.join(self.run_dir, "slurm"),
                                          slurmd_timeout_s=cfg.slurmd_timeout_s).start()
                env.update(TG_NODE_CONTROLLER="slurm", SLURM_CONF=self.slurm.conf)
            self.stack = Stack(services=cfg.services, agent_nodes=(), rendezvous=True,
                               log_dir=os.path.join(self.run_dir, "logs"), env=env,
                               host=self.net.host_addr)
            self.stack.start(timeout=120)
            for n in self.net.names:
                self.start_agent(n)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Everything down, nothing left (see the module docstring). Idempotent. SIGTERM and
        SIGINT wait until it is done (``stop_on_signals``)."""
        global _stopping
        _stopping += 1
        try:
            self._stop()
        finally:
            _stopping -= 1
            if self in _LIVE:
                _LIVE.remove(self)
        if not _stopping and _deferred:
            raise SystemExit(128 + _deferred.pop())

    def _stop(self) -> None:
        for nodes in self.launchers.values():
            for p in nodes.values():
                if p.poll() is None:
                    p.terminate()
        for nodes in self.launchers.values():
            for p in nodes.values():
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.launchers.clear()
        try:
            if self.slurm is not None:
                self.slurm.stop()
        finally:
            self.slurm = None
            try:
                self.net.stop()  # SIGKILLs what is left in the nodes (agents, ranks, slurmd)
            finally:
                for p in self.agents.values():
                    p.poll()
                self.agents.clear()
                if self.stack is not None:
                    self.stack.stop()
                    self.stack = None
                if self._own_dir:
                    shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- processes on the nodes ---------------------------------------------------------
    def _log(self, name: str):
        return open(os.path.join(self.run_dir, "logs", f"{name}.log"), "ab")

    def start_agent(self, node: str) -> subprocess.Popen:
        """The node agent of ``node``, inside it (role ``agent``)."""
        nats_url, redis_url = self.stack.urls("agent")
        env = {**os.environ, "NATS_URL": nats_url, "REDIS_URL": redis_url}
        with self._log(f"agent-{node}") as log:
            p = self.net.popen(node, [sys.executable, "-m", "trainguard.agents", "--node", node,
                                      "--kmsg", "none", "--no-nvml"], env=env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.agents[node] = p
        return p

    def launch_argv(self, job: str, nnodes: int, node_rank: int | None, node: str,
                    nproc_per_node: int = 2, spare: bool = False, mode: str = "action",
                    script: str = TRAIN_SCRIPT, script_args: Sequence[str] | None = None,
                    extra: Sequence[str] = (), ckpt_dir: str = "", spares: int = 0) -> list[str]:
        """The ``trainguard launch`` command line of one node of ``job`` (``node_rank`` None:
        ``$SLURM_NODEID``, expanded by the shell of an sbatch script). A spare node keeps
        ``nproc_per_node`` warm processes (it takes a whole node's ranks); the others keep
        ``spares`` (0: a ``trainguard.run`` job's survivors rejoin in process, and a node that
        failed is replaced by the spare node)."""
        args = list(script_args) if script_args is not None else [
            "--records", self.records_dir(job)]
        rank = ["--spare-node", "--spares", str(nproc_per_node)] if spare else \
            ["--node-rank", "$SLURM_NODEID" if node_rank is None else str(node_rank),
             "--spares", str(spares)]
        return [sys.executable, "-m", "trainguard.cli", "launch", *rank,
                "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
                "--node", node, "--job", job, "--mode", mode,
                "--rdzv-endpoint", self.stack.rdzv_endpoint,
                "--ckpt-dir", ckpt_dir or self.ckpt_dir(job),
                "--node-timeout", str(self.cfg.node_timeout_s), *extra, script, *args]

    def worker_env(self) -> dict[str, str]:
        """What a launcher needs (role ``worker``): ``NATS_URL``, ``REDIS_URL``,
        ``TG_RDZV_ENDPOINT``."""
        nats_url, redis_url = self.stack.urls("worker")
        return {"NATS_URL": nats_url, "REDIS_URL": redis_url,
                "TG_RDZV_ENDPOINT": self.stack.rdzv_endpoint}

    def launch(self, job: str, nodes: Sequence[str], spare_nodes: Sequence[str] = (),
               nproc_per_node: int = 2, **kw: Any) -> dict[str, subprocess.Popen]:
        """One launcher per node of ``nodes`` (node rank = position) and per spare node, each
        inside its node; logs in ``<run_dir>/logs/launcher-<job>-<node>.log``."""
        env = {**os.environ, **self.worker_env()}
        procs = {}
        for i, node in enumerate([*nodes, *spare_nodes]):
            spare = i >= len(nodes)
            tmp = os.path.join(self.run_dir, "tmp", node)  # the node's own /tmp (see sbatch)
            os.makedirs(tmp, exist_ok=True)
            argv = self.launch_argv(job, len(nodes), None if spare else i, node,
                                    nproc_per_node, spare=spare, **kw)
            with self._log(f"launcher-{job}-{node}") as log:
                procs[node] = self.net.popen(node, argv, env={**env, "TMPDIR": tmp}, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.launchers.setdefault(job, {}).update(procs)
        return procs

    def sbatch(self, job: str, nnodes: int, spare_nodes: int = 0, nproc_per_node: int = 2,
               opts: Sequence[str] = (), **kw: Any) -> str:
        """Submit ``job`` to this cluster's Slurm (``slurm=True``) as ``deploy/slurm/
        train.sbatch`` runs it: ``sbatch -N <nnodes + spare_nodes> --no-kill --requeue``, one
        ``trainguard launch`` per node of the allocation through ``srun``, node rank
        ``$SLURM_NODEID``, the last ``spare_nodes`` nodes spare nodes (``--spare-node``);
        ``opts`` go to sbatch, ``kw`` to ``launch_argv``. The job's environment is the
        launcher's (``worker_env``), ``GLOO_SOCKET_IFNAME=eth0`` and ``TMPDIR`` the node's own
        ``<run_dir>/tmp/<host name>`` (default log dirs and sockets stay in the run directory,
        never in this machine's /tmp). Returns the Slurm job id;
        its output: ``<run_dir>/logs/slurm-<job>-<id>.out``."""
        import shlex

        def line(spare: bool) -> str:
            argv = self.launch_argv(job, nnodes, None, "$(hostname)", nproc_per_node,
                                    spare=spare, **kw)
            return "exec " + " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)

        # each node's temporary files (the launcher's default log dir, the node writer's
        # socket) in the run directory, as a machine's own /tmp: nothing is left in ours
        tmp = shlex.quote(os.path.join(self.run_dir, "tmp"))
        body = (f'export TMPDIR={tmp}/$(hostname); mkdir -p "$TMPDIR"; '
                f'if [ "$SLURM_NODEID" -lt {nnodes} ]; then {line(False)}; '
                f'else {line(True)}; fi')
        script = os.path.join(self.run_dir, f"{job}.sbatch")
        with open(script, "w") as fh:
            fh.write("#!/bin/bash\nsrun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 "
                     f"bash -c {shlex.quote(body)}\n")
        out = os.path.join(self.run_dir, "logs", f"slurm-{job}-%j.out")
        return self.slurm.sbatch(script, "-N", str(nnodes + spare_nodes), "--no-kill",
                                 "--requeue", "-J", job, "-o", out, *opts,
                                 env={**self.worker_env(), "GLOO_SOCKET_IFNAME": "eth0"})

    def launcher_log(self, job: str, node: str) -> str:
        try:
            with open(os.path.join(self.run_dir, "logs", f"launcher-{job}-{node}.log"),
                      errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    # ---- what happened ----------------------------------------------------------------
    def records_dir(self, job: str) -> str:
        return os.path.join(self.run_dir, job)

    def ckpt_dir(self, job: str) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def steps(self, job: str) -> list[dict[str, Any]]:
        """The ranks' step records of ``job`` (oldest first; a torn last line is skipped)."""
        out = []
        try:
            with open(os.path.join(self.records_dir(job), "steps.jsonl")) as fh:
                for line in fh:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        except FileNotFoundError:
            pass
        return out

    def wait_step(self, job: str, step: int, rank: int = 0, timeout: float = 120.0,
                  since: float = 0.0) -> dict[str, Any] | None:
        """The first record of ``rank`` at ``step`` or later (after Unix s ``since``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for r in self.steps(job):
                if r["rank"] == rank and r["step"] >= step and r["t"] >= since:
                    return r
            time.sleep(0.05)
        return None


def training_again(records: list[dict[str, Any]], fault_s: float) -> dict[str, Any] | None:
    """When every rank trained again after a fault at Unix s ``fault_s``: the records of the
    newest generation that started after it must cover its whole world. Returns ``{"t": Unix s
    of the last rank's first step there, "gen", "world", "first_step", "hosts"}`` or None."""
    before = [r for r in records if r["t"] <= fault_s]
    g0 = max((r["gen"] for r in before), default=-1)
    after = [r for r in records if r["t"] > fault_s and r["gen"] > g0]
    if not after:
        return None
    for gen in sorted({r["gen"] for r in after}, reverse=True):
        recs = [r for r in after if r["gen"] == gen]
        world = recs[0]["world"]
        first: dict[int, dict[str, Any]] = {}
        for r in recs:
            first.setdefault(r["rank"], r)
        if len(first) >= world:
            return {"t": max(r["t"] for r in first.values()), "gen": gen, "world": world,
                    "first_step": min(r["step"] for r in first.values()),
                    "hosts": sorted({r["host"] for r in first.values()})}
    return None


class FaultRunner(threading.Thread):
    """Carries out the node faults of a schedule on ``cluster`` for ``job`` (rank faults are the
    launchers'): each at its trigger — ``step``: the first record of ``rank`` (default 0) at that
    step on the fault's node (a rank moved to another node before it does not fire it);
    ``at_s``: seconds after ``start()`` — then its heal (``heal_after_s``) or end
    (``duration_s``). ``fired``: ``[{"id", "kind", "node", "ts": Unix s, "end": Unix s or
    None}]``; ``error``: what stopped it (a node that is not there), else None."""

    def __init__(self, cluster: Cluster, job: str, faults: Sequence[Fault],
                 timeout_s: float = 300.0):
        super().__init__(daemon=True, name=f"faults-{job}")
        self.cluster, self.job = cluster, job
        self.faults = [f for f in faults if not f.on_rank]
        self.timeout_s = timeout_s
        self.fired: list[dict[str, Any]] = []
        self.error: str | None = None
        self._cancelled = threading.Event()
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.time()
        super().start()

    def cancel(self) -> None:
        self._cancelled.set()

    def _due(self, f: Fault) -> bool:
        if f.at_s is not None:
            return time.time() - self.t0 >= f.at_s
        rank = f.rank if f.rank is not None else 0
        # a record of that rank on the fault's node: once the job moved the rank elsewhere (a
        # decision before the fault), the node is out of the job and the fault waits
        node = f.node_name(self.cluster.net.names)
        return any(r["rank"] == rank and r["step"] >= f.step and r.get("host", node) == node
                   for r in self.cluster.steps(self.job))

    def run(self) -> None:
        net = self.cluster.net
        pending = list(self.faults)
        deadline = time.monotonic() + self.timeout_s
        try:
            while pending and not self._cancelled.is_set() and time.monotonic() < deadline:
                for f in [f for f in pending if self._due(f)]:
                    pending.remove(f)
                    node = f.node_name(net.names)
                    rec = {"id": f.id, "kind": f.kind, "node": node, "end": None}
                    if f.kind == "power_off":
                        rec["ts"] = net.power_off(node) / 1e9
                    elif f.kind == "partition":
                        rec["ts"] = net.partition(node) / 1e9
                        if f.heal_after_s:
                            self._later(f.heal_after_s, rec, lambda n=node: net.heal(n))
                    elif f.kind == "slow_link":
                        rec["ts"] = net.slow_link(node, f.rate) / 1e9
                        if f.duration_s:
                            self._later(f.duration_s, rec, lambda n=node: net.fast_link(n))
                    self.fired.append(rec)
                self._cancelled.wait(0.05)
        except Exception as exc:  # noqa: BLE001 - reported to whoever reads .error
            self.error = f"{type(exc).__name__}: {exc}"

    def _later(self, delay: float, rec: dict[str, Any], fn) -> None:
        def _go() -> None:
            if not self._cancelled.is_set():
                rec["end"] = fn() / 1e9

        t = threading.Timer(delay, _go)
        t.daemon = True
        t.start()

"""``trainguard launch``: a drop-in for ``torchrun`` that starts the ranks of one node, keeps
warm spares, reports worker lifecycle on the bus, and executes the remediator's decisions for
this node.

    trainguard launch --nnodes 2 --nproc-per-node 2 --node-rank 0 --job demo train.py [args]
    trainguard launch --standalone --nproc-per-node 2 train.py      # torchrun's command line

The command line is torchrun's (``trainguard.launch_args``). Every rank gets torchrun's
environment contract — ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_NAME``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` (the rendezvous store), ``TORCHELASTIC_USE_AGENT_STORE=True``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_ERROR_FILE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS=1`` with more
than one rank per node unless set — plus ``TG_JOB``, ``TG_NODE``, ``TG_GENERATION``,
``TG_MODE``, ``TG_RDZV_ENDPOINT``, ``NATS_URL``, ``REDIS_URL``, ``TG_CKPT_DIR``. Ranks start
from warm spare processes (``trainguard.spare``) that have torch imported and warmed, and a
replacement spare is started after each use, so a respawn costs no interpreter or torch
start-up. What a decision means for each rank is ``trainguard.executor.plan_node``.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from trainguard import schemas
from trainguard.schemas import JobSettings, subjects

from .bus import ThreadedBus
from .executor import EXIT_STOPPED, LocalRank, plan_node
from .launch_args import StdSpec
from .state import LauncherConflict, StateStore

if TYPE_CHECKING:
    from .checkpoint.writer import NodeWriter

log = logging.getLogger("trainguard.launcher")


@dataclass
class LaunchConfig:
    """Settings of one node's launcher (defaults in brackets).

    ``mode`` [observe]: ``action`` executes decisions, ``observe`` only publishes them.
    ``spares`` [1]: warm spare processes kept ready on this node.
    ``hang_timeout_s`` [0 = learned by the detector], ``startup_timeout_s`` [120],
    ``node_timeout_s`` [3]: detection settings registered for the job.
    ``retry_budget`` [10], ``min_world_size`` [1]: remediator policy settings for the job.
    ``spare_node`` [False]: this node only waits to replace an excluded node.
    ``refill_delay_s`` [2]: seconds after a spare became a rank before its replacement spare
    starts warming — a spare importing torch takes a core for seconds, and during the
    recovery it would slow every rank's restore (measured on 2 cores: the restore of a hang
    recovery 0.47 s with an immediate refill).
    ``node_writer`` [True]: hold one checkpoint writer daemon for this node's ranks
    (``trainguard.checkpoint.NodeWriter``, exported as ``TG_CKPT_WRITER``); its writers share
    the daemon's imports, ≈ 4 MB per rank instead of ≈ 16 MB for a writer per rank. A rank falls
    back to a writer of its own when the daemon does not answer.
    torchrun's settings (``trainguard.launch_args``): ``max_restarts`` [0] (observe mode: group
    restarts after a failure), ``role`` ["default"], ``log_dir`` [""], ``redirects``/``tee``
    (which local ranks' stdout/stderr go to files), ``local_ranks_filter`` [all] (console),
    ``no_python`` [False] (run the program itself: no spare, no hooks),
    ``monitor_interval_s`` [0.5], ``standalone`` [False] (start an embedded stack when none is
    configured).
    """

    script: str
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    node: str = field(default_factory=subjects.default_node)
    job: str = "default"
    mode: str = "observe"
    rdzv_endpoint: str = ""
    nats_url: str = ""
    redis_url: str = ""
    ckpt_dir: str = ""
    spares: int = 1
    hang_timeout_s: float = 0.0
    startup_timeout_s: float = 120.0
    node_timeout_s: float = 3.0
    retry_budget: int = 10
    min_world_size: int = 1
    spare_node: bool = False
    heartbeat_interval_s: float = 0.5
    refill_delay_s: float = 2.0
    warm_imports: str = ""
    node_writer: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    role: str = "default"
    log_dir: str = ""
    redirects: StdSpec = field(default_factory=StdSpec)
    tee: StdSpec = field(default_factory=StdSpec)
    local_ranks_filter: frozenset[int] = frozenset()
    no_python: bool = False
    monitor_interval_s: float = 0.5
    standalone: bool = False

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def _is_local(host: str) -> bool:
    """True when ``host`` names this machine (loopback, its host name, or one of its
    addresses)."""
    if host in ("localhost", "0.0.0.0", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    if host in names:
        return True
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        return bool(mine & {a[4][0] for a in socket.getaddrinfo(host, None)})
    except OSError:
        return False


def _pdeathsig_kill() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Proc:
    """A spare or worker process with its output pumps.

    ``argv`` None: a warm spare (``trainguard.spare``), assigned a rank later; else the program
    itself (``--no-python``), started with its rank's environment. ``in_process`` becomes True
    when the rank says on its launcher pipe (``TG_LAUNCHER_FD``) that it runs ``trainguard.run``
    and so rejoins in process (``trainguard.executor``)."""

    def __init__(self, launcher: "Launcher", env: dict[str, str],
                 argv: list[str] | None = None):
        self.launcher = launcher
        rfd, wfd = os.pipe()
        self.direct = argv is not None
        self.popen = subprocess.Popen(
            argv or [sys.executable, "-m", "trainguard.spare"],
            env={**env, "TG_LAUNCHER_FD": str(wfd)},
            stdin=subprocess.DEVNULL if self.direct else subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_pdeathsig_kill,
            text=True, bufsize=1, pass_fds=(wfd,))
        os.close(wfd)
        self.local_rank: int | None = None
        self.rank: int | None = None
        self.generation = 0
        self.expected_exit = False
        self.started_ns = 0
        self.in_process = False
        self.files: dict[str, Any] = {}   # "stdout"/"stderr" → per-rank log file
        self.console = {"stdout": True, "stderr": True}
        threading.Thread(target=self._control, args=(rfd,), daemon=True).start()
        if not self.direct:  # a direct program's pumps start once it is assigned (its files)
            self._start_pumps()

    def _start_pumps(self) -> None:
        for stream, name in ((self.popen.stdout, "stdout"), (self.popen.stderr, "stderr")):
            threading.Thread(target=self._pump, args=(stream, name), daemon=True).start()

    def _control(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for line in fh:
                if line.strip() == b"restart in_process":
                    self.in_process = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def assign(self, local_rank: int, rank: int, generation: int, env: dict[str, str],
               argv: list[str], module: bool, log_dir: str = "") -> None:
        """Make this process rank ``rank``; with ``log_dir``, its output goes to
        ``<log_dir>/{stdout,stderr}.log`` as ``--redirects``/``--tee`` say."""
        cfg = self.launcher.cfg
        for name, bit in (("stdout", 1), ("stderr", 2)):
            to_file = bool((cfg.redirects.of(local_rank) | cfg.tee.of(local_rank)) & bit)
            if to_file and log_dir:
                os.makedirs(log_dir, exist_ok=True)
                self.files[name] = open(os.path.join(log_dir, f"{name}.log"), "a")
            # --tee copies to the console what --redirects sends to the file (as torchrun)
            shown = not (cfg.redirects.of(local_rank) & bit) or bool(cfg.tee.of(local_rank) & bit)
            self.console[name] = shown and (
                not cfg.local_ranks_filter or local_rank in cfg.local_ranks_filter)
        self.local_rank, self.rank, self.generation = local_rank, rank, generation
        self.started_ns = time.time_ns()
        if self.direct:
            self._start_pumps()
        else:
            assert self.popen.stdin is not None
            self.popen.stdin.write(json.dumps({"env": env, "argv": argv, "cwd": os.getcwd(),
                                               "module": module}) + "\n")
            self.popen.stdin.flush()
        threading.Thread(target=self._wait, daemon=True).start()

    def _pump(self, stream, name: str) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        budget, window = 50, time.monotonic()
        for line in stream:
            fh = self.files.get(name)
            if fh is not None:
                fh.write(line)
                fh.flush()
            if self.console[name]:
                tag = f"[{self.launcher.cfg.node} rank {self.rank}]" if self.rank is not None \
                    else f"[{self.launcher.cfg.node} spare]"
                out.write(f"{tag} {line}")
                out.flush()
            if name == "stderr" and self.rank is not None:
                now = time.monotonic()
                if now - window > 1.0:
                    budget, window = 50, now
                if budget > 0:  # at most 50 lines/s per rank go on the bus
                    budget -= 1
                    self.launcher.publish_log(self, line.rstrip("\n"))

    def _wait(self) -> None:
        self.popen.wait()
        for fh in self.files.values():
            try:
                fh.close()
            except OSError:
                pass
        self.launcher.events.put(("exited", self))

    def kill(self) -> None:
        self.expected_exit = True
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass


class Launcher:
    """One node's launcher. ``run()`` returns the node's exit status: 0 when every local rank
    finished, ``EXIT_STOPPED`` when the job was stopped, 1 on an unrecovered failure."""

    def __init__(self, cfg: LaunchConfig):
        for name, val, env in (("--nats-url", cfg.nats_url, "NATS_URL"),
                               ("--redis-url", cfg.redis_url, "REDIS_URL"),
                               ("--rdzv-endpoint", cfg.rdzv_endpoint, "TG_RDZV_ENDPOINT")):
            if not val:
                raise SystemExit(f"trainguard launch: no {name}: pass it or set {env} "
                                 f"(`trainguard up` prints all three)")
        if not cfg.module and not os.path.isfile(cfg.script):
            raise SystemExit(f"trainguard launch: no such training script: {cfg.script!r} "
                             f"(give a path to a .py file, or -m for a module)")
        self.cfg = cfg
        self.events: queue.Queue = queue.Queue()
        self.bus = ThreadedBus(cfg.nats_url, f"launcher-{cfg.node}")
        self.workers: dict[int, _Proc] = {}
        self.spares: list[_Proc] = []
        self.seen_keys: set[str] = set()
        self.world_size = cfg.world_size
        self.generation = 0
        self._stop = threading.Event()
        self.exit_status: int | None = None
        self.hosted_ranks: set[int] = set()
        self._started = False
        self._st: StateStore | None = None  # the lease's connection, on the bus thread
        self.node_writer: NodeWriter | None = None
        self.restart_count = 0   # TORCHELASTIC_RESTART_COUNT: group restarts of this node
        self.attempt = 0         # observe-mode group restarts (part of the store prefix)
        self.rdzv_proc: subprocess.Popen | None = None

    # ---- environment --------------------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        """Every process's environment: torchrun's per-node contract (``MASTER_ADDR`` and
        ``MASTER_PORT`` name the rendezvous store, which ranks join as clients:
        ``TORCHELASTIC_USE_AGENT_STORE=True``) and trainguard's. ``OMP_NUM_THREADS`` is set
        here, not at assignment: a spare's torch sizes its thread pool when it warms up."""
        cfg = self.cfg
        env = dict(os.environ)
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        env.update({
            "TG_JOB": cfg.job, "TG_NODE": cfg.node, "TG_MODE": cfg.mode,
            "TG_RDZV_ENDPOINT": cfg.rdzv_endpoint, "MASTER_ADDR": host or "127.0.0.1",
            "MASTER_PORT": port, "NATS_URL": cfg.nats_url, "REDIS_URL": cfg.redis_url,
            "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node), "PYTHONUNBUFFERED": "1",
            "TG_WARM_IMPORTS": cfg.warm_imports, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts if cfg.mode != "action"
                                             else cfg.retry_budget),
            "TORCHELASTIC_RUN_ID": cfg.job, "GROUP_WORLD_SIZE": str(cfg.nnodes),
            "ROLE_NAME": cfg.role,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                              "1"),
        })
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: oversubscribed cores stall collectives
        if cfg.ckpt_dir:
            env["TG_CKPT_DIR"] = cfg.ckpt_dir
        if self.node_writer is not None:
            env["TG_CKPT_WRITER"] = self.node_writer.socket_path
        env.update(cfg.extra_env)
        return env

    def _start_spare(self) -> None:
        self.spares.append(_Proc(self, self._base_env()))

    def _fill_pool(self) -> None:
        """Top the pool up to ``cfg.spares`` warm spares. Runs on the main thread: the children
        get PR_SET_PDEATHSIG, which the kernel fires when the *thread* that forked them exits."""
        if self.cfg.no_python:
            return  # the program is not Python: there is nothing to warm
        if self.cfg.mode != "action" and not self.cfg.max_restarts:
            return  # observe mode without restarts: a spare would only cost memory
        while len(self.spares) < self.cfg.spares:
            self._start_spare()

    def _rank_dir(self, local_rank: int) -> str:
        """torchrun's per-rank directory: ``<log dir>/<job>/attempt_<n>/<local rank>``
        (the log dir defaults to a temporary one, as torchrun's)."""
        if not self.cfg.log_dir:
            self.cfg.log_dir = tempfile.mkdtemp(prefix=f"trainguard-{self.cfg.job}-")
        return os.path.join(self.cfg.log_dir, self.cfg.job, f"attempt_{self.restart_count}",
                            str(local_rank))

    def _spawn(self, local_rank: int, rank: int, generation: int, world_size: int,
               decision: schemas.Decision | None = None) -> _Proc:
        cfg = self.cfg
        rank_dir = self._rank_dir(local_rank)
        env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
               "GROUP_RANK": str(cfg.node_rank), "ROLE_RANK": str(rank),
               "ROLE_WORLD_SIZE": str(world_size), "TG_GENERATION": str(generation),
               "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
               "TG_ATTEMPT": str(self.attempt),
               "TORCHELASTIC_ERROR_FILE": os.path.join(rank_dir, "error.json"),
               "TG_FAULT_TS": str(decision.fault_ts if decision else 0),
               "TG_DECISION_ID": decision.event_id if decision else ""}
        if cfg.no_python:
            proc = _Proc(self, {**self._base_env(), **env}, [cfg.script, *cfg.script_args])
        else:
            while self.spares and not self.spares[0].alive():
                self.spares.pop(0)  # a spare that died (e.g. killed by hand) is no use
            proc = self.spares.pop(0) if self.spares else _Proc(self, self._base_env())
        os.makedirs(rank_dir, exist_ok=True)
        proc.assign(local_rank, rank, generation, env, [cfg.script, *cfg.script_args],
                    cfg.module, log_dir=rank_dir)
        self.workers[local_rank] = proc
        self.hosted_ranks.add(rank)
        self.bus.publish(subjects.job(self.cfg.job, "worker"), schemas.WorkerStarted(
            job=self.cfg.job, node=self.cfg.node, rank=rank, local_rank=local_rank, pid=proc.pid,
            generation=generation, world_size=world_size, spare=True))
        if self._started:  # a respawn: refill once the job is training again
            t = threading.Timer(self.cfg.refill_delay_s, self.events.put,
                                args=(("fill_pool", None),))
            t.daemon = True
            t.start()
        attempt = f", attempt {self.attempt}" if self.attempt else ""
        print(f"trainguard launch [{self.cfg.node}]: rank {rank} (local {local_rank}) started "
              f"as pid {proc.pid} at generation {generation}{attempt}", file=sys.stderr,
              flush=True)
        return proc

    # ---- bus ----------------------------------------------------------------------------------
    def publish_log(self, proc: _Proc, line: str) -> None:
        self.bus.publish(subjects.job(self.cfg.job, "log"), schemas.LogLine(
            job=self.cfg.job, node=self.cfg.node, rank=proc.rank, stream="stderr", line=line,
            generation=proc.generation, source="launcher"))

    def _on_decision(self, subject: str, ev: schemas.Event) -> None:
        if isinstance(ev, schemas.Decision):
            self.events.put(("decision", ev))

    #: Seconds a launcher's lease on its job's run lasts without renewal (renewed every 2 s):
    #: a launch more than this after the last launcher of a run died is a new run.
    LEASE_S = 10.0

    def _register(self) -> None:
        cfg = self.cfg
        settings = JobSettings(mode=cfg.mode, world_size=cfg.world_size,
                               min_world_size=cfg.min_world_size, retry_budget=cfg.retry_budget,
                               nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
                               hang_timeout_s=cfg.hang_timeout_s,
                               startup_timeout_s=cfg.startup_timeout_s,
                               node_timeout_s=cfg.node_timeout_s)

        async def _reg() -> None:
            st = self._store()
            await st.register_settings(cfg.job, settings)
            # a launcher of this node that died keeps its lease for up to LEASE_S: wait that
            # out; a live one renews it (its expiry moves), and this launch is refused
            expiry = None
            while True:
                try:
                    self.generation, new_run = await st.begin_run(
                        cfg.job, cfg.node, self.LEASE_S, settings)
                    break
                except LauncherConflict as exc:
                    now = time.monotonic()
                    if expiry is not None and now + exc.remaining_s > expiry + 0.5:
                        raise  # renewed: that launcher is alive
                    if expiry is None:
                        expiry = now + exc.remaining_s
                        print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} has a "
                              f"launcher on this node (lease runs out in "
                              f"{exc.remaining_s:.1f} s); waiting to see whether it is alive",
                              file=sys.stderr, flush=True)
                    await asyncio.sleep(min(max(exc.remaining_s, 0.05), 2.5))
            if new_run:
                print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} ran before: this "
                      f"is a new run of it, at generation {self.generation} (it resumes "
                      f"from its newest valid checkpoint)", file=sys.stderr, flush=True)
            if cfg.spare_node:
                await st.add_spare(cfg.job, cfg.node)
            else:
                await st.add_members(cfg.job, [
                    {"rank": cfg.node_rank * cfg.nproc_per_node + lr, "node": cfg.node,
                     "local_rank": lr} for lr in range(cfg.nproc_per_node)])

        try:
            self.bus.call(_reg(), timeout=self.LEASE_S + 20.0)
        except LauncherConflict as exc:
            raise SystemExit(f"trainguard launch: {exc}") from None
        except (ConnectionError, OSError, RedisError, TimeoutError) as exc:
            raise SystemExit(f"trainguard launch: cannot register job {cfg.job!r} in the state "
                             f"store at {cfg.redis_url} ({type(exc).__name__}: {exc}): start "
                             f"one with `trainguard up` or set REDIS_URL / --redis-url") from None

    def _store(self) -> StateStore:
        """The launcher's one state-store connection; used on the bus thread only."""
        if self._st is None:
            self._st = StateStore(self.cfg.redis_url)
        return self._st

    def _renew_lease(self) -> None:
        """Renew this launcher's lease without waiting: a slow state store must not delay the
        node heartbeat sent from the same thread."""
        fut = asyncio.run_coroutine_threadsafe(
            self._store().renew_launcher(self.cfg.job, self.cfg.node, self.LEASE_S),
            self.bus.loop)

        def _done(f) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("cannot renew this launcher's lease on job %s: %s", self.cfg.job,
                            f.exception())

        fut.add_done_callback(_done)

    def _publish_attempt(self) -> None:
        asyncio.run_coroutine_threadsafe(
            self._store().set_group_attempt(self.cfg.job, self.generation, self.attempt),
            self.bus.loop)

    def _sync_attempt(self) -> None:
        """Observe mode on several nodes: read the job's group attempt (``<generation>:<n>``);
        a newer one of this generation means another node restarted its group: so does this
        one (an event for the main thread)."""
        async def _read() -> None:
            job = await self._store().job(self.cfg.job)
            gen, _, n = job.group_attempt.partition(":")
            if gen == str(self.generation) and n.isdigit() and int(n) > self.attempt:
                self.events.put(("group_restart", int(n)))

        asyncio.run_coroutine_threadsafe(_read(), self.bus.loop)

    def _check_rendezvous(self, timeout_s: float = 5.0) -> None:
        """Fail before starting any rank when the rendezvous store does not answer. A store
        endpoint on this machine that nothing serves yet is hosted here, as torchrun's c10d
        backend hosts its store (``python -m trainguard.rendezvous``, dies with the launcher);
        another node waits up to ``startup_timeout_s`` for its host."""
        host, _, port = self.cfg.rdzv_endpoint.rpartition(":")
        host = host or "127.0.0.1"
        hosting = _is_local(host) and self.cfg.node_rank == 0 and not self.cfg.spare_node
        deadline = time.monotonic() + (timeout_s if hosting else self.cfg.startup_timeout_s)
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=timeout_s):
                    return
            except ValueError as exc:
                raise SystemExit(f"trainguard launch: bad rendezvous endpoint "
                                 f"{self.cfg.rdzv_endpoint!r} ({exc}): give host:port") from None
            except OSError as exc:
                if hosting and self.rdzv_proc is None:
                    self._host_rendezvous(host, int(port))
                    deadline = time.monotonic() + 60.0  # its torch import takes seconds
                elif time.monotonic() >= deadline or (
                        self.rdzv_proc is not None and self.rdzv_proc.poll() is not None):
                    raise SystemExit(
                        f"trainguard launch: the rendezvous store at {self.cfg.rdzv_endpoint} "
                        f"does not answer ({exc}): start it with `trainguard up` (it prints "
                        f"TG_RDZV_ENDPOINT) or `python -m trainguard.rendezvous --port N`"
                    ) from None
            time.sleep(0.1)

    def _host_rendezvous(self, host: str, port: int) -> None:
        print(f"trainguard launch [{self.cfg.node}]: nothing serves the rendezvous store at "
              f"{host}:{port}: hosting it in this launcher", file=sys.stderr, flush=True)
        self.rdzv_proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.rendezvous", "--host", host, "--port",
             str(port)], stdout=subprocess.DEVNULL, preexec_fn=_pdeathsig_kill)

    def _mark_status(self, status: str) -> None:
        """Record how the job ended here: ``finished`` (every local rank finished, so late
        anomalies such as a node lost after the end decide nothing) or ``failed`` (this node
        stopped on a failure it did not recover from in action mode). A job
        already ``stopped`` by a decision keeps that status."""
        async def _mark() -> None:
            await self._store().end_run(self.cfg.job, status)

        try:
            self.bus.call(_mark(), timeout=5.0)
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass

    def _heartbeat(self) -> None:
        seq = 0
        last_lease = time.monotonic()
        while not self._stop.is_set():
            seq += 1
            if time.monotonic() - last_lease >= 2.0:
                last_lease = time.monotonic()
                self._renew_lease()
                if self.cfg.mode != "action" and self.cfg.max_restarts and self.cfg.nnodes > 1:
                    self._sync_attempt()
            self.bus.publish(subjects.node(self.cfg.node, "heartbeat"), schemas.NodeHeartbeat(
                node=self.cfg.node, job=self.cfg.job, role="launcher", seq=seq, pid=os.getpid(),
                interval_s=self.cfg.heartbeat_interval_s))
            self._stop.wait(self.cfg.heartbeat_interval_s)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        self.bus.subscribe(subjects.job(cfg.job, "decision"), self._on_decision)
        self.bus.start()
        if not self.bus.wait_connected(15.0):
            raise SystemExit(f"trainguard launch: cannot reach NATS at {cfg.nats_url}")
        self._check_rendezvous()
        self._register()
        self._start_node_writer()
        threading.Thread(target=self._heartbeat, daemon=True).start()
        # the pool warms beside the first ranks: a slower start (on 2 cores, 6 processes
        # importing torch: ≈ 20 s instead of ≈ 13 s) buys a warm spare for an early fault
        # (measured: a SIGKILL 2 s into training took 6-12 s with the pool warmed afterwards)
        if not cfg.spare_node:
            for lr in range(cfg.nproc_per_node):
                self._spawn(lr, cfg.node_rank * cfg.nproc_per_node + lr, self.generation,
                            cfg.world_size)
        self._fill_pool()
        self._started = True

    def _start_node_writer(self) -> None:
        """Start this node's checkpoint writer daemon (``cfg.node_writer``). A daemon that does
        not start is reported and the ranks write with writers of their own."""
        if not self.cfg.node_writer:
            return
        from .checkpoint.config import CheckpointConfig
        from .checkpoint.writer import NodeWriter

        # short and unique on this machine (a Unix socket path holds at most 107 bytes)
        path = os.path.join(tempfile.gettempdir(), f"trainguard-ckpt-{os.getpid()}.sock")
        try:
            self.node_writer = NodeWriter(path, nice=CheckpointConfig.writer_nice).start()
        except (RuntimeError, OSError) as exc:
            print(f"trainguard launch [{self.cfg.node}]: no node checkpoint writer ({exc}); "
                  f"each rank starts its own", file=sys.stderr, flush=True)
            self.node_writer = None

    def run(self) -> int:
        self.start()
        try:
            while self.exit_status is None:
                try:
                    kind, obj = self.events.get(timeout=self.cfg.monitor_interval_s)
                except queue.Empty:
                    continue
                if kind == "exited":
                    self._on_exit(obj)
                elif kind == "decision":
                    self._on_decision_event(obj)
                elif kind == "fill_pool":
                    self._fill_pool()
                elif kind == "group_restart" and obj > self.attempt and self.workers:
                    print(f"trainguard launch [{self.cfg.node}]: another node restarted the "
                          f"worker group (attempt {obj}): restarting this node's ranks too",
                          file=sys.stderr, flush=True)
                    self._restart_group(obj)
                elif kind == "stop":
                    print(f"trainguard launch [{self.cfg.node}]: stopping (exit status {obj}): "
                          f"ranks and spares stopped, staging buffers freed; launch the job "
                          f"again under its name to resume", file=sys.stderr, flush=True)
                    self._kill_all()
                    self.exit_status = obj
        finally:
            self.shutdown()
        return self.exit_status or 0

    def _on_exit(self, proc: _Proc) -> None:
        cfg = self.cfg
        rc = proc.popen.returncode
        sig = -rc if rc is not None and rc < 0 else None
        code = rc if rc is not None and rc >= 0 else None
        self.bus.publish(subjects.job(cfg.job, "worker"), schemas.WorkerExited(
            job=cfg.job, node=cfg.node, rank=proc.rank, local_rank=proc.local_rank or 0,
            pid=proc.pid, generation=proc.generation, exit_code=code, signal=sig,
            expected=proc.expected_exit or rc in (0, EXIT_STOPPED)))
        if self.workers.get(proc.local_rank) is not proc or proc.expected_exit:
            return  # replaced or killed on purpose: its exit is not a new fault
        if rc not in (0, EXIT_STOPPED):
            print(f"trainguard launch [{cfg.node}]: rank {proc.rank} (pid {proc.pid}) exited "
                  f"with {'signal ' + str(sig) if sig else 'status ' + str(code)}",
                  file=sys.stderr, flush=True)
        if rc in (0, EXIT_STOPPED):
            del self.workers[proc.local_rank]
            if not self.workers:
                self.exit_status = 0 if rc == 0 else EXIT_STOPPED
            return
        if cfg.mode != "action":
            # observe mode: what torchrun does — restart the worker group up to --max-restarts
            # times, then stop; the decisions trainguard would take are published meanwhile
            if self.attempt < cfg.max_restarts:
                print(f"trainguard launch [{cfg.node}]: rank {proc.rank} failed (exit={code} "
                      f"signal={sig}); observe mode: restarting the worker group (restart "
                      f"{self.attempt + 1} of --max-restarts {cfg.max_restarts})",
                      file=sys.stderr, flush=True)
                self._restart_group()
                return
            print(f"trainguard launch: rank {proc.rank} failed (exit={code} signal={sig}); "
                  f"observe mode: stopping this node", file=sys.stderr)
            self._kill_all()
            self.exit_status = 1

    def _restart_group(self, attempt: int | None = None) -> None:
        """Observe mode's torchrun-style restart: stop every local rank, then start them all
        again (from warm spares) at ``attempt`` (default: the next one), a new store prefix.
        The attempt is written to the job record, where every other node's launcher sees it
        and restarts its group too (``_sync_attempt``), as torchrun's agents all restart."""
        self.attempt = self.attempt + 1 if attempt is None else attempt
        if attempt is None and self.cfg.nnodes > 1:
            self._publish_attempt()
        old = list(self.workers.values())
        for p in old:
            p.kill()
        for p in old:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.restart_count += 1
        for lr, p in sorted(self.workers.items()):
            self._spawn(lr, p.rank if p.rank is not None else lr, self.generation,
                        self.world_size)

    def _on_decision_event(self, d: schemas.Decision) -> None:
        if d.idempotency_key in self.seen_keys:
            return
        self.seen_keys.add(d.idempotency_key)
        cfg = self.cfg
        if d.execute and d.generation <= self.generation:
            # decided for a generation this run is already past: e.g. the hang of the ranks of
            # a launcher that was killed, decided while this launch waited out its lease
            print(f"trainguard launch [{cfg.node}]: ignoring a decision for generation "
                  f"{d.generation} ({d.action}): this run is at generation {self.generation}",
                  file=sys.stderr, flush=True)
            return
        how = "(executing)" if d.execute else "(flag only)" if d.action == "none" else \
            "(observe mode: not executed)"
        print(f"trainguard launch [{cfg.node}]: decision {d.action} {how} "
              f"generation {d.generation} ranks {d.ranks} nodes {d.nodes}: {d.reason}",
              file=sys.stderr, flush=True)
        if not d.execute:
            return
        if d.world_size:
            self.world_size = d.world_size
        self.generation = max(self.generation, d.generation)
        for proc in self.workers.values():
            # every executed decision moves the whole job to its generation (in-process
            # restarts too): a later exit must be reported in the generation the rank was in
            proc.generation = max(proc.generation, d.generation)
        plan = plan_node(d, cfg.node, [
            LocalRank(lr, p.rank if p.rank is not None else lr,
                      p.alive() and not p.expected_exit, p.in_process)
            for lr, p in self.workers.items()])
        if plan.empty:
            return  # nothing for this node
        for lr in plan.kill:
            self.workers[lr].kill()
        if plan.exit_status is not None:
            self._kill_all()
            self.exit_status = plan.exit_status
        else:
            for lr, rank in plan.rerank.items():
                self.workers[lr].rank = rank
            for lr in set(plan.kill) - {x for x, _ in plan.start}:
                del self.workers[lr]  # this node no longer runs that local rank
            if plan.start:
                self.restart_count += 1
            for lr, rank in plan.start:
                self._spawn(lr, rank, d.generation, self.world_size, decision=d)
        self.bus.publish(subjects.job(cfg.job, "action"), schemas.ActionResult(
            job=cfg.job, node=cfg.node, decision_id=d.event_id,
            idempotency_key=d.idempotency_key, executor=f"launcher-{cfg.node}", action=d.action,
            ok=True, detail=plan.why, trace=d.child_trace()))

    def _kill_all(self) -> None:
        for proc in list(self.workers.values()):
            proc.kill()

    def _release_staging(self) -> None:
        """Remove the /dev/shm staging buffers of the ranks this node hosted (the job is over
        here: nothing will restore from them)."""
        from .checkpoint.config import CheckpointConfig, staging_path

        shm = CheckpointConfig.shm_dir
        for rank in self.hosted_ranks:
            for suffix in ("", ".meta"):
                try:
                    os.unlink(staging_path(shm, self.cfg.job, rank) + suffix)
                except (FileNotFoundError, OSError):
                    pass

    def shutdown(self) -> None:
        self._stop.set()
        self._kill_all()
        for proc in self.spares:
            try:
                proc.popen.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            proc.kill()
        for proc in [*self.workers.values(), *self.spares]:
            try:
                proc.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self.node_writer is not None:
            self.node_writer.close()  # it finishes the saves in flight on its own, then exits
            if self.node_writer.proc is not None and self.node_writer.proc.poll() is not None:
                self.node_writer.stop()  # it died: remove the socket it left
        # the job is over on this node (finished, stopped, failed, or stopped by hand: a new
        # launch restores from disk): the staging buffers would only hold shared memory. A
        # writer still finishing a save keeps reading its open file.
        self._release_staging()
        if not self.cfg.spare_node and self.exit_status == 0:
            self._mark_status("finished")
        elif not self.cfg.spare_node and self.exit_status == 1 and self.cfg.mode == "action":
            # (observe mode leaves the status: the decision that would have been taken for
            # this failure is still to be published, and an ended job decides nothing)
            self._mark_status("failed")

        async def _end() -> None:
            st = self._store()
            try:
                await st.end_launcher(self.cfg.job, self.cfg.node)
            finally:
                await st.close()

        try:
            self.bus.call(_end(), timeout=5.0)
        except Exception:  # noqa: BLE001 - the lease then expires on its own
            pass
        self.bus.close(timeout=2.0)
        if self.rdzv_proc is not None:
            self.rdzv_proc.kill()
            self.rdzv_proc.wait()

    def request_stop(self, status: int = 1) -> None:
        self.events.put(("stop", status))


def parse_args(argv: list[str]) -> LaunchConfig:
    """``trainguard launch`` arguments (torchrun's and trainguard's: ``trainguard.launch_args``)
    → LaunchConfig; a bad argument exits with argparse's usage error (status 2)."""
    from .launch_args import parse

    return parse(argv, description=__doc__.split("\n\n")[0])


def _embedded_stack(cfg: LaunchConfig):
    """With no NATS, state store and rendezvous store configured on a single-node job, start
    an embedded stack for this launch (as ``trainguard demo`` does) and point ``cfg`` at it.
    Returns the stack (stopped by the caller) or None when one is configured."""
    if cfg.nats_url or cfg.redis_url or cfg.nnodes != 1:
        return None
    from .stack import Stack

    stack = Stack(agent_nodes=(cfg.node,), rendezvous=not cfg.rdzv_endpoint)
    print(f"trainguard launch: no NATS_URL / REDIS_URL given: starting an embedded stack for "
          f"this job (services' logs in {stack.log_dir}); `trainguard up` runs one to share",
          file=sys.stderr, flush=True)
    stack.start(timeout=120)
    cfg.nats_url, cfg.redis_url = stack.nats_url, stack.redis_url
    cfg.rdzv_endpoint = cfg.rdzv_endpoint or stack.rdzv_endpoint
    return stack


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    stack = _embedded_stack(cfg)
    try:
        launcher = Launcher(cfg)
        signal.signal(signal.SIGTERM, lambda *a: launcher.request_stop(143))
        signal.signal(signal.SIGINT, lambda *a: launcher.request_stop(130))
        return launcher.run()
    finally:
        if stack is not None:
            stack.stop()

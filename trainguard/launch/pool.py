"""The processes of one node's launcher: warm spares, the ranks they become, their output, their end.

A ``ProcessPool`` keeps ``cfg.spares`` warm spare processes (``python -m trainguard.launch.spare``: torch
imported and warmed) and turns one into a rank on ``spawn`` — torchrun's environment contract,
the rank's log directory, a replacement spare ``refill_delay_s`` later — so a respawn costs no
interpreter or torch start-up. Each process's stdout and stderr are pumped to the console (tagged
``[<node> rank <r>]``) and to the rank's files as ``--redirects``/``--tee`` say; its stderr lines
also go on the bus (at most 50 a second). When a rank's process ends the pool posts
``RankExited`` for the run loop (``trainguard.launch.loop``), which decides what it means.
It also holds the node's checkpoint writer daemon and frees the ranks' staging buffers at the end.

The job's own imports: local rank 0 writes the modules it imported to ``job_imports.json`` in
the run directory (``trainguard.rank.job_imports``); ``JobImportsWatch``
(``trainguard.launch.job_imports``) has the template import what may be imported twice, and
once it has, the run loop replaces the idle spares forked before (``renew_spares``): a
replacement rank then finds its framework imported.
"""
from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from trainguard import schemas
from trainguard.schemas import subjects

from trainguard.core.recovery_plan import LocalRank
from trainguard.launch.forkserver import ForkedProcess, ForkServer, pdeathsig_kill, start_template, warm_env
from trainguard.launch.job_imports import JobImportsWatch
from trainguard.launch.loop import RankExited, RefillPool
from trainguard.rendezvous.gate import TOKEN_ENV

if TYPE_CHECKING:
    from trainguard.checkpoint.writer import NodeWriter
    from trainguard.launch.config import LaunchConfig

__all__ = ["ProcessPool", "RankProcess", "pdeathsig_kill"]


class RankProcess:
    """A spare or worker process with its output pumps.

    ``argv`` None: a warm spare (``trainguard.launch.spare``), assigned a rank later; else the program
    itself (``--no-python``), started with its rank's environment. ``in_process`` becomes True
    when the rank says on its launcher pipe (``TG_LAUNCHER_FD``) that it runs ``trainguard.run``
    and so rejoins in process (``trainguard.core.recovery_plan``)."""

    def __init__(self, pool: "ProcessPool", env: dict[str, str],
                 argv: list[str] | None = None):
        self.pool = pool
        rfd, wfd = os.pipe()
        self.direct = argv is not None
        template = None if self.direct else pool.template()
        try:
            self.popen: "subprocess.Popen | ForkedProcess" = (
                template and template.spawn({**env, "TG_LAUNCHER_FD": str(wfd)})
            ) or subprocess.Popen(
                argv or [sys.executable, "-m", "trainguard.launch.spare"],
                env={**env, "TG_LAUNCHER_FD": str(wfd)},
                stdin=subprocess.DEVNULL if self.direct else subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pdeathsig_kill,
                text=True, bufsize=1, pass_fds=(wfd,))
        finally:
            os.close(wfd)
        self.local_rank: int | None = None
        self.rank: int | None = None
        self.generation = 0
        self.expected_exit = False
        self.started_ns = 0
        self.in_process = False
        self.files: dict[str, Any] = {}   # "stdout"/"stderr" → per-rank log file
        self.console = {"stdout": True, "stderr": True}
        self.pumps: list[threading.Thread] = []
        threading.Thread(target=self._control, args=(rfd,), daemon=True).start()
        if not self.direct:  # a direct program's pumps start once it is assigned (its files)
            self._start_pumps()

    def _start_pumps(self) -> None:
        for stream, name in ((self.popen.stdout, "stdout"), (self.popen.stderr, "stderr")):
            t = threading.Thread(target=self._pump, args=(stream, name), daemon=True)
            t.start()
            self.pumps.append(t)

    def _control(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for line in fh:
                if line.strip() == b"restart in_process":
                    self.in_process = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once ended (negative: the signal), else None."""
        return self.popen.returncode

    def alive(self) -> bool:
        return self.popen.poll() is None

    def assign(self, local_rank: int, rank: int, generation: int, env: dict[str, str],
               argv: list[str], module: bool, log_dir: str = "") -> None:
        """Make this process rank ``rank``; with ``log_dir``, its output goes to
        ``<log_dir>/{stdout,stderr}.log`` as ``--redirects``/``--tee`` say."""
        cfg = self.pool.cfg
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
                tag = f"[{self.pool.cfg.node} rank {self.rank}]" if self.rank is not None \
                    else f"[{self.pool.cfg.node} spare]"
                out.write(f"{tag} {line}")
                out.flush()
            if name == "stderr" and self.rank is not None:
                now = time.monotonic()
                if now - window > 1.0:
                    budget, window = 50, now
                if budget > 0:  # at most 50 lines/s per rank go on the bus
                    budget -= 1
                    self.pool.publish_log(self, line.rstrip("\n"))
        # the stream's end, not the process's: closed at the exit, a file lost the last lines
        # the pump had still to write (a race: ≈ 1 % of the one-line ranks of a --no-python
        # launch ended with an empty stdout.log)
        fh = self.files.pop(name, None)
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass

    #: seconds a rank that exited (not killed by a signal) waits for its output pumps to reach
    #: the end of its streams before its exit is reported: a child of the rank (a DataLoader
    #: worker) may hold them open for seconds more
    DRAIN_S = 0.2

    def _wait(self) -> None:
        rc = self.popen.wait()
        if rc >= 0:
            # its last lines first (the traceback it printed as it failed), then its exit: a
            # crash published before the relayed traceback was attributed as a crash, not as
            # the exception (seen on a loaded machine: a loop check missed because of it)
            deadline = time.monotonic() + self.DRAIN_S
            for t in self.pumps:
                t.join(max(0.0, deadline - time.monotonic()))
        self.pool.post(RankExited(self))

    def kill(self) -> None:
        self.expected_exit = True
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass


class ProcessPool:
    """This node's ranks (``workers``: local rank → process) and warm spares.

    ``post`` queues an event for the run loop (``RankExited``, ``RefillPool``). Every method
    that starts a process must run on the launcher's main thread (PR_SET_PDEATHSIG)."""

    def __init__(self, cfg: "LaunchConfig", bus: Any, post: Callable[[object], None]):
        self.cfg, self.bus, self.post = cfg, bus, post
        self.workers: dict[int, RankProcess] = {}
        self.spares: list[RankProcess] = []
        self.hosted_ranks: set[int] = set()
        self.node_writer: NodeWriter | None = None
        self.started_at = time.time()  # Unix s: the origin of scheduled faults' at_s
        #: the local relay the ranks reach the rendezvous store through ("": the store itself)
        self.rdzv_relay = ""
        self._template: ForkServer | None = None
        self._template_said = False
        self._template_restarts = 0
        #: why spares no longer fork from the template ("" while they do): its import of the
        #: job's modules initialised CUDA or started threads a fork would not carry
        self._template_tainted = ""
        self.imports = JobImportsWatch(cfg.node, cfg.job_imports_budget_s,
                                       lambda: self._template, post, self._taint)

    # ---- environment --------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        """Every process's environment: torchrun's per-node contract (``MASTER_ADDR`` and
        ``MASTER_PORT`` name the rendezvous store, which ranks join as clients:
        ``TORCHELASTIC_USE_AGENT_STORE=True``) and trainguard's. ``OMP_NUM_THREADS`` is set
        here, not at assignment: a spare's torch sizes its thread pool when it warms up."""
        cfg = self.cfg
        env = dict(os.environ)
        # with a store token, the ranks reach the store through this launcher's relay
        # (``rdzv_relay``) and never hold the token themselves
        env.pop(TOKEN_ENV, None)
        endpoint = self.rdzv_relay or cfg.rdzv_endpoint
        host, _, port = endpoint.rpartition(":")
        env.update({
            "TG_JOB": cfg.job, "TG_NODE": cfg.node, "TG_MODE": cfg.mode,
            "TG_RDZV_ENDPOINT": endpoint, "MASTER_ADDR": host or "127.0.0.1",
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
        if not cfg.auto_resume:
            env["TG_AUTO_RESUME"] = "0"  # trainguard.rank.auto_resume
        env.update(warm_env(cfg))
        if cfg.ckpt_dir:
            env["TG_CKPT_DIR"] = cfg.ckpt_dir
        if self.node_writer is not None:
            env["TG_CKPT_WRITER"] = self.node_writer.socket_path
        if cfg.faults:  # `--faults`: fired in the ranks (trainguard.rank.fault_inject)
            env.update(TG_FAULTS=cfg.faults, TG_FAULTS_DIR=cfg.faults_dir,
                       TG_FAULTS_T0=str(self.started_at))
        env.update(cfg.extra_env)
        return env

    def start_node_writer(self) -> None:
        """Start this node's checkpoint writer daemon (``cfg.node_writer``). A daemon that does
        not start is reported and the ranks write with writers of their own."""
        if not self.cfg.node_writer:
            return
        from trainguard.checkpoint.config import CheckpointConfig
        from trainguard.checkpoint.writer import NodeWriter

        # short and unique on this machine (a Unix socket path holds at most 107 bytes)
        path = os.path.join(tempfile.gettempdir(), f"trainguard-ckpt-{os.getpid()}.sock")
        try:
            self.node_writer = NodeWriter(path, nice=CheckpointConfig.writer_nice).start()
        except (RuntimeError, OSError) as exc:
            print(f"trainguard launch [{self.cfg.node}]: no node checkpoint writer ({exc}); "
                  f"each rank starts its own", file=sys.stderr, flush=True)
            self.node_writer = None

    # ---- spares and ranks ---------------------------------------------------------------------
    def fill(self) -> None:
        """Top the pool up to ``cfg.spares`` warm spares. Runs on the main thread: the children
        get PR_SET_PDEATHSIG, which the kernel fires when the *thread* that forked them exits."""
        if self.cfg.no_python:
            return  # the program is not Python: there is nothing to warm
        if self.cfg.mode != "action" and not self.cfg.max_restarts:
            return  # observe mode without restarts: a spare would only cost memory
        if self._template is not None and self._template.importing and not self._template_tainted:
            return  # forked once the template has the job's modules (``renew_spares``)
        while len(self.spares) < self.cfg.spares:
            self.spares.append(RankProcess(self, self.base_env()))

    #: new templates a launcher starts after one that warmed died (its ranks died with it)
    TEMPLATE_RESTARTS = 3

    def _start_template(self) -> ForkServer:
        return start_template(self.cfg, self.base_env())

    def adopt_template(self, template: ForkServer | None) -> None:
        """Use ``template`` (``early_template``: started before this pool) as the spares'
        template; nothing when this pool has one already or ``template`` is None."""
        if template is not None and self._template is None:
            self._template = template

    def template(self) -> ForkServer | None:
        """The warm template the spares are forked from (``trainguard.launch.forkserver``), started on
        first need (main thread: its PR_SET_PDEATHSIG); None with ``--no-fork-spares``. One that
        warmed and then died (its ranks with it) is replaced, up to ``TEMPLATE_RESTARTS``
        times; spares start cold until the new one is warm (a spawn never waits for it). One
        that could not warm is not: why is said once, and the spares start cold."""
        if not self.cfg.fork_spares or self.cfg.no_python or self._template_tainted:
            return None
        if self._template is None:
            self._template = self._start_template()
        elif self._template.died_after_ready and \
                self._template_restarts < self.TEMPLATE_RESTARTS:
            self._template_restarts += 1
            print(f"trainguard launch [{self.cfg.node}]: the spares' template exited (the ranks "
                  f"forked from it with it): a new one warms, spares start cold meanwhile",
                  file=sys.stderr, flush=True)
            self._template = self._start_template()
            self._template.ready_wait_s = 0.0
        if self._template.failure and not self._template_said:
            self._template_said = True
            print(f"trainguard launch [{self.cfg.node}]: spares start cold "
                  f"({self._template.failure})", file=sys.stderr, flush=True)
        return self._template

    # ---- the job's own imports (trainguard.rank.job_imports) ---------------------------------------
    def _imports_path(self) -> str:
        """``<log dir>/<job>/job_imports.json``: where local rank 0 records its imports."""
        self._own_log_dir()
        d = os.path.join(self.cfg.log_dir, self.cfg.job)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, "job_imports.json")

    def _own_log_dir(self) -> None:
        """Make the temporary log folder (``trainguard-<job>-…``, as torchrun's
        ``torchelastic_…``) when the launch was given none; ``remove_log_dir`` takes it away."""
        if not self.cfg.log_dir:
            self.cfg.log_dir = tempfile.mkdtemp(prefix=f"trainguard-{self.cfg.job}-")
            self._made_log_dir = self.cfg.log_dir

    def remove_log_dir(self, keep: bool) -> str | None:
        """At the end of the launch: remove the temporary log folder this pool made (nothing
        when the launch was given ``--log-dir``), or, with ``keep`` (the job failed), leave it
        and return its path for the launch to name."""
        made = getattr(self, "_made_log_dir", None)
        if made is None or not os.path.isdir(made):
            return None
        if keep:
            return made
        shutil.rmtree(made, ignore_errors=True)
        return None

    def _taint(self, why: str) -> None:
        self._template_tainted = why

    def renew_spares(self) -> None:
        """Replace the idle spares (forked before the template imported the job's modules) with
        new ones. Main thread (PR_SET_PDEATHSIG)."""
        old, self.spares = self.spares, []
        for proc in old:
            proc.kill()
        self.fill()

    def _rank_dir(self, local_rank: int, restart_count: int) -> str:
        """torchrun's per-rank directory: ``<log dir>/<job>/attempt_<n>/<local rank>``
        (the log dir defaults to a temporary one, as torchrun's)."""
        self._own_log_dir()
        return os.path.join(self.cfg.log_dir, self.cfg.job, f"attempt_{restart_count}",
                            str(local_rank))

    def spawn(self, local_rank: int, rank: int, *, generation: int, world_size: int,
              attempt: int, restart_count: int, decision: schemas.Decision | None = None,
              refill: bool = True) -> RankProcess:
        """Make a warm spare (a new process when none is ready; the program itself with
        ``--no-python``) local rank ``local_rank`` = rank ``rank`` of ``world_size`` at
        ``generation``; ``attempt`` and ``restart_count`` go to its environment (``TG_ATTEMPT``,
        ``TORCHELASTIC_RESTART_COUNT``, the log directory). ``refill``: a replacement spare
        starts ``refill_delay_s`` later (a ``RefillPool`` event)."""
        cfg = self.cfg
        rank_dir = self._rank_dir(local_rank, restart_count)
        env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
               "GROUP_RANK": str(cfg.node_rank), "ROLE_RANK": str(rank),
               "ROLE_WORLD_SIZE": str(world_size), "TG_GENERATION": str(generation),
               "TORCHELASTIC_RESTART_COUNT": str(restart_count),
               "TG_ATTEMPT": str(attempt),
               "TORCHELASTIC_ERROR_FILE": os.path.join(rank_dir, "error.json"),
               "TG_FAULT_TS": str(decision.fault_ts if decision else 0),
               "TG_DECISION_ID": decision.event_id if decision else ""}
        if cfg.job_imports and not cfg.no_python and local_rank == 0 and cfg.fork_spares:
            from trainguard.rank.job_imports import ENV_FILE

            env[ENV_FILE] = self._imports_path()
            self.imports.start(env[ENV_FILE])  # once per launch
        if cfg.no_python:
            proc = RankProcess(self, {**self.base_env(), **env}, [cfg.script, *cfg.script_args])
        else:
            while self.spares and not self.spares[0].alive():
                self.spares.pop(0)  # a spare that died (e.g. killed by hand) is no use
            proc = self.spares.pop(0) if self.spares else RankProcess(self, self.base_env())
        os.makedirs(rank_dir, exist_ok=True)
        proc.assign(local_rank, rank, generation, env, [cfg.script, *cfg.script_args],
                    cfg.module, log_dir=rank_dir)
        self.workers[local_rank] = proc
        self.hosted_ranks.add(rank)
        self.bus.publish(subjects.job(cfg.job, "worker"), schemas.WorkerStarted(
            job=cfg.job, node=cfg.node, rank=rank, local_rank=local_rank, pid=proc.pid,
            generation=generation, world_size=world_size, spare=True))
        if refill:  # a respawn: refill once the job is training again
            t = threading.Timer(cfg.refill_delay_s, self.post, args=(RefillPool(),))
            t.daemon = True
            t.start()
        at = f", attempt {attempt}" if attempt else ""
        print(f"trainguard launch [{cfg.node}]: rank {rank} (local {local_rank}) started "
              f"as pid {proc.pid} at generation {generation}{at}", file=sys.stderr, flush=True)
        return proc

    def ranks(self) -> list[LocalRank]:
        """This node's ranks as ``plan_node`` sees them (alive: running and not being
        killed)."""
        return [LocalRank(lr, p.rank if p.rank is not None else lr,
                          p.alive() and not p.expected_exit, p.in_process)
                for lr, p in self.workers.items()]

    def current(self, local_rank: int) -> RankProcess | None:
        """The process that is local rank ``local_rank`` now (None: none)."""
        return self.workers.get(local_rank)

    def kill(self, local_rank: int) -> None:
        self.workers[local_rank].kill()

    def kill_all(self) -> None:
        for proc in list(self.workers.values()):
            proc.kill()

    def stop_ranks(self, wait_s: float) -> None:
        """SIGKILL every rank and wait up to ``wait_s`` seconds for each (a group restart: the
        old ranks are gone before their replacements start)."""
        old = list(self.workers.values())
        for p in old:
            p.kill()
        for p in old:
            try:
                p.popen.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass

    def rerank(self, local_rank: int, rank: int) -> None:
        self.workers[local_rank].rank = rank

    def forget(self, local_rank: int) -> None:
        """This node no longer runs ``local_rank`` (it ended, or was re-ranked away)."""
        del self.workers[local_rank]

    def advance_generation(self, generation: int) -> None:
        """Every rank is now in ``generation`` at least (a later exit is reported in it)."""
        for proc in self.workers.values():
            proc.generation = max(proc.generation, generation)

    def publish_log(self, proc: RankProcess, line: str) -> None:
        self.bus.publish(subjects.job(self.cfg.job, "log"), schemas.LogLine(
            job=self.cfg.job, node=self.cfg.node, rank=proc.rank, stream="stderr", line=line,
            generation=proc.generation, source="launcher"))

    # ---- the end ------------------------------------------------------------------------------
    def _release_staging(self) -> None:
        """Remove the /dev/shm staging buffers of the ranks this node hosted (the job is over
        here: nothing will restore from them)."""
        from trainguard.checkpoint.config import CheckpointConfig, staging_path

        shm = CheckpointConfig.shm_dir
        for rank in self.hosted_ranks:
            for suffix in ("", ".meta"):
                try:
                    os.unlink(staging_path(shm, self.cfg.job, rank) + suffix)
                except (FileNotFoundError, OSError):
                    pass

    def shutdown(self) -> None:
        """Kill every rank and spare (waiting up to 5 s for each), let the node writer finish
        its saves in flight, free the staging buffers."""
        self.imports.close()
        self.kill_all()
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
        if self._template is not None:
            self._template.close()
        if self.node_writer is not None:
            self.node_writer.close()  # it finishes the saves in flight on its own, then exits
            if self.node_writer.proc is not None and self.node_writer.proc.poll() is not None:
                self.node_writer.stop()  # it died: remove the socket it left
        # the job is over on this node (finished, stopped, failed, or stopped by hand: a new
        # launch restores from disk): the staging buffers would only hold shared memory. A
        # writer still finishing a save keeps reading its open file.
        self._release_staging()

"""``trainguard launch``: a drop-in for ``torchrun`` that starts the ranks of one node, keeps
warm spares, reports worker lifecycle on the bus, and executes the remediator's decisions for
this node.

    trainguard launch --nnodes 2 --nproc-per-node 2 --node-rank 0 --job demo train.py [args]
    trainguard launch --standalone --nproc-per-node 2 train.py      # torchrun's command line

The command line is torchrun's (``trainguard.launch.args``). Every rank gets torchrun's
environment contract — ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_NAME``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` (the rendezvous store), ``TORCHELASTIC_USE_AGENT_STORE=True``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_ERROR_FILE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS=1`` with more
than one rank per node unless set — plus ``TG_JOB``, ``TG_NODE``, ``TG_GENERATION``,
``TG_MODE``, ``TG_RDZV_ENDPOINT``, ``NATS_URL``, ``REDIS_URL``, ``TG_CKPT_DIR``. Ranks start
from warm spare processes (``trainguard.launch.spare``) that have torch imported and warmed, and a
replacement spare is started after each use, so a respawn costs no interpreter or torch
start-up. What a decision means for each rank is ``trainguard.core.recovery_plan.plan_node``.

The launcher is three parts around one loop, in the shape of torch.distributed.elastic's agent:
a process pool (``trainguard.launch.pool``: warm spares, ranks, their output, killing), a job
lease (``trainguard.launch.lease``: the run's registration in the state store, lease renewal,
the group attempt, the node heartbeat, how the run ended) and a run loop over typed events with a
state enum (``trainguard.launch.loop``: ``LaunchState``). ``Launcher`` wires them together.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

from trainguard import schemas
from trainguard.schemas import subjects

from trainguard.security.credentials import redact
from trainguard.clients.threaded_bus import ThreadedBus
from trainguard.launch.config import LaunchConfig, StdSpec
from trainguard.launch.lease import JobLease
from trainguard.launch.loop import (DecisionReceived, LaunchState, RunLoop, RunOnLoop,
                                    StopRequested)
from trainguard.launch.forkserver import early_template
from trainguard.launch.pool import ProcessPool, pdeathsig_kill

__all__ = ["LaunchConfig", "Launcher", "LaunchState", "StdSpec", "main", "parse_args"]


def ends_on_purpose(status: int | None, fenced: bool, under_slurm: bool) -> bool:
    """Whether a launch ending with exit ``status`` ends on purpose, so that its last heartbeat
    says ``ending`` and its silence is no lost launcher (``detector.signals``). Not when fenced
    (its lease lost: the job may have moved on without it), nor when stopped from outside
    (SIGTERM 143, SIGINT 130: a pod deleted, a container killed — the job's ranks there are
    lost) — except under Slurm (``under_slurm``: ``SLURM_JOB_ID`` set), where a SIGTERM is
    Slurm ending the job's step on purpose (``scancel``, a requeue, a time limit, preemption:
    slurmstepd delivers it, so the node is alive) and the job's record or the Slurm watcher says
    what became of the job."""
    if fenced or status is None:
        return False
    if status == 143:
        return under_slurm
    return status != 130


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


#: Seconds a failed observe-mode launch waits at its end for the decision about its failure
#: before it marks the job failed (an ended job decides nothing); the services decide within
#: a second of a crash (README: SIGKILL detected 0.05 s, decided 0.05 s later).
OBSERVE_DECISION_WAIT_S = 3.0


class Launcher:
    """One node's launcher. ``run()`` returns the node's exit status: 0 when every local rank
    finished (or this node was excluded), ``EXIT_STOPPED`` when the job was stopped, 1 on an
    unrecovered failure, the signal's status (130, 143) when stopped by hand.

    ``start()`` is the INIT state: connect to the bus, check (or host) the rendezvous store,
    register the run (``JobLease``), start the node's checkpoint writer and heartbeat, then the
    first ranks (``RunLoop.start``). ``run()`` runs the loop; ``shutdown()`` ends every process,
    records how the run ended and gives the lease up, whatever the state.
    """

    LEASE_S = JobLease.LEASE_S

    def __init__(self, cfg: LaunchConfig, template=None):
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
        self.bus = ThreadedBus(cfg.nats_url, f"launcher-{cfg.node}",
                               dead_letters=subjects.job_dead_letter(cfg.job,
                                                                     f"launcher-{cfg.node}"))
        self.pool = ProcessPool(cfg, self.bus, self.events.put)
        self.pool.adopt_template(template)  # started early (``early_template``), else None
        self.lease = JobLease(cfg, self.bus, self.events.put)
        self.loop = RunLoop(cfg, self.pool, self.lease, self.bus, self.events)
        self.rdzv_proc: subprocess.Popen | None = None
        #: set when a deferred stack's services are to start (``when_training``)
        self._services_wanted: threading.Event | None = None
        self._training_ranks: set[int] = set()
        self._want_services: Callable[[], None] = lambda: None

    def when_training(self, start_services: Callable[[], None],
                      max_wait_s: float | None = None) -> None:
        """Call ``start_services`` (an embedded stack's ``Stack.start_services``) once every
        rank of this node reported a completed step (its heartbeat), a rank failed, or
        ``max_wait_s`` seconds (``SERVICES_DEFER_MAX_S``) passed, whichever comes first, on
        the loop's thread (``RunOnLoop``: a service started from a thread that ends would get
        its parent-death signal). Before ``start()``."""
        wanted = self._services_wanted = threading.Event()

        def _want() -> None:
            if not wanted.is_set():
                wanted.set()
                self.bus.unsubscribe(self._ranks_hb_subject())  # no more to learn from them
                self.loop.post(RunOnLoop(start_services))
        self._want_services = _want
        self.loop.on_fault = _want
        t = threading.Timer(SERVICES_DEFER_MAX_S if max_wait_s is None else max_wait_s, _want)
        t.daemon = True
        t.start()

    def _ranks_hb_subject(self) -> str:
        return f"{subjects.PREFIX}.job.{subjects.token(self.cfg.job)}.rank.*.hb"

    def _on_rank_hb(self, subject: str, ev: schemas.Event) -> None:
        """Until every rank of this (single-node: an embedded stack's) job reported a step."""
        if isinstance(ev, schemas.RankHeartbeat) and ev.phase == "train" and ev.step >= 0:
            self._training_ranks.add(ev.rank)
            if len(self._training_ranks) >= self.cfg.nproc_per_node:
                self._want_services()

    @property
    def state(self) -> LaunchState:
        return self.loop.state

    @property
    def exit_status(self) -> int | None:
        return self.loop.exit_status

    @property
    def node_writer(self):
        return self.pool.node_writer

    def _base_env(self) -> dict[str, str]:
        return self.pool.base_env()

    def _start_node_writer(self) -> None:
        self.pool.start_node_writer()

    def _on_decision(self, subject: str, ev: schemas.Event) -> None:
        if isinstance(ev, schemas.Decision):
            self.events.put(DecisionReceived(ev))

    # ---- rendezvous store ---------------------------------------------------------------------
    def _check_rendezvous(self, timeout_s: float = 5.0) -> None:
        """Fail before starting any rank when the rendezvous store does not answer. A store
        endpoint on this machine that nothing serves yet is hosted here, as torchrun's c10d
        backend hosts its store (``python -m trainguard.rendezvous.store``, dies with the launcher);
        another node waits up to ``startup_timeout_s`` for its host."""
        from trainguard.rendezvous.endpoint import is_tls, parse_endpoint, split_endpoints

        try:
            stores = [parse_endpoint(e) for e in split_endpoints(self.cfg.rdzv_endpoint)]
        except ValueError as exc:
            raise SystemExit(f"trainguard launch: bad rendezvous endpoint "
                             f"{self.cfg.rdzv_endpoint!r} ({exc}): give host:port") from None
        host, port = stores[0]
        # a tls:// store is a `trainguard up`'s, a list of standbys a stack's: never hosted here
        hosting = _is_local(host) and self.cfg.node_rank == 0 and not self.cfg.spare_node \
            and not is_tls(self.cfg.rdzv_endpoint) and len(stores) == 1
        deadline = time.monotonic() + (timeout_s if hosting else self.cfg.startup_timeout_s)
        while True:
            exc: OSError | None = None
            for store in stores:  # any of them: the ranks' relay takes the one that answers
                try:
                    with socket.create_connection(store, timeout=timeout_s):
                        return
                except OSError as e:
                    exc = e
            if hosting and self.rdzv_proc is None:
                self._host_rendezvous(host, port)
                deadline = time.monotonic() + 60.0  # its torch import takes seconds
            elif time.monotonic() >= deadline or (
                    self.rdzv_proc is not None and self.rdzv_proc.poll() is not None):
                raise SystemExit(
                    f"trainguard launch: the rendezvous store at {self.cfg.rdzv_endpoint} "
                    f"does not answer ({exc}): start it with `trainguard up` (it prints "
                    f"TG_RDZV_ENDPOINT) or `python -m trainguard.rendezvous.store --port N`"
                ) from None
            time.sleep(0.1)

    def _host_rendezvous(self, host: str, port: int) -> None:
        print(f"trainguard launch [{self.cfg.node}]: nothing serves the rendezvous store at "
              f"{host}:{port}: hosting it in this launcher", file=sys.stderr, flush=True)
        self.rdzv_proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.rendezvous.store", "--host", host, "--port",
             str(port)], stdout=subprocess.DEVNULL, preexec_fn=pdeathsig_kill)

    def _open_relay(self) -> None:
        """With ``TG_RDZV_TOKEN`` set, the ranks reach the store through a relay on this node's
        loopback that opens each connection with the token (``trainguard.rendezvous.gate``); they get
        the relay's endpoint and not the token. ``relay_for`` refuses a ``tls://`` endpoint
        without the token (before anything waits on the store)."""
        from trainguard.rendezvous.gate import relay_for

        try:
            self.pool.rdzv_relay = relay_for(self.cfg.rdzv_endpoint)
        except ValueError as exc:
            raise SystemExit(f"trainguard launch: {exc}") from None
        except OSError as exc:
            raise SystemExit(f"trainguard launch: cannot open the relay to the rendezvous "
                             f"store at {self.cfg.rdzv_endpoint}: {exc}") from None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        # the spares' template warms while this launcher connects, registers and rendezvous
        self.pool.template()
        # last_stored: a decision published while this launcher was off the bus (NATS restarted,
        # its connection cut) is read from the stream when it is back, else the ranks would
        # wait for a recovery nobody carries out (the chaos bench's lost trial)
        self.bus.subscribe(subjects.job(cfg.job, "decision"), self._on_decision,
                           last_stored=True)
        wanted = self._services_wanted
        if wanted is not None and not wanted.is_set():  # an embedded stack's services wait
            self.bus.subscribe(self._ranks_hb_subject(), self._on_rank_hb)
        self.bus.start()
        if not self.bus.wait_connected(15.0):
            raise SystemExit(f"trainguard launch: {self.bus.error}" if self.bus.error else
                             f"trainguard launch: cannot reach NATS at {redact(cfg.nats_url)}")
        self._open_relay()
        self._check_rendezvous()
        generation = self.lease.register()
        where = ("a spare node" if cfg.spare_node else
                 f"node rank {cfg.node_rank} of {cfg.nnodes}")
        print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} ({cfg.mode} mode), {where}, "
              f"{cfg.nproc_per_node} rank(s) here, generation {generation}", file=sys.stderr,
              flush=True)
        self.pool.start_node_writer()
        self.lease.start_heartbeat(lambda: (self.loop.generation, self.loop.attempt))
        # the first ranks and the spares are forked from the template started above (cold
        # processes with --no-fork-spares: on 2 cores, 6 importing torch took ≈ 20 s, not ≈ 13)
        self.loop.start(generation)

    def run(self) -> int:
        self.start()
        try:
            return self.loop.run()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        cfg = self.cfg
        self.lease.stop_heartbeat(ending=ends_on_purpose(
            self.loop.exit_status, self.loop.fenced, bool(os.environ.get("SLURM_JOB_ID"))))
        self.pool.shutdown()
        status = self.loop.exit_status
        kept = self.pool.remove_log_dir(keep=status != 0)
        if kept is not None:
            print(f"trainguard launch [{cfg.node}]: the ranks' logs are kept in {kept}",
                  file=sys.stderr, flush=True)
        if self.loop.fenced:
            pass  # lost its lease: the job's record is no longer this node's to write
        elif not cfg.spare_node and status == 0:
            self.lease.mark_status("finished")
        elif not cfg.spare_node and status == 1 and cfg.mode == "action":
            self.lease.mark_status("failed")
        elif not cfg.spare_node and status == 1:
            # observe mode: the decision that would have been taken for this failure is still
            # to be published, and an ended job decides nothing; so the job is marked failed
            # once that decision came (or OBSERVE_DECISION_WAIT_S passed), not before
            self._await_observed_decision(OBSERVE_DECISION_WAIT_S)
            self.lease.mark_status("failed")
        if not self.loop.fenced:
            self.lease.end()
        print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} ended on this node: exit status "
              f"{status}, generation {self.loop.generation}, {self.loop.restart_count} "
              f"restart(s) here", file=sys.stderr, flush=True)
        self.bus.close(timeout=2.0)
        if self.rdzv_proc is not None:
            self.rdzv_proc.kill()
            self.rdzv_proc.wait()

    def _await_observed_decision(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` seconds) for a decision not seen before on this job's
        decision subject and print it; True when one came."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if isinstance(ev, DecisionReceived) and \
                    ev.decision.idempotency_key not in self.loop.seen_keys:
                d = ev.decision  # said, as torchrun's user would read it: nothing carried out
                print(f"trainguard launch [{self.cfg.node}]: decision {d.action} (observe mode: "
                      f"not executed) generation {d.generation} ranks {d.ranks} nodes "
                      f"{d.nodes}: {d.reason}", file=sys.stderr, flush=True)
                return True
        return False

    def request_stop(self, status: int = 1) -> None:
        self.events.put(StopRequested(status))


def parse_args(argv: list[str]) -> LaunchConfig:
    """``trainguard launch`` arguments (torchrun's and trainguard's: ``trainguard.launch.args``)
    → LaunchConfig; a bad argument exits with argparse's usage error (status 2)."""
    from trainguard.launch.args import parse

    return parse(argv, description=__doc__.split("\n\n")[0])


#: Seconds a failed launch waits for its embedded stack's services to come up before stopping it.
STACK_SERVICES_WAIT_S = 20.0
#: Seconds after the launch an embedded stack's services start at the latest when no rank has
#: reported a step yet (a script that works long before its first step). Until then they wait
#: (``Launcher.when_training``): on 2 cores their start-up beside the ranks' put a launch 1.5 s
#: behind torchrun's (bench/startup.py); what the ranks publish meanwhile waits in the streams.
SERVICES_DEFER_MAX_S = 20.0


def _needs_embedded_stack(cfg: LaunchConfig) -> bool:
    """A single-node job with no NATS and no state store given runs on a stack of its own."""
    return not (cfg.nats_url or cfg.redis_url or cfg.nnodes != 1)


def _embedded_stack(cfg: LaunchConfig):
    """With no NATS, state store and rendezvous store configured on a single-node job, start
    an embedded stack for this launch (as ``trainguard demo`` does) and point ``cfg`` at it.
    Returns the stack (stopped by the caller) or None when one is configured."""
    if not _needs_embedded_stack(cfg):
        return None
    from trainguard.stack.local import Stack

    stack = Stack(agent_nodes=(cfg.node,), rendezvous=not cfg.rdzv_endpoint, rdzv_token=True)
    print(f"trainguard launch: no NATS_URL / REDIS_URL given: starting an embedded stack for "
          f"this job (services' logs in {stack.log_dir}, removed at the end unless the job "
          f"fails); `trainguard up` runs one to share",
          file=sys.stderr, flush=True)
    # the ranks start once the servers and the rendezvous store answer; the services come up
    # once they train (``Launcher.when_training``; what they publish meanwhile waits in the
    # streams)
    stack.start(timeout=120, defer_services=True)
    cfg.nats_url, cfg.redis_url = stack.nats_url, stack.redis_url
    if stack.rdzv_token:  # this launcher's relay opens its connections with it
        from trainguard.rendezvous.gate import TOKEN_ENV

        os.environ[TOKEN_ENV] = stack.rdzv_token
    cfg.rdzv_endpoint = cfg.rdzv_endpoint or stack.rdzv_endpoint
    return stack


def _script_missing(cfg: LaunchConfig) -> str | None:
    """Why the job's program cannot run here (a script path that is not a file), or None; a
    module (``-m``) is left to its import."""
    if cfg.module or cfg.no_python or os.path.isfile(cfg.script):
        return None  # --no-python: a program on PATH, checked with the arguments
    return f"trainguard launch: {cfg.script}: no such file (the training script to run)"


def standalone_lock(job: str, node: str) -> TextIO:
    """Hold the lock of job ``job`` on this host for an embedded stack (``--standalone``, or no
    NATS_URL/REDIS_URL): each such launch has a state store of its own, so the store's launcher
    lease (``StateStore.begin_run``) cannot see a second launch of the same job, and two runs
    of one job would train side by side into the same checkpoint directory. An ``fcntl``
    lock on ``$TMPDIR/trainguard-<uid>/<job>@<node>.lock``, released by the kernel when the
    process ends however it ends. Returns the open lock file (keep it open); raises
    ``SystemExit`` (a message) when another process holds it."""
    import fcntl
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"trainguard-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = os.path.join(d, f"{subjects.token(job)}@{subjects.token(node)}.lock")
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise SystemExit(f"trainguard launch: job {job!r} is already running on this host with "
                         f"an embedded stack ({holder}; lock {path}): stop it first, or give "
                         f"this launch another --job") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}")
    fh.flush()
    return fh


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    if (why := _script_missing(cfg)) is not None:
        print(why, file=sys.stderr)
        return 2
    lock = template = None
    if _needs_embedded_stack(cfg):
        lock = standalone_lock(cfg.job, cfg.node)
        # the template imports torch and the job's modules while the stack starts
        template = early_template(cfg)
    status = 1
    stack = launcher = None
    try:
        stack = _embedded_stack(cfg)
        launcher = Launcher(cfg, template)
        if stack is not None:
            launcher.when_training(stack.start_services)
        signal.signal(signal.SIGTERM, lambda *a: launcher.request_stop(143))
        signal.signal(signal.SIGINT, lambda *a: launcher.request_stop(130))
        status = launcher.run()
        return status
    finally:
        if template is not None and launcher is None:
            template.close()  # the launcher never took it over
        if stack is not None:
            if status != 0:
                # a job that failed at once: its services get the moment to come up and read
                # what the ranks published, so the logs kept say it
                stack.start_services()
                stack.services_ready.wait(STACK_SERVICES_WAIT_S)
            # the embedded stack's temporary logs go with it, unless the job failed
            stack.keep_logs = stack.keep_logs or status != 0
            stack.stop()
            if stack.keep_logs:
                print(f"trainguard launch: the embedded stack's logs are kept in "
                      f"{stack.log_dir}", file=sys.stderr, flush=True)
        if lock is not None:
            lock.close()

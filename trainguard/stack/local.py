"""The local stack: ``trainguard up``, and ``Stack`` for the demo and tests.

``Stack`` starts (or reuses) NATS with JetStream and Valkey, creates the JetStream streams, the
rendezvous store host (``python -m trainguard.rendezvous.store``), and each service as its own process
(``python -m <package> --nats-url … --redis-url …``), then waits until every service answers its
health request (``tg.svc.<name>.health``; agents are named ``agent-<node>``). Children get
``PR_SET_PDEATHSIG`` and their own process group, so they die with the stack even when it is
SIGKILLed, and a Ctrl-C in the terminal reaches only the stack, which stops them in order.

Use::

    with Stack(services=("remediator",)) as stack:   # start(timeout=60) on enter
        stack.nats_url, stack.redis_url, stack.rdzv_endpoint, stack.procs
        stack.restart_service("remediator")

``trainguard up`` prints one line ``export NATS_URL=… REDIS_URL=… TG_RDZV_ENDPOINT=…`` on stdout
(the rest goes to stderr), runs until Ctrl-C or SIGTERM, restarts a service that dies (at most
``--max-restarts`` times each), then stops everything, leaving no process behind.

Security (``trainguard.security.roles``): the embedded servers require a user; each service connects as
its role (URLs with credentials in its environment, never on a command line that ``ps`` shows),
the printed line carries the ``worker`` role's URLs (what a launcher needs), and
``<data dir>/env/<role>.env`` holds each role's. ``Stack.nats_url``/``redis_url`` are ``admin``'s.
With ``tls`` (``trainguard up``'s default) NATS is TLS-only, the line adds ``TG_TLS_CA`` and the
children get it in their environment; ``issue_job`` adds a per-job worker user.
State: ``trainguard up`` keeps credentials, the JetStream store and Valkey's AOF in
``--data-dir`` (default ``$XDG_STATE_HOME/trainguard``) across a stop/start; ``--ephemeral`` (and
``Stack`` by default: the demo, the tests) uses a temporary directory removed on stop. The
children's logs go to ``log_dir``; a stack that made its own temporary folder for them removes
it when it stops, unless ``keep_logs`` (set too when a start failed: its error names a log).

The parts: ``trainguard.stack.services`` (which services, their process names and commands),
``.children`` (the process groups), ``.health`` (streams and health requests),
``.rendezvous_store``, ``.endpoints`` (console and ``/metrics`` ports), and the servers of
``.embedded`` or ``.ha``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from trainguard.rendezvous.gate import TOKEN_ENV as RDZV_TOKEN_ENV
from trainguard.schemas import subjects
from trainguard.security.roles import ROLES
from trainguard.security.tls import CA_ENV as TLS_CA_ENV
from trainguard.stack import rendezvous_store
from trainguard.stack.children import StackError, kill_group, spawn, stop_all, tail
from trainguard.stack.embedded import EmbeddedServers
from trainguard.stack.endpoints import console_command, kept_ports, wait_http
from trainguard.stack.endpoints import url as stack_url
from trainguard.stack.health import ask_health, ensure_streams, run_async, wait_healthy
from trainguard.stack.services import (DEFAULT_SERVICES, check_services, kernel_log_file,
                                       memory_budget_file, process_health_subject,
                                       service_command, service_names)


class Stack:
    """NATS + Valkey + rendezvous store + services, as child processes (see module docstring).

    * ``nats_url``/``redis_url`` — servers to use; None or "" → embedded servers on free
      loopback ports (the environment is not read here: ``trainguard up`` passes
      ``NATS_URL``/``REDIS_URL`` itself; the demo and the tests always start their own);
    * ``services`` — names from ``services.SERVICE_SPECS``; ``agent_nodes`` — an agent each;
    * ``rendezvous`` — also host the rendezvous store (skipped, with ``rdzv_endpoint = ""``, when
      ``trainguard.rendezvous.store`` is not installed); ``rdzv_standby`` (default: ``ha``) a
      standby too: ``rdzv_endpoint`` is ``primary,standby`` (``rendezvous.gate.Relay``);
    * ``log_dir`` — one ``<name>.log`` per child (default: a new temporary directory, removed
      by ``stop`` unless ``keep_logs``, which a failed start sets);
    * ``env`` — extra environment for the children;
    * ``grace_s`` — seconds between SIGTERM and SIGKILL when stopping;
    * ``kernel_log_dir`` — when set, each agent follows ``<dir>/kernel-<node>.log`` instead of
      the host's kernel log (simulated nodes on one machine: the demo and tests append real
      ``NVRM: Xid`` lines there);
    * ``sim_dir`` — each agent is a simulated node's there: the demo's simulated NVML
      (``trainguard.demo.fake_pynvml:for_node``, ``<dir>/nvml-<node>.json``) and a share of the
      host's memory (``agents.host.NodeMemory``, ``memory_budget_path``);
    * ``data_dir`` — embedded servers keep credentials and data there across starts (None: a
      temporary directory removed on stop); ``auth`` — embedded servers require the users of
      ``trainguard.security.roles``; ``rotate_credentials`` — new passwords for every role;
    * ``host`` — the address NATS, Valkey and the rendezvous store listen on (default loopback;
      the cluster harness gives its bridge's address);
    * ``tls`` — the embedded servers serve TLS (``trainguard.stack.embedded``; ``trainguard up`` by
      default, off here so that the demo and the tests stay as they were), with a certificate
      for loopback, this host and ``tls_names``; the children get the CA in ``TG_TLS_CA``;
    * ``ha`` — the replicated control plane instead of one NATS and one Valkey
      (``trainguard.stack.ha``: 3 NATS servers, a Valkey primary, a replica and 3
      sentinels; the URLs are a NATS server list and a ``redis+sentinel://`` URL);
    * ``rdzv_token`` — the rendezvous store admits only clients with its token
      (``trainguard.rendezvous.gate``; ``trainguard up`` by default, off here as ``tls``): kept in
      ``<data dir>/rdzv.token`` (0600) across starts, given as ``TG_RDZV_TOKEN`` on the
      export lines and to the store alone among the children;
    * ``console`` — also run the console (``python -m trainguard.tools.console``, ``reader`` role) on
      ``host``: ``console_url`` (``trainguard up`` by default, off here as ``tls``);
    * ``metrics`` — every service serves Prometheus ``/metrics`` on ``host`` at a port of its
      own: ``metrics_urls`` (``trainguard up`` by default, off here). Both take the ports of the
      last start while free (``trainguard.stack.endpoints.kept_ports``).
    """

    def __init__(self, nats_url: str | None = None, redis_url: str | None = None,
                 services: Sequence[str] = DEFAULT_SERVICES,
                 agent_nodes: Sequence[str] | None = None, rendezvous: bool = True,
                 log_dir: str | os.PathLike | None = None, env: dict[str, str] | None = None,
                 grace_s: float = 5.0, kernel_log_dir: str | os.PathLike | None = None,
                 data_dir: str | os.PathLike | None = None, auth: bool = True,
                 rotate_credentials: bool = False, replicas: int = 1,
                 host: str = "127.0.0.1", sim_dir: str | os.PathLike | None = None,
                 tls: bool = False, tls_names: Sequence[str] = (),
                 rdzv_token: bool = False, console: bool = False, metrics: bool = False,
                 ha: bool = False, keep_logs: bool = False, rdzv_standby: bool | None = None):
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, not {replicas}")
        self.replicas = replicas
        check_services(services)
        if ha:  # the replicated control plane (``trainguard.stack.ha``)
            from trainguard.stack.ha import ha_servers

            self._servers = ha_servers(nats_url, redis_url, data_dir=data_dir, auth=auth,
                                       rotate=rotate_credentials, host=host, tls=tls,
                                       tls_names=tuple(tls_names))
        else:
            self._servers = EmbeddedServers(nats_url, redis_url, data_dir=data_dir, auth=auth,
                                            rotate=rotate_credentials, host=host, tls=tls,
                                            tls_names=tuple(tls_names))
        self.host = host
        self.services = tuple(services)
        self.agent_nodes = tuple(agent_nodes or (subjects.default_node(),))
        self.rendezvous = rendezvous
        #: the log folder is this stack's own temporary one (removed by ``stop``)
        self._own_log_dir = not log_dir
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="trainguard-up-"))
        #: keep the log folder at ``stop`` even when it is the stack's own temporary one
        self.keep_logs = keep_logs
        self.env = dict(env or {})
        self.grace_s = grace_s
        self.kernel_log_dir = Path(kernel_log_dir) if kernel_log_dir else None
        self.sim_dir = Path(sim_dir) if sim_dir else None
        if self.sim_dir is not None:
            self.sim_dir.mkdir(parents=True, exist_ok=True)
            self.env["TG_DEMO_NVML_DIR"] = str(self.sim_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}
        self.roles: dict[str, str | None] = {}  # process name -> auth role (None: no servers)
        self.rdzv_endpoint = ""
        #: the rendezvous store's token (``trainguard.rendezvous.gate``; "" when it is open)
        self.rdzv_token = ""
        self._want_rdzv_token = rdzv_token
        self._rdzv_starts: list = []  # rendezvous_store.start_stores
        #: a standby rendezvous store is started beside the primary
        self.rdzv_standby = ha if rdzv_standby is None else rdzv_standby
        self._started = False
        self.services_ready = threading.Event()
        self.services_error = ""
        self._stopping = False
        self._services_started = False
        self._services_lock = threading.Lock()
        self.console = console
        self.metrics = metrics
        #: endpoint name ("console", "metrics-<process>") → port, given at start
        self.http_ports: dict[str, int] = {}

    # ---- URLs ------------------------------------------------------------------------------------
    @property
    def nats_url(self) -> str:
        """NATS URL of the ``admin`` role (the given one when not embedded)."""
        return self._servers.nats_url

    @property
    def redis_url(self) -> str:
        """Valkey URL of the ``admin`` role (the given one when not embedded)."""
        return self._servers.redis_url

    def urls(self, role: str) -> tuple[str, str]:
        """``(nats_url, redis_url)`` of ``role`` (see ``trainguard.security.roles.ROLES``) or of a
        per-job user ``job-<job>`` given by ``issue_job`` (or per-node ``node-<node>``).
        Raises ``KeyError``."""
        creds = self._servers.creds
        if role not in ROLES:
            try:
                known = creds is not None and bool(creds.password(role))
            except KeyError:
                known = False
            if not known:
                raise KeyError(f"no role {role!r}: choose from {', '.join(ROLES)}")
        return self._servers.urls(role)

    def issue_job(self, job: str, rotate: bool = False) -> tuple[str, str]:
        """Give ``job``'s workers their own user on the running servers
        (``trainguard.security.roles.job_role``); returns their ``(nats_url, redis_url)``."""
        return self._servers.issue_job(job, rotate)

    def revoke_job(self, job: str) -> bool:
        """Take ``job``'s workers' own user away on the running servers (its connections are
        closed); returns whether it had one."""
        return self._servers.revoke_job(job)

    @property
    def tls_ca(self) -> str | None:
        """The CA file clients need (``TG_TLS_CA``) when the embedded NATS serves TLS."""
        return self._servers.tls_ca

    @property
    def data_dir(self) -> Path | None:
        """Where the embedded servers keep credentials and data (None before start)."""
        return self._servers.dir

    def env_exports(self, role: str = "worker") -> str:
        """``export NATS_URL=… REDIS_URL=… TG_RDZV_ENDPOINT=…`` of ``role`` (for a shell), with
        ``TG_TLS_CA=…`` when the servers serve TLS."""
        nats_url, redis_url = self.urls(role)
        ca = f" {TLS_CA_ENV}={self.tls_ca}" if self.tls_ca else ""
        tok = f" {RDZV_TOKEN_ENV}={self.rdzv_token}" if self.rdzv_token else ""
        return (f"export NATS_URL={nats_url} REDIS_URL={redis_url} "
                f"TG_RDZV_ENDPOINT={self.rdzv_endpoint}{tok}{ca}")

    # ---- children ---------------------------------------------------------------------------------
    def _child_env(self, role: str | None) -> dict[str, str]:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        # small objects from the C heap, not pymalloc's 1 MiB arenas: a flood of hostile
        # messages left a service's arenas pinned by a few live objects each (+12 arenas for
        # +2 MB of live objects, bench/fuzz.py), which no trim returns; the C heap's free pages
        # go back to the OS (``service.release_freed_memory``). Same in the Dockerfile.
        env.setdefault("PYTHONMALLOC", "malloc")
        env.pop("NATS_URL", None)
        env.pop("REDIS_URL", None)
        if role is not None:
            env["NATS_URL"], env["REDIS_URL"] = self.urls(role)
        if self.rdzv_endpoint:
            env["TG_RDZV_ENDPOINT"] = self.rdzv_endpoint
        if self.tls_ca:
            env[TLS_CA_ENV] = self.tls_ca
        root = str(Path(__file__).resolve().parents[2])  # the folder holding ``trainguard``
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def _spawn(self, name: str, cmd: list[str], role: str | None) -> subprocess.Popen:
        """Start child ``name``; its URLs (with ``role``'s credentials) go in its environment,
        which other users cannot read, unlike a command line."""
        env = self._child_env(role)
        port = self.http_ports.get(f"metrics-{name}")
        if port is not None:
            env.update(TG_METRICS_PORT=str(port), TG_METRICS_HOST=self.host)
        proc = spawn(cmd, self.log_dir / f"{name}.log", env)
        self.procs[name] = proc
        self.commands[name] = cmd
        self.roles[name] = role
        return proc

    def service_names(self) -> list[str]:
        """Process names of the services (``trainguard.stack.services.service_names``)."""
        return service_names(self.services, self.agent_nodes, self.replicas)

    def _health_subject(self, name: str) -> str:
        return process_health_subject(self.services, name)

    def _service_cmd(self, name: str) -> tuple[list[str], str]:
        """Command line and auth role of service process ``name`` (URLs: ``_child_env``)."""
        try:
            return service_command(self.services, name, self.replicas, self.kernel_log_dir,
                                   self.sim_dir)
        except KeyError:
            raise KeyError(f"no service process named {name!r}; running: "
                           f"{', '.join(self.procs)}") from None

    def kernel_log_path(self, node: str) -> Path:
        """The kernel-log file the agent of ``node`` follows (needs ``kernel_log_dir``)."""
        if self.kernel_log_dir is None:
            raise ValueError("this stack's agents follow the host kernel log: pass "
                             "kernel_log_dir to give each simulated node its own file")
        return kernel_log_file(self.kernel_log_dir, node)

    def memory_budget_path(self, node: str) -> Path:
        """The file holding the memory budget (bytes) of simulated node ``node`` (needs
        ``sim_dir``)."""
        if self.sim_dir is None:
            raise ValueError("this stack's agents read the host's memory: pass sim_dir to make "
                             "each simulated node a share of the host")
        return memory_budget_file(self.sim_dir, node)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0, defer_services: bool = False) -> "Stack":
        """Start everything and wait until each service is healthy (``timeout`` seconds in all).
        Raises ``StackError`` (with the failing child's log tail) after stopping what started;
        the logs are then kept (``keep_logs``). ``defer_services`` (a launch's embedded stack):
        return once NATS, Valkey, the streams and the rendezvous store answer; the services
        wait for ``start_services`` (the launcher's, once its ranks train or one fails: on 2
        cores their start-up beside the ranks' put a launch 1.5 s behind torchrun's), and
        their new consumers then deliver what the streams stored since this start
        (``durable.CONSUME_SINCE_ENV``)."""
        if self._started:
            return self
        self._started = True
        deadline = time.monotonic() + timeout
        if defer_services:
            from trainguard.services.durable import CONSUME_SINCE_ENV

            self.env.setdefault(CONSUME_SINCE_ENV, str(time.time_ns()))
        try:
            self._servers.start()
            size = getattr(self._servers, "n_nats", None)  # a replicated stack's servers
            run_async(lambda: ensure_streams(self.nats_url, self.tls_ca, size))
            self._start_rendezvous()
            self._give_http_ports()
            if not defer_services:
                self._services_started = True
                self._spawn_services()
            self._wait_rendezvous(deadline)
            if not defer_services:
                self._await_services(deadline, raise_errors=True)
        except BaseException:
            self.keep_logs = True  # the error names a log: it stays to be read
            self.stop()
            raise
        return self

    def _spawn_services(self) -> None:
        for name in self.service_names():
            self._spawn(name, *self._service_cmd(name))
        if self.console:
            self._spawn("console", console_command(self.host, self.http_ports["console"]),
                        "reader")

    def start_services(self, timeout: float = 60.0) -> None:
        """Start the services (and the console) of a stack started with ``defer_services`` and
        await their health on a thread, ``timeout`` seconds: ``services_ready`` is set when
        all are healthy, else ``services_error`` says why (also printed, the log kept). Does
        nothing once called before, or once the stack is stopping."""
        with self._services_lock:
            if self._services_started or self._stopping:
                return
            self._services_started = True
            self._spawn_services()
        threading.Thread(target=self._await_services,
                         args=(time.monotonic() + timeout, False),
                         name="stack-services-health", daemon=True).start()

    def _await_services(self, deadline: float, raise_errors: bool) -> None:
        """Wait for the services' (and the console's) health; sets ``services_ready``. Without
        ``raise_errors`` (on a thread: ``start_services``) a failure is kept in
        ``services_error`` and printed instead of raised."""
        try:
            self.wait_healthy(self.service_names(), max(1.0, deadline - time.monotonic()))
            if self.console:
                self._wait_console(deadline)
            if self.metrics:
                self._check_metrics_ports()
        except Exception as exc:  # noqa: BLE001 - on the thread: said, not raised
            if raise_errors:
                raise
            if self._stopping:
                return  # stopped before the services were up (a job that ended at once)
            self.keep_logs = True
            self.services_error = str(exc)
            print(f"trainguard: a service of the stack did not come up: {exc}", file=sys.stderr,
                  flush=True)
            return
        self.services_ready.set()

    # ---- the operator's endpoints (trainguard.stack.endpoints) ------------------------------------------
    def _give_http_ports(self) -> None:
        names = (["console"] if self.console else []) + (
            [f"metrics-{n}" for n in self.service_names()] if self.metrics else [])
        if names:
            self.http_ports = kept_ports(names, self.host, self.data_dir)

    @property
    def console_url(self) -> str:
        """The console's page (``""`` without ``console``)."""
        port = self.http_ports.get("console")
        return stack_url(self.host, port) if port else ""

    def metrics_urls(self) -> dict[str, str]:
        """Service process name → its ``/metrics`` URL (with ``console``, the console's too:
        the jobs' goodput); empty without ``metrics``."""
        out = {n[len("metrics-"):]: stack_url(self.host, p, "/metrics")
               for n, p in self.http_ports.items() if n.startswith("metrics-")}
        if out and self.console_url:
            out["console"] = self.console_url + "metrics"
        return out

    def _wait_console(self, deadline: float) -> None:
        log = self.log_dir / "console.log"
        try:
            wait_http(self.console_url + "healthz", self.procs["console"],
                      max(deadline, time.monotonic() + 5.0))
        except (ChildProcessError, TimeoutError) as exc:
            raise StackError(f"console: {exc}; log {log}:\n{tail(log)}") from None

    def _check_metrics_ports(self) -> None:
        """Every service serves ``/metrics`` on the port it was given (its health reply says);
        one that could not (the port taken meanwhile: the service logs it and runs on) loses
        its URL, with a line on stderr."""
        for name in self.service_names():
            key = f"metrics-{name}"
            try:
                got = self.health(name, timeout=2.0).get("metrics_port")
            except Exception:  # noqa: BLE001 - no answer: as no metrics
                got = None
            if got != self.http_ports.get(key):
                print(f"trainguard up: {name} serves no /metrics on port "
                      f"{self.http_ports.get(key)} (see {self.log_dir / (name + '.log')})",
                      file=sys.stderr)
                self.http_ports.pop(key, None)

    # ---- the rendezvous store (trainguard.stack.rendezvous_store) ---------------------------------
    RDZV_NAMES = rendezvous_store.NAMES

    def _start_rendezvous(self) -> None:
        """Start the rendezvous store, and with ``rdzv_standby`` its standby."""
        if not self.rendezvous:
            return
        if not rendezvous_store.store_installed():
            print("trainguard up: trainguard.rendezvous.store is not installed: no rendezvous store",
                  file=sys.stderr)
            return
        if self._want_rdzv_token:
            self.rdzv_token = rendezvous_store.store_token(self.data_dir, self._servers.rotate)
            self.env[RDZV_TOKEN_ENV] = self.rdzv_token
        files = self._servers.tls_files
        gate_tls = files if self.rdzv_token and self.tls_ca and files is not None else None
        try:
            self._rdzv_starts = rendezvous_store.start_stores(
                lambda name, cmd: self._spawn(name, cmd, None), self.log_dir, self.data_dir,
                self.host, self._want_rdzv_token, gate_tls, self.rdzv_standby)
        finally:
            self.env.pop(RDZV_TOKEN_ENV, None)  # the stores' alone among the children

    def _wait_rendezvous(self, deadline: float) -> None:
        if self._rdzv_starts:
            self.rdzv_endpoint = rendezvous_store.wait_stores(self._rdzv_starts, self.log_dir,
                                                              deadline)

    # ---- health (trainguard.stack.health) ------------------------------------------------------------
    def wait_healthy(self, names: Sequence[str], timeout: float = 30.0) -> None:
        """Wait until each process in ``names`` answers its health request with ``ok``.
        Raises ``StackError`` naming the first that exited or did not answer in time."""
        procs = {n: self.procs[n] for n in names}
        run_async(lambda: wait_healthy(self.nats_url, self.tls_ca, procs, self._health_subject,
                                       self.log_dir, timeout))

    def health(self, name: str, timeout: float = 1.0) -> dict[str, Any]:
        """The health answer of process ``name`` (raises on no answer)."""
        return run_async(lambda: ask_health(self.nats_url, self.tls_ca,
                                            self._health_subject(name), timeout))

    def dead(self) -> list[str]:
        """Names of child processes that have exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def dead_servers(self) -> list[str]:
        """The embedded NATS / Valkey servers this stack started that have exited, as
        ``"the embedded <kind> server at <address> exited (<status>)"`` (the replicated set:
        only once a majority of a kind is gone, ``HAServers.dead_servers``)."""
        if hasattr(self._servers, "dead_servers"):
            return self._servers.dead_servers()
        return [f"the embedded {s.kind} server at {s.address} exited ({s.proc.returncode})"
                for s in self._servers.servers if s.proc is not None and s.proc.poll() is not None]

    def kill_service(self, name: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Send ``sig`` to the process group of child ``name`` and wait until it exited."""
        kill_group(self.procs[name], sig, timeout)

    def restart_service(self, name: str, timeout: float = 30.0) -> None:
        """Stop child ``name`` (SIGTERM, SIGKILL after the grace period), start it again with the
        same command, and wait until it is healthy."""
        if name not in self.procs:
            raise KeyError(f"no child named {name!r}; running: {', '.join(self.procs)}")
        self.kill_service(name, signal.SIGTERM, self.grace_s)
        self._spawn(name, self.commands[name], self.roles[name])
        if name == "console":
            self._wait_console(time.monotonic() + timeout)
        elif name not in self.RDZV_NAMES:
            self.wait_healthy([name], timeout)

    def stop(self) -> None:
        """SIGTERM every child (services first, then the rendezvous store), SIGKILL what is left
        after ``grace_s``, then stop the embedded servers; the stack's own temporary log folder
        is removed unless ``keep_logs``. Idempotent."""
        with self._services_lock:  # a deferred start of the services spawns nothing after this
            self._stopping = True  # a health wait still running on its thread is no failure now
        stop_all(list(self.procs.values())[::-1], self.grace_s)
        self._servers.stop()
        if self._own_log_dir and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

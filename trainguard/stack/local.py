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

Security (``trainguard.security.auth``): the embedded servers require a user; each service connects as
its role (URLs with credentials in its environment, never on a command line that ``ps`` shows),
the printed line carries the ``worker`` role's URLs (what a launcher needs), and
``<data dir>/env/<role>.env`` holds each role's. ``Stack.nats_url``/``redis_url`` are ``admin``'s.
With ``tls`` (``trainguard up``'s default) NATS is TLS-only, the line adds ``TG_TLS_CA`` and the
children get it in their environment; ``issue_job`` adds a per-job worker user.
State: ``trainguard up`` keeps credentials, the JetStream store and Valkey's AOF in
``--data-dir`` (default ``$XDG_STATE_HOME/trainguard``) across a stop/start; ``--ephemeral`` (and
``Stack`` by default: the demo, the tests) uses a temporary directory removed on stop.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from trainguard.schemas import subjects

from trainguard.security.private_file import write_private
from trainguard.security.roles import ROLES
from trainguard.stack.embedded import EmbeddedServers, _die_with_parent, free_port
from trainguard.rendezvous.gate import TOKEN_ENV as RDZV_TOKEN_ENV
from trainguard.services.base import health_subject
from trainguard.stack.endpoints import console_command, kept_ports, wait_http
from trainguard.stack.endpoints import url as stack_url
from trainguard.security.tls import CA_ENV as TLS_CA_ENV

#: The services of the design, in start order.
DEFAULT_SERVICES = ("agent", "detector", "attributor", "remediator", "checkpoint_validator")


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: the package run with ``python -m``; ``per_node`` services run
    once per node name with ``--node NAME`` and are named ``<name>-<node>``; ``role``: the
    ``trainguard.security.auth`` role it connects as."""

    module: str
    role: str
    per_node: bool = False
    partitioned: bool = False


SERVICE_SPECS: dict[str, ServiceSpec] = {
    "agent": ServiceSpec("trainguard.agents", "agent", per_node=True),
    "detector": ServiceSpec("trainguard.detector", "detector", partitioned=True),
    "attributor": ServiceSpec("trainguard.attributor", "attributor", partitioned=True),
    "remediator": ServiceSpec("trainguard.remediator", "remediator", partitioned=True),
    "checkpoint_validator": ServiceSpec("trainguard.checkpoint_validator", "checkpoint_validator",
                                        partitioned=True),
    # not in DEFAULT_SERVICES: it needs the Slurm clients (trainguard.cluster starts it with Slurm)
    "slurm_watch": ServiceSpec("trainguard.scheduler.slurm.watch", "slurm_watch"),
}


class StackError(RuntimeError):
    """The stack could not start; the message names the process and has the tail of its log."""


def service_available(name: str) -> bool:
    """True when ``python -m <module>`` of service ``name`` can run here."""
    spec = SERVICE_SPECS.get(name)
    if spec is None:
        return False
    try:
        return importlib.util.find_spec(f"{spec.module}.__main__") is not None
    except (ImportError, ValueError):
        return False


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _run_async(fn: Callable[[], Any]) -> Any:
    """Run coroutine function ``fn`` to completion from sync code, even when the caller's thread
    already runs an event loop (then on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fn())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = asyncio.run(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["e"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box.get("v")


class Stack:
    """NATS + Valkey + rendezvous store + services, as child processes (see module docstring).

    * ``nats_url``/``redis_url`` — servers to use; None or "" → embedded servers on free
      loopback ports (the environment is not read here: ``trainguard up`` passes
      ``NATS_URL``/``REDIS_URL`` itself; the demo and the tests always start their own);
    * ``services`` — names from ``SERVICE_SPECS``; ``agent_nodes`` — one agent per simulated
      node name;
    * ``rendezvous`` — also host the rendezvous store (skipped, with ``rdzv_endpoint = ""``, when
      ``trainguard.rendezvous.store`` is not installed);
    * ``log_dir`` — one ``<name>.log`` per child (default: a new temporary directory);
    * ``env`` — extra environment for the children;
    * ``grace_s`` — seconds between SIGTERM and SIGKILL when stopping;
    * ``kernel_log_dir`` — when set, each agent follows ``<dir>/kernel-<node>.log`` instead of
      the host's kernel log (simulated nodes on one machine: the demo and tests append real
      ``NVRM: Xid`` lines there);
    * ``sim_dir`` — when set, each agent is a simulated node's with simulated hardware there:
      its GPUs are the demo's simulated NVML (``trainguard.demo.fake_pynvml:for_node``, one
      healthy H100 whose degradation follows ``<dir>/nvml-<node>.json``) and its memory is a
      share of the host (``agents.host.NodeMemory``: the node's own processes against the budget
      in ``<dir>/memory-budget-<node>``, ``memory_budget_path``);
    * ``data_dir`` — embedded servers keep credentials and data there across starts (None: a
      temporary directory removed on stop); ``auth`` — embedded servers require the users of
      ``trainguard.security.auth``; ``rotate_credentials`` — new passwords for every role;
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
                 ha: bool = False):
        if replicas < 1:
            raise ValueError(f"replicas must be 1 or more, not {replicas}")
        self.replicas = replicas
        unknown = [s for s in services if s not in SERVICE_SPECS]
        if unknown:
            raise ValueError(f"unknown service(s) {', '.join(unknown)}: choose from "
                             f"{', '.join(SERVICE_SPECS)}")
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
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="trainguard-up-"))
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
        self._rdzv_log_offset = 0
        self._started = False
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
        """``(nats_url, redis_url)`` of ``role`` (see ``trainguard.security.auth.ROLES``) or of a
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
        (``trainguard.security.auth.job_role``); returns their ``(nats_url, redis_url)``."""
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
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return env

    def _spawn(self, name: str, cmd: list[str], role: str | None) -> subprocess.Popen:
        """Start child ``name``; its URLs (with ``role``'s credentials) go in its environment,
        which other users cannot read, unlike a command line."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        env = self._child_env(role)
        port = self.http_ports.get(f"metrics-{name}")
        if port is not None:
            env.update(TG_METRICS_PORT=str(port), TG_METRICS_HOST=self.host)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.procs[name] = proc
        self.commands[name] = cmd
        self.roles[name] = role
        return proc

    def service_names(self) -> list[str]:
        """Process names of the services: ``agent-<node>`` per node; ``<service>-<i>`` per
        replica of a partitioned service when ``replicas`` > 1; else the service name. A
        partitioned service's process name is its replica name (``--replica``), so a restarted
        one resumes its durable consumers."""
        out = []
        for s in self.services:
            spec = SERVICE_SPECS[s]
            if spec.per_node:
                out += [f"{s}-{n}" for n in self.agent_nodes]
            elif spec.partitioned and self.replicas > 1:
                out += [f"{s}-{i}" for i in range(self.replicas)]
            else:
                out.append(s)
        return out

    def _health_subject(self, name: str) -> str:
        """The health subject of process ``name`` (a replica answers on its own)."""
        for s in self.services:
            if SERVICE_SPECS[s].partitioned and (name == s or name.startswith(f"{s}-")):
                return health_subject(s, name)
        return health_subject(name)

    def _service_cmd(self, name: str) -> tuple[list[str], str]:
        """Command line and auth role of service process ``name`` (URLs: ``_child_env``)."""
        for s in self.services:
            spec = SERVICE_SPECS[s]
            if spec.per_node and name.startswith(f"{s}-"):
                node = name[len(s) + 1:]
                cmd = [sys.executable, "-m", spec.module, "--node", node]
                if self.kernel_log_dir is not None:
                    cmd += ["--kmsg", str(self.kernel_log_path(node))]
                if self.sim_dir is not None:
                    cmd += ["--nvml-module", "trainguard.demo.fake_pynvml:for_node",
                            "--memory-budget-file", str(self.memory_budget_path(node))]
                return cmd, spec.role
            if spec.partitioned and (name == s or (self.replicas > 1 and name.startswith(f"{s}-")
                                                   and name[len(s) + 1:].isdigit())):
                return [sys.executable, "-m", spec.module, "--replica", name], spec.role
            if name == s:
                return [sys.executable, "-m", spec.module], spec.role
        raise KeyError(f"no service process named {name!r}; running: {', '.join(self.procs)}")

    def kernel_log_path(self, node: str) -> Path:
        """The kernel-log file the agent of ``node`` follows (needs ``kernel_log_dir``)."""
        if self.kernel_log_dir is None:
            raise ValueError("this stack's agents follow the host kernel log: pass "
                             "kernel_log_dir to give each simulated node its own file")
        return self.kernel_log_dir / f"kernel-{node}.log"

    def memory_budget_path(self, node: str) -> Path:
        """The file holding the memory budget (bytes) of simulated node ``node`` (needs
        ``sim_dir``)."""
        if self.sim_dir is None:
            raise ValueError("this stack's agents read the host's memory: pass sim_dir to make "
                             "each simulated node a share of the host")
        return self.sim_dir / f"memory-budget-{node}"

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "Stack":
        """Start everything and wait until each service is healthy (``timeout`` seconds in all).
        Raises ``StackError`` (with the failing child's log tail) after stopping what started."""
        if self._started:
            return self
        self._started = True
        deadline = time.monotonic() + timeout
        try:
            self._servers.start()
            _run_async(self._ensure_streams)
            rdzv = self._start_rendezvous()
            self._give_http_ports()
            for name in self.service_names():
                self._spawn(name, *self._service_cmd(name))
            if self.console:
                self._spawn("console", console_command(self.host, self.http_ports["console"]),
                            "reader")
            if rdzv is not None:
                self._wait_rendezvous(rdzv, deadline)
            self.wait_healthy(self.service_names(), max(1.0, deadline - time.monotonic()))
            if self.console:
                self._wait_console(deadline)
            if self.metrics:
                self._check_metrics_ports()
        except BaseException:
            self.stop()
            raise
        return self

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
            raise StackError(f"console: {exc}; log {log}:\n{_tail(log)}") from None

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

    async def _ensure_streams(self) -> None:
        from trainguard.clients.bus import Bus

        bus = await Bus(self.nats_url, "trainguard-up", tls_ca=self.tls_ca).connect(timeout=10.0)
        try:
            await bus.ensure_streams()
        finally:
            await bus.close()

    def _start_rendezvous(self) -> subprocess.Popen | None:
        if not self.rendezvous:
            return None
        if importlib.util.find_spec("trainguard.rendezvous.store") is None:
            print("trainguard up: trainguard.rendezvous.store is not installed: no rendezvous store",
                  file=sys.stderr)
            return None
        port = self._rdzv_port()
        log = self.log_dir / "rendezvous.log"
        # logs are appended across runs: only what this store prints counts as its answer
        self._rdzv_log_offset = log.stat().st_size if log.exists() else 0
        if self._want_rdzv_token:
            self.rdzv_token = self._load_rdzv_token()
            self.env[RDZV_TOKEN_ENV] = self.rdzv_token
        cmd = [sys.executable, "-m", "trainguard.rendezvous.store", "--host", self.host, "--port",
               str(port)]
        files = self._servers.tls_files
        if self.rdzv_token and self.tls_ca and files is not None:
            # the gate serves TLS with the servers' certificate: the token never crosses the
            # network in clear (the endpoint becomes tls://host:port)
            cmd += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
        try:
            return self._spawn("rendezvous", cmd, None)
        finally:
            self.env.pop(RDZV_TOKEN_ENV, None)  # the store's alone among the children

    def _rdzv_port(self) -> int:
        """The rendezvous store's port: the one of the last start, kept in the data dir
        (``rdzv.port``), when it is free again, so that a launcher's line (its
        ``TG_RDZV_ENDPOINT``) outlives a restart of the stack as NATS's and Valkey's ports do;
        else a free one, kept for the next start."""
        d = self.data_dir
        path = Path(d) / "rdzv.port" if d is not None else None
        try:
            kept = int(path.read_text()) if path is not None else 0
        except (OSError, ValueError):
            kept = 0
        if kept:
            # the gate binds the stack's host (reusing the address, as asyncio does); a store
            # without the gate is torch's TCPStore, which binds every interface
            host = self.host if self._want_rdzv_token else ""
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, kept))
                    return kept
                except OSError:
                    print(f"trainguard up: the rendezvous port of the last start ({kept}) is "
                          f"taken: a new one (launchers need the new line)", file=sys.stderr)
        port = free_port(self.host)
        if path is not None:
            write_private(path, f"{port}\n")
        return port

    def _load_rdzv_token(self) -> str:
        """The token kept in the data dir (made on first use; ``rotate_credentials``: anew)."""
        from trainguard.rendezvous.gate import new_token

        d = self.data_dir
        path = Path(d) / "rdzv.token" if d is not None else None
        if path is not None and path.exists() and not self._servers.rotate:
            tok = path.read_text().strip()
            if tok:
                return tok
        tok = new_token()
        if path is not None:
            write_private(path, tok + "\n")
        return tok

    def _wait_rendezvous(self, proc: subprocess.Popen, deadline: float) -> None:
        log = self.log_dir / "rendezvous.log"
        while time.monotonic() < deadline:
            with open(log, "rb") as fh:
                fh.seek(self._rdzv_log_offset)
                text = fh.read().decode(errors="replace")
            for line in text.splitlines():
                if line.startswith("ready "):
                    self.rdzv_endpoint = line.split()[1]
                    return
            if proc.poll() is not None:
                raise StackError(f"rendezvous store exited with {proc.returncode}; log "
                                 f"{log}:\n{_tail(log)}")
            time.sleep(0.05)
        raise StackError(f"rendezvous store not ready in time; log {log}:\n{_tail(log)}")

    def wait_healthy(self, names: Sequence[str], timeout: float = 30.0) -> None:
        """Wait until each process in ``names`` answers its health request with ``ok``.
        Raises ``StackError`` naming the first that exited or did not answer in time."""
        _run_async(lambda: self._wait_healthy(list(names), timeout))

    async def _wait_healthy(self, names: list[str], timeout: float) -> None:
        from trainguard.clients.bus import Bus

        deadline = time.monotonic() + timeout
        bus = await Bus(self.nats_url, "trainguard-up",
                        tls_ca=self.tls_ca).connect(timeout=min(10.0, timeout))
        try:
            pending = list(names)
            while pending:
                for name in list(pending):
                    proc = self.procs[name]
                    if proc.poll() is not None:
                        log = self.log_dir / f"{name}.log"
                        raise StackError(f"{name} exited with {proc.returncode} before it was "
                                         f"healthy; log {log}:\n{_tail(log)}")
                    try:
                        body = json.loads(await bus.request(self._health_subject(name),
                                                            timeout=0.5))
                    except Exception:  # noqa: BLE001 - no responder yet
                        continue
                    if body.get("ok"):
                        pending.remove(name)
                if pending and time.monotonic() > deadline:
                    name = pending[0]
                    log = self.log_dir / f"{name}.log"
                    raise StackError(f"{name} not healthy after {timeout:.0f} s (no answer on "
                                     f"{self._health_subject(name)}); log {log}:\n{_tail(log)}")
                if pending:
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()

    def health(self, name: str, timeout: float = 1.0) -> dict[str, Any]:
        """The health answer of process ``name`` (raises on no answer)."""
        async def ask() -> dict[str, Any]:
            from trainguard.clients.bus import Bus

            bus = await Bus(self.nats_url, "trainguard-up",
                            tls_ca=self.tls_ca).connect(timeout=5.0)
            try:
                return json.loads(await bus.request(self._health_subject(name),
                                                    timeout=timeout))
            finally:
                await bus.close()
        return _run_async(ask)

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
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def restart_service(self, name: str, timeout: float = 30.0) -> None:
        """Stop child ``name`` (SIGTERM, SIGKILL after the grace period), start it again with the
        same command, and wait until it is healthy."""
        if name not in self.procs:
            raise KeyError(f"no child named {name!r}; running: {', '.join(self.procs)}")
        self.kill_service(name, signal.SIGTERM, self.grace_s)
        self._spawn(name, self.commands[name], self.roles[name])
        if name == "console":
            self._wait_console(time.monotonic() + timeout)
        elif name != "rendezvous":
            self.wait_healthy([name], timeout)

    def stop(self) -> None:
        """SIGTERM every child (services first, then the rendezvous store), SIGKILL what is left
        after ``grace_s``, then stop the embedded servers. Idempotent."""
        procs = list(self.procs.items())[::-1]
        for _, p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + self.grace_s
        for _, p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()
        self._servers.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

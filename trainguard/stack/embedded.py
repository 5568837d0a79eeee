"""Embedded servers: nats-server with JetStream (``trainguard.stack.nats_server``) and
valkey-server (``trainguard.stack.valkey_server``), started on free loopback ports for the local
stack, the demo and tests, dying with the process that started them
(``trainguard.stack.process``).

Both require a user by default (``auth=True``): the roles of ``trainguard.security.roles``, one
password each, in ``credentials.json`` of the data directory (``trainguard.stack.statedir``);
``nats_url``/``redis_url`` are the ``admin`` URLs, ``urls(role)`` the others.

TLS (``tls=True``, what ``trainguard up`` asks for): NATS requires TLS from every client
(``tls://`` URLs; the certificate from ``trainguard.security.tls``, the CA in ``tls/ca.pem``).
Valkey serves TLS (``rediss://``, the same certificate) only when a valkey-server built with it
is found (``valkey_server.valkey_server_binary``); else it stays on plaintext (``redis://``) and
``tls_valkey`` is False.

Per-job and per-node users on running servers: ``issue_job`` / ``issue_node`` / ``revoke_job``
(``trainguard.stack.users``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainguard.security import tls as tlsmod
from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.security.roles import job_user, node_user
from trainguard.stack.nats_server import nats_command
from trainguard.stack.process import (ServerStartError, die_with_parent, free_port, port_free,
                                      stop_process, wait_port)
from trainguard.stack.statedir import close_state_dir, open_state_dir
from trainguard.stack.users import issue_job, issue_node, revoke_job
from trainguard.stack.valkey_server import pick_binary, refused_tls, valkey_command


@dataclass
class EmbeddedServer:
    """One child server process. ``url`` is set once ``start()`` returned.

    ``creds`` — require a user (``trainguard.security.roles`` roles; None: open, as before);
    ``persistent`` — Valkey keeps an append-only file in ``workdir`` (the JetStream store is
    always on disk in ``workdir/js``); ``max_file_store`` — NATS: cap of the JetStream store
    (bytes); ``tls`` — serve TLS only, with these files (Valkey: when its binary can; ``start``
    sets it to None when it cannot).
    """

    kind: str  # "nats" | "valkey"
    host: str = "127.0.0.1"
    port: int = 0
    workdir: str = ""
    creds: Credentials | None = None
    persistent: bool = False
    max_file_store: int = 2 * 1024 ** 3
    tls: tlsmod.TLSFiles | None = None
    proc: subprocess.Popen | None = None
    binary: str = ""
    _owned_dir: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        """``scheme://host:port``, without credentials (for messages)."""
        if self.kind == "nats":
            scheme = "tls" if self.tls else "nats"
        else:
            scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The ``admin`` URL when users are required, else the address."""
        return self.url_for("admin")

    def url_for(self, role: str) -> str:
        """The URL with ``role``'s credentials (the address when no user is required)."""
        if self.creds is None:
            return self.address
        if self.kind == "nats":
            return self.creds.nats_url(role, self.host, self.port, tls=self.tls is not None)
        return self.creds.redis_url(role, self.host, self.port, tls=self.tls is not None)

    def _command(self, log: Path) -> list[str]:
        """The command line to start; writes the server's configuration or ACL file."""
        if self.kind == "nats":
            return nats_command(Path(self.workdir), self.host, self.port, log, self.creds,
                                self.tls, self.max_file_store)
        return valkey_command(self.binary, Path(self.workdir), self.host, self.port, log,
                              self.creds, self.tls, self.persistent)

    def start(self, timeout: float = 10.0) -> "EmbeddedServer":
        """Start the server on ``port`` (a free one when 0 or taken); returns self. Raises
        ServerStartError."""
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"tg-{self.kind}-")
            self._owned_dir = True
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        if self.port and not port_free(self.host, self.port):
            self.port = 0  # the last start's port is taken now: another one
        for attempt in range(4):
            if self.kind == "valkey":
                self.binary, served = pick_binary(self.tls is not None, self.host)
                if not served:
                    self.tls = None  # plaintext (see the module docstring)
            self.port = self.port or free_port(self.host)
            log = Path(self.workdir) / f"{self.kind}.log"
            offset = log.stat().st_size if log.exists() else 0
            self.proc = subprocess.Popen(self._command(log), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)
            try:
                wait_port(self.host, self.port, self.proc, timeout, log)
                return self
            except ServerStartError:
                if self.kind == "valkey" and self.tls is not None \
                        and refused_tls(self.binary, log, offset):
                    continue  # the next attempt picks another binary
                if attempt == 3:
                    raise
                self.port = 0  # port taken between probe and bind: try another
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; removes its temporary directory."""
        stop_process(self.proc, timeout)
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class AdminURLs:
    """The ``admin`` role's URLs of a set of servers that has ``urls(role)``: what the stack's
    own clients connect with (``EmbeddedServers`` and ``trainguard.stack.ha.HAServers``)."""

    def urls(self, role: str) -> tuple[str, str]:
        raise NotImplementedError

    @property
    def nats_url(self) -> str:
        """The ``admin`` NATS URL (or the given one)."""
        return self.urls("admin")[0]

    @property
    def redis_url(self) -> str:
        """The ``admin`` Valkey URL (or the given one)."""
        return self.urls("admin")[1]


class EmbeddedServers(AdminURLs):
    """nats-server + valkey-server on free ports of ``host`` (loopback), or the given URLs.

    ``nats_url``/``redis_url`` make it use existing servers instead of starting its own (every
    role then uses that URL as given). The environment is never read here (a ``NATS_URL`` left
    in a shell must not send the demo's injected faults, or the tests' events, to somebody's
    bus). ``data_dir`` — keep credentials, the JetStream store and Valkey's AOF there across
    starts (None: a temporary directory removed by ``stop``); ``auth`` — require the users of
    ``trainguard.security.roles``; ``rotate`` — new passwords for every role; ``host`` — the address the
    servers listen on (default loopback; the cluster harness gives its bridge's, so that node
    namespaces reach them); ``tls`` — serve TLS (see the module docstring) with a certificate
    for ``trainguard.security.tls.default_names(host, tls_names)``. Context manager; ``stop()`` is
    idempotent.
    """

    def __init__(self, nats_url: str | None = None, redis_url: str | None = None,
                 data_dir: str | os.PathLike | None = None, auth: bool = True,
                 rotate: bool = False, host: str = "127.0.0.1", tls: bool = False,
                 tls_names: tuple[str, ...] | list[str] = ()):
        self._given = {"nats": nats_url or "", "valkey": redis_url or ""}
        self.host = host
        self.tls = tls
        self.tls_names = tuple(tls_names)
        self.tls_files: tlsmod.TLSFiles | None = None
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.auth = auth
        self.rotate = rotate
        self.creds: Credentials | None = None
        self.dir: Path | None = None
        self._owned_dir = False
        self._lock: int | None = None
        self.servers: list[EmbeddedServer] = []

    def _server(self, kind: str) -> EmbeddedServer | None:
        return next((s for s in self.servers if s.kind == kind), None)


    @property
    def tls_ca(self) -> str | None:
        """The CA file a client needs (``TG_TLS_CA``) when an embedded server serves TLS."""
        if self.tls_files is not None and any(s.tls for s in self.servers):
            return str(self.tls_files.ca)
        return None

    @property
    def tls_valkey(self) -> bool:
        """True when the embedded Valkey serves TLS (its binary has it)."""
        s = self._server("valkey")
        return bool(s and s.tls)

    @property
    def valkey_binary(self) -> str:
        """The valkey-server the stack started ("" when it uses a given URL)."""
        s = self._server("valkey")
        return s.binary if s else ""

    def issue_job(self, job: str, rotate: bool = False) -> tuple[str, str]:
        """Give ``job``'s workers their own user on the running servers (``issue_job``);
        returns their ``(nats_url, redis_url)``. Raises ``ValueError`` for a job name that
        cannot be one (``trainguard.security.roles.job_user``), ``RuntimeError`` before ``start``."""
        return self._issue(issue_job, job, job_user(job), rotate)

    def issue_node(self, node: str, rotate: bool = False) -> tuple[str, str]:
        """Give ``node``'s agent its own user on the running servers (``issue_node``); returns
        its ``(nats_url, redis_url)``. Raises as ``issue_job``."""
        return self._issue(issue_node, node, node_user(node), rotate)

    def _issue(self, issue: Callable, name: str, user: str, rotate: bool) -> tuple[str, str]:
        if self.dir is None or self.creds is None:
            raise RuntimeError("start the servers (with auth) before issuing credentials")
        self.creds, _ = issue(self.dir, name, rotate)
        for s in self.servers:
            s.creds = self.creds
        return self.urls(user)

    def revoke_job(self, job: str) -> bool:
        """Take ``job``'s workers' own user away on the running servers (``revoke_job``);
        returns whether it had one. Raises ``RuntimeError`` before ``start``."""
        if self.dir is None or self.creds is None:
            raise RuntimeError("start the servers (with auth) before revoking job credentials")
        had, _ = revoke_job(self.dir, job)
        self.creds = Credentials.load_or_create(self.dir / "credentials.json")
        for s in self.servers:
            s.creds = self.creds
        return had

    def urls(self, role: str) -> tuple[str, str]:
        """``(nats_url, redis_url)`` for ``role`` (a name of ``trainguard.security.roles.ROLES``, or a
        per-job user ``job-<job>``)."""
        out = []
        for kind in ("nats", "valkey"):
            s = self._server(kind)
            out.append(self._given[kind] or (s.url_for(role) if s else ""))
        return out[0], out[1]

    def start(self) -> "EmbeddedServers":
        if self._given["nats"] and self._given["valkey"]:
            return self
        from trainguard.clients.streams import streams_max_bytes  # the JetStream cap follows the streams' limits

        self.dir, self._lock, self._owned_dir = open_state_dir(self.data_dir, "trainguard-")
        if self.auth:
            self.creds = Credentials.load_or_create(self.dir / "credentials.json", self.rotate)
        if self.tls:
            self.tls_files = tlsmod.ensure(self.dir / "tls",
                                           tlsmod.default_names(self.host, self.tls_names),
                                           rotate=self.rotate)
        ports_file = self.dir / "ports.json"
        try:
            ports = json.loads(ports_file.read_text()) if self.data_dir is not None else {}
        except (OSError, ValueError):
            ports = {}
        persistent = self.data_dir is not None
        for kind in ("nats", "valkey"):
            if not self._given[kind]:
                s = EmbeddedServer(kind, host=self.host, port=int(ports.get(kind) or 0),
                                   workdir=str(self.dir / kind), creds=self.creds,
                                   persistent=persistent, tls=self.tls_files,
                                   max_file_store=streams_max_bytes() + 256 * 1024 ** 2)
                self.servers.append(s)
                s.start()
        write_private(ports_file, json.dumps({"host": self.host, **{
            s.kind: s.port for s in self.servers},
            "tls": {s.kind: s.tls is not None for s in self.servers}}) + "\n")
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()
        close_state_dir(self.dir, self._lock, self._owned_dir)
        self._owned_dir, self._lock = False, None

    def __enter__(self) -> "EmbeddedServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

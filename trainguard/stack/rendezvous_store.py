"""The stack's rendezvous store (``python -m trainguard.rendezvous.store``): its port and token,
kept in the data directory across starts, its command line, and the wait for its ``ready`` line.

A launcher's line (its ``TG_RDZV_ENDPOINT``, ``TG_RDZV_TOKEN``) outlives a restart of the stack,
as NATS's and Valkey's ports do: the port of the last start is taken again while free
(``rdzv.port``), the token kept (``rdzv.token``, 0600) until credentials are rotated.
"""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.security import tls as tlsmod
from trainguard.security.private_file import write_private
from trainguard.stack.children import StackError, tail
from trainguard.stack.process import free_port

MODULE = "trainguard.rendezvous.store"
#: The stores' process names: the primary, then (a replicated stack) a standby that the
#: launchers' relays move to when the primary stops answering (``rendezvous.gate.Relay``).
NAMES = ("rendezvous", "rendezvous-standby")
#: The file in the data directory that keeps each store's port across starts.
PORT_FILES = {"rendezvous": "rdzv.port", "rendezvous-standby": "rdzv-standby.port"}


def store_installed() -> bool:
    """True when ``python -m trainguard.rendezvous.store`` can run here."""
    return importlib.util.find_spec(MODULE) is not None


def store_port(data_dir: Path | None, host: str, gated: bool, name: str = "rendezvous") -> int:
    """The port of rendezvous store ``name`` (``rendezvous``, or a replicated stack's
    ``rendezvous-standby``): the one of the last start, kept in ``data_dir``
    (``PORT_FILES``), when it is free again; else a free one on ``host``, kept for the
    next start. ``gated``: the store is behind the token gate, which binds ``host``; without it
    the store is torch's TCPStore, which binds every interface."""
    path = Path(data_dir) / PORT_FILES[name] if data_dir is not None else None
    try:
        kept = int(path.read_text()) if path is not None else 0
    except (OSError, ValueError):
        kept = 0
    if kept:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds it
            try:
                s.bind((host if gated else "", kept))
                return kept
            except OSError:
                print(f"trainguard up: the {name} port of the last start ({kept}) is "
                      f"taken: a new one (launchers need the new line)", file=sys.stderr)
    port = free_port(host)
    if path is not None:
        write_private(path, f"{port}\n")
    return port


def store_token(data_dir: Path | None, rotate: bool) -> str:
    """The gate's token kept in ``data_dir`` (``rdzv.token``, made on first use; ``rotate``: a
    new one); a new one each time without a data directory."""
    from trainguard.rendezvous.gate import new_token

    path = Path(data_dir) / "rdzv.token" if data_dir is not None else None
    if path is not None and path.exists() and not rotate:
        tok = path.read_text().strip()
        if tok:
            return tok
    tok = new_token()
    if path is not None:
        write_private(path, tok + "\n")
    return tok


def store_command(host: str, port: int, tls: tlsmod.TLSFiles | None = None) -> list[str]:
    """The store's command line on ``host:port``; with ``tls`` the gate serves TLS with the
    servers' certificate, so that the token never crosses the network in clear (the endpoint
    becomes ``tls://host:port``)."""
    cmd = [sys.executable, "-m", MODULE, "--host", host, "--port", str(port)]
    if tls is not None:
        cmd += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    return cmd


def wait_ready(proc: subprocess.Popen, log: Path, offset: int, deadline: float) -> str:
    """The endpoint of the store's ``ready <endpoint>`` line, read from ``log`` past ``offset``
    (logs are appended across runs: only what this store printed counts), waiting until
    ``deadline`` (``time.monotonic()``). Raises ``StackError`` with the log's tail when the store
    exited or was not ready in time."""
    while time.monotonic() < deadline:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        for line in text.splitlines():
            if line.startswith("ready "):
                return line.split()[1]
        if proc.poll() is not None:
            raise StackError(f"rendezvous store exited with {proc.returncode}; log "
                             f"{log}:\n{tail(log)}")
        time.sleep(0.05)
    raise StackError(f"rendezvous store not ready in time; log {log}:\n{tail(log)}")


def start_stores(spawn, log_dir: Path, data_dir: Path | None, host: str, gated: bool,
                 tls: tlsmod.TLSFiles | None, standby: bool) -> list[tuple[str, Any, int]]:
    """Start the store (and with ``standby`` its standby), each through ``spawn(name, cmd)``
    on its own port (``store_port``); returns ``(name, process, log offset)`` for
    ``wait_stores``: logs are appended across runs, only what this start prints counts."""
    out = []
    for name in NAMES[:2 if standby else 1]:
        port = store_port(data_dir, host, gated, name)
        log = log_dir / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        out.append((name, spawn(name, store_command(host, port, tls)), offset))
    return out


def wait_stores(starts: list[tuple[str, Any, int]], log_dir: Path, deadline: float) -> str:
    """The endpoint of the stores ``start_stores`` started: the primary's, then the
    standby's (``a,b``). Raises ``StackError`` (``wait_ready``)."""
    return ",".join(wait_ready(proc, log_dir / f"{name}.log", offset, deadline)
                    for name, proc, offset in starts)

"""The local stack's HTTP endpoints for the operator: the console and every service's Prometheus
``/metrics`` (``trainguard up`` serves both by default; ``Stack(console=True, metrics=True)``).

* ports: ``kept_ports`` gives each endpoint the port of the last start, kept in
  ``<data dir>/http-ports.json`` (0600), while that port is free again, else a free one — as the
  rendezvous store keeps its port (``rdzv.port``), so a Prometheus configuration or a bookmark
  outlives a restart of the stack;
* the console: ``console_command`` (``python -m trainguard.tools.console`` on the stack's host; it
  runs as the ``reader`` role, its URLs in its environment), ready when ``wait_http`` gets an
  answer from ``/healthz``;
* a service's ``/metrics``: ``TG_METRICS_PORT`` and ``TG_METRICS_HOST`` in its environment
  (``trainguard.services.metrics.mount``); the port it serves is in its health reply (``metrics_port``),
  which ``Stack`` compares with the one it gave.

Errors: ``wait_http`` raises ``TimeoutError`` (the endpoint did not answer in time) or
``ChildProcessError`` (its process exited first); the messages name the URL.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from trainguard.security.private_file import write_private
from trainguard.stack.process import free_port

__all__ = ["PORTS_FILE", "port_free", "kept_ports", "console_command", "wait_http", "url"]

#: The file in the data directory that keeps each endpoint's port across starts.
PORTS_FILE = "http-ports.json"


def port_free(host: str, port: int) -> bool:
    """True when a TCP listener could bind ``host:port`` now (address reuse on, as uvicorn's and
    the Python HTTP servers' are)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def kept_ports(names: list[str], host: str, data_dir: Path | None) -> dict[str, int]:
    """A port for each endpoint in ``names`` (``"console"``, ``"metrics-<process>"``): the one
    ``<data_dir>/http-ports.json`` kept when it is free on ``host``, else a free one; the file is
    updated (other names in it are kept). ``data_dir`` None: free ports, nothing kept."""
    path = Path(data_dir) / PORTS_FILE if data_dir is not None else None
    kept: dict[str, int] = {}
    if path is not None:
        try:
            raw = json.loads(path.read_text())
            kept = {str(k): int(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
        except (OSError, ValueError, TypeError):
            kept = {}
    out: dict[str, int] = {}
    for name in names:
        port = kept.get(name, 0)
        if not (0 < port < 65536 and port not in out.values() and port_free(host, port)):
            port = free_port(host)
            while port in out.values():  # two endpoints of this start on one port: never
                port = free_port(host)
        out[name] = port
    if path is not None:
        write_private(path, json.dumps({**kept, **out}, indent=1, sort_keys=True) + "\n")
    return out


def url(host: str, port: int, path: str = "/") -> str:
    """``http://host:port/path`` (an IPv6 address in brackets)."""
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}{path}"


def console_command(host: str, port: int, refresh_s: float = 15.0) -> list[str]:
    """The console's command line (its state-store and NATS URLs come from the environment:
    ``REDIS_URL``/``NATS_URL``, never the command line that ``ps`` shows)."""
    return [sys.executable, "-m", "trainguard.tools.console", "--host", host, "--port", str(port),
            "--refresh-s", str(refresh_s)]


def wait_http(target: str, proc: subprocess.Popen | None, deadline: float) -> None:
    """Return once GET ``target`` answers with a status below 500 (``time.monotonic()``
    ``deadline``). Raises ``ChildProcessError`` when ``proc`` exits first, ``TimeoutError`` at
    the deadline."""
    last = ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"exited with {proc.returncode} before {target} answered")
        try:
            with urllib.request.urlopen(target, timeout=1.0) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target} did not answer in time ({last})")
        time.sleep(0.1)

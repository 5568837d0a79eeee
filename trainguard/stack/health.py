"""Talking to the stack's NATS from its synchronous owner: the JetStream streams created, each
service's health asked (``tg.svc.<name>.health``) until it answers ``ok``."""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainguard.stack.children import StackError, tail

#: the bus client name the stack's own connections use
CLIENT_NAME = "trainguard-up"


def run_async(fn: Callable[[], Any]) -> Any:
    """Run coroutine function ``fn`` to completion from sync code, even when the caller's thread
    already runs an event loop (then on a thread of its own); its exception is raised here."""
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


async def ensure_streams(nats_url: str, tls_ca: str | None, cluster_size: int | None = None,
                         timeout: float = 30.0, connect_timeout: float = 10.0,
                         on_retry: Callable[[Exception], None] | None = None) -> None:
    """Create (or update) the JetStream streams on the NATS at ``nats_url`` (waiting up to
    ``connect_timeout`` seconds for it to accept the connection). ``cluster_size`` (a replicated
    stack's server count): the streams get that cluster's copies, and their creation is tried
    again until every server has joined (JetStream refuses more copies than servers, and a
    server announces only the peers it has met: on a loaded machine the third server may join a
    second after the first answers), ``on_retry`` told of each refusal; None: the cluster the
    server announces. Raises what the last try raised after ``timeout`` seconds."""
    from trainguard.clients.bus import Bus

    deadline = time.monotonic() + timeout
    bus = await Bus(nats_url, CLIENT_NAME, tls_ca=tls_ca).connect(timeout=connect_timeout)
    try:
        while True:
            try:
                await bus.ensure_streams(cluster_size=cluster_size)
                return
            except Exception as exc:  # noqa: BLE001 - the cluster has not formed yet
                if cluster_size is None or time.monotonic() > deadline:
                    raise
                if on_retry is not None:
                    on_retry(exc)
                await asyncio.sleep(0.5)
    finally:
        await bus.close()


async def ask_health(nats_url: str, tls_ca: str | None, subject: str,
                     timeout: float = 1.0) -> dict[str, Any]:
    """The health answer on ``subject`` (raises when none comes in ``timeout`` seconds)."""
    from trainguard.clients.bus import Bus

    bus = await Bus(nats_url, CLIENT_NAME, tls_ca=tls_ca).connect(timeout=5.0)
    try:
        return json.loads(await bus.request(subject, timeout=timeout))
    finally:
        await bus.close()


async def wait_healthy(nats_url: str, tls_ca: str | None, procs: dict[str, subprocess.Popen],
                       subject: Callable[[str], str], log_dir: Path, timeout: float) -> None:
    """Wait until each process of ``procs`` (name → process) answers its health request
    (``subject(name)``) with ``ok``, ``timeout`` seconds in all. Raises ``StackError`` naming
    the first that exited or did not answer in time, with the tail of its
    ``<log_dir>/<name>.log``."""
    from trainguard.clients.bus import Bus

    deadline = time.monotonic() + timeout
    bus = await Bus(nats_url, CLIENT_NAME, tls_ca=tls_ca).connect(timeout=min(10.0, timeout))
    try:
        pending = list(procs)
        while pending:
            for name in list(pending):
                proc = procs[name]
                if proc.poll() is not None:
                    log = log_dir / f"{name}.log"
                    raise StackError(f"{name} exited with {proc.returncode} before it was "
                                     f"healthy; log {log}:\n{tail(log)}")
                try:
                    body = json.loads(await bus.request(subject(name), timeout=0.5))
                except Exception:  # noqa: BLE001 - no responder yet
                    continue
                if body.get("ok"):
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                name = pending[0]
                log = log_dir / f"{name}.log"
                raise StackError(f"{name} not healthy after {timeout:.0f} s (no answer on "
                                 f"{subject(name)}); log {log}:\n{tail(log)}")
            if pending:
                await asyncio.sleep(0.1)
    finally:
        await bus.close()

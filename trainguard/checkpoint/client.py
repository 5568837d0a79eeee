"""The rank's side of its checkpoint writer (torch-free): starting or reaching the writer
process, and the connection that sends requests and delivers the replies.

A rank writes through a writer forked by the node writer named by ``TG_CKPT_WRITER`` (the
launcher's, ``node_writer.NodeWriter``), or, without one or when it does not answer, through a
private writer process of its own (``spawn_writer``). Messages: ``protocol``.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Protocol

from trainguard.checkpoint.protocol import recv_msg, send_msg

log = logging.getLogger("trainguard.checkpoint")

#: the reply a save gets when its writer dies before answering
WRITER_DIED = ("the checkpoint writer process died; the save was abandoned (a new writer "
               "starts on the next save)")


def _package_root() -> str:
    """The directory holding the ``trainguard`` package: put on the writer's PYTHONPATH."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn_writer(nice: int = 0) -> tuple[socket.socket, subprocess.Popen]:
    """Start a private writer process; returns (our end of the socket pair, the process)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env.pop("TG_CKPT_WRITER", None)
    cmd = [sys.executable, "-m", "trainguard.checkpoint.writer", "--fd", str(theirs.fileno()),
           "--nice", str(nice)]
    here = _package_root()
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    theirs.close()
    return ours, proc


def connect_writer(address: str, timeout: float = 2.0) -> socket.socket:
    """Connect to a node writer at Unix socket ``address``. Raises ConnectionError saying what to
    do when it does not answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(address)
    except OSError as exc:
        s.close()
        raise ConnectionError(f"no checkpoint writer at {address} ({exc}): start one with "
                              f"NodeWriter({address!r}).start() or unset TG_CKPT_WRITER") from None
    s.settimeout(None)
    return s


class Awaiting(Protocol):
    """What ``WriterClient`` needs of a request waiting for its reply (``session.SaveSession``):
    its ``id``, and ``complete(reply)``, called once from the reader thread."""

    id: int

    def complete(self, reply: dict) -> None: ...


class WriterClient:
    """Connection to this rank's writer; a reader thread receives the replies and completes the
    requests waiting for them (``pending``: id → request). ``plans``: the plan ids this writer
    holds. ``dead`` turns True when the writer closed the connection or died: every pending
    request then completes as failed. ``proc`` is the private writer process, None when the
    node writer's child serves this rank.

    ``nice``: niceness of a private writer. ``address``: the node writer's socket (default
    ``$TG_CKPT_WRITER``; empty: a private writer)."""

    def __init__(self, nice: int, address: str | None = None):
        addr = os.environ.get("TG_CKPT_WRITER", "") if address is None else address
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        if addr:
            try:
                self.sock = connect_writer(addr)
            except ConnectionError as exc:  # the node writer is gone: saving goes on alone
                log.warning("%s; this rank starts a writer of its own", exc)
        if self.sock is None:
            self.sock, self.proc = spawn_writer(nice)
        self.lock = threading.Lock()
        self.pending: dict[int, Awaiting] = {}
        self.plans: set[int] = set()
        self.dead = False
        self.thread = threading.Thread(target=self._read, name="tg-ckpt-replies", daemon=True)
        self.thread.start()

    def send(self, msg: dict) -> None:
        """Send one request. Raises OSError when the writer is gone."""
        with self.lock:
            send_msg(self.sock, msg)

    def _read(self) -> None:
        while True:
            try:
                msg = recv_msg(self.sock)
            except OSError:
                msg = None
            if msg is None:
                self.dead = True
                for p in list(self.pending.values()):
                    self.pending.pop(p.id, None)
                    p.complete({"op": "failed", "id": p.id, "errno": None,
                                "error": WRITER_DIED})
                return
            p = self.pending.pop(msg.get("id"), None)
            if p is not None:
                p.complete(msg)

    def close(self) -> None:
        """Close the connection (the reader thread ends; a private writer finishes the save it
        holds and exits). Never raises."""
        try:  # shutdown wakes the reader thread and lets the writer see the end of the stream
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """``close``, then wait up to ``timeout`` s for a private writer to exit (killed after)."""
        self.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except Exception:  # noqa: BLE001
                self.proc.kill()

"""The node writer daemon: one per node, held by the launcher (``trainguard launch`` does this),
forking one writer per connecting rank. Torch-free.

``NodeWriter(socket_path).start()`` listens on a Unix socket (mode 0600); ranks find it through
the environment variable ``TG_CKPT_WRITER=<socket_path>``. The daemon imports what a writer
needs (numpy included) before it forks, so its writers share those pages: ≈ 4 MB of unique
memory per rank instead of ≈ 16 MB for a private writer (measured here with psutil's USS after
three 200 MB saves). ``close()`` (or the death of the process that started it) lets it finish
the saves in flight, remove the staging files of the ranks it served and exit; ``stop()`` does
the same at once, cutting saves short. Run it alone with
``python -m trainguard.checkpoint.writer --listen PATH``.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from trainguard.checkpoint.client import _package_root, connect_writer
from trainguard.checkpoint.protocol import recv_msg, send_msg
from trainguard.checkpoint.serve import WriterConnection


class NodeWriter:
    """A node writer daemon for all ranks of one node, held by the launcher.

    ``socket_path``: Unix socket to listen on (created mode 0600; a stale file is replaced).
    ``nice``: niceness of the writer processes (≥ 0 keeps them out of the training's way).
    ``start()`` starts the daemon and returns once it answers; export
    ``TG_CKPT_WRITER=<socket_path>`` to the ranks. Lifecycle: the daemon holds a pipe from this
    object; ``close()`` closes it (so does the death of this process): the daemon stops
    accepting, its writers finish the saves they hold (each exits when its rank disconnects),
    then it removes the staging files its writers served and exits — a fully staged save
    survives its launcher as it survives its rank, and no staged state outlives both.
    ``stop()`` ends the daemon and its writers at once (SIGTERM) and removes the staging files
    they served. The staging files live in /dev/shm, so the state a rank staged survives that
    rank's death while the node writer runs. Raises RuntimeError from ``start()`` when the
    daemon exits or does not answer within ``timeout`` seconds.
    """

    def __init__(self, socket_path: str, nice: int = 0):
        self.socket_path = socket_path
        self.nice = nice
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "NodeWriter":
        here = _package_root()
        env = dict(os.environ)
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        # its own session (a scheduler's kill of the launcher's process group leaves the saves
        # in flight to finish), and none of the launcher's output streams: a scheduler waits for
        # every holder of a job step's stdout/stderr (slurmstepd: up to 60 s, "Abandoning IO",
        # seen holding a requeued job COMPLETING for 66 s); its messages go to <socket>.log
        with open(self.socket_path + ".log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.checkpoint.writer", "--listen",
                 self.socket_path, "--nice", str(self.nice), "--until-stdin-closes"], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node writer exited with {self.proc.returncode}")
            try:
                s = connect_writer(self.socket_path, 0.5)
                send_msg(s, {"op": "ping"})
                recv_msg(s)
                s.close()
                return self
            except (ConnectionError, OSError):
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"node writer did not listen on {self.socket_path} within {timeout} s")

    def close(self) -> None:
        """Let the daemon finish the saves in flight and exit (does not wait; never raises)."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the daemon and its writers now (SIGTERM, then SIGKILL after ``timeout`` s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()
        self.proc = None
        for leftover in (self.socket_path, self.socket_path + ".staging"):  # if it was killed
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        _remove_if_empty(self.socket_path + ".log")


def _preload() -> None:
    """Import what a writer uses before the daemon forks (numpy for the NaN count), then freeze
    the heap out of the cyclic GC, so that the forked writers share these pages instead of
    each importing its own copy."""
    import gc

    try:
        import numpy  # noqa: F401
    except ImportError:  # pragma: no cover - numpy is a dependency; the count then fails alone
        pass
    gc.collect()
    gc.freeze()


def listen(path: str, until_stdin_closes: bool = False) -> None:
    """The node writer daemon: accept ranks on ``path`` and fork one writer per connection.
    With ``until_stdin_closes``, end of file on stdin (its starter closed the pipe or died) ends
    it gracefully: no new connections, the writers finish, their staging files are removed,
    the daemon exits."""
    _preload()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(64)
    children: list[int] = []
    staging_log = path + ".staging"

    def _term(*_: Any) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _remove_staged(staging_log)
        try:
            os.unlink(path)  # no socket left for a rank to find after the daemon
        except OSError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGCHLD, lambda *_: _reap(children))
    watch = [srv, sys.stdin] if until_stdin_closes else [srv]
    while True:
        try:
            ready, _, _ = select.select(watch, [], [])
        except InterruptedError:
            continue
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            break
        if srv not in ready:
            continue
        try:
            conn, _ = srv.accept()
        except (InterruptedError, BlockingIOError):
            continue
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            srv.close()
            s = WriterConnection(conn)
            try:
                s.run()
            finally:
                try:
                    with open(staging_log, "a") as fh:
                        for p in s.staging_paths:
                            fh.write(p + "\n")
                except OSError:
                    pass
            os._exit(0)
        children.append(pid)
        conn.close()
    # graceful end: refuse new ranks, let every writer finish its saves, then leave
    srv.close()
    try:
        os.unlink(path)
    except OSError:
        pass
    while children:
        _reap(children)
        for pid in list(children):  # one reaped before it was listed (SIGCHLD came first)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                children.remove(pid)
        time.sleep(0.05)
    # its owner (the launcher) is gone or done and every save is finished: nothing will
    # restore from the staged copies now (a new launch restores from disk); free them
    _remove_staged(staging_log)
    _remove_if_empty(path + ".log")  # what it said, kept only when it said something
    os._exit(0)


def _remove_if_empty(path: str) -> None:
    try:
        if os.path.getsize(path) == 0:
            os.unlink(path)
    except OSError:
        pass


def _remove_staged(staging_log: str) -> None:
    """Remove the staging files (and sidecars) the node's writers registered in
    ``staging_log``, then the log itself. Never raises."""
    try:
        with open(staging_log) as fh:
            for line in fh:
                for suffix in ("", ".meta"):
                    try:
                        os.unlink(line.strip() + suffix)
                    except OSError:
                        pass
        os.unlink(staging_log)
    except OSError:
        pass


def _reap(children: list[int]) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:
            children.remove(pid)


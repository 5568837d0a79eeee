"""One warm template process per launcher that forks the node's spares.

A cold spare (``python -m trainguard.launch.spare``) costs ≈ 2 CPU-seconds before it can become a rank:
the interpreter, torch and trainguard's rank modules (≈ 0.9 s), torch.distributed.checkpoint
(≈ 0.4 s), the state store and bus clients (≈ 0.25 s), the first DDP and optimizer step (≈ 0.25 s;
measured alone on this machine, 2026-12-03). A node starting 8 ranks paid that 8 times at once,
and every refill after a respawn paid it again while the job trained. The launcher now starts
one template (``python -m trainguard.launch.spare --fork-server FD``) that warms once, freezes what it
loaded out of the collector's scans (``gc.freeze``: the pages stay shared copy-on-write) and then
forks each spare on request: a spare is ready in milliseconds and costs only the pages it writes.

The protocol, over a ``SOCK_SEQPACKET`` socket pair (one JSON object a packet):

- template → launcher ``{"ready": pid}`` once warm (or ``{"failed": reason}``, then it exits);
- launcher → template ``{"env": {...}}`` with four descriptors (``SCM_RIGHTS``): the spare's
  stdin (read end), stdout and stderr (write ends) and its launcher pipe (``TG_LAUNCHER_FD``);
- template → launcher ``{"pid": n}``: the spare forked; later ``{"exit": n, "code": c}`` when it
  ends (``c`` as ``Popen.returncode``: negative for the signal that ended it);
- launcher → template ``{"import_from": path, "budget_s": s}`` (no descriptors): import the
  job's own modules (``trainguard.rank.job_imports``; ``path``: a JSON list of module names, which
  may be longer than a packet) so that the spares forked from now on have them; template → launcher ``{"warmed": {…}}`` (``job_imports.import_all``'s summary) when done.

Lifetimes: the template gets ``PR_SET_PDEATHSIG`` (SIGKILL) from the launcher's main thread as
every child does; each forked spare gets it from the template, so the launcher's death still
ends every process of the node. The template's death ends its spares and ranks too: the launcher
then reports each as ended by SIGKILL (a rank fault it handles as any other), starts spares cold
and a new template (``ProcessPool.template``). Where the template cannot start (it fails to
warm, or no ``send_fds``), the launcher starts cold spares as before.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any, Callable

__all__ = ["ForkServer", "ForkedProcess", "pdeathsig_kill", "serve"]

#: seconds the launcher waits for the template to warm before it starts a spare cold
READY_TIMEOUT_S = 120.0
_MAX_PACKET = 1 << 20  # bytes: one request (the spare's environment) or one reply


# ---- the launcher's side ------------------------------------------------------------------------
class ForkedProcess:
    """A spare forked by the template, seen through the part of ``subprocess.Popen`` the pool
    uses: ``pid``, ``stdin``/``stdout``/``stderr`` (text, line-buffered), ``returncode``,
    ``poll``, ``wait`` (raises ``subprocess.TimeoutExpired``), ``send_signal``, ``kill``. It is
    the template's child, not the launcher's: its end is reported by the template."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], stderr: IO[str]):
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"spare pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reaped, the pid may be another process's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's handle on its template process.

    ``start(env, preexec_fn, on_output)`` starts it (``env``: the spares' base environment, read
    by the template's warm-up: ``OMP_NUM_THREADS``, ``TG_WARM_IMPORTS``); ``spawn(env)`` returns
    a ``ForkedProcess`` or None when the template is not (or no longer) usable, and the caller
    starts the spare cold. ``close()`` ends the template (its spares with it). Thread-safe."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()        # one request at a time
        self._ready = threading.Event()      # set once warm, failed or gone
        self._usable = False
        self._replies: list[dict] = []
        self._reply = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}     # ends reported before their spare was registered
        self._children_lock = threading.Lock()
        self.failure = ""                    # why the template is not usable ("" while it is)
        self.died_after_ready = False        # it warmed, forked, then exited (killed by hand?)
        #: seconds ``spawn`` waits for the template to warm by default
        self.ready_wait_s = READY_TIMEOUT_S
        #: an import of the job's modules is in flight (``import_modules``) for up to this
        #: many seconds: a spawn asked meanwhile waits that much longer for its answer
        self.importing_s = 0.0
        self._on_warmed: Callable[[dict], None] | None = None

    def start(self, env: dict[str, str], preexec_fn: Callable[[], None] | None = None,
              on_output: Callable[[IO[str]], None] | None = None) -> "ForkServer":
        if not hasattr(socket, "send_fds"):
            self.failure = "this Python has no socket.send_fds"
            self._ready.set()
            return self
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.launch.spare", "--fork-server", str(theirs.fileno())],
                env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if on_output is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT, text=True, bufsize=1, pass_fds=(theirs.fileno(),),
                preexec_fn=preexec_fn)
        except OSError as exc:
            ours.close()
            self.failure = f"the template did not start: {exc}"
            self._ready.set()
            return self
        finally:
            theirs.close()
        self._sock = ours
        if on_output is not None:
            threading.Thread(target=on_output, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._read, daemon=True, name="tg-forkserver").start()
        return self

    def _read(self) -> None:
        """Dispatch the template's packets until it goes away."""
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(_MAX_PACKET)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if "exit" in msg:
                with self._children_lock:
                    child = self._children.pop(int(msg["exit"]), None)
                    if child is None:
                        self._exits[int(msg["exit"])] = int(msg["code"])
                if child is not None:
                    child._set_exit(int(msg["code"]))
            elif "warmed" in msg:
                self.importing_s, cb = 0.0, self._on_warmed
                if cb is not None:
                    cb(msg["warmed"] if isinstance(msg["warmed"], dict) else {})
            elif "ready" in msg:
                self._usable = True
                self._ready.set()
            elif "failed" in msg:
                self.failure = f"the template did not warm: {msg['failed']}"
                self._ready.set()
            else:
                with self._reply:
                    self._replies.append(msg)
                    self._reply.notify_all()
        # the template is gone: so are its spares (PR_SET_PDEATHSIG), which nobody reaps now
        self.died_after_ready = self._usable
        self._usable = False
        self.importing_s = 0.0
        self.failure = self.failure or "the template exited"
        self._ready.set()
        with self._reply:
            self._reply.notify_all()
        with self._children_lock:
            orphans = list(self._children.values())
            self._children.clear()
        for child in orphans:
            child._set_exit(-signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(10)  # reaped: no zombie for the rest of the job
            except subprocess.TimeoutExpired:
                pass

    def spawn(self, env: dict[str, str], timeout: float | None = None
              ) -> ForkedProcess | None:
        """Fork one spare with environment ``env`` (its ``TG_LAUNCHER_FD`` is set by the
        template). Waits up to ``timeout`` seconds (default ``ready_wait_s``) for the template
        to be warm; None when it is not usable (``failure`` says why) or not warm yet."""
        if not self._ready.wait(self.ready_wait_s if timeout is None else timeout) \
                or not self._usable:
            return None
        with self._lock:
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            ctl_fd = int(env.pop("TG_LAUNCHER_FD", "-1"))
            fds = [in_r, out_w, err_w] + ([ctl_fd] if ctl_fd >= 0 else [])
            try:
                assert self._sock is not None
                socket.send_fds(self._sock, [json.dumps({"env": env}).encode()], fds)
                with self._reply:
                    ok = bool(self._reply.wait_for(
                        lambda: self._replies or not self._usable,
                        timeout=30.0 + self.importing_s))
                    msg = self._replies.pop(0) if self._replies else {}
            except OSError as exc:
                self.failure, ok, msg = f"the template did not answer: {exc}", False, {}
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            if not ok or "pid" not in msg:
                for fd in (in_w, out_r, err_r):
                    os.close(fd)
                return None
            child = ForkedProcess(int(msg["pid"]), open(in_w, "w", buffering=1),
                                  open(out_r, errors="replace"),
                                  open(err_r, errors="replace"))
            with self._children_lock:
                code = self._exits.pop(child.pid, None)
                if code is None and self._usable:
                    self._children[child.pid] = child
            if code is not None:
                child._set_exit(code)
            elif not self._usable:  # the template went between its answer and now
                child._set_exit(-signal.SIGKILL)
            return child

    def import_modules(self, path: str, budget_s: float,
                       on_done: Callable[[dict], None]) -> bool:
        """Have the template import the modules listed in file ``path`` (a JSON list, in order,
        for up to ``budget_s`` seconds);
        ``on_done(summary)`` is called from the reader thread when it has
        (``trainguard.rank.job_imports.import_all``'s summary). Waits up to ``ready_wait_s`` for
        the template to be warm; False when it is not usable (nothing is asked)."""
        self._ready.wait(self.ready_wait_s)
        if not self._usable or self._sock is None:
            return False
        with self._lock:
            self._on_warmed = on_done
            self.importing_s = float(budget_s) + 10.0
            try:
                self._sock.send(json.dumps({"import_from": path,
                                            "budget_s": float(budget_s)}).encode())
            except OSError:
                self.importing_s = 0.0
                return False
        return True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (default ``ready_wait_s``) for the template to be warm
        (or to fail); True when it is usable."""
        self._ready.wait(self.ready_wait_s if timeout is None else timeout)
        return self._usable

    @property
    def importing(self) -> bool:
        """An import of the job's modules is in flight."""
        return self.importing_s > 0

    @property
    def usable(self) -> bool:
        return self._usable

    def close(self) -> None:
        """End the template (and with it any spare still its child)."""
        self._usable = False
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


# ---- the template's side ------------------------------------------------------------------------
def pdeathsig_kill() -> None:
    """Have the kernel SIGKILL this process when the thread that forked it exits
    (``PR_SET_PDEATHSIG``): the ``preexec_fn`` of every child of the launcher, and what a
    forked spare sets against its template."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _become_spare(sock: socket.socket, wake: tuple[int, int], env: dict[str, str],
                  fds: list[int], template_pid: int) -> None:
    """In the forked child: take the spare's descriptors and environment, then return to the
    spare's wait for its assignment (``trainguard.launch.spare.main``)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for fd in wake:
        os.close(fd)
    pdeathsig_kill()
    if os.getppid() != template_pid:  # the template died before the line above
        os._exit(1)
    in_r, out_w, err_w, *ctl = fds
    for src, dst in ((in_r, 0), (out_w, 1), (err_w, 2)):
        os.dup2(src, dst)
        os.close(src)
    os.environ.clear()
    os.environ.update(env)
    if ctl:
        os.set_inheritable(ctl[0], True)  # as Popen's pass_fds: the rank's own children too
        os.environ["TG_LAUNCHER_FD"] = str(ctl[0])
    # the template's random state is every fork's: a fresh process seeds Python's, numpy's
    # legacy and torch's default generators from the OS (torch: a user's trial found every
    # forked rank's DataLoader workers drawing the same augmentation, as they seed from torch)
    import random

    random.seed()
    if "numpy" in sys.modules:
        try:
            sys.modules["numpy"].random.seed()
        except Exception:  # noqa: BLE001 - a numpy without the legacy global generator
            pass
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def serve(fd: int) -> bool:
    """The template's loop on socket ``fd`` (after the warm-up). Returns True in a forked
    child (which then becomes a spare), False in the template when the launcher is gone."""
    sock = socket.socket(fileno=fd)
    me = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd carries it
    sys.stdout.flush()
    sys.stderr.flush()
    sock.send(json.dumps({"ready": me}).encode())
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                _reap(sock)
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 8)
            except OSError:
                data, fds = b"", []
            if not data:
                return False
            try:
                msg = json.loads(data)
                if isinstance(msg, dict) and "import_from" in msg and not fds:
                    from trainguard.rank import job_imports

                    try:
                        summary = job_imports.import_file(str(msg["import_from"]),
                                                          float(msg.get("budget_s", 30.0)))
                    except Exception as exc:  # noqa: BLE001 - the template serves on
                        summary = {"error": f"{type(exc).__name__}: {exc}"}
                    import gc

                    gc.freeze()  # as after the warm-up: shared with the spares, never scanned
                    sys.stdout.flush()
                    sys.stderr.flush()
                    sock.send(json.dumps({"warmed": summary}).encode())
                    continue
                env = {str(k): str(v) for k, v in msg["env"].items()}
            except (ValueError, KeyError, AttributeError, TypeError):
                for f in fds:
                    os.close(f)
                sock.send(json.dumps({"error": "bad request"}).encode())
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sel.close()
                _become_spare(sock, (wake_r, wake_w), env, fds, me)
                return True
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"pid": pid}).encode())
            _reap(sock)


def _reap(sock: socket.socket) -> None:
    """Report every ended child to the launcher."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}
                                 ).encode())
        except OSError:
            return


def failed(fd: int, reason: str) -> None:
    """Tell the launcher the warm-up failed (it then starts spares cold)."""
    try:
        socket.socket(fileno=fd).send(json.dumps({"failed": reason[:2000]}).encode())
    except OSError:
        pass


def child_output_pump(tag: str, out: Any) -> Callable[[IO[str]], None]:
    """A pump for the template's own output: each line to ``out`` as ``<tag> <line>``."""
    def pump(stream: IO[str]) -> None:
        for line in stream:
            out.write(f"{tag} {line}")
            out.flush()
    return pump


def warm_env(cfg) -> dict[str, str]:
    """What the template's warm-up reads of the environment: ``TG_WARM_IMPORTS`` and, with more
    than one rank on the node and none set, ``OMP_NUM_THREADS=1`` (as torchrun: oversubscribed
    cores stall collectives; a spare's torch sizes its thread pool when it warms up)."""
    env = {"TG_WARM_IMPORTS": cfg.warm_imports}
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


def start_template(cfg, env: dict[str, str]) -> ForkServer:
    """Start the spares' template (``trainguard.launch.forkserver``) with ``env``, from the
    main thread (its PR_SET_PDEATHSIG)."""
    return ForkServer().start(env, preexec_fn=pdeathsig_kill,
                              on_output=child_output_pump(f"[{cfg.node} spare]", sys.stderr))


def early_template(cfg) -> ForkServer | None:
    """The spares' template started before the launcher knows its servers (an embedded stack
    still starting), so it imports torch and the job's modules meanwhile; None where the
    spares are not forked (``--no-fork-spares``, ``--no-python``). Safe: its warm-up reads only
    ``warm_env``, and every spare forked from it gets its whole environment at the fork."""
    if not cfg.fork_spares or cfg.no_python:
        return None
    return start_template(cfg, {**os.environ, "PYTHONUNBUFFERED": "1", **warm_env(cfg)})

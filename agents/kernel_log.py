"""Kernel log followers of the node agent: ``/dev/kmsg``, ``journalctl -k -f``, or a file.

Each follower is a daemon thread that calls ``on_line(message)`` for every new kernel message
(text only: the ``/dev/kmsg`` record header and the dictionary continuation lines are removed;
journal and file lines are passed as printed, prefixes included, because
``trainguard.core.xid.parse_xid_line`` accepts every prefix). ``stop()`` ends the thread within about
``poll_s`` seconds.

* ``KmsgFollower`` — ``/dev/kmsg`` records ``<prio>,<seq>,<ts_usec>,<flags>;<message>`` (kernel
  documentation, Documentation/ABI/testing/dev-kmsg). Each ``read()`` returns one record, so the
  buffer must hold the longest record (``READ_SIZE``). Starts at the end of the ring buffer unless
  ``from_start``; records overwritten before they were read (``EPIPE``) and sequence gaps are
  counted in ``lost``.
* ``JournalFollower`` — ``journalctl -k -f -o short-monotonic`` as a child process, restarted
  (after ``restart_s``) when it exits.
* ``FileFollower`` — ``tail -F`` semantics: follows appends, reopens the path when it is rotated
  (a new inode) and rereads from the start when it is truncated; waits for a path that does not
  exist yet. Lines may be in any printed form, including ``/dev/kmsg`` records.

``open_follower(spec, on_line, config)`` picks one: ``auto`` (``/dev/kmsg`` when readable, else
``journalctl`` when installed, else none), ``/dev/kmsg``, ``journal``, ``none`` or a file path.

``KERNEL_LINE_PATTERNS`` is the table of non-XID kernel lines the agent forwards to the
detector (host OOM kills and the like); ``classify_kernel_line`` applies it.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import select
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("trainguard.agent.kernel_log")

#: Bytes per ``read()`` of ``/dev/kmsg``: one record per read, and a read with a smaller buffer
#: than the record fails with EINVAL. The kernel caps a record at 1024 bytes of text
#: (LOG_LINE_MAX) plus its dictionary; 16 KiB leaves ample room.
READ_SIZE = 16384

#: A partial line longer than this (bytes) is passed on as it is rather than buffered further.
MAX_LINE = 65536

_KMSG = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<ts>\d+),(?P<flags>[^;]*);(?P<msg>.*)$")
_KMSG_DICT = re.compile(r"^[ \t]+[A-Z][A-Z_]*=")
_KMSG_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")

#: Kernel lines (other than XIDs) forwarded as ``LogLine(stream="kernel")``: (name, pattern).
#: Forms from the Linux sources: mm/oom_kill.c (``Out of memory: Killed process <pid> (<comm>)``,
#: ``Memory cgroup out of memory: Killed process …``, the one-line ``oom-kill:constraint=…,pid=…``
#: summary of kernels ≥ 4.19), arch/x86/mm/fault.c (``<comm>[<pid>]: segfault at …``),
#: kernel/hung_task.c (``INFO: task <comm>:<pid> blocked for more than <n> seconds.``) and the
#: NVIDIA driver's ``NVRM: GPU … has fallen off the bus`` announcement.
KERNEL_LINE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("oom_kill", re.compile(r"(?:Out of memory|out of memory): Kill(?:ed)? process \d+ \(")),
    ("oom_kill", re.compile(r"\boom-kill:.*\bpid=\d+")),
    ("oom_reaper", re.compile(r"oom_reaper: reaped process \d+ \(")),
    ("segfault", re.compile(r"\[\d+\]: segfault at [0-9a-fA-F]+ ")),
    ("bus_error", re.compile(r"\[\d+\]: (?:bus error|general protection fault)\b")),
    ("hung_task", re.compile(r"INFO: task .+:\d+ blocked for more than \d+ seconds")),
    ("gpu_off_bus", re.compile(r"NVRM: GPU .*has fallen off the bus")),
)


@dataclass
class KmsgRecord:
    """A ``/dev/kmsg`` record: ``prio`` (facility × 8 + level), ``seq`` (64-bit sequence
    number), ``ts_usec`` (microseconds since boot, CLOCK_MONOTONIC), ``flags`` (``-`` or ``c``
    for a continuation fragment), ``message`` (``\\xNN`` escapes decoded)."""

    prio: int
    seq: int
    ts_usec: int
    flags: str
    message: str

    @property
    def level(self) -> int:
        """Syslog level 0 (emerg) … 7 (debug)."""
        return self.prio & 7


def parse_kmsg_record(line: str) -> KmsgRecord | None:
    """``KmsgRecord`` of a ``/dev/kmsg`` record line, or None when the line is not one."""
    m = _KMSG.match(line)
    if not m:
        return None
    msg = _KMSG_ESCAPE.sub(lambda e: chr(int(e.group(1), 16)), m.group("msg"))
    return KmsgRecord(prio=int(m.group("prio")), seq=int(m.group("seq")),
                      ts_usec=int(m.group("ts")), flags=m.group("flags"), message=msg)


def message_of(line: str) -> str:
    """The kernel message of a printed line: a ``/dev/kmsg`` record loses its header; any other
    form is returned as it is (stripped of the line end)."""
    line = line.rstrip("\r\n")
    rec = parse_kmsg_record(line)
    return rec.message if rec else line


def classify_kernel_line(line: str) -> str | None:
    """Name of the first ``KERNEL_LINE_PATTERNS`` row matching ``line``; else the name of the
    detector's log-pattern row (``trainguard.detector.patterns``) that matches it with a
    hardware or system-software layer (a machine-check, a NIC or PCIe error, an NFS server not
    responding); else None. Application rows (a Python exception's shape) never match here:
    the kernel prints none."""
    for name, pattern in KERNEL_LINE_PATTERNS:
        if pattern.search(line):
            return name
    if "NVRM: Xid" in line:
        return None  # an XID line is the XID parser's (``XidEvent``), never a log line
    m = _patterns().match_line(line)
    if m is not None and m.pattern.layer in ("hardware", "system_software", "infrastructure"):
        return m.pattern.name
    return None


def _patterns():
    from trainguard.detector import patterns  # the table the detector reads the line with

    return patterns


@dataclass
class KernelLogConfig:
    """Settings of the kernel log follower.

    ``source`` — ``auto`` | ``/dev/kmsg`` | ``journal`` | ``none`` | a file path.
    ``from_start`` — read what is already there (default False: only lines written after the
    agent started, so an old XID is not reported again after an agent restart).
    ``poll_s`` — how often a file is checked for growth / rotation and how long ``stop()`` may
    take, seconds (default 0.2).
    ``journal_cmd`` — the journal command (``-n 0``: no history; ``from_start`` drops it).
    ``restart_s`` — wait before restarting an exited journal command, seconds.
    """

    source: str = "auto"
    from_start: bool = False
    poll_s: float = 0.2
    kmsg_path: str = "/dev/kmsg"
    journal_cmd: tuple[str, ...] = ("journalctl", "-k", "-f", "-o", "short-monotonic",
                                    "--no-pager", "-n", "0")
    restart_s: float = 2.0


LineCallback = Callable[[str], None]


class Follower(threading.Thread):
    """Base of the followers: a daemon thread calling ``on_line`` per message.

    ``source`` is the ``XidEvent.source`` value of what it reads (``kmsg``, ``journal``,
    ``file``); ``lines`` counts messages delivered, ``lost`` messages known to be missed.
    """

    source = "file"

    def __init__(self, on_line: LineCallback, config: KernelLogConfig):
        super().__init__(name=f"tg-kernel-{self.source}", daemon=True)
        self.on_line = on_line
        self.config = config
        self._halt = threading.Event()
        self.lines = 0
        self.lost = 0
        self._logged: set[str] = set()

    def describe(self) -> str:
        return self.source

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end and wait for it (default: ``poll_s`` + 2 s)."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(self.config.poll_s + 2.0 if timeout is None else timeout)

    def _emit(self, text: str) -> None:
        self.lines += 1
        try:
            self.on_line(text)
        except Exception:  # noqa: BLE001 - a consumer error must not end the follower
            self._log_once("callback", logging.ERROR, "kernel line handler failed",
                           exc_info=True)

    def _log_once(self, key: str, level: int, msg: str, *args: object,
                  exc_info: bool = False) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args, exc_info=exc_info)


class _LineSplitter:
    """Bytes → complete lines; keeps the trailing partial line for the next chunk."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_LINE:
            done.append(self.buf)
            self.buf = b""
        return [d.decode("utf-8", errors="replace").rstrip("\r") for d in done]

    def rest(self) -> list[str]:
        out = [self.buf.decode("utf-8", errors="replace")] if self.buf else []
        self.buf = b""
        return out


class KmsgFollower(Follower):
    """Follows ``/dev/kmsg`` (or any character device / FIFO carrying its records)."""

    source = "kmsg"

    def __init__(self, on_line: LineCallback, config: KernelLogConfig, path: str | None = None):
        super().__init__(on_line, config)
        self.path = path or config.kmsg_path
        self.last_seq: int | None = None

    def describe(self) -> str:
        return self.path

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.warning("cannot read %s (%s): kernel XIDs and OOM kills are not followed; "
                        "run the agent as root or with CAP_SYSLOG, or pass --kmsg journal",
                        self.path, exc)
            return
        try:
            if not self.config.from_start:
                try:
                    os.lseek(fd, 0, os.SEEK_END)
                except OSError:
                    pass  # a FIFO cannot seek: it has no history anyway
            split = _LineSplitter()
            while not self._halt.is_set():
                ready, _, _ = select.select([fd], [], [], self.config.poll_s)
                if not ready:
                    continue
                try:
                    data = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # records overwritten before we read them
                        self.lost += 1
                        self._log_once("epipe", logging.WARNING,
                                       "%s: kernel ring buffer overran the reader; some "
                                       "records were lost", self.path)
                        continue
                    raise
                if not data:  # FIFO without a writer
                    self._halt.wait(self.config.poll_s)
                    continue
                for line in split.feed(data):
                    self._record(line)
        except OSError as exc:
            log.warning("reading %s failed (%s): kernel log no longer followed", self.path, exc)
        finally:
            os.close(fd)

    def _record(self, line: str) -> None:
        if not line or _KMSG_DICT.match(line):
            return  # dictionary continuation (" SUBSYSTEM=pci", " DEVICE=+pci:…")
        rec = parse_kmsg_record(line)
        if rec is None:
            self._emit(line)
            return
        if self.last_seq is not None and rec.seq > self.last_seq + 1:
            self.lost += rec.seq - self.last_seq - 1
        self.last_seq = rec.seq
        self._emit(rec.message)


class JournalFollower(Follower):
    """Follows the kernel messages of the systemd journal through ``journalctl``."""

    source = "journal"

    def __init__(self, on_line: LineCallback, config: KernelLogConfig):
        super().__init__(on_line, config)
        cmd = list(config.journal_cmd)
        if config.from_start and "-n" in cmd:
            i = cmd.index("-n")
            del cmd[i:i + 2]
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def describe(self) -> str:
        return " ".join(self.cmd)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL,
                                             stdin=subprocess.DEVNULL)
            except OSError as exc:
                log.warning("cannot run %s (%s): kernel log not followed", self.cmd[0], exc)
                return
            assert self.proc.stdout is not None
            fd = self.proc.stdout.fileno()
            split = _LineSplitter()
            while not self._halt.is_set():
                ready, _, _ = select.select([fd], [], [], self.config.poll_s)
                if not ready:
                    continue
                data = os.read(fd, READ_SIZE)
                if not data:
                    break
                for line in split.feed(data):
                    if line and not line.startswith("-- "):  # "-- No entries --" banners
                        self._emit(line)
            self._end_child()
            if not self._halt.is_set():
                self.restarts += 1
                self._log_once("restart", logging.WARNING,
                               "%s exited (%s); restarting it every %.1f s while it fails",
                               self.cmd[0], self.proc.returncode, self.config.restart_s)
                self._halt.wait(self.config.restart_s)

    def _end_child(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p.stdout:
            p.stdout.close()


class FileFollower(Follower):
    """``tail -F`` of a file: appends, rotation (new inode at the path), truncation."""

    source = "file"

    def __init__(self, on_line: LineCallback, config: KernelLogConfig, path: str):
        super().__init__(on_line, config)
        self.path = path
        self.reopened = 0

    def describe(self) -> str:
        return self.path

    def run(self) -> None:
        fh = None
        ident: tuple[int, int] | None = None
        first = True
        split = _LineSplitter()
        try:
            while not self._halt.is_set():
                if fh is None:
                    try:
                        fh = open(self.path, "rb")
                    except FileNotFoundError:
                        self._log_once("missing", logging.WARNING,
                                       "kernel log file %s does not exist yet; waiting for it",
                                       self.path)
                        first = False  # when it appears, all of it is new
                        self._halt.wait(self.config.poll_s)
                        continue
                    except OSError as exc:
                        log.warning("cannot read %s (%s): kernel log not followed",
                                    self.path, exc)
                        return
                    st = os.fstat(fh.fileno())
                    ident = (st.st_dev, st.st_ino)
                    if first and not self.config.from_start:
                        fh.seek(0, os.SEEK_END)
                    first = False
                data = fh.read(READ_SIZE * 4)
                if data:
                    for line in split.feed(data):
                        self._line(line)
                    continue
                # at the end of the file: rotated or truncated?
                try:
                    st = os.stat(self.path)
                except FileNotFoundError:
                    self._halt.wait(self.config.poll_s)  # rotated away, new one not there yet
                    continue
                if (st.st_dev, st.st_ino) != ident:
                    for line in split.feed(fh.read()) + split.rest():
                        self._line(line)  # what was written to the old file meanwhile
                    fh.close()
                    fh = None
                    self.reopened += 1
                    continue
                if st.st_size < fh.tell():
                    fh.seek(0)
                    split.rest()  # a partial line of the old contents is void
                    self.reopened += 1
                    continue
                self._halt.wait(self.config.poll_s)
        finally:
            if fh is not None:
                fh.close()

    def _line(self, line: str) -> None:
        if not line.strip() or _KMSG_DICT.match(line):
            return  # empty, or a /dev/kmsg dictionary line copied into the file
        self._emit(message_of(line))


def open_follower(on_line: LineCallback, config: KernelLogConfig) -> Follower | None:
    """The follower for ``config.source`` (not started), or None for ``none`` / when ``auto``
    finds no readable kernel log (logged once, at warning level)."""
    src = config.source
    if src == "none":
        return None
    if src == "auto":
        if os.access(config.kmsg_path, os.R_OK):
            return KmsgFollower(on_line, config)
        if shutil.which(config.journal_cmd[0]):
            return JournalFollower(on_line, config)
        log.warning("no readable kernel log (%s not readable, %s not installed): kernel XIDs "
                    "and OOM kills are not followed; pass --kmsg PATH to follow a file",
                    config.kmsg_path, config.journal_cmd[0])
        return None
    if src in ("kmsg", config.kmsg_path):
        return KmsgFollower(on_line, config)
    if src == "journal":
        return JournalFollower(on_line, config)
    return FileFollower(on_line, config, src)


__all__ = ["KernelLogConfig", "KmsgRecord", "parse_kmsg_record", "message_of",
           "classify_kernel_line", "KERNEL_LINE_PATTERNS", "Follower", "KmsgFollower",
           "JournalFollower", "FileFollower", "open_follower", "READ_SIZE"]

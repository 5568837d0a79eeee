"""Kernel log followers against real files, a FIFO carrying /dev/kmsg records, the real
/dev/kmsg (read only), and a journal command's output."""
from __future__ import annotations

import os
import queue
import shlex
import sys
import time
from pathlib import Path

import pytest

from trainguard.agents.kernel_log import (
    FileFollower,
    JournalFollower,
    KernelLogConfig,
    KmsgFollower,
    classify_kernel_line,
    message_of,
    open_follower,
    parse_kmsg_record,
)

FIX = Path(__file__).parent / "fixtures" / "agent"
XID79 = "[ 9301.772210] NVRM: Xid (PCI:0000:3b:00): 79, pid=4121, name=python3, GPU has fallen off the bus."


class Sink:
    def __init__(self) -> None:
        self.q: queue.Queue[str] = queue.Queue()

    def __call__(self, line: str) -> None:
        self.q.put(line)

    def take(self, n: int, timeout: float = 5.0) -> list[str]:
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out.append(self.q.get(timeout=left))
            except queue.Empty:
                break
        return out

    def empty_for(self, seconds: float) -> bool:
        try:
            self.q.get(timeout=seconds)
            return False
        except queue.Empty:
            return True


def cfg(**kw) -> KernelLogConfig:
    kw.setdefault("poll_s", 0.02)
    return KernelLogConfig(**kw)


def append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)
        fh.flush()


@pytest.fixture
def follow(request):
    started = []

    def _start(f):
        f.start()
        started.append(f)
        return f

    yield _start
    for f in started:
        f.stop()
        assert not f.is_alive()


def test_parse_kmsg_record():
    rec = parse_kmsg_record("4,2317,9301772210,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4121")
    assert (rec.prio, rec.level, rec.seq, rec.ts_usec, rec.flags) == (4, 4, 2317, 9301772210, "-")
    assert rec.message == "NVRM: Xid (PCI:0000:3b:00): 79, pid=4121"
    assert parse_kmsg_record("6,9,10,c;tab\\x09end").message == "tab\tend"
    assert parse_kmsg_record(XID79) is None
    assert message_of("4,1,2,-;hello\n") == "hello"
    assert message_of(XID79 + "\n") == XID79


def test_classify_kernel_line_table():
    got = {ln.split("] ", 1)[-1][:30]: classify_kernel_line(ln)
           for ln in (FIX / "kernel_xid.log").read_text().splitlines()}
    kinds = [k for k in got.values() if k]
    assert kinds == ["gpu_off_bus", "oom_kill", "oom_kill", "segfault", "hung_task"]
    assert classify_kernel_line("Memory cgroup out of memory: Killed process 77 (python) "
                                "total-vm:1kB") == "oom_kill"
    assert classify_kernel_line("eth0: link up") is None
    # the detector's machine rows are forwarded too; a program's lines are not the kernel's
    assert classify_kernel_line("EDAC MC0: 1 UE memory read error on CPU_SrcID#0") is not None
    assert classify_kernel_line("RuntimeError: boom") is None


def test_file_follower_follows_appends_only_new_lines(tmp_path, follow):
    log = tmp_path / "kern.log"
    log.write_text("[ 1.0] old line, already there\n" + XID79 + "\n")
    sink = Sink()
    f = follow(FileFollower(sink, cfg(), str(log)))
    time.sleep(0.1)
    assert sink.empty_for(0.05), "existing contents must not be reported again"
    append(log, "[ 9.0] NVRM: Xid (PCI:0000:af:00): 48, pid='<unknown>', name=<unknown>, "
                "An uncorrectable double bit error\n")
    append(log, "[ 9.1] half a li")
    (line,) = sink.take(1)
    assert ": 48, " in line
    assert sink.empty_for(0.1), "a partial line waits for its end"
    append(log, "ne\n")
    assert sink.take(1) == ["[ 9.1] half a line"]
    assert f.lines == 2


def test_file_follower_from_start_and_kmsg_records(tmp_path, follow):
    log = tmp_path / "kmsg.txt"
    log.write_text((FIX / "kmsg_records.txt").read_text())
    sink = Sink()
    follow(FileFollower(sink, cfg(from_start=True), str(log)))
    lines = sink.take(5)
    assert lines[1] == "NVRM: Xid (PCI:0000:3b:00): 79, pid=4121, name=python3, GPU has fallen off the bus."
    assert not any(ln.startswith(" ") or "SUBSYSTEM=" in ln for ln in lines)
    assert lines[-1] == "eth0: renamed from veth1a2b3c\n"  # \x0a escape decoded
    assert len(lines) == 5 and sink.empty_for(0.1)


def test_file_follower_survives_rotation_and_truncation(tmp_path, follow):
    log = tmp_path / "kern.log"
    log.write_text("")
    sink = Sink()
    f = follow(FileFollower(sink, cfg(), str(log)))
    time.sleep(0.05)
    append(log, "before rotation\n")
    assert sink.take(1) == ["before rotation"]
    # logrotate "create": move away, the writer still has the old file open and writes to it
    os.rename(log, tmp_path / "kern.log.1")
    append(tmp_path / "kern.log.1", "late write to the old file\n")
    time.sleep(0.1)
    log.write_text("first line of the new file\n")
    assert sink.take(2) == ["late write to the old file", "first line of the new file"]
    # copytruncate: same inode, size drops
    with open(log, "w") as fh:
        fh.write("after truncation\n")
    assert sink.take(1) == ["after truncation"]
    assert f.reopened == 2


def test_file_follower_waits_for_missing_file(tmp_path, follow):
    log = tmp_path / "later.log"
    sink = Sink()
    follow(FileFollower(sink, cfg(), str(log)))
    time.sleep(0.1)
    log.write_text(XID79 + "\n")  # appears later: all of it is new
    assert sink.take(1) == [XID79]


def test_kmsg_follower_reads_records_from_a_fifo(tmp_path, follow):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    sink = Sink()
    f = follow(KmsgFollower(sink, cfg(), str(fifo)))
    w = os.open(fifo, os.O_WRONLY)  # blocks until the follower has opened the read end
    try:
        for rec in (FIX / "kmsg_records.txt").read_text().splitlines(keepends=True):
            os.write(w, rec.encode())  # one record per write, as /dev/kmsg hands them out
    finally:
        os.close(w)
    lines = sink.take(5)
    assert [ln.split(":")[0] for ln in lines] == [
        "NVRM", "NVRM", "NVRM", "Out of memory", "eth0"]
    assert "79, pid=4121" in lines[1]
    assert f.last_seq == 2321
    assert f.lost == (2317 - 2201 - 1) + (2320 - 2318 - 1)  # sequence gaps


def test_kmsg_follower_on_the_real_dev_kmsg(follow):
    """Reads the real kernel ring buffer from its start: every record must parse."""
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here")
    sink = Sink()
    f = follow(KmsgFollower(sink, cfg(from_start=True), "/dev/kmsg"))
    first = sink.take(1)
    assert first, "the kernel ring buffer holds at least its boot messages"
    deadline = time.monotonic() + 2.0
    while f.last_seq is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.last_seq is not None  # the records carried a sequence number: real format parsed
    assert parse_kmsg_record(first[0]) is None  # the record header was taken off


def test_journal_follower_reads_command_output_and_restarts(tmp_path, follow):
    """The journal command's stdout in ``-o short-monotonic`` form; the command exits after
    its lines, so the follower must restart it."""
    script = tmp_path / "journal.py"
    script.write_text(
        "import sys\n"
        "print('-- Logs begin at Fri 2025-03-14 01:00:00 UTC. --')\n"
        "print('[ 9301.772210] node-007 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=4121, "
        "name=python3, GPU has fallen off the bus.')\n"
        "sys.stdout.flush()\n")
    sink = Sink()
    c = cfg(journal_cmd=(sys.executable, str(script)), restart_s=0.05)
    f = follow(JournalFollower(sink, c))
    lines = sink.take(2)
    assert len(lines) == 2 and all("kernel: NVRM: Xid (PCI:0000:3b:00): 79" in ln for ln in lines)
    assert f.restarts >= 1


def test_journal_from_start_drops_history_limit():
    f = JournalFollower(lambda s: None, cfg(from_start=True))
    assert "-n" not in f.cmd and f.cmd[:3] == ["journalctl", "-k", "-f"]
    assert shlex.join(JournalFollower(lambda s: None, cfg()).cmd).endswith("-n 0")


def test_open_follower_choices(tmp_path):
    assert open_follower(print, cfg(source="none")) is None
    assert isinstance(open_follower(print, cfg(source="journal")), JournalFollower)
    assert isinstance(open_follower(print, cfg(source="/dev/kmsg")), KmsgFollower)
    f = open_follower(print, cfg(source=str(tmp_path / "x.log")))
    assert isinstance(f, FileFollower) and f.path == str(tmp_path / "x.log")
    # auto with nothing readable
    none = cfg(source="auto", kmsg_path=str(tmp_path / "absent"),
               journal_cmd=("no-such-journalctl-binary",))
    assert open_follower(print, none) is None

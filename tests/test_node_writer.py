"""The node writer daemon (one per node, held by the launcher): ranks write through it, it
outlives a closed or dead owner only as long as its writers have saves to finish, and a rank
whose node writer is gone writes with a writer of its own. Real processes, real signals."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from trainguard.checkpoint_validator.validate import validate_checkpoint
from trainguard.checkpoint import CheckpointConfig, Checkpointer, NodeWriter
from trainguard.checkpoint import format as fmt

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def _gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_saves_go_through_the_node_writer_and_close_lets_them_finish(tmp_path, monkeypatch):
    sock = str(tmp_path / "nw.sock")
    nw = NodeWriter(sock).start()
    daemon = nw.proc.pid
    monkeypatch.setenv("TG_CKPT_WRITER", sock)
    root = str(tmp_path / "ckpt")
    model = _model()
    ck = Checkpointer(model, None, config=CheckpointConfig(root=root), job="nw-close",
                      rank=0, world_size=1)
    try:
        assert ck.save(1)
        ck.wait()
        assert ck.resources.writer.proc is None  # no writer of its own: the daemon's child wrote it
        assert len(psutil.Process(daemon).children()) == 1
        with torch.no_grad():  # a state unchanged since step 1 would be a stale checkpoint
            for p in model.parameters():
                p.add_(1.0)
        assert ck.save(2)
        nw.close()  # the launcher ends while a save is in flight
        ck.wait()
        assert ck.stats["committed"] == 2, ck.stats
        newest = fmt.list_checkpoints(root)[0]
        assert newest.step == 2 and validate_checkpoint(newest.path).ok
        assert not os.path.exists(sock)  # no new ranks once closed
        assert nw.proc.poll() is None  # still serving the connected rank
    finally:
        ck.finalize()
    assert nw.proc.wait(10) == 0  # its writer finished and left: so does the daemon
    assert not os.path.exists(sock + ".staging")


def test_node_writer_exits_when_its_owner_is_killed(tmp_path, monkeypatch):
    """The launcher is SIGKILLed while a rank is connected: the daemon refuses new ranks, its
    writer serves the rank until it goes, then the staged copy is freed and the daemon exits."""
    sock = str(tmp_path / "owner.sock")
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from trainguard.checkpoint import NodeWriter\n"
         f"nw = NodeWriter({sock!r}).start(); print(nw.proc.pid, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        daemon = int(owner.stdout.readline())
        assert psutil.pid_exists(daemon) and os.path.exists(sock)
        monkeypatch.setenv("TG_CKPT_WRITER", sock)
        ck = Checkpointer(_model(), None, config=CheckpointConfig(root=str(tmp_path / "ck")),
                          job="nw-owner", rank=0, world_size=1)
        assert ck.save(3)
        ck.wait()
        staged = ck.resources.staging.path
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        time.sleep(0.3)
        assert not os.path.exists(sock)  # no new ranks
        assert psutil.pid_exists(daemon) and os.path.exists(staged)  # the rank still lives
        ck.resources.writer.close()  # the rank goes (as if killed: no finalize)
        assert _gone(daemon, 10.0), "node writer outlived its killed owner and its rank"
        assert not os.path.exists(staged) and not os.path.exists(staged + ".meta")
        assert validate_checkpoint(fmt.list_checkpoints(str(tmp_path / "ck"))[0].path).ok
    finally:
        owner.kill()


def test_unreachable_node_writer_falls_back_to_a_writer_of_its_own(tmp_path, monkeypatch,
                                                                   caplog):
    monkeypatch.setenv("TG_CKPT_WRITER", str(tmp_path / "nobody.sock"))
    root = str(tmp_path / "ckpt")
    ck = Checkpointer(_model(), None, config=CheckpointConfig(root=root), job="nw-fallback",
                      rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint"):
            assert ck.save(5)
            ck.wait()
        assert ck.resources.writer.proc is not None
        assert "starts a writer of its own" in caplog.text
        newest = fmt.list_checkpoints(root)[0]
        assert newest.step == 5 and validate_checkpoint(newest.path).ok
    finally:
        ck.finalize()


def test_launcher_holds_a_node_writer_for_its_ranks(tmp_path):
    """``trainguard launch`` starts the daemon before any rank and hands its socket to every
    rank and spare it starts; its end lets the daemon go."""
    from trainguard.checkpoint.writer import connect_writer, recv_msg, send_msg
    from trainguard.launch.launcher import LaunchConfig, Launcher

    script = tmp_path / "train.py"
    script.write_text("")
    launcher = Launcher(LaunchConfig(script=str(script), nats_url="nats://127.0.0.1:1",
                                     redis_url="redis://127.0.0.1:1",
                                     rdzv_endpoint="127.0.0.1:1"))
    launcher._start_node_writer()
    nw = launcher.node_writer
    try:
        sock = launcher._base_env()["TG_CKPT_WRITER"]
        assert sock == nw.socket_path
        conn = connect_writer(sock)
        send_msg(conn, {"op": "ping"})
        pid = recv_msg(conn)["pid"]
        assert psutil.Process(pid).ppid() == nw.proc.pid  # a writer forked for this rank
        conn.close()
    finally:
        nw.close()
    assert nw.proc.wait(10) == 0
    assert not os.path.exists(nw.socket_path)

"""Training never waits on the control plane: a real 2-rank gloo job under ``trainguard launch``
keeps stepping while the embedded nats-server is stopped (SIGSTOP), and once it runs again a
SIGKILLed rank is recovered as usual (detector → attributor → remediator → launcher)."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = '''
import os, time, torch, trainguard

def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = ctx.checkpointer(model, opt)
    start = ckpt.restore()
    net = ctx.ddp(model)
    for step in range(start, {steps}):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.progress(step, loss=float(loss))
        with open(f"{progress}/.rank-{{ctx.rank}}", "w") as fh:  # whole, never half-written
            fh.write(f"{{step}} {{ctx.generation}}")
        os.replace(f"{progress}/.rank-{{ctx.rank}}", f"{progress}/rank-{{ctx.rank}}")
        if step % 20 == 0:
            ckpt.save(step)
        time.sleep(0.03)
    if ctx.rank == 0:
        print(f"finished at step {{step}} generation {{ctx.generation}}", flush=True)

trainguard.run(train)
'''


def _steps(progress) -> dict[int, tuple[int, int]]:
    out = {}
    for r in (0, 1):
        try:
            step, gen = (progress / f"rank-{r}").read_text().split()
            out[r] = (int(step), int(gen))
        except (OSError, ValueError):
            pass
    return out


def _wait(pred, timeout: float, what: str, out) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s:\n{out.read_text()[-3000:]}")


@contextlib.contextmanager
def _job(tmp_path, job: str, steps: int, mode: tuple[str, ...] = ()):
    """A 2-rank job of ``_SCRIPT`` (``steps`` steps) under ``trainguard launch`` on a stack of
    its own: yields ``(stack, launcher, its output file, the progress directory)`` once both
    ranks are at step 30; the launcher (SIGTERM) and the stack are stopped at the end."""
    from trainguard.stack.local import Stack

    progress = tmp_path / "progress"
    progress.mkdir()
    (tmp_path / "ckpt").mkdir()
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(steps=steps, progress=progress))
    stack = Stack(services=("detector", "attributor", "remediator", "checkpoint_validator"),
                  rendezvous=True, log_dir=str(tmp_path / "logs"))
    stack.start(timeout=120)
    out = tmp_path / "launch.out"
    cmd = [sys.executable, "-m", "trainguard.cli", "launch", "--nproc-per-node", "2",
           "--job", job, *mode, "--nats-url", stack.urls("worker")[0],
           "--redis-url", stack.urls("worker")[1], "--rdzv-endpoint", stack.rdzv_endpoint,
           "--ckpt-dir", str(tmp_path / "ckpt"), str(script)]
    launcher = None
    try:
        with open(out, "w") as fh:
            launcher = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path)
        _wait(lambda: min((s for s, _ in _steps(progress).values()), default=-1) >= 30
              and len(_steps(progress)) == 2, 120, "both ranks at step 30", out)
        yield stack, launcher, out, progress
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(20)
            except subprocess.TimeoutExpired:
                launcher.kill()
        stack.stop()


@contextlib.contextmanager
def _stopped(*procs):
    """``procs`` stopped (SIGSTOP: every client's socket to them hangs) while inside."""
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def test_training_steps_on_while_nats_is_stopped_and_recovers_after(tmp_path):
    with _job(tmp_path, "outage", 700, ("--mode", "action")) as (stack, _launcher, out, progress):
        with _stopped(stack._servers._server("nats").proc):  # the bus is gone
            before = _steps(progress)
            time.sleep(3.0)
            during = _steps(progress)
        for r in (0, 1):  # 3 s at ≈ 0.03-0.1 s a step: well over 10 steps each
            assert during[r][0] - before[r][0] >= 10, (before, during)

        pid = int(re.search(r"rank 1 \(local 1\) started as pid (\d+)",
                            out.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)  # recovery works again with the bus back
        _wait(lambda: "decision restart_workers (executing) generation 1" in out.read_text(),
              60, "the decision of the SIGKILL", out)
        _wait(lambda: all(g >= 1 for _, g in _steps(progress).values()), 60,
              "both ranks training at generation 1", out)
        t = _steps(progress)
        time.sleep(1.0)
        assert all(_steps(progress)[r][0] > t[r][0] for r in (0, 1))  # stepping again


def test_observe_mode_trains_through_a_control_plane_outage_longer_than_the_lease(tmp_path):
    """The whole control plane out of reach (NATS and Valkey stopped) for 12 s, longer than the
    launcher's 10 s lease: in observe mode (the default) nothing is executed, so nothing can have
    moved the ranks, and the job trains on to its end, exit 0, as under torchrun. It used to
    fence itself and stop every rank (exit 1; found by a new user's trial restarting
    `trainguard up`)."""
    from trainguard.launch.lease import JobLease

    with _job(tmp_path, "observe-outage", 600) as (stack, launcher, out, progress):
        with _stopped(*(stack._servers._server(k).proc for k in ("nats", "valkey"))):
            before = _steps(progress)
            time.sleep(JobLease.LEASE_S + 2.0)
            during = _steps(progress)
        assert all(during[r][0] - before[r][0] >= 10 for r in (0, 1)), (before, during)
        assert launcher.wait(120) == 0, out.read_text()[-3000:]
        text = out.read_text()
        assert "observe mode executes no decision" in text and "fenced" not in text, text[-3000:]
        assert "finished at step 599 generation 0" in text

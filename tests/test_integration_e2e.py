"""End to end: unmodified framework scripts — a Lightning ``Trainer.fit`` (strategy ddp, CPU,
gloo) and a Hugging Face ``Trainer.train`` — with trainguard's callbacks, 2 ranks under
``trainguard launch --mode action`` on the embedded stack; rank 1 is SIGKILLed after a few
steps. The whole worker group restarts from warm spares and each script resumes from its
framework's own checkpoint; the job must finish.

The scripts are ``tests/fixtures/integrations/``; they log every step (rank, restart count,
pid, global step) and write each rank's result at the end.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# about a minute each on an idle 2-core machine; the limits leave room for a loaded one
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPTS = Path(__file__).parent / "fixtures" / "integrations"
NODE = "node0"
_STARTED = re.compile(r"rank (\d+) \(local \d+\) started as pid (\d+) at generation (\d+)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator"),
               agent_nodes=(NODE,), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs))
    st.start(timeout=120)
    yield st
    st.stop()


class Launch:
    """``trainguard launch`` of a script in a subprocess; its stderr is kept and scanned for
    the ranks' pids."""

    def __init__(self, stack, tmp: Path, job: str, script: str, args: list[str],
                 warm: str):
        self.out = tmp / "out"
        self.out.mkdir()
        env = {**os.environ, "NATS_URL": stack.nats_url, "REDIS_URL": stack.redis_url,
               "TG_RDZV_ENDPOINT": stack.rdzv_endpoint, "PYTHONUNBUFFERED": "1"}
        exe = os.path.join(os.path.dirname(sys.executable), "trainguard")
        cmd = [exe, "launch", "--nproc-per-node", "2", "--job", job, "--mode", "action",
               "--node", NODE, "--warm-import", warm, "--log-dir", str(tmp / "logs"),
               # a loaded 2-core host starves the node agent for seconds: no false node loss
               "--node-timeout", "20",
               str(SCRIPTS / script), str(self.out), *args]
        self.lines: list[str] = []
        self.pids: dict[tuple[int, int], int] = {}  # (rank, generation) -> pid
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = _STARTED.search(line)
            if m:
                self.pids[(int(m.group(1)), int(m.group(3)))] = int(m.group(2))

    def steps(self) -> list[dict]:
        try:
            text = (self.out / "steps.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(s) for s in text.splitlines() if s.strip()]

    def wait_for(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"{what}: not within {timeout} s (launcher rc {self.proc.returncode})\n"
                    + "\n".join(self.lines[-60:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def results(self) -> dict[int, dict]:
        out = {}
        for r in (0, 1):
            p = self.out / f"result-{r}.json"
            if p.exists():
                out[r] = json.loads(p.read_text())
        return out


def _kill_rank1_and_finish(launch: Launch, kill_at: int, max_steps: int, ckpt_every: int,
                           first_logged: int) -> dict:
    """``first_logged``: what a script logs for the first step it trains after resuming at
    global step g is g + first_logged (Lightning logs in training_step, before the optimizer
    step: g; the Trainer's on_step_end, after it: g + 1)."""
    launch.wait_for(lambda: any(s["rank"] == 1 and s["step"] >= kill_at for s in launch.steps()),
                    300, f"rank 1 reaching step {kill_at}")
    victim = launch.pids[(1, 0)]
    before = launch.steps()
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    killed_step = max(s["step"] for s in before if s["rank"] == 1)

    def resumed() -> bool:
        after = [s for s in launch.steps() if s["restart"] > 0]
        return {s["rank"] for s in after} == {0, 1}

    launch.wait_for(resumed, 120, "both ranks training again after the kill")
    back = time.monotonic() - killed
    try:
        rc = launch.proc.wait(180)
    except subprocess.TimeoutExpired:
        launch.stop()
        pytest.fail("the job did not finish\n" + "\n".join(launch.lines[-60:]))
    log = "\n".join(launch.lines[-60:])
    assert rc == 0, log
    res = launch.results()
    assert set(res) == {0, 1}, log
    for r, x in res.items():
        assert x["restart"] > 0, (r, x)  # the results are from the restarted group
        assert x["global_step"] == max_steps, (r, x)
        # resumed from the framework's checkpoint: a saved step, not past the fault, not 0
        assert 0 < x["resumed_step"] <= killed_step + 1, (r, x, killed_step)
        assert x["resumed_step"] % ckpt_every == 0, (r, x)
    after = [s for s in launch.steps() if s["restart"] > 0]
    for r in (0, 1):
        mine = [s for s in after if s["rank"] == r]
        first = res[r]["resumed_step"] + first_logged
        assert mine and min(s["step"] for s in mine) == first, (r, mine[:3])
        assert max(s["step"] for s in mine) == max_steps - 1 + first_logged
        assert victim not in {s["pid"] for s in mine}
    assert res[0]["resumed_step"] == res[1]["resumed_step"]
    steps = launch.steps()
    t0 = launch.wall0
    first = min(s["t"] for s in steps) - t0
    first_after = min(s["t"] for s in after) - t0
    last = max(s["t"] for s in steps) - t0
    print(f"timeline: first step {first:.1f} s, kill {killed - launch.t0:.1f} s, first step "
          f"after {first_after:.1f} s, last step {last:.1f} s, exit {time.monotonic() - launch.t0:.1f} s")
    return {"killed_step": killed_step, "resumed_step": res[0]["resumed_step"],
            "fault_to_training_s": round(back, 2),
            "total_s": round(time.monotonic() - launch.t0, 1)}


def test_lightning_ddp_resumes_after_a_rank_is_killed(stack, tmp_path):
    launch = Launch(stack, tmp_path, "int-lightning", "lightning_ddp.py", ["40", "0.05"],
                    warm="lightning.pytorch")
    try:
        rep = _kill_rank1_and_finish(launch, kill_at=12, max_steps=40, ckpt_every=5,
                                     first_logged=0)
    finally:
        launch.stop()
    # the checkpoints the group restarted from were verified by TrainguardCheckpointIO
    from trainguard.rank import verified_file as _verified

    ck = launch.out / "ckpt" / f"epoch=0-step={rep['resumed_step']}.ckpt"
    assert _verified.verify(str(ck))[0]
    print("lightning e2e:", rep)


def test_hf_trainer_resumes_after_a_rank_is_killed(stack, tmp_path):
    launch = Launch(stack, tmp_path, "int-hf", "hf_trainer.py", ["40", "0.05"],
                    warm="transformers.trainer")
    try:
        rep = _kill_rank1_and_finish(launch, kill_at=12, max_steps=40, ckpt_every=5,
                                     first_logged=1)
    finally:
        launch.stop()
    print("hf e2e:", rep)


def test_accelerate_script_runs_under_trainguard_launch(stack, tmp_path):
    """What ``accelerate launch --num_processes 2`` would run, started by ``trainguard launch``:
    accelerate forms its group from torchrun's environment, shards the data and keeps the
    replicas equal."""
    launch = Launch(stack, tmp_path, "int-accelerate", "accelerate_loop.py", ["30"],
                    warm="accelerate")
    try:
        rc = launch.proc.wait(300)
    finally:
        launch.stop()
    assert rc == 0, "\n".join(launch.lines[-40:])
    res = launch.results()
    assert set(res) == {0, 1}
    for r in res.values():
        assert r["num_processes"] == 2 and r["distributed_type"].endswith("MULTI_CPU"), r
        assert r["steps"] == 30
    assert res[0]["first_batch_sum"] != res[1]["first_batch_sum"]  # each rank its own shard
    assert res[0]["weights_sum"] == res[1]["weights_sum"]  # gradients averaged across ranks

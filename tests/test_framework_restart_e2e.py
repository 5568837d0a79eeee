"""End to end: unmodified Lightning and Hugging Face ``Trainer`` jobs restarted as a group.

The jobs are the benchmark's (``bench/dropin_jobs/``), run with ``--no-own-resume``: their
scripts call ``fit(ckpt_path=None)`` / ``train()`` whatever is on disk, as the current Hugging
Face examples do. Real launcher (observe mode, ``--max-restarts 1``: torchrun's group restart),
real spares forked from the launcher's template, 2 gloo ranks, a real NATS, Valkey and
rendezvous store. Rank 1 is SIGKILLed once the job has written checkpoints and the spares'
template has imported the job's modules; a newer, incomplete checkpoint (zero-byte files) is
planted just before. Asserted from the ranks' own records (``records.py``: a line per completed
step, and a line per process start saying whether the framework was already imported):

* every restarted rank's first step is the step of the newest complete checkpoint (> 0), named
  in the launch log ("resuming from …"); the planted one is skipped, with its reason;
* the processes that became the restarted ranks had the framework imported before the script
  imported it (``'lightning.pytorch' in sys.modules`` at the script's first line), and the
  first generation's had not.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "bench" / "dropin_jobs"
BIN = Path(sys.executable).parent
_RESUMING = re.compile(r"\[node0 rank (\d)\] trainguard: resuming from (\S+) \(step (\d+)\)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=(), agent_nodes=(), rendezvous=True, log_dir=str(logs))
    st.start(timeout=120)
    yield st
    st.stop()


class Job:
    """One launch of a benchmark job under ``trainguard launch``, in ``tmp``."""

    def __init__(self, stack, tmp: Path, script: str, args: list[str]):
        self.tmp = tmp
        self.records = tmp / "records.txt"
        self.log = tmp / "launcher.log"
        env = {k: v for k, v in os.environ.items()
               if k not in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_MODE", "TG_JOB")}
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [str(BIN / "trainguard"), "launch", "--nproc-per-node", "2", "--max-restarts", "1",
               "--node", "node0", "--job", f"fw-{uuid.uuid4().hex[:6]}",
               "--nats-url", stack.nats_url, "--redis-url", stack.redis_url,
               "--rdzv-endpoint", stack.rdzv_endpoint, "--log-dir", str(tmp / "logs"),
               str(JOBS / script), "--records", str(self.records), "--no-own-resume",
               "--width", "32", "--batch", "64", "--ckpt-every", "4", "--sleep", "0.05", *args]
        self.fh = open(self.log, "w")
        self.p = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=self.fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def steps(self) -> list[tuple[int, int, int, int, int]]:
        """(rank, step, t_ns, pid, restart count) of every completed step."""
        out = []
        if self.records.exists():
            for line in self.records.read_text().splitlines():
                parts = line.split()
                if len(parts) == 5:
                    out.append(tuple(int(x) for x in parts))
        return out

    def starts(self) -> list[tuple[int, int, int, int]]:
        """(rank, pid, restart count, framework already imported) of every script start."""
        f = Path(str(self.records) + ".starts")
        return [tuple(int(x) for x in ln.split()) for ln in f.read_text().splitlines()
                if len(ln.split()) == 4] if f.exists() else []

    def wait_for(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            if self.p.poll() is not None:
                pytest.fail(f"the launcher exited ({self.p.returncode}) before {what}:\n"
                            + self.text()[-5000:])
            time.sleep(0.1)
        pytest.fail(f"no {what} in {timeout} s:\n" + self.text()[-5000:])

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(10)
        self.fh.close()


@pytest.fixture
def jobs():
    made: list[Job] = []
    yield made
    for j in made:  # nothing left behind: the launcher's session, and any rank it forked
        pids = {s[3] for s in j.steps()[-8:]}
        j.close()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _restart_and_check(job: Job, plant, newest) -> int:
    """The shared course of both tests (module docstring); returns the step resumed at."""
    job.wait_for("spares renewed with the job's imports",
                 lambda: "renewing the idle spares" in job.text(), 150)
    job.wait_for("a checkpoint", lambda: newest() is not None, 60)
    assert "the spares' template imports them" in job.text()
    assert "records (the job's own code" in job.text()  # skipped, with its reason
    planted = plant()
    victim = max((s for s in job.steps() if s[0] == 1), key=lambda s: s[2])
    t_fault = time.time_ns()
    os.kill(victim[3], signal.SIGKILL)
    job.wait_for("both ranks training again",
                 lambda: {s[0] for s in job.steps() if s[4] == 1 and s[2] > t_fault} == {0, 1}
                 and len([s for s in job.steps() if s[4] == 1]) >= 4, 120)
    text = job.text()
    said = {int(r): (path, int(step)) for r, path, step in _RESUMING.findall(text)}
    assert set(said) == {0, 1}, text[-5000:]
    assert len({v for v in said.values()}) == 1, said  # both ranks chose the same checkpoint
    path, step = said[0]
    assert step > 0 and os.path.realpath(path) != os.path.realpath(planted), said
    assert f"not resuming from {planted}: empty" in text, text[-5000:]
    # every restarted rank's first step is the one after the checkpoint's (its index: `step`)
    for rank in (0, 1):
        first = min((s for s in job.steps() if s[0] == rank and s[4] == 1), key=lambda s: s[2])
        assert first[1] == step, (rank, first, step)
    # the processes that became the restarted ranks had the framework imported already; the
    # first generation's (forked before the job ran) had not
    starts = job.starts()
    assert {(s[0], s[3]) for s in starts if s[2] == 0} == {(0, 0), (1, 0)}, starts
    assert {(s[0], s[3]) for s in starts if s[2] == 1} == {(0, 1), (1, 1)}, starts
    return step


def test_an_unmodified_lightning_job_restarted_as_a_group_resumes_warm(stack, tmp_path, jobs):
    ckpt = tmp_path / "ckpt"
    job = Job(stack, tmp_path, "lightning_job.py", ["--ckpt-dir", str(ckpt)])
    jobs.append(job)

    def newest():
        return ckpt / "last.ckpt" if (ckpt / "last.ckpt").exists() else None

    def plant():  # a save killed before its first byte, of a later step than any real one
        p = ckpt / "epoch=999-step=99999.ckpt"
        p.write_bytes(b"")
        return str(p)

    step = _restart_and_check(job, plant, newest)
    assert "Trainer.fit was given no ckpt_path" in job.text()
    assert step % 4 == 0  # --ckpt-every 4


def test_an_unmodified_hf_trainer_job_restarted_as_a_group_resumes_warm(stack, tmp_path, jobs):
    out = tmp_path / "hf_out"
    job = Job(stack, tmp_path, "hf_job.py", ["--out", str(out)])
    jobs.append(job)

    def newest():
        if not out.exists():
            return None
        done = [p for p in out.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
        return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None

    def plant():  # every file the Trainer writes, the weights empty: a killed save
        good = newest()
        p = out / "checkpoint-99999"
        p.mkdir()
        for f in good.iterdir():
            (p / f.name).write_bytes(b"" if f.name == "model.safetensors" else f.read_bytes())
        (p / "trainer_state.json").write_text(
            (good / "trainer_state.json").read_text().replace(
                f'"global_step": {good.name.split("-")[1]}', '"global_step": 99999'))
        return str(p)

    step = _restart_and_check(job, plant, newest)
    assert "Trainer.train was given no checkpoint" in job.text()
    assert step % 4 == 0

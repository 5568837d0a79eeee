"""End to end: an unmodified torchrun script under ``trainguard launch``.

The script (``tests/fixtures/dropin/train_ddp.py``) is a DDP script written for torchrun in the
usual way: ``init_process_group`` from the environment, a ``DistributedSampler``, its own
``torch.save`` snapshot written atomically by rank 0 every epoch. Real launchers, real warm
spares, real gloo ranks, a real stack (NATS, Valkey, rendezvous store, detector, attributor,
remediator). Every assertion is on what happened: the per-step records each rank appended (which
process trained which epoch when), the launchers' exit codes, and the decision on the bus.

* 2 nodes × 2 ranks, action mode: SIGKILL of one rank → the whole group restarts from warm
  spares and resumes from the script's snapshot, on every rank, and finishes;
* 1 node × 2 ranks: an exception in a rank; a hang (SIGSTOP) of a rank, named by the decision;
  a rank that busy-loops inside its step (it runs and beats; its peer waits in the gradient
  allreduce): named from the collective counts, the waiting rank not;
* a script that fails at import is stopped as a loop after two tries;
* torchrun's own command line, only the program name changed, with no stack configured (the
  launcher starts its own), SIGKILL of a rank → the group restarts as under torchrun; and the
  same script and arguments under real ``torchrun``.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "dropin"
SCRIPT = FIXTURES / "train_ddp.py"
BIN = Path(sys.executable).parent
#: Seconds of pause per optimizer step: 8 steps per epoch per rank (512 samples, batch 32,
#: 2 ranks; 4 steps with 4 ranks), so an epoch takes ≈ 0.1-0.2 s and a job of EPOCHS epochs
#: runs long enough to be hit mid-way.
SLEEP = "0.03"
EPOCHS = 20
FAULT_EPOCH = 3  # inject once every rank has recorded this epoch (a snapshot exists by then)
_STARTED = re.compile(r"rank (\d+) \(local \d+\) started as pid (\d+) at generation (\d+)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from trainguard.stack.local import Stack

    logs = tmp_path_factory.mktemp("stack-logs")
    st = Stack(services=("agent", "detector", "attributor", "remediator"),
               agent_nodes=("node0", "node1"), rendezvous=True, log_dir=str(logs),
               kernel_log_dir=str(logs))
    st.start(timeout=120)
    yield st
    st.stop()


def _job(name: str) -> str:
    return f"dropin-{name}-{uuid.uuid4().hex[:6]}"


class Proc:
    """A launcher (``trainguard launch`` or ``torchrun``) in its own session, output to a file."""

    def __init__(self, cmd: list[str], cwd: Path, log: Path, env: dict[str, str]):
        self.cmd, self.log = cmd, log
        self.fh = open(log, "w")
        self.p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.fh,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def started(self) -> list[tuple[int, int, int]]:
        """(rank, pid, generation) of every rank start the launcher printed."""
        return [(int(r), int(p), int(g)) for r, p, g in _STARTED.findall(self.text())]

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return -999

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait(10)
        self.fh.close()


class Run:
    """One job: its directory, snapshot, per-step records and launchers."""

    def __init__(self, tmp: Path, job: str, script: Path = SCRIPT, epochs: int = EPOCHS,
                 extra: tuple[str, ...] = ()):
        self.tmp, self.job = tmp, job
        self.rec_dir = tmp / "records"
        self.snapshot = tmp / "snapshot.pt"
        self.script = script
        self.script_args = ["--epochs", str(epochs), "--snapshot", str(self.snapshot),
                            "--record-dir", str(self.rec_dir), "--sleep", SLEEP, *extra]
        self.procs: list[Proc] = []

    # ---- starting ---------------------------------------------------------------------------
    def launch(self, stack, args: list[str], name: str = "launcher") -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for k in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_MODE", "TG_JOB"):
            env.pop(k, None)
        cmd = [str(BIN / "trainguard"), "launch", *args]
        if stack is not None:
            cmd += ["--nats-url", stack.nats_url, "--redis-url", stack.redis_url,
                    "--rdzv-endpoint", stack.rdzv_endpoint, "--job", self.job,
                    "--log-dir", str(self.tmp / "logs")]
        proc = Proc(cmd + [str(self.script), *self.script_args], self.tmp,
                    self.tmp / f"{name}.log", env)
        self.procs.append(proc)
        return proc

    # ---- records ----------------------------------------------------------------------------
    def records(self) -> list[dict]:
        out = []
        for f in sorted(self.rec_dir.glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                if line.strip():
                    out.append(json.loads(line))
        return sorted(out, key=lambda r: r["t_ns"])

    def by_rank(self) -> dict[int, list[dict]]:
        out: dict[int, list[dict]] = {}
        for r in self.records():
            out.setdefault(r["rank"], []).append(r)
        return out

    def wait_epoch(self, world: int, epoch: int, timeout: float) -> dict[int, dict]:
        """Wait until every rank recorded a step of ``epoch`` and the snapshot exists; returns
        each rank's latest record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ranks = self.by_rank()
            if len(ranks) == world and all(rs[-1]["epoch"] >= epoch for rs in ranks.values()) \
                    and self.snapshot.exists():
                return {r: rs[-1] for r, rs in ranks.items()}
            for p in self.procs:
                if p.p.poll() is not None:
                    pytest.fail(f"{p.cmd[0]} exited ({p.p.returncode}) before epoch {epoch}:\n"
                                + self.tails())
            time.sleep(0.05)
        pytest.fail(f"no rank reached epoch {epoch} in {timeout} s:\n" + self.tails())

    def last_before(self, t_ns: int) -> dict[int, dict]:
        """Each rank's last record written before ``t_ns`` (by the process the fault hit)."""
        return {rank: max((r for r in rs if r["t_ns"] <= t_ns), key=lambda r: r["t_ns"])
                for rank, rs in self.by_rank().items()}

    def tails(self, n: int = 4000) -> str:
        return "\n".join(f"--- {p.log.name} ---\n{p.text()[-n:]}" for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def runs():
    made: list[Run] = []
    yield made
    for r in made:  # a failed test leaves no launcher, rank or stopped process behind
        for rec in r.records()[-8:]:
            try:
                os.kill(rec["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        r.close()


def events(stack, job: str, kind: str) -> list[dict]:
    """The events JetStream kept on ``tg.job.<job>.<kind>``, oldest first."""
    from trainguard.tools.replay import history

    buf = io.StringIO()
    asyncio.run(history(stack.nats_url, buf, subject=f"tg.job.{job}.{kind}"))
    return [json.loads(line)["event"] for line in buf.getvalue().splitlines() if line.strip()]


def decisions(stack, job: str) -> list[dict]:
    return events(stack, job, "decision")


def assert_resumed(run: Run, world: int, before: dict[int, dict], t_fault: int,
                   epochs: int = EPOCHS) -> dict[int, dict]:
    """Every rank trained again after ``t_fault`` in a new process, restarted
    (``TORCHELASTIC_RESTART_COUNT`` ≥ 1) from the script's snapshot (a start epoch > 0, no later
    than the epoch after the last one trained before the fault), and reached the last epoch.
    Returns each rank's first record after the fault."""
    ranks = run.by_rank()
    assert sorted(ranks) == list(range(world)), run.tails()
    last_before = max(r["epoch"] for r in before.values())
    first = {}
    for rank, rs in ranks.items():
        new = [r for r in rs if r["t_ns"] > t_fault and r["pid"] != before[rank]["pid"]]
        assert new, f"rank {rank} never trained again after the fault\n" + run.tails()
        f = first[rank] = new[0]
        assert f["restarts"] >= 1, f
        assert 0 < f["start_epoch"] <= last_before + 1, (f, last_before)
        assert f["epoch"] == f["start_epoch"], f  # it started at the snapshot's next epoch
        assert {r["pid"] for r in new} == {f["pid"]}, "restarted more than once\n" + run.tails()
        assert rs[-1]["epoch"] == epochs - 1, f"rank {rank} stopped at {rs[-1]}"
    # the restarted group resumed together from one snapshot
    assert len({f["start_epoch"] for f in first.values()}) == 1, first
    return first


# ---------------------------------------------------------------------------------------------
def test_sigkill_two_nodes_restarts_the_group_from_the_scripts_snapshot(stack, tmp_path, runs):
    run = Run(tmp_path, _job("kill"))
    runs.append(run)
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--mode", "action"]
    node0 = run.launch(stack, [*common, "--node", "node0", "--node-rank", "0"], "node0")
    node1 = run.launch(stack, [*common, "--node", "node1", "--node-rank", "1"], "node1")
    before = run.wait_epoch(4, FAULT_EPOCH, 150)
    victim = 2  # rank 2: local rank 0 of node1
    t_fault = time.time_ns()
    os.kill(before[victim]["pid"], signal.SIGKILL)
    rc0, rc1 = node0.wait(120), node1.wait(60)
    assert (rc0, rc1) == (0, 0), run.tails()
    assert_resumed(run, 4, run.last_before(t_fault), t_fault)
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds, "no executed decision on the bus"
    assert ds[0]["action"] == "restart_workers" and victim in ds[0]["ranks"], ds[0]
    assert ds[0]["generation"] >= 1
    # both nodes' ranks were started again at the decision's generation
    for proc in (node0, node1):
        gens = {g for _r, _p, g in proc.started()}
        assert ds[0]["generation"] in gens, proc.text()[-3000:]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(ln for ln in fh if ln.startswith("PPid:")).split()[1])


def test_the_spares_template_killed_by_hand_takes_its_ranks_and_the_job_recovers_cold(
        stack, tmp_path, runs):
    """The ranks are the template's children (trainguard.launch.forkserver): SIGKILL of the template
    ends them too (PR_SET_PDEATHSIG); the launcher recovers as from any rank fault, from spares
    started cold while a new template warms."""
    run = Run(tmp_path, _job("template"))
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--mode", "action", "--node", "node0"])
    before = run.wait_epoch(2, FAULT_EPOCH, 150)
    template = _ppid(before[0]["pid"])
    assert template == _ppid(before[1]["pid"]) != node0.p.pid
    t_fault = time.time_ns()
    os.kill(template, signal.SIGKILL)
    assert node0.wait(150) == 0, run.tails()
    first = assert_resumed(run, 2, run.last_before(t_fault), t_fault)
    assert "the spares' template exited (the ranks forked from it with it): a new one warms" \
        in node0.text(), node0.text()[-3000:]
    assert not os.path.exists(f"/proc/{template}")  # reaped: no zombie left of it
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds and ds[0]["action"] == "restart_workers", ds
    assert all(f["pid"] != before[r]["pid"] for r, f in first.items())


def test_exception_in_a_rank_restarts_the_group(stack, tmp_path, runs):
    marker = tmp_path / "raise_once"
    marker.write_text("")
    run = Run(tmp_path, _job("exc"), extra=("--raise-marker", str(marker), "--raise-rank", "1",
                                            "--raise-epoch", str(FAULT_EPOCH)))
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--mode", "action", "--node", "node0"])
    deadline = time.monotonic() + 150
    while marker.exists() and time.monotonic() < deadline and node0.p.poll() is None:
        time.sleep(0.02)
    t_fault = time.time_ns()
    assert not marker.exists(), run.tails()
    assert node0.wait(120) == 0, run.tails()
    before = run.last_before(t_fault)
    assert before[1]["epoch"] in (FAULT_EPOCH - 1, FAULT_EPOCH), before  # it raised there
    assert_resumed(run, 2, before, t_fault)
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds and ds[0]["action"] in ("restart_workers", "restart_in_process"), ds
    # the rank published its exception before it exited
    exc = [e for e in events(stack, run.job, "log") if e.get("stream") == "exception"]
    assert any("injected bug in rank 1" in e["line"] and e["rank"] == 1 for e in exc), exc


def test_observe_mode_without_restarts_fails_as_torchrun_and_prints_its_decision(
        stack, tmp_path, runs):
    """Observe mode (the default) with no --max-restarts: a rank's exception ends the job with
    exit 1, as under torchrun, and the launch log still says what trainguard would have done."""
    marker = tmp_path / "raise_once"
    marker.write_text("")
    run = Run(tmp_path, _job("obs"), extra=("--raise-marker", str(marker), "--raise-rank", "1",
                                            "--raise-epoch", str(FAULT_EPOCH)))
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--node", "node0"])
    assert node0.wait(150) == 1, run.tails()
    text = node0.text()
    said = re.search(r"decision (\w+) \(observe mode: not executed\) generation \d+ ranks "
                     r"\[([\d, ]*)\]", text)
    assert said, text[-3000:]
    assert said.group(1) in ("restart_workers", "restart_in_process") and "1" in said.group(2)
    assert [d["action"] for d in decisions(stack, run.job) if not d["execute"]], "on the bus"


def test_hang_is_named_and_the_group_restarts(stack, tmp_path, runs):
    run = Run(tmp_path, _job("hang"))
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--mode", "action", "--node", "node0",
                               "--hang-timeout", "2"])
    before = run.wait_epoch(2, FAULT_EPOCH, 150)
    victim = 1
    t_fault = time.time_ns()
    os.kill(before[victim]["pid"], signal.SIGSTOP)
    try:
        rc = node0.wait(120)
    finally:
        try:
            os.kill(before[victim]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert rc == 0, run.tails()
    first = assert_resumed(run, 2, run.last_before(t_fault), t_fault)
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds, "no executed decision"
    assert ds[0]["action"] == "restart_workers" and ds[0]["ranks"] == [victim], ds[0]
    # detected after the hang timeout, not at the gloo timeout (30 min)
    assert min(f["t_ns"] for f in first.values()) - t_fault < 60e9


def test_a_busy_rank_is_named_from_its_collective_counts(stack, tmp_path, runs):
    """Rank 1 spins inside its step (not SIGSTOP: it keeps beating); rank 0 enters the
    gradient allreduce and waits. The stall rule names rank 1 from the counts the hooks report
    (rank 1: every collective it entered completed; rank 0: one more entered than completed),
    and only rank 1 is named by the decision. From the fault to the end of the job ≈ 10 s; the
    launch before it takes what the host's load allows (100 s at a load of 31 on 2 cores)."""
    marker = tmp_path / "busy"
    run = Run(tmp_path, _job("busy"), epochs=FAULT_EPOCH + 4,
              extra=("--busy-marker", str(marker), "--busy-rank", "1",
                     "--busy-epoch", str(FAULT_EPOCH + 1)))
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--mode", "action", "--node", "node0",
                               "--hang-timeout", "2"])
    run.wait_epoch(2, FAULT_EPOCH, 150)
    t_fault = time.time_ns()
    marker.touch()
    rc = node0.wait(120)
    assert rc == 0, run.tails()
    assert not marker.exists(), "the busy rank never reached its loop"
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds, "no executed decision\n" + run.tails()
    assert ds[0]["action"] == "restart_workers" and ds[0]["ranks"] == [1], ds[0]
    [v] = [v for v in events(stack, run.job, "verdict") if v["fault_class"] == "hang"][:1]
    assert v["culprit"]["ranks"] == [1], v
    assert v["detail"]["in_compute"] == [1] and v["detail"]["blocked"] == [0], v["detail"]
    ranks = run.by_rank()
    assert all(rs[-1]["epoch"] == FAULT_EPOCH + 3 for rs in ranks.values()), run.tails()
    assert min(r["t_ns"] for rs in ranks.values() for r in rs if r["t_ns"] > t_fault) - t_fault \
        < 60e9


def test_a_script_that_fails_at_import_is_stopped_as_a_loop(stack, tmp_path, runs):
    run = Run(tmp_path, _job("import"), script=FIXTURES / "fails_at_import.py")
    runs.append(run)
    node0 = run.launch(stack, ["--nproc-per-node", "2", "--mode", "action", "--node", "node0"])
    rc = node0.wait(150)
    assert rc == 3, run.tails()
    ds = [d for d in decisions(stack, run.job) if d["execute"]]
    assert ds and ds[-1]["action"] == "stop_job_notify_user", ds
    assert "would loop" in ds[-1]["reason"], ds[-1]
    assert "a_module_that_does_not_exist_anywhere" in node0.text()
    # two tries: generation 0 and one restart, then stopped
    gens = sorted({g for _r, _p, g in node0.started()})
    assert len(gens) == 2, node0.text()[-3000:]
    assert not run.records()


def test_a_standalone_launch_whose_script_fails_at_once_still_gets_its_decisions(tmp_path, runs):
    """The embedded stack's services wait for the ranks' first steps (``--standalone``): a
    script that never gets there is still decided on, because the ranks' failure starts the
    services (``Launcher.when_training``): stopped as a loop after two tries, as on a shared
    stack."""
    run = Run(tmp_path, _job("import-standalone"), script=FIXTURES / "fails_at_import.py")
    runs.append(run)
    node0 = run.launch(None, ["--standalone", "--nproc-per-node", "2", "--mode", "action",
                              "--job", run.job])
    assert node0.wait(150) == 3, run.tails()
    assert "decision stop_job_notify_user (executing)" in node0.text(), node0.text()[-3000:]
    assert len({g for _r, _p, g in node0.started()}) == 2, node0.text()[-3000:]


def test_a_second_launch_under_another_node_name_is_refused_and_harms_nothing(
        stack, tmp_path, runs):
    """The running job's ranks are held by node0's live launcher: a second launch of the job
    under another ``--node`` with the same node rank is refused, naming the rank and its node,
    and gives its lease back; the job trains on to its end. It used to take the ranks' entries
    in the job record and start a second copy of them, which met the running job's rendezvous
    and hung (found by a new user's trial)."""
    from trainguard.clients.store import StateStore

    run = Run(tmp_path, _job("dup"), epochs=12)
    runs.append(run)
    first = run.launch(stack, ["--nproc-per-node", "2", "--node", "node0"], name="first")
    run.wait_epoch(2, 1, 120)
    second = run.launch(stack, ["--nproc-per-node", "2", "--node", "fake"], name="second")
    assert second.wait(60) == 1, run.tails()
    assert "rank 0 of job" in second.text() and "already run by node 'node0'" in second.text()
    assert not second.started()

    async def _record():
        st = StateStore(stack.redis_url)
        try:
            return (await st.job(run.job)).members, await st.r.zrange(
                f"tg:job:{run.job}:launchers", 0, -1)
        finally:
            await st.close()
    members, launchers = asyncio.run(_record())
    assert {m["node"] for m in members} == {"node0"} and launchers == ["node0"], (
        members, launchers)
    assert first.wait(120) == 0, run.tails()
    assert {r for r, rs in run.by_rank().items() if rs[-1]["epoch"] == 11} == {0, 1}


def test_torchruns_command_line_with_only_the_program_name_changed(tmp_path, runs):
    """No NATS_URL/REDIS_URL/TG_RDZV_ENDPOINT: the launcher starts an embedded stack, whose
    services start once the ranks train; observe mode (the default) restarts the group after a
    SIGKILL as torchrun does. (The same script
    and arguments under torchrun itself run in ``tests/test_bench_dropin.py``'s real sample.)"""
    argv = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    run = Run(tmp_path / "tg", _job("torchrun-cli"))
    run.tmp.mkdir()
    runs.append(run)
    tg = run.launch(None, argv, "trainguard")
    before = run.wait_epoch(2, FAULT_EPOCH, 180)
    # the embedded stack's services started once both ranks trained, not beside their start-up
    # (``Launcher.when_training``): every service process is younger than every rank
    import psutil

    from trainguard.stack.services import SERVICE_SPECS

    modules = {f"-m {spec.module}" for spec in SERVICE_SPECS.values()}

    def _services() -> list:
        out = []
        for p in psutil.Process(tg.p.pid).children(recursive=True):
            try:
                if any(m in " ".join(p.cmdline()) for m in modules):
                    out.append(p)
            except psutil.Error:  # gone, or a zombie not yet reaped
                pass
        return out

    deadline = time.monotonic() + 30
    while len(services := _services()) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(services) >= 4, [p.cmdline() for p in services]
    # ordered by the processes' own start times, not by a tolerance on the clock: a rank's
    # first heartbeat after its optimizer step precedes its script's record of that step (under
    # load by more than 0.5 s), so the record is no bound; the ranks' processes are (the code
    # before started every service before the first rank)
    ranks_started = max(psutil.Process(rs[0]["pid"]).create_time()
                        for rs in run.by_rank().values())
    assert min(p.create_time() for p in services) > ranks_started, (
        [(p.cmdline()[-1], p.create_time()) for p in services], ranks_started)
    # the ranks were forked from the node's warm template (trainguard.launch.forkserver), a child of
    # the launcher
    for rec in before.values():
        ppid = _ppid(rec["pid"])
        with open(f"/proc/{ppid}/cmdline", "rb") as fh:
            assert b"--fork-server" in fh.read(), ppid
        assert _ppid(ppid) == tg.p.pid
    t_fault = time.time_ns()
    os.kill(before[1]["pid"], signal.SIGKILL)
    assert tg.wait(120) == 0, run.tails()
    assert_resumed(run, 2, run.last_before(t_fault), t_fault)
    assert "embedded stack" in tg.text()

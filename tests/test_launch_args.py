"""``trainguard launch`` takes torchrun's command line: every flag, both spellings, and a clear
error for what cannot mean here what it means under torchrun."""
from __future__ import annotations

import os

import pytest

from trainguard.launch.args import UNSUPPORTED, parse, parse_nnodes, parse_nproc, parse_std


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_JOB", "TG_MODE", "TG_CKPT_DIR",
              "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)


def test_torchrun_standalone_line():
    c = parse(["--standalone", "--nproc-per-node", "2", "train.py", "--lr", "0.1"])
    assert (c.nnodes, c.nproc_per_node, c.node_rank, c.standalone) == (1, 2, 0, True)
    assert c.script == "train.py" and c.script_args == ["--lr", "0.1"]
    assert c.spares == 2  # a whole worker group restarts from warm spares
    assert c.mode == "observe" and c.max_restarts == 0


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_both_spellings(flag):
    assert parse([flag, "3", "t.py"]).nproc_per_node == 3


def test_underscore_spellings_of_the_rest():
    c = parse(["--nnodes=2", "--node_rank=1", "--rdzv_backend=c10d",
               "--rdzv_endpoint=10.0.0.1:29400", "--rdzv_id=job7", "--max_restarts=4",
               "--monitor_interval=0.2", "--log_dir=/tmp/x", "--local_ranks_filter=0",
               "--nproc_per_node=2", "t.py"])
    assert (c.nnodes, c.node_rank, c.rdzv_endpoint, c.job) == (2, 1, "10.0.0.1:29400", "job7")
    assert (c.max_restarts, c.monitor_interval_s, c.log_dir) == (4, 0.2, "/tmp/x")
    assert c.local_ranks_filter == frozenset({0})


def test_max_restarts_is_the_retry_budget_in_action_mode():
    assert parse(["--mode", "action", "--max-restarts", "2", "t.py"]).retry_budget == 2
    assert parse(["--max-restarts", "2", "t.py"]).retry_budget == 10  # observe: group restarts


def test_elastic_range_min_world_size():
    c = parse(["--nnodes", "1:3", "--node-rank", "0", "--nproc-per-node", "2", "t.py"])
    assert (c.nnodes, c.world_size, c.min_world_size) == (3, 6, 2)
    # a fixed node count keeps trainguard's floor: the job may shrink on exclusion
    c = parse(["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2", "t.py"])
    assert (c.world_size, c.min_world_size) == (4, 1)


def test_master_addr_port_is_the_rendezvous_store():
    c = parse(["--master-addr", "node0", "--master-port", "29511", "t.py"])
    assert c.rdzv_endpoint == "node0:29511"


def test_rdzv_conf_join_timeout_and_unknown_key(capsys):
    assert parse(["--rdzv-conf", "join_timeout=30,read_timeout=5", "t.py"]).startup_timeout_s \
        == 30.0
    assert "read_timeout=5 has no effect here" in capsys.readouterr().err  # said, not ignored
    with pytest.raises(SystemExit) as e:
        parse(["--rdzv-conf", "bogus=1", "t.py"])
    assert e.value.code == 2 and "unknown key 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(UNSUPPORTED))
def test_unsupported_flags_are_errors(flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse([flag, "x", "t.py"])
    assert e.value.code == 2
    assert f"{flag} is not supported" in capsys.readouterr().err


def test_etcd_backend_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--rdzv-backend", "etcd", "t.py"])
    assert "not supported" in capsys.readouterr().err


def test_multi_node_needs_a_node_rank(capsys):
    with pytest.raises(SystemExit):
        parse(["--nnodes", "2", "t.py"])
    assert "--node-rank is needed" in capsys.readouterr().err


def test_standalone_is_one_node(capsys):
    with pytest.raises(SystemExit):
        parse(["--standalone", "--nnodes", "2", "--node-rank", "0", "t.py"])
    assert "single node" in capsys.readouterr().err


def test_job_flag_wins_over_rdzv_id():
    assert parse(["--rdzv-id", "a", "--job", "b", "t.py"]).job == "b"


def test_no_python_and_module(capsys):
    c = parse(["--no-python", "--nproc-per-node", "1", "true"])
    assert c.no_python and c.script == "true"
    with pytest.raises(SystemExit):
        parse(["--no-python", "-m", "pkg"])


def test_nproc_values(monkeypatch):
    assert parse_nproc("cpu") == (os.cpu_count() or 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert parse_nproc("gpu") == 3 and parse_nproc("auto") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse_nproc("auto") == (os.cpu_count() or 1)
    with pytest.raises(ValueError, match="no GPU"):
        parse_nproc("gpu")
    with pytest.raises(ValueError):
        parse_nproc("many")


def test_nnodes_and_std_specs():
    assert parse_nnodes("4") == (4, 4) and parse_nnodes("2:4") == (2, 4)
    for bad in ("0", "3:2", "a:b"):
        with pytest.raises(ValueError):
            parse_nnodes(bad)
    s = parse_std("0:1,1:3")
    assert (s.of(0), s.of(1), s.of(2)) == (1, 3, 0)
    assert parse_std("3").of(7) == 3
    with pytest.raises(ValueError):
        parse_std("4")


def test_trainguard_checks_still_apply(capsys):
    with pytest.raises(SystemExit):
        parse(["--job", "a*b", "t.py"])  # a wildcard; dots are allowed (subjects.token)
    assert "--job" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_no_python_with_log_files_tee_and_rank_filter(tmp_path):
    """torchrun's output flags on a real launch (an embedded stack, a program that is not
    Python): every rank's stdout in ``<log-dir>/<job>/attempt_0/<local rank>/stdout.log``,
    ``--tee`` shows what ``--redirects`` sends to the files, ``--local-ranks-filter`` only rank 0."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT")}
    p = subprocess.run([sys.executable, "-m", "trainguard.cli", "launch", "--standalone",
                        "--nproc-per-node", "2", "--no-python", "--log-dir", str(tmp_path),
                        "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
                        "--job", "echoes", "/bin/sh", "-c", "echo hello from $RANK of $WORLD_SIZE"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    for rank in (0, 1):
        log = tmp_path / "echoes" / "attempt_0" / str(rank) / "stdout.log"
        assert log.read_text() == f"hello from {rank} of 2\n"
    shown = [ln for ln in p.stdout.splitlines() if "hello from" in ln]
    assert len(shown) == 1 and shown[0].endswith("rank 0] hello from 0 of 2"), p.stdout


def test_a_missing_script_is_said_before_anything_starts(tmp_path, capsys):
    """No stack, no lock, no process: the path is checked first (exit 2)."""
    from trainguard.launch.launcher import main

    assert main(["--standalone", "--nproc-per-node", "1", str(tmp_path / "nope.py")]) == 2
    assert "nope.py: no such file" in capsys.readouterr().err


def test_two_embedded_launches_of_one_job_on_a_host_cannot_both_run(tmp_path, monkeypatch):
    """Each embedded stack has a state store of its own, whose launcher lease cannot see the
    other launch: a host lock (fcntl) refuses the second run of the job, and is free again
    when its holder ends, even SIGKILLed."""
    import signal
    import subprocess
    import sys
    import tempfile

    from trainguard.launch.launcher import standalone_lock

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try:
        first = standalone_lock("job.a", "n0")
        with pytest.raises(SystemExit, match=r"job 'job.a' is already running on this host .*pid"):
            standalone_lock("job.a", "n0")
        other = standalone_lock("job.b", "n0")  # another job, another lock
        first.close()
        standalone_lock("job.a", "n0").close()  # free once its holder let go
        other.close()
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; from trainguard.launch.launcher import "
             "standalone_lock; fh = standalone_lock('job.a', 'n0'); print('held', flush=True); "
             "time.sleep(60)"], stdout=subprocess.PIPE, text=True, env={**os.environ})
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=f"pid {holder.pid}"):
            standalone_lock("job.a", "n0")
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        standalone_lock("job.a", "n0").close()  # the kernel released it
    finally:
        tempfile.tempdir = None


def test_a_scheduled_fault_on_a_rank_the_job_lacks_is_refused(tmp_path, capsys):
    """A rank fault for rank 5 of a 2-rank job would never fire (a user's trial: accepted
    silently): argparse's error names the entry and the job's ranks."""
    sched = tmp_path / "s.yaml"
    sched.write_text("faults:\n  - {kind: sigkill, rank: 1, step: 3}\n"
                     "  - {kind: exception, rank: 5, step: 9}\n")
    with pytest.raises(SystemExit) as ei:
        parse(["--standalone", "--nproc-per-node", "2", "--faults", str(sched), "t.py"])
    assert ei.value.code == 2
    assert "rank 5 is not a rank of this job (ranks 0-1)" in capsys.readouterr().err
    ok = parse(["--nnodes", "1:3", "--node-rank", "0", "--nproc-per-node", "2", "--faults",
                str(sched), "t.py"])
    assert '"rank": 5' in ok.faults  # 3 nodes of 2: rank 5 exists


def test_a_no_python_program_on_path_is_no_missing_script(tmp_path):
    """``--no-python`` runs a program found on PATH, not a file beside the launch."""
    from trainguard.launch.launcher import _script_missing

    assert _script_missing(parse(["--no-python", "--standalone", "true"])) is None
    assert "no such file" in _script_missing(parse(["--standalone", str(tmp_path / "x.py")]))

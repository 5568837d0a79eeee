"""The node's warm template (``trainguard.launch.forkserver``): real processes, real signals.

A forked spare becomes a rank with the environment, descriptors and exit status a cold spare
has; its end is reported whatever ends it; the template's death ends its spares and makes the
launcher start cold ones; the launcher's death ends the template and every spare it forked."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainguard.launch.forkserver import ForkServer
from trainguard.launch.pool import pdeathsig_kill


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` no longer runs (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(ln for ln in fh if ln.startswith("PPid:")).split()[1])


@pytest.fixture(scope="module")
def template():
    fs = ForkServer().start({**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=pdeathsig_kill)
    yield fs
    fs.close()


def _assign(proc, script, *args, env=None, cwd=None) -> None:
    proc.stdin.write(json.dumps({"env": env or {}, "argv": [str(script), *args],
                                 "cwd": str(cwd or script.parent)}) + "\n")
    proc.stdin.flush()


def test_a_forked_spare_runs_its_script_with_its_environment_and_exit_status(template,
                                                                            tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, random, sys
        import numpy, torch
        print("args", sys.argv[1:], os.environ["TG_TEST_SPARE"], os.environ["RANK"],
              os.getcwd(), random.random(), numpy.random.random(), torch.rand(1).item())
        os.write(int(os.environ["TG_LAUNCHER_FD"]), b"restart in_process\\n")
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    """))
    outs = []
    for n in range(2):
        rfd, wfd = os.pipe()
        proc = template.spawn({**os.environ, "TG_TEST_SPARE": f"spare{n}",
                               "TG_LAUNCHER_FD": str(wfd)})
        os.close(wfd)
        assert proc is not None, template.failure
        assert _ppid(proc.pid) == template.proc.pid  # forked, not started cold
        _assign(proc, script, "--lr", "0.1", env={"RANK": str(n)}, cwd=tmp_path)
        out, err = proc.stdout.read(), proc.stderr.read()
        assert proc.wait(30) == 3
        assert os.read(rfd, 100) == b"restart in_process\n"
        os.close(rfd)
        assert "to stderr" in err
        words = out.split()
        assert words[:6] == ["args", "['--lr',", "'0.1']", f"spare{n}", str(n), str(tmp_path)]
        outs.append([float(w) for w in words[6:9]])
    # each fork seeds Python's, numpy's and torch's generators from the OS, as a fresh process
    # does (unseeded DataLoader workers seed from torch's: they drew alike on every rank)
    assert all(a != b for a, b in zip(*outs)), outs


def test_a_killed_spare_is_reported_with_its_signal_and_a_second_fork_is_quick(template):
    t0 = time.monotonic()
    proc = template.spawn(dict(os.environ))
    fork_s = time.monotonic() - t0
    assert proc is not None and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    assert _gone(proc.pid)
    with pytest.raises(subprocess.TimeoutExpired):
        template.spawn(dict(os.environ)).wait(0.2)  # a live spare: wait times out
    assert fork_s < 5.0, fork_s  # no interpreter start (a cold spare warms for seconds)


def test_the_templates_death_ends_its_spares_and_later_spares_start_cold(tmp_path):
    fs = ForkServer().start({**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=pdeathsig_kill)
    try:
        a, b = fs.spawn(dict(os.environ)), fs.spawn(dict(os.environ))
        assert a is not None and b is not None, fs.failure
        fs.proc.kill()
        assert a.wait(10) == -signal.SIGKILL and b.wait(10) == -signal.SIGKILL
        assert _gone(a.pid) and _gone(b.pid)  # PR_SET_PDEATHSIG from the template
        assert fs.spawn(dict(os.environ), timeout=5) is None
        assert not fs.usable and "exited" in fs.failure and fs.died_after_ready
        deadline = time.monotonic() + 10
        while fs.proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fs.proc.returncode == -signal.SIGKILL  # reaped, no zombie
    finally:
        fs.close()


def test_a_template_that_cannot_start_python_is_no_template():
    fs = ForkServer().start({**os.environ, "PYTHONHOME": "/nonexistent"})
    try:
        assert fs.spawn(dict(os.environ), timeout=30) is None
        assert fs.failure
    finally:
        fs.close()


def test_the_launchers_death_ends_the_template_and_every_spare(tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text(textwrap.dedent("""
        import os, sys, time
        from trainguard.launch.forkserver import ForkServer
        from trainguard.launch.pool import pdeathsig_kill
        fs = ForkServer().start(dict(os.environ), preexec_fn=pdeathsig_kill)
        spares = [fs.spawn(dict(os.environ)) for _ in range(2)]
        print(fs.proc.pid, *[s.pid for s in spares], flush=True)
        time.sleep(600)
    """))
    p = subprocess.Popen([sys.executable, str(owner)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 3, pids
        assert all(not _gone(pid, 0.1) for pid in pids)
        p.kill()
        p.wait(10)
        assert all(_gone(pid) for pid in pids), pids
    finally:
        if p.poll() is None:
            p.kill()


def test_a_template_whose_warm_up_fails_says_why_and_forks_nothing(tmp_path):
    (tmp_path / "tg_breaks_at_import.py").write_text("raise RuntimeError('no licence server')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TG_WARM_IMPORTS": "tg_breaks_at_import"}
    fs = ForkServer().start(env, on_output=lambda stream: stream.read())
    try:
        assert fs.spawn(dict(os.environ), timeout=60) is None
        assert "RuntimeError: no licence server" in fs.failure, fs.failure
    finally:
        fs.close()


def test_the_template_imports_the_jobs_modules_and_spares_forked_after_have_them(template,
                                                                                 tmp_path):
    """``import_modules``: the template imports the listed modules (one that does not exist is
    reported, not fatal), says so, and the spares forked afterwards find them imported."""
    listing = tmp_path / "chosen.json"
    listing.write_text(json.dumps(["xml.dom.minidom", "a_module_that_does_not_exist_here",
                                   "wave"]))
    got = []
    import threading

    done = threading.Event()
    assert template.import_modules(str(listing), 30.0, lambda s: (got.append(s), done.set()))
    assert done.wait(60)
    [summary] = got
    assert summary["imported"] >= 1 and summary["n_failed"] == 1, summary
    assert "a_module_that_does_not_exist_here" in summary["failed"], summary
    assert summary["threads"] == [] and summary["cuda"] is False
    assert not template.importing
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint('xml.dom.minidom' in sys.modules, "
                      "'wave' in sys.modules)\n")
    proc = template.spawn({**os.environ})
    assert proc is not None, template.failure
    _assign(proc, script)
    assert proc.stdout.read().split() == ["True", "True"]
    assert proc.wait(30) == 0

"""``trainguard.launch.job_imports.JobImportsWatch`` with a real template process: a rank's record
on disk → the chosen modules imported by the template → ``RenewSpares`` posted; a module that
starts a thread at import taints the template (spares then start cold), with the reason said."""
from __future__ import annotations

import json
import os
import queue
import textwrap

import pytest

from trainguard.launch.forkserver import ForkServer
from trainguard.launch.job_imports import JobImportsWatch
from trainguard.launch.loop import RenewSpares
from trainguard.launch.pool import pdeathsig_kill


@pytest.fixture
def lib(tmp_path):
    """Two installed-looking modules on the template's path: one quiet, one that starts a
    thread when imported."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "tg_quiet_mod.py").write_text("VALUE = 1\n")
    (d / "tg_thread_mod.py").write_text(textwrap.dedent("""
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    """))
    return d


@pytest.fixture
def template(lib):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(lib),
                                                       os.environ.get("PYTHONPATH", "")]))}
    fs = ForkServer().start(env, preexec_fn=pdeathsig_kill)
    yield fs
    fs.close()


def _watch(tmp_path, template, modules, capsys):
    events: queue.Queue = queue.Queue()
    taints: list[str] = []
    w = JobImportsWatch("node0", 30.0, lambda: template, events.put, taints.append)
    path = tmp_path / "job_imports.json"
    w.start(str(path))
    # written as the rank writes it (trainguard.rank.job_imports.record): whole, by a rename; a
    # plain write could be seen half-done by the watch (under load, it was: the record read as
    # empty JSON and nothing was imported)
    tmp = tmp_path / "job_imports.json.tmp"
    tmp.write_text(json.dumps({"modules": modules, "rank": 0, "pid": 1}))
    os.replace(tmp, path)
    ev = events.get(timeout=120)
    w.close()
    return ev, taints, capsys.readouterr().err


def test_the_record_is_imported_by_the_template_and_the_spares_renewed(tmp_path, template,
                                                                       capsys):
    ev, taints, err = _watch(tmp_path, template, [["tg_quiet_mod", "lib"], ["myjob", "job"],
                                                  ["wandb", "lib"]], capsys)
    assert isinstance(ev, RenewSpares) and taints == []
    assert "imported 1 more modules (top level: tg_quiet_mod)" in err
    assert "myjob (the job's own code, not an installed package)" in err
    assert "wandb (experiment tracker" in err
    assert "the spares' template imported 1 of the job's modules" in err


def test_a_module_that_starts_a_thread_taints_the_template(tmp_path, template, capsys):
    ev, taints, err = _watch(tmp_path, template, [["tg_thread_mod", "lib"]], capsys)
    assert isinstance(ev, RenewSpares)
    assert taints == ["threads were started by ['tg_thread_mod']"]
    assert "which a forked rank would not carry: spares start cold from now on" in err

"""The warm spare (``python -m trainguard.launch.spare``) started in a job directory that holds a
folder named like one of trainguard's packages: trainguard still loads its own, and the script
runs as ``__main__`` with its own directory on the path. A real spare process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_users_schemas_and_detector_folders_change_nothing(tmp_path):
    """Everything of trainguard installs under the ``trainguard`` import name: a job directory
    with its own ``schemas/`` and ``detector/`` packages runs them, trainguard runs its own, and
    the script runs as ``__main__`` with its own directory on the path (as under torchrun)."""
    for pkg in ("schemas", "detector"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(f"WHO = \"the user's {pkg}\"\n")
    out = tmp_path / "out.json"
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys, schemas, detector\n"
        "import trainguard.schemas, trainguard.rank.hooks\n"
        f"json.dump({{'mine': [schemas.WHO, detector.WHO], "
        f"'ours': trainguard.schemas.__file__, 'hooks': trainguard.rank.hooks.active(), "
        f"'argv': sys.argv[1:], 'path0': sys.path[0]}}, open({str(out)!r}, 'w'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "trainguard.launch.spare"], cwd=tmp_path, env=env,
                       input=json.dumps({"env": {}, "argv": [str(script), "--x", "1"],
                                         "cwd": str(tmp_path), "module": False}) + "\n",
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["mine"] == ["the user's schemas", "the user's detector"]
    assert got["ours"] == os.path.join(ROOT, "schemas", "__init__.py") and got["hooks"]
    assert got["argv"] == ["--x", "1"] and got["path0"] == str(tmp_path)


def test_only_trainguard_is_a_top_level_import_name(tmp_path):
    """The distribution puts one name at the top of site-packages: its wheel, built from this
    checkout, holds ``trainguard/`` (with ``schemas``, ``detector``, … inside) and its metadata;
    and none of the parts imports at the top level here."""
    import zipfile

    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), ROOT], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    [wheel] = tmp_path.glob("trainguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"trainguard"}, top
    for part in ("schemas/__init__.py", "detector/rules.py", "schemas/xid_table.csv",
                 "checkpoint_validator/__main__.py"):
        assert f"trainguard/{part}" in names, part
    for name in ("schemas", "agents", "detector", "attributor", "remediator",
                 "checkpoint_validator"):
        q = subprocess.run([sys.executable, "-c", f"import {name}"], cwd="/",
                           capture_output=True, text=True, timeout=60)
        assert q.returncode != 0, f"{name} is importable at the top level"


def test_a_script_failing_at_start_prints_an_unlabelled_traceback(tmp_path):
    """The spare's warm-up group must not leave torch's "[rank0]:" traceback label behind: a
    rank whose script fails before trainguard.run would print it whatever its rank."""
    script = tmp_path / "train.py"
    script.write_text("raise RuntimeError('boom at start')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "trainguard.launch.spare"], cwd=tmp_path, env=env,
                       input=json.dumps({"env": {"RANK": "3"}, "argv": [str(script)],
                                         "cwd": str(tmp_path)}) + "\n",
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 1
    assert "RuntimeError: boom at start" in p.stderr
    assert "[rank" not in p.stderr, p.stderr[-2000:]


def test_unwrapping_rank_labels_keeps_the_programs_own_hook():
    import torch.distributed as dist

    from trainguard.rendezvous.store import unwrap_rank_excepthook

    def mine(*exc_info):
        pass

    old = sys.excepthook
    sys.excepthook = mine
    try:
        for _ in range(2):  # two generations: two stacked "[rank0]" wrappers
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            dist.destroy_process_group()
        assert sys.excepthook is not mine
        unwrap_rank_excepthook()
        assert sys.excepthook is mine
    finally:
        sys.excepthook = old


@pytest.mark.parametrize("service", ["agents", "detector", "attributor", "remediator",
                                     "checkpoint_validator"])
def test_services_start_in_a_directory_holding_a_schemas_folder(tmp_path, service):
    """``python -m trainguard.<service>`` (what ``trainguard up`` runs, in the user's directory)
    starts in a directory that holds packages named like trainguard's parts."""
    for pkg in ("schemas", service):
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("raise ImportError(\"the user's\")\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-m", f"trainguard.{service}", "--help"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage" in p.stdout, p.stderr[-2000:]


def test_a_failing_script_still_gets_the_buffers_of_its_open_files_written(tmp_path):
    """The failure path leaves without the interpreter's finalization (``spare._exit_now``);
    what finalization would have flushed (a file the script left open) is on disk anyway."""
    out = tmp_path / "metrics.txt"
    script = tmp_path / "train.py"
    script.write_text(f"f = open({str(out)!r}, 'w')\nf.write('last line\\n')\n"
                      "raise RuntimeError('boom')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "trainguard.launch.spare"], cwd=tmp_path, env=env,
                       input=json.dumps({"env": {"RANK": "0"}, "argv": [str(script)],
                                         "cwd": str(tmp_path)}) + "\n",
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 1, p.stderr[-2000:]
    assert out.read_text() == "last line\n"


def test_a_waiting_spare_ignores_ctrl_c_and_the_rank_it_becomes_does_not(tmp_path):
    """A Ctrl-C reaches the launcher's whole process group: a spare not yet assigned stays
    quiet (each printed a KeyboardInterrupt traceback: a user's trial), the rank it then
    becomes gets SIGINT as under torchrun (KeyboardInterrupt in the script)."""
    import signal
    import time

    out = tmp_path / "out.txt"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    import time; time.sleep(5)\n"
        f"    open({str(out)!r}, 'w').write('no interrupt')\n"
        "except KeyboardInterrupt:\n"
        f"    open({str(out)!r}, 'w').write('interrupted')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "trainguard.launch.spare"], cwd=tmp_path, env=env,
                         stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)  # while it warms up or waits
        time.sleep(0.5)
        assert p.poll() is None  # still a spare
        p.stdin.write(json.dumps({"env": {}, "argv": [str(script)], "cwd": str(tmp_path),
                                  "module": False}) + "\n")
        p.stdin.close()
        assert p.wait(100) == 0
        assert out.read_text() == "interrupted"
        assert "KeyboardInterrupt" not in p.stderr.read()
    finally:
        p.kill()

"""The warm spare (``python -m trainguard.spare``) started in a job directory that holds a
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


def test_a_schemas_folder_in_the_job_directory_does_not_shadow_trainguard(tmp_path):
    (tmp_path / "schemas" / "json").mkdir(parents=True)  # what `trainguard schemas` once wrote
    out = tmp_path / "out.json"
    script = tmp_path / "train.py"
    script.write_text(
        "import json, sys, schemas\n"
        "from schemas import DecodeError  # trainguard's; the folder has no such name\n"
        f"json.dump({{'schemas': schemas.__file__, 'argv': sys.argv[1:], "
        f"'path0': sys.path[0]}}, open({str(out)!r}, 'w'))\n")
    # no PYTHONPATH: trainguard comes from its installation (`make install`: editable), whose
    # import hook runs after the path scan, the case a folder in the working directory broke
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "trainguard.spare"], cwd=tmp_path, env=env,
                       input=json.dumps({"env": {}, "argv": [str(script), "--x", "1"],
                                         "cwd": str(tmp_path), "module": False}) + "\n",
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["schemas"] == os.path.join(ROOT, "schemas", "__init__.py")
    assert got["argv"] == ["--x", "1"] and got["path0"] == str(tmp_path)


def test_a_script_failing_at_start_prints_an_unlabelled_traceback(tmp_path):
    """The spare's warm-up group must not leave torch's "[rank0]:" traceback label behind: a
    rank whose script fails before trainguard.run would print it whatever its rank."""
    script = tmp_path / "train.py"
    script.write_text("raise RuntimeError('boom at start')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-m", "trainguard.spare"], cwd=tmp_path, env=env,
                       input=json.dumps({"env": {"RANK": "3"}, "argv": [str(script)],
                                         "cwd": str(tmp_path)}) + "\n",
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 1
    assert "RuntimeError: boom at start" in p.stderr
    assert "[rank" not in p.stderr, p.stderr[-2000:]


def test_unwrapping_rank_labels_keeps_the_programs_own_hook():
    import torch.distributed as dist

    from trainguard.rendezvous import unwrap_rank_excepthook

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
    """``python -m <service>`` (what ``trainguard up`` runs, in the user's directory) loads
    trainguard's own ``schemas`` even when the directory holds a ``schemas/`` folder."""
    (tmp_path / "schemas").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-m", service, "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage" in p.stdout, p.stderr[-2000:]

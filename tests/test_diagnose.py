"""``trainguard diagnose`` as a user runs it, on log files written for these tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "tests" / "fixtures" / "logs"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "diagnose", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_json_sigkill_cascade_names_the_killed_rank():
    p = run(str(LOGS / "torchrun_sigkill_cascade.log"), "--json")
    assert p.returncode == 0, p.stderr
    v = json.loads(p.stdout)
    assert set(v) >= {"fault_class", "layer", "culprit", "action", "confidence", "evidence"}
    assert v["culprit"]["ranks"] == [2]          # not the peers 1 and 3 that saw the reset
    assert v["fault_class"] == "oom_host"        # unexplained SIGKILL: the OOM killer's
    assert v["confidence"] == "low"
    assert any("Connection closed by peer" in e for e in v["evidence"])


def test_xid79_dmesg_and_text_output():
    p = run(str(LOGS / "dmesg_xid79.log"))
    assert p.returncode == 0
    assert "fault:      gpu_xid" in p.stdout and "layer:      hardware" in p.stdout
    assert "exclude_node_and_requeue" in p.stdout and "0000:4e:00" in p.stdout


def test_app_xids_across_processes_vs_once():
    many = json.loads(run(str(LOGS / "journal_app_xids.log"), "--json").stdout)
    once = json.loads(run(str(LOGS / "single_app_xid.log"), "--json").stdout)
    assert (many["layer"], many["action"]) == ("hardware", "exclude_node_and_requeue")
    assert many["culprit"]["nodes"] == ["gpu-host-7"]
    assert once["layer"] == "application"


def test_watchdog_hang_and_disk_full_from_several_files():
    v = json.loads(run(str(LOGS / "nccl_watchdog_hang.log"), "--json").stdout)
    assert v["fault_class"] == "hang" and v["culprit"]["ranks"] == [3]
    v = json.loads(run(str(LOGS / "nccl_watchdog_hang.log"), str(LOGS / "disk_full_save.log"),
                       "--json").stdout)
    assert v["fault_class"] == "filesystem" and v["layer"] == "infrastructure"


def test_clean_log_and_missing_file():
    p = run(str(LOGS / "clean_training.log"), "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["fault_class"] is None
    p = run(str(LOGS / "no_such_file.log"))
    assert p.returncode == 2 and "cannot read" in p.stderr


def test_trainguard_launch_log_names_the_rank_of_its_tag(tmp_path):
    """A saved ``trainguard launch`` log: every rank line carries ``[node rank r] ``."""
    log = tmp_path / "launch.log"
    log.write_text("[vm rank 0] step 40 loss 0.12\n"
                   "[vm rank 1] Traceback (most recent call last):\n"
                   '[vm rank 1]   File "train.py", line 20, in train\n'
                   "[vm rank 1] ValueError: bad batch shape (4, 3)\n")
    v = json.loads(run(str(log), "--json").stdout)
    assert v["fault_class"] == "app_exception" and v["culprit"]["ranks"] == [1]
    assert v["culprit"]["nodes"] == ["vm"]

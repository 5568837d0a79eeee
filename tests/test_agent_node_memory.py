"""A node that is a share of its host (``agents.host.NodeMemory``), measured on real processes:
the anonymous resident memory of the processes started for the node, against its budget; and
the fill process of the demo (``trainguard.demo.fill``) that stops by itself."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from trainguard.agents.host import HostSampler, NodeMemory
from trainguard.agents.nvml import NvmlSampler, load_module

MiB = 2**20


def _wait(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return pred()


def test_the_nodes_processes_are_measured_against_its_budget(tmp_path):
    node = f"memtest-{os.getpid()}"
    mem = NodeMemory(node, str(tmp_path / "budget"))
    assert mem.used_bytes() == 0 and mem.budget_bytes() is None  # nothing started for it yet
    fill = subprocess.Popen([sys.executable, "-m", "trainguard.demo.fill", "--mb", "64",
                             "--rate", "256", "--hold", "30", "--max-s", "30"],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TG_NODE": node})
    other = subprocess.Popen([sys.executable, "-m", "trainguard.demo.fill", "--mb", "64",
                              "--rate", "256", "--hold", "30", "--max-s", "30"],
                             stdout=subprocess.DEVNULL, env={**os.environ, "TG_NODE": "elsewhere"})
    try:
        # the 64 MiB it wrote are resident and counted; the other node's 64 MiB are not
        used = _wait(lambda: (u := mem.used_bytes()) >= 64 * MiB and u)
        assert 64 * MiB <= used < 120 * MiB, used / MiB
        (tmp_path / "budget").write_text(str(200 * MiB))
        s = HostSampler(mem).sample()
        assert s.mem_total_bytes == 200 * MiB and 64 * MiB <= s.mem_used_bytes < 120 * MiB
    finally:
        fill.kill(), other.kill()
        fill.wait(), other.wait()
    assert _wait(lambda: mem.used_bytes() < 8 * MiB)  # gone with its process
    (tmp_path / "budget").write_text("not a number")
    assert mem.budget_bytes() is None


def test_the_fill_stops_by_itself_and_is_bounded():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "trainguard.demo.fill", "--mb", "16",
                          "--rate", "64", "--hold", "0.5", "--max-s", "20"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "16 MiB" in out.stdout, out
    assert time.monotonic() - t0 < 20
    bad = subprocess.run([sys.executable, "-m", "trainguard.demo.fill", "--mb", "100000"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--mb must be" in bad.stderr


def test_the_simulated_gpu_of_a_node_counts_corrected_errors_once_told(tmp_path, monkeypatch):
    from trainguard.demo import fake_pynvml

    monkeypatch.setenv(fake_pynvml.STATE_DIR_ENV, str(tmp_path))
    s = NvmlSampler(module=load_module("trainguard.demo.fake_pynvml:for_node", "node7"))
    assert s.open()
    (g,) = s.sample()
    assert g.ecc_volatile_corrected == 0 and g.clock_event_names == ["sw_power_cap"]
    fake_pynvml.set_ecc_rate(str(tmp_path), "node7", 100.0)
    assert _wait(lambda: s.sample()[0].ecc_volatile_corrected >= 10, 5)
    fake_pynvml.set_ecc_rate(str(tmp_path), "node7", 0.0)
    n = s.sample()[0].ecc_volatile_corrected
    time.sleep(0.2)
    assert s.sample()[0].ecc_volatile_corrected == n  # stopped rising, never went back
    s.close()
    with pytest.raises(ValueError, match="cannot import"):
        load_module("no_such_module_here:f", "node7")

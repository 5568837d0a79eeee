"""Multi-process gloo jobs: a checkpoint saved by 2 ranks restores on 1, 2 and 3 ranks, for
DDP and FSDP2 (``fully_shard``); a writer killed mid-save never yields a restorable checkpoint."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainguard.checkpoint import format as fmt
from trainguard.stack.process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(mode: str, wrap: str, world: int, root: str, out: str, job: str, **kw) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    extra = [f"--{k}={v}" for k, v in kw.items()]
    procs = [subprocess.Popen([sys.executable, "-m", "trainguard.checkpoint._harness",
                               "--mode", mode, "--wrap", wrap, "--rank", str(r), "--world",
                               str(world), "--port", str(port), "--root", root, "--out", out,
                               "--job", f"{job}-{mode}-w{world}", *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    bad = [f"rank {r} exit {p.returncode}:\n{o[-2500:]}" for r, (p, o) in
           enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not bad, "\n".join(bad)


def _same(ref: dict, got: dict) -> None:
    assert ref["model"].keys() == got["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    assert ref["optim"]["state"].keys() == got["optim"]["state"].keys()
    for k, st in ref["optim"]["state"].items():
        for kk, v in st.items():
            assert torch.equal(v, got["optim"]["state"][k][kk]), (k, kk)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_reshard_2_to_1_and_3(tmp_path, wrap):
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    _job("save", wrap, 2, root, out, wrap, steps=4, every=2)
    ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
    assert ref["stats"]["saves"] == 3 and ref["stats"]["failed"] == 0
    path = os.path.join(root, fmt.checkpoint_name(3, 0))
    man = fmt.read_manifest(path)
    assert man["world_size"] == 2
    assert {f["name"] for f in man["files"]} == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    from trainguard.checkpoint_validator.validate import validate_checkpoint

    assert validate_checkpoint(path).ok
    for world in (1, 3):
        _job("restore", wrap if world > 1 else "plain", world, root, out, wrap)
        got = torch.load(os.path.join(out, f"restored_w{world}.pt"), weights_only=False)
        assert got["next"] == 4 and got["source"] == "disk", got["reason"]
        _same(ref, got)


def test_killed_writer_leaves_no_restorable_partial(tmp_path):
    """SIGKILL the coordinator's writer while it waits for a shard that never comes: the
    temporary directory is never taken for a checkpoint."""
    import signal
    import time

    import torch.nn as nn

    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    root = str(tmp_path / "ckpt")
    m = nn.Linear(8, 8)
    c = Checkpointer(m, None, config=CheckpointConfig(root=root, commit_timeout_s=30),
                     job="kill-writer", rank=0, world_size=1)
    c.save(1)
    c.wait(30)
    # tell the writer it is rank 0 of a 2-rank world (torch.distributed is not initialised, so
    # planning stays local): the commit waits for rank 1's shard, which never comes
    c.world_size = 2
    assert c.save(2)
    time.sleep(0.3)
    pid = c.resources.writer.proc.pid
    os.kill(pid, signal.SIGKILL)
    assert c.wait(10)
    assert c.stats["failed"] == 1 and "died" in c.stats["last_error"]
    tmps = [n for n in os.listdir(root) if n.startswith(".tmp-")]
    assert tmps, "the killed save should have left its temporary directory"
    c.world_size = 1
    m2 = nn.Linear(8, 8)
    c2 = Checkpointer(m2, None, config=CheckpointConfig(root=root), job="kill-writer-r",
                      rank=0, world_size=1)
    assert c2.restore() == 2 and c2.restored_step == 1
    assert torch.equal(m2.weight, m.weight)
    c.finalize()

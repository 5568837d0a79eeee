"""save()'s agreement exchange between real gloo ranks: one collective when every rank's
message is small, and the same answer through all_gather_object when one rank's is not."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainguard.stack.process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)

RANK = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from trainguard.checkpoint.collectives import all_gather_small
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
small = all_gather_small({"rank": rank, "byte_lens": [rank, 7]}, group, 2)
big = all_gather_small({"rank": rank, "pad": "x" * (5000 if rank == 1 else 0)}, group, 2)
if rank == 0:
    json.dump({"small": small, "big": [[b["rank"], len(b["pad"])] for b in big]},
              open(out + "/agree.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_agreement_small_and_overflow(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(tmp_path)],
                              env=env) for r in range(2)]
    assert [p.wait(100) for p in procs] == [0, 0]
    got = json.loads((tmp_path / "agree.json").read_text())
    assert got["small"] == [{"rank": 0, "byte_lens": [0, 7]}, {"rank": 1, "byte_lens": [1, 7]}]
    assert got["big"] == [[0, 0], [1, 5000]]


OVERLAP = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
import trainguard.checkpoint.checkpointer as ckmod
import trainguard.checkpoint.session as sessmod
from trainguard.checkpoint import CheckpointConfig, Checkpointer, collectives
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(rank)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
events = []  # the order of: the agreement started, the staging copy, the agreement awaited
start, wait, copy = (collectives.start_all_gather_small, collectives.PendingGather.wait,
                     ckmod.copy_state)
def start_(*a, **k):
    events.append("start")
    return start(*a, **k)
def wait_(self):
    events.append("wait")
    return wait(self)
def copy_(*a, **k):
    events.append("copy")
    return copy(*a, **k)
collectives.start_all_gather_small, collectives.PendingGather.wait = start_, wait_
ckmod.copy_state = sessmod.copy_state = copy_
def model_of(n):
    m = torch.nn.Module()
    for i in range(n):  # rank-specific keys: each rank owns its tensors (shards)
        m.register_parameter(f"r{rank}_p{i}", torch.nn.Parameter(torch.randn(1000 + 17 * i)))
    return m
shm = os.path.join(out, f"shm{rank}")
os.makedirs(shm, exist_ok=True)
cfg = CheckpointConfig(root=os.path.join(out, "ckpt"), certify=False, shm_dir=shm)
model = model_of(2)
ck = Checkpointer(model, None, config=cfg, job="overlap", rank=rank, world_size=2, group=group)
log = {}
for step in (1, 2, 3):
    if step == 3 and rank == 1:  # one rank's state changes structure: a new plan for all
        model.register_parameter("r1_extra", torch.nn.Parameter(torch.randn(333)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    events.clear()
    assert ck.save(step)
    assert ck.wait(60)
    log[step] = list(events)
want = {k: v.detach().clone() for k, v in model.state_dict().items()}
ck.finalize()
fresh = model_of(2)
if rank == 1:
    fresh.register_parameter("r1_extra", torch.nn.Parameter(torch.zeros(333)))
ck2 = Checkpointer(fresh, None, config=cfg, job="overlap-r", rank=rank, world_size=2,
                   group=group)
nxt = ck2.restore()
same = all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
json.dump({"events": log, "next": nxt, "same": same, "source": ck2.restore_source,
           "committed": ck.stats["committed"]}, open(os.path.join(out, f"r{rank}.json"), "w"))
ck2.finalize()
dist.barrier()
dist.destroy_process_group()
"""


def test_staging_copy_runs_while_the_agreement_is_in_flight(tmp_path):
    """From the second save on, a rank copies its state into the staging buffer between
    starting the save agreement and awaiting it; when another rank's state changed structure,
    the rank whose own did not stages again under the new plan, and the checkpoint restores
    every rank's exact values."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("TG_CKPT_WRITER", None)
    procs = [subprocess.Popen([sys.executable, "-c", OVERLAP, str(r), str(port), str(tmp_path)],
                              env=env) for r in range(2)]
    assert [p.wait(110) for p in procs] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["events"]["2"] == ["start", "copy", "wait"]
        assert r["next"] == 4 and r["same"], r
    assert r0["committed"] == 3
    # step 3: rank 0 staged during the agreement, then again under rank 1's new plan; rank 1
    # (its own plan changed) staged only after it
    assert r0["events"]["3"][:3] == ["start", "copy", "wait"]
    assert r0["events"]["3"].count("copy") == 2
    assert r1["events"]["3"][:2] == ["start", "wait"] and r1["events"]["3"].count("copy") == 1

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

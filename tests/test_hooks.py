"""trainguard's hooks in a rank whose script never calls ``trainguard.run``: a real spare process
runs a plain DDP script; its heartbeats, step counts, rendezvous keys and fault report are read
back from a real NATS and a real TCPStore."""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys

import pytest

from trainguard.rank.hooks import store_prefix

pytestmark = pytest.mark.timeout(150)

SCRIPT = r'''
import os, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import trainguard.rank.hooks as hooks
assert hooks.active() and hooks.restart_count() == 2
hooks.restored(41)                                    # a framework restored its checkpoint
from torch.distributed import rendezvous              # the env:// handler init_process_group uses
store, _, _ = next(rendezvous("env://", rank=0, world_size=1))
store.set("probe", "1")
dist.init_process_group("gloo")                       # env://, as a torchrun script does
net = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); net(torch.ones(2, 4)).sum().backward(); opt.step()
time.sleep(0.5)
dist.all_reduce(torch.ones(1))                        # the script's own collectives count
dist.all_reduce(torch.ones(1), async_op=True).wait()
net2 = DDP(torch.nn.Linear(4, 1))                     # a comm hook of the script's own
seen = []
def my_hook(state, bucket):
    seen.append(state)
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])
net2.register_comm_hook("mine", my_hook)
net2(torch.ones(2, 4)).sum().backward()
assert seen == ["mine"], seen
time.sleep(0.5)
hooks.expect_framework_steps()                        # a framework callback's setup
opt.zero_grad(); net(torch.ones(2, 4)).sum().backward(); opt.step()
time.sleep(0.5)
hooks.report(step=100, loss=0.25)                     # a framework's own global step
time.sleep(0.5)
raise ValueError("boom in the plain script")
'''


def test_plain_script_progress_rendezvous_and_fault(tmp_path, servers):
    import torch.distributed as dist

    from trainguard import schemas
    from trainguard.clients.bus import Bus

    master = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=30))
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    env = {"TG_JOB": "hooks", "TG_GENERATION": "3", "TG_ATTEMPT": "1", "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(master.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "2", "NATS_URL": servers.nats_url,
           "TG_HEARTBEAT_INTERVAL_S": "0.05", "TG_DECISION_ID": "d1"}
    got: list = []

    async def run() -> subprocess.CompletedProcess:
        bus = await Bus(servers.nats_url, "test-hooks").connect()
        await bus.subscribe("tg.job.hooks.>", lambda s, ev: got.append(ev))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trainguard.launch.spare", cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = json.dumps({"env": env, "argv": [str(script)], "cwd": str(tmp_path)}) + "\n"
        out, err = await asyncio.wait_for(proc.communicate(line.encode()), 120)
        await asyncio.sleep(0.3)
        await bus.close()
        return subprocess.CompletedProcess([], proc.returncode, out, err)

    p = asyncio.run(run())
    assert p.returncode == 1, p.stderr.decode()[-3000:]
    assert b"boom in the plain script" in p.stderr
    # the store keys of this group live under its generation's prefix
    assert store_prefix(env) == "hooks/g3/a1"
    assert master.get("hooks/g3/a1/probe") == b"1" and not master.check(["probe"])
    hbs = [e for e in got if isinstance(e, schemas.RankHeartbeat)]
    steps = [h.step for h in hbs]
    assert hbs and all(h.generation == 3 and h.rank == 0 for h in hbs)
    assert all(h.phase == "startup" for h in hbs if h.step == -1)  # before the first step
    # optimizer-hook count, on from the restored step 41 (0-based), then the framework's
    assert 44 in steps and 100 in steps
    at2 = next(h for h in hbs if h.step == 44)
    # collectives entered and completed: one gradient bucket per step
    assert at2.phase == "train" and (at2.collective_seq, at2.collectives_completed) == (3, 3)
    assert at2.compute_s is not None and at2.compute_s >= 0
    # + a sync and an async all_reduce, + the script's own comm hook's all_reduce
    at_step2 = {(h.collective_seq, h.collectives_completed) for h in hbs if h.step == 44}
    assert (6, 6) in at_step2 and max(at_step2) == (7, 7), at_step2
    assert next(h for h in hbs if h.step == 100).loss == 0.25
    # once a framework reports steps, an optimizer step only advances the collective count
    assert max(h.collective_seq for h in hbs if h.step == 44) == 7
    assert 45 not in steps
    resumed = [e for e in got if isinstance(e, schemas.TrainingResumed)]
    assert len(resumed) == 1 and resumed[0].resumed_step == 42
    assert resumed[0].restored_step == 41  # as the framework said (else -1: unknown)
    assert resumed[0].restore_source == "script" and resumed[0].decision_id == "d1"
    faults = [e for e in got if isinstance(e, schemas.LogLine) and e.stream == "exception"]
    assert len(faults) == 1 and "ValueError: boom in the plain script" in faults[0].line
    assert faults[0].step == 100 and faults[0].generation == 3

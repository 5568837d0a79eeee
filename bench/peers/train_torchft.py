"""The benchmark job under torchft (0.2.0): one replica group per rank, each replica group a
one-process torchrun with restarts (torchft's usage: every replica group is kept alive by its own
launcher), a lighthouse forms a quorum every step, a restarted replica fetches the live state from
a healthy peer, the quorum goes on without a dead or hung one.

The progress record's rank is the replica group id and its world size the number of replicas
in the step's quorum: after a fault, "every rank trained again" means every member of the new,
smaller quorum committed a step (torchft trains on without the failed replica; a restarted one
rejoins later). The demo model's global batch is
split over the 4 replica groups by ``REPLICA_GROUP_ID``. Rank 0 of the quorum saves a
``torch.save`` checkpoint (model, optimizer, manager state) every ``--ckpt-every`` steps; a
(re)started replica loads it, then torchft brings it to the quorum's step.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import Faults, Progress  # noqa: E402
from trainguard.demo import model as M  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--pg-timeout", type=float, default=10.0,
                   help="torchft Manager timeout (collectives, commit), s (its default is 60)")
    p.add_argument("--faults", default="[]")
    return p.parse_args(argv)


def main(argv=None) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel as FTDDP

    logging.basicConfig(level=logging.WARNING)
    args = parse(argv)
    torch.set_num_threads(1)
    gid = int(os.environ["REPLICA_GROUP_ID"])
    ngroups = int(os.environ["NUM_REPLICA_GROUPS"])
    inc = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.getpid()}"
    progress = Progress()
    faults = Faults(args.faults, args.ckpt_dir, progress)
    data = M.load(args.seed)
    model = M.build(args.seed)
    opt = M.optimizer(model)
    timeout = datetime.timedelta(seconds=args.pg_timeout)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=2,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_{gid}", timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=60))
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt")
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, weights_only=False)
        load_state_dict(sd["user"])
        manager.load_state_dict(sd["torchft"])
    net = FTDDP(manager, model)
    loss_fn = nn.CrossEntropyLoss()
    while manager.current_step() < args.steps:
        step = manager.current_step()
        manager.start_quorum()
        opt.zero_grad()
        x, y = M.batch(data, args.seed, step, gid, ngroups)
        loss = loss_fn(net(x), y)
        loss.backward()
        faults.before_optimizer(gid, step)
        if manager.should_commit():
            opt.step()
            prank = manager.participating_rank()
            if prank is not None:
                progress.step(gid, step, loss.item(), inc, manager.num_participants())
            if prank == 0 and step > 0 and step % args.ckpt_every == 0:
                tmp = f"{ckpt}.tmp{os.getpid()}"
                torch.save({"user": state_dict(), "torchft": manager.state_dict()}, tmp)
                os.replace(tmp, ckpt)
        sleep = args.step_sleep + faults.extra_sleep(gid, step, args.step_sleep)
        time.sleep(sleep)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()

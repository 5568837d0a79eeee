"""The benchmark job as a plain torch.distributed script: the trainguard demo model (digits MLP,
``trainguard.demo.model``), DDP over gloo, a ``torch.save`` checkpoint by rank 0 every
``--ckpt-every`` steps, resume from it on start. Run by torchrun (``--max-restarts``), by the
full-restart baseline (the benchmark starts every rank itself) and by NVRx's ``ft_launcher``
(``--nvrx``: the rank also sends NVRx heartbeats every step, its documented usage).

Environment: torchrun's contract (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
``BENCH_PROGRESS`` (progress file, see ``common.py``), ``BENCH_INCARNATION`` (optional; else
torchrun's ``TORCHELASTIC_RESTART_COUNT``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from common import Faults, Progress, load_checkpoint, save_checkpoint  # noqa: E402
from trainguard.demo import model as M  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--step-sleep", type=float, default=0.02, help="seconds per step")
    p.add_argument("--pg-timeout", type=float, default=10.0,
                   help="collective timeout in seconds (torch's default is 1800)")
    p.add_argument("--faults", default="[]", help="JSON fault schedule (exception, straggler)")
    p.add_argument("--nvrx", action="store_true", help="send NVRx ft_launcher heartbeats")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = os.environ.get("BENCH_INCARNATION") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    inc = f"{inc}.{os.getpid()}"
    progress = Progress()
    faults = Faults(args.faults, args.ckpt_dir, progress)
    monitor = None
    if args.nvrx:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        monitor = RankMonitorClient()
        monitor.init_workload_monitoring()
    # A long timeout for forming the group (ranks start at different times on a loaded machine),
    # then the short one for the collectives (a short init timeout also bounds the rendezvous).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=args.pg_timeout))
    data = M.load(args.seed)
    model = M.build(args.seed)
    opt = M.optimizer(model)
    ckpt = os.path.join(args.ckpt_dir, "ckpt.pt")
    start = load_checkpoint(ckpt, model, opt)
    net = DDP(model)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, args.steps):
        x, y = M.batch(data, args.seed, step, rank, world)
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        faults.before_optimizer(rank, step)
        opt.step()
        progress.step(rank, step, loss.item(), inc, world)
        if monitor is not None:
            monitor.send_heartbeat()
        if rank == 0 and step > 0 and step % args.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step)
        sleep = args.step_sleep + faults.extra_sleep(rank, step, args.step_sleep)
        if sleep:
            time.sleep(sleep)
    dist.barrier()
    if monitor is not None:
        monitor.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The demo training script, run in every rank by ``trainguard launch``.

    trainguard launch ... trainguard/demo/train.py --steps 600 --seed 0 --run-dir DIR

Faults to raise from inside a rank come from ``--faults`` (JSON list of
``{"kind": "exception", "rank": R, "step": S, "id": N}``); each fires once: its marker file
``<run-dir>/fault-<id>.injected`` (holding the Unix ns of injection) is written before raising.
``"message"`` replaces the exception's text (independent faults fail with different errors).
With ``"repeat": true`` it fires at that step every time (to exercise loop detection).
``"phase"`` says where in the step it raises: ``"backward"`` (after the backward pass, the
default for a one-off fault: the other ranks complete the step, so a recovery from their state
moves past it) or ``"forward"`` (before the forward pass, the default with ``repeat``: no rank
completes the step, so it runs again after recovery — a deterministic bug in that step's data
fails again, which is what loop detection must catch).
``--dropout P`` adds dropout (masks from torch's global generator, which recovery restores);
``--loss-log`` appends ``<step> <loss as float.hex>`` per completed step to
``<run-dir>/losses-r<rank>.txt`` (to compare a run with faults against a fault-free one).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard
from trainguard.demo import model as M


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.01)
    p.add_argument("--run-dir", default=".")
    p.add_argument("--faults", default="[]")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--loss-log", action="store_true")
    return p.parse_args(argv)


class InjectedFault(RuntimeError):
    """The demo's injected Python exception."""


def maybe_raise(args, faults, ctx, step: int, phase: str) -> None:
    for f in faults:
        if f["kind"] != "exception" or f["rank"] != ctx.rank or f["step"] != step:
            continue
        if f.get("phase", "forward" if f.get("repeat") else "backward") != phase:
            continue
        marker = os.path.join(args.run_dir, f"fault-{f['id']}.injected")
        if os.path.exists(marker) and not f.get("repeat"):
            continue
        with open(marker, "w") as fh:
            fh.write(str(time.time_ns()))
        raise InjectedFault(f.get("message")
                            or f"injected exception in rank {ctx.rank} at step {step}")


def main(argv=None) -> None:
    args = parse(argv)
    faults = json.loads(args.faults)
    torch.set_num_threads(1)
    data = M.load(args.seed)

    def train(ctx: trainguard.Context) -> None:
        model = M.build(args.seed, args.dropout)
        opt = M.optimizer(model)
        ckpt = ctx.checkpointer(model, opt)
        start = ckpt.restore()  # before DDP: DDP then broadcasts rank 0's restored weights
        net = ctx.ddp(model)
        loss_fn = nn.CrossEntropyLoss()
        slow_flag = os.path.join(args.run_dir, f"slow-{ctx.node}-{ctx.local_rank}")
        for step in range(start, args.steps):
            t_step = time.monotonic()
            x, y = M.batch(data, args.seed, step, ctx.rank, ctx.world_size)
            opt.zero_grad()
            maybe_raise(args, faults, ctx, step, "forward")
            loss = loss_fn(net(x), y)
            loss.backward()
            maybe_raise(args, faults, ctx, step, "backward")
            opt.step()
            if args.loss_log:
                with open(os.path.join(args.run_dir, f"losses-r{ctx.rank}.txt"), "a") as fh:
                    fh.write(f"{step} {loss.item().hex()}\n")
            ctx.progress(step, loss=loss.item())
            if step % args.ckpt_every == 0 and step > 0:
                ckpt.save(step, loss=loss.item())
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if os.path.exists(slow_flag):  # injected straggler: this rank runs `factor`× slower
                factor = float(open(slow_flag).read() or 3)
                time.sleep((factor - 1) * (time.monotonic() - t_step))
        ckpt.wait()
        if ctx.rank == 0:
            result = {"accuracy": M.accuracy(model, data), "steps": args.steps,
                      "world_size": ctx.world_size, "generation": ctx.generation}
            with open(os.path.join(args.run_dir, "result.json"), "w") as fh:
                json.dump(result, fh)
        if dist.is_initialized():
            dist.barrier()

    trainguard.run(train)


if __name__ == "__main__":
    main()

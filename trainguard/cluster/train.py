"""The training job of the cluster harness, run in every rank by ``trainguard launch``.

    trainguard launch … trainguard/cluster/train.py --steps 400 --records DIR

A small MLP trained with DDP over gloo on data that is a function of the step and the rank
(``--batch`` samples a step: 256 keeps the loss of the step after a restore within the
checkpointer's post-recovery loss check, ±50 %, of the loss saved; with 8 it was off by up
to 141 % between neighbouring steps and ranks, and a correct restore from disk was taken for
a corrupt checkpoint and stopped the job), a checkpoint every ``--ckpt-every`` steps through
``ctx.checkpointer``. Every completed step
appends one JSON line to ``<records>/steps.jsonl`` (``O_APPEND``, one write per line):
``{"t": Unix s, "rank", "world", "gen", "step", "host": the host name, "pid"}``; the first step
of each generation also carries ``"peers"``: the remote ``address:port`` of every TCP socket
this process has open (its gloo pairs, NATS, the rendezvous store), read from the process's own
``/proc/net/tcp``: what the tests check to see that ranks talk over the bridge, not loopback.
Rank 0 writes ``<records>/done.json`` at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time

import torch
from torch import nn

import trainguard


def tcp_peers() -> list[str]:
    """``ip:port`` of the remote end of each established TCP (IPv4) socket of this process."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    out = []
    with open("/proc/self/net/tcp") as fh:
        next(fh)
        for line in fh:
            f = line.split()
            if f[3] != "01" or f[9] not in mine:  # 01: ESTABLISHED
                continue
            ip_hex, port_hex = f[2].split(":")
            ip = socket.inet_ntoa(struct.pack("<I", int(ip_hex, 16)))
            out.append(f"{ip}:{int(port_hex, 16)}")
    return sorted(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--records", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.records, exist_ok=True)
    path = os.path.join(args.records, "steps.jsonl")
    host = socket.gethostname()

    def record(rec: dict) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    def train(ctx: trainguard.Context) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ckpt = ctx.checkpointer(model, opt)
        start = ckpt.restore()
        net = ctx.ddp(model)
        first = True
        for step in range(start, args.steps):
            g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
            x = torch.randn(args.batch, 16, generator=g)
            loss = (net(x) - x[:, :1]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.progress(step, loss=float(loss))
            rec = {"t": time.time(), "rank": ctx.rank, "world": ctx.world_size,
                   "gen": ctx.generation, "step": step, "host": host, "pid": os.getpid()}
            if first:
                rec["peers"] = tcp_peers()
                first = False
            record(rec)
            if step % args.ckpt_every == 0 and step > 0:
                ckpt.save(step, loss=float(loss))
            time.sleep(args.step_sleep)
        ckpt.wait()
        if ctx.rank == 0:
            with open(os.path.join(args.records, "done.json"), "w") as fh:
                json.dump({"steps": args.steps, "world": ctx.world_size,
                           "gen": ctx.generation}, fh)

    trainguard.run(train)


if __name__ == "__main__":
    main()

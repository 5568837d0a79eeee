"""What counting collectives costs an unmodified script (``trainguard.rank.hooks``).

    python bench/collective_counting.py [--n 20000] [--steps 300]

One process, a gloo group of one rank (the collective itself is then as cheap as gloo gets, so
the figure is the wrapper's cost, not hidden by the network):

* ``dist.all_reduce`` of one float, ``--n`` times, through torch's own function and through
  the counting wrapper the hooks install: µs per call each and the difference;
* a DDP training step of a small MLP (several gradient buckets), ``--steps`` steps, with DDP's
  built-in allreduce and with the counting communication hook: µs per step and per bucket.

Prints the figures; the README's table quotes them. Nothing is asserted here.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, n: int) -> float:
    """Mean seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _pair(a, b, n: int, rounds: int = 7) -> tuple[float, float]:
    """Fastest of ``rounds`` interleaved rounds of ``a`` and ``b`` (a shared, noisy host: the
    minimum is the cost without interference)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_time(a, n))
        tb.append(_time(b, n))
    return min(ta), min(tb)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", TG_JOB="bench-counting")
    os.environ.pop("NATS_URL", None)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.rank import hooks

    torch.set_num_threads(1)
    plain_ddp = DDP.__init__
    hooks.install()
    dist.init_process_group("gloo")
    t = torch.ones(1)
    raw = hooks._ORIGINAL["all_reduce"]
    wrapped = dist.all_reduce
    t_raw, t_wrap = _pair(lambda: raw(t), lambda: wrapped(t), args.n)
    p_ = hooks._RT.p
    assert p_.collective_seq == p_.collectives_completed == 7 * args.n, (
        p_.collective_seq, p_.collectives_completed)

    def ddp_step(net, opt, x, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    def ddp(counting: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        if counting:
            net = DDP(model, bucket_cap_mb=0.3)
        else:
            net = DDP.__new__(DDP)
            plain_ddp(net, model, bucket_cap_mb=0.3)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        x, y = torch.randn(32, 256), torch.randn(32, 256)
        for _ in range(10):
            ddp_step(net, opt, x, y)
        return lambda: ddp_step(net, opt, x, y)

    plain, counting = ddp(False), ddp(True)
    before = p_.collective_seq
    d_plain, d_count = _pair(plain, counting, args.steps)
    buckets = (p_.collective_seq - before) // (7 * args.steps)
    dist.destroy_process_group()
    print(f"dist.all_reduce (1 float, gloo, 1 rank): torch {t_raw * 1e6:.1f} µs, counted "
          f"{t_wrap * 1e6:.1f} µs per call: +{(t_wrap - t_raw) * 1e6:.2f} µs per collective")
    print(f"DDP step (8 x Linear(256, 256), {buckets} buckets): built-in allreduce "
          f"{d_plain * 1e6:.0f} µs, counting hook {d_count * 1e6:.0f} µs per step: "
          f"{(d_count - d_plain) * 1e6 / max(1, buckets):+.1f} µs per bucket")
    hooks.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

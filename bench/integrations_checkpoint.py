"""How long Lightning's checkpoint writers make the training loop wait: Lightning's default
``TorchCheckpointIO``, its ``AsyncCheckpointIO`` (clone, then ``torch.save`` in a thread) and
trainguard's ``TrainguardCheckpointIO`` (stage into reused host buffers, then write + fsync +
checksum + atomic rename in a thread), on the checkpoint dict of a model trained with AdamW
(weights + two moment buffers, ``--mb`` MB in all).

Per writer: the median over ``--repeats`` saves of the time ``save_checkpoint`` blocks and of
the time until the file is written (``teardown()`` returned; only trainguard's is fsynced).
Then how much a training step slows while a background write runs (steps of a small MLP on
the same cores). ``--json`` prints the figures as JSON.

usage: python bench/integrations_checkpoint.py [--mb 200] [--repeats 5] [--dir DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch


def state(mb: int) -> dict:
    n = int(mb * 1e6 / 4 / 3)  # params + exp_avg + exp_avg_sq, float32
    width = 1024
    layers = max(1, n // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"epoch": 0, "global_step": 100, "pytorch-lightning_version": "2",
            "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [], "loops": {"fit_loop": {"epoch_progress": {"total": 1}}}}


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def measure(make, st: dict, d: str, repeats: int) -> dict:
    io = make()
    blocking, total = [], []
    for i in range(repeats + 1):
        p = os.path.join(d, f"bench-{i % 2}.ckpt")
        t0 = time.perf_counter()
        io.save_checkpoint(st, p)
        t1 = time.perf_counter()
        io.teardown()
        t2 = time.perf_counter()
        if i:  # the first save allocates staging buffers / starts threads
            blocking.append(t1 - t0)
            total.append(t2 - t0)
    return {"blocking_s": statistics.median(blocking), "until_written_s": statistics.median(total),
            "first_blocking_s": None}


def step_slowdown(make, st: dict, d: str) -> dict:
    """Median step time of a small MLP alone and while ``make()`` writes in the background."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(64, 512)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(20):
        step()
    alone = statistics.median(step() for _ in range(60))
    io = make()
    io.save_checkpoint(st, os.path.join(d, "warm.ckpt"))
    io.teardown()
    done = threading.Event()
    times: list[float] = []
    io.save_checkpoint(st, os.path.join(d, "bg.ckpt"))
    threading.Thread(target=lambda: (io.teardown(), done.set()), daemon=True).start()
    while not done.is_set():
        times.append(step())
    during = statistics.median(times) if times else float("nan")
    return {"step_alone_s": alone, "step_during_write_s": during, "steps_during_write": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
    import provenance

    load0 = provenance.loadavg()
    torch.set_num_threads(1)
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from trainguard.integrations.lightning import TrainguardCheckpointIO

    writers = {"TorchCheckpointIO (Lightning default)": TorchCheckpointIO,
               "AsyncCheckpointIO (Lightning)": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
               "TrainguardCheckpointIO": TrainguardCheckpointIO}
    st = state(a.mb)
    out = {"state_mb": round(nbytes(st) / 1e6, 1), "writers": {}}
    with tempfile.TemporaryDirectory(dir=a.dir or None) as d:
        for name, make in writers.items():
            out["writers"][name] = measure(make, st, d, a.repeats)
            out["writers"][name].pop("first_blocking_s")
        for name in ("AsyncCheckpointIO (Lightning)", "TrainguardCheckpointIO"):
            out["writers"][name].update(step_slowdown(writers[name], st, d))
    out["provenance"] = provenance.record(load0)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"checkpoint dict: {out['state_mb']} MB (weights + AdamW moments)")
    print(f"{'writer':40} {'blocking':>10} {'written':>10}  fsync")
    for name, r in out["writers"].items():
        print(f"{name:40} {r['blocking_s']:9.3f}s {r['until_written_s']:9.3f}s  "
              f"{'yes' if name.startswith('Trainguard') else 'no'}")
        if "step_alone_s" in r:
            print(f"{'':40} step {r['step_alone_s'] * 1e3:.1f} ms alone, "
                  f"{r['step_during_write_s'] * 1e3:.1f} ms during the write")


if __name__ == "__main__":
    main()

"""A small multi-rank training job for the checkpoint tests and benches (not a public API).

``python -m trainguard.checkpoint._harness --mode save|restore --wrap plain|ddp|fsdp
--rank R --world W --port P --root DIR --job J --out DIR [--steps N --every K --hidden H]``

Ranks form a gloo training group (TCP store on ``127.0.0.1:P``) and a separate gloo group for
checkpoint collectives. ``save`` trains ``steps`` steps on deterministic data, saves every
``every`` steps and at the last step, and rank 0 writes the full (gathered) model and optimizer
state of the last step to ``out/ref.pt``. ``restore`` builds the model from another seed,
restores, and rank 0 writes the full state plus what restore reported to
``out/restored_w<W>.pt``.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def build(wrap: str, hidden: int, world: int, seed: int):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
              torch.nn.ReLU(), torch.nn.Linear(hidden, 8)]
    model: torch.nn.Module = torch.nn.Sequential(*layers)
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    elif wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def step_fn(model, opt, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    return {"model": {k: v.clone() for k, v in msd.items()},
            "optim": {"state": {k: {kk: vv.clone() for kk, vv in v.items()}
                                for k, v in osd.get("state", {}).items()}}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("save", "restore"), required=True)
    p.add_argument("--wrap", choices=("plain", "ddp", "fsdp"), default="ddp")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--job", default="harness")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    from trainguard.checkpoint import CheckpointConfig, Checkpointer

    group = None
    if a.world > 1:
        store = dist.TCPStore("127.0.0.1", a.port, a.world, a.rank == 0, timeout=__import__(
            "datetime").timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world)
        group = dist.new_group(backend="gloo")
    model, opt = build(a.wrap, a.hidden, a.world, seed=0 if a.mode == "save" else 1234)
    ckpt = Checkpointer(model, opt, config=CheckpointConfig(root=a.root), job=a.job,
                        rank=a.rank, world_size=a.world, group=group)
    if a.mode == "save":
        start = ckpt.restore()
        assert start == 0, "harness save mode expects an empty root"
        for s in range(a.steps):
            loss = step_fn(model, opt, s, a.rank)
            if s % a.every == 0 or s == a.steps - 1:
                ckpt.save(s, loss=loss)
        ckpt.wait(60)
        ref = full_state(model, opt)
        if a.rank == 0:
            torch.save({**ref, "stats": ckpt.stats}, os.path.join(a.out, "ref.pt"))
    else:
        nxt = ckpt.restore()
        got = full_state(model, opt)
        if a.rank == 0:
            torch.save({**got, "next": nxt, "source": ckpt.restore_source,
                        "reason": ckpt.restore_reason, "loss": ckpt.restored_loss},
                       os.path.join(a.out, f"restored_w{a.world}.pt"))
    if dist.is_initialized():
        dist.barrier()
    ckpt.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

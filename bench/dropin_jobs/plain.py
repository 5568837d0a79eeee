"""A plain DDP script written for torchrun: env init, a DistributedSampler, its own snapshot
(rank 0, every epoch, written to a temporary file and renamed), resume from it on start.
``--records PATH``: a line per completed step (``records.py``)."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from records import Records

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1000)
p.add_argument("--snapshot", default="snapshot.pt")
p.add_argument("--records", default="")
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch", type=int, default=64)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(2048, 64)
y = (x.sum(1, keepdim=True) > 0).float()
ds = TensorDataset(x, y)
sampler = DistributedSampler(ds)
dl = DataLoader(ds, batch_size=args.batch, sampler=sampler)
w = args.width
model = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w),
                            torch.nn.ReLU(), torch.nn.Linear(w, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(args.snapshot):
    snap = torch.load(args.snapshot)
    model.load_state_dict(snap["model"])
    opt.load_state_dict(snap["opt"])
    start = snap["epoch"] + 1
rec = Records(args.records, rank)
net = DDP(model)
lossf = torch.nn.BCEWithLogitsLoss()
step = start * len(dl)
for epoch in range(start, args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in dl:
        opt.zero_grad()
        loss = lossf(net(xb), yb)
        loss.backward()
        opt.step()
        rec.step(step)
        step += 1
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                   args.snapshot + ".tmp")
        os.replace(args.snapshot + ".tmp", args.snapshot)
dist.destroy_process_group()

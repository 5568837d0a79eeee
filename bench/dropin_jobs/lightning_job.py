"""A Lightning job as people write it: ``Trainer(strategy="ddp", accelerator="cpu",
devices=2)``, ``ModelCheckpoint(save_last=True)``, ``fit(ckpt_path=last.ckpt)`` when one exists.
Started by a launcher (torchrun or trainguard), Lightning takes the ranks from the torchelastic
environment instead of spawning them. ``--records PATH``: a line per completed step.
``--no-own-resume``: ``fit(ckpt_path=None)`` always, as scripts that never resume are written;
``--sleep S``: seconds of pause per step (a job slow enough to be hit mid-way)."""
import argparse
import os
import time

from records import Records, note_start

note_start("lightning.pytorch")  # before the import: was it warm in this process?

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1000)
p.add_argument("--ckpt-dir", default="lightning_ckpt")
p.add_argument("--records", default="")
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--ckpt-every", type=int, default=32)
p.add_argument("--no-own-resume", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()


class MLP(pl.LightningModule):
    def __init__(self, width: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))
        self.lossf = torch.nn.BCEWithLogitsLoss()

    def training_step(self, batch, _idx):
        xb, yb = batch
        return self.lossf(self.net(xb), yb)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Record(pl.Callback):
    def __init__(self, path: str):
        self.path, self.rec = path, None

    def on_train_batch_end(self, trainer, module, outputs, batch, idx):
        if self.rec is None:
            self.rec = Records(self.path, trainer.global_rank)
        self.rec.step(trainer.global_step - 1)
        if args.sleep:
            time.sleep(args.sleep)


torch.manual_seed(0)
x = torch.randn(2048, 64)
y = (x.sum(1, keepdim=True) > 0).float()
dl = DataLoader(TensorDataset(x, y), batch_size=args.batch)
last = os.path.join(args.ckpt_dir, "last.ckpt")
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, logger=False,
    enable_progress_bar=False, enable_model_summary=False,
    callbacks=[Record(args.records),
               ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True,
                               every_n_train_steps=args.ckpt_every)])
trainer.fit(MLP(args.width), dl, ckpt_path=last if os.path.exists(last) and not args.no_own_resume else None)

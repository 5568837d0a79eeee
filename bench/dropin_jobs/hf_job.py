"""A Hugging Face ``Trainer`` job as people write it, on a tiny model built in code (a
``PreTrainedModel`` with its own config: nothing is downloaded): ``TrainingArguments`` with
step checkpoints, ``train(resume_from_checkpoint=...)`` from the newest ``checkpoint-N`` when
there is one. The Trainer takes its ranks from the launcher's environment.
``--records PATH``: a line per completed step. ``--no-own-resume``: ``train()`` with no
checkpoint always, as the current examples are written; ``--sleep S``: seconds of pause per
step (a job slow enough to be hit mid-way)."""
import argparse
import os
import time

from records import Records, note_start

note_start("transformers.trainer")  # before the import: was it warm in this process?

import torch  # noqa: E402
from transformers import (PretrainedConfig, PreTrainedModel, Trainer,  # noqa: E402
                          TrainerCallback, TrainingArguments)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--out", default="hf_out")
p.add_argument("--records", default="")
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--ckpt-every", type=int, default=32)
p.add_argument("--no-own-resume", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()


class TinyConfig(PretrainedConfig):
    model_type = "tg_bench_tiny"

    def __init__(self, width: int = 512, **kw):
        super().__init__(**kw)
        self.width = width


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        w = config.width
        self.net = torch.nn.Sequential(torch.nn.Linear(64, w), torch.nn.ReLU(),
                                       torch.nn.Linear(w, w), torch.nn.ReLU(),
                                       torch.nn.Linear(w, 1))
        self.lossf = torch.nn.BCEWithLogitsLoss()

    def forward(self, x, labels=None):
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = self.lossf(logits, labels)
        return out


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(2048, 64, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Record(TrainerCallback):
    def __init__(self, path: str):
        self.path, self.rec = path, None

    def on_step_end(self, targs, state, control, **kw):
        if self.rec is None:
            self.rec = Records(self.path, targs.process_index)
        self.rec.step(state.global_step - 1)
        if args.sleep:
            time.sleep(args.sleep)


targs = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
    learning_rate=0.01, save_strategy="steps", save_steps=args.ckpt_every, save_total_limit=2,
    logging_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
    dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=False, seed=0)
trainer = Trainer(model=TinyModel(TinyConfig(width=args.width)), args=targs, train_dataset=Data(),
                  callbacks=[Record(args.records)])
last = get_last_checkpoint(args.out) if os.path.isdir(args.out) and not args.no_own_resume \
    else None
trainer.train(resume_from_checkpoint=last)

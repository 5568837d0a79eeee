"""trainguard for a Hugging Face ``transformers.Trainer`` (and, through the launcher's torchrun
environment, any ``accelerate`` script).

```python
from trainguard.integrations.huggingface import TrainguardCallback, resume_from_checkpoint

trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, save_steps=50, ...),
                  train_dataset=ds, callbacks=[TrainguardCallback()])
trainer.train(resume_from_checkpoint=resume_from_checkpoint(out))  # None on a first start
```

``TrainguardCallback`` reports ``state.global_step`` after every optimizer step, the logged
``loss`` and the ``checkpoint`` phase while the Trainer saves, through ``trainguard.hooks``.
``resume_from_checkpoint(output_dir)`` is the newest *complete* ``checkpoint-N`` there: a rank
killed while the Trainer wrote one leaves a directory that ``Trainer.train(
resume_from_checkpoint=True)`` would pick and then fail on (or load a truncated optimizer
state from); this skips it.
"""
from __future__ import annotations

import json
import os
import re
import struct
import sys
import zipfile
from typing import Any

from transformers import TrainerCallback

from .. import hooks

__all__ = ["TrainguardCallback", "resume_from_checkpoint", "checkpoint_complete"]

_CKPT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
           "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


class TrainguardCallback(TrainerCallback):
    """Progress, loss and phases of a ``transformers.Trainer`` to ``trainguard.hooks``: after
    each optimizer step the index of the step just completed (``state.global_step - 1``, the
    count the optimizer hook would give); the ``loss`` of every log (the Trainer's mean over
    ``logging_steps``); ``checkpoint`` from the step end at which the Trainer decided to save
    until the next step. ``resumed_step``: the ``global_step`` training started at in this
    process (> 0 after a resume). Outside ``trainguard launch`` every hook returns at once."""

    def __init__(self) -> None:
        self.resumed_step: int | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hooks.expect_framework_steps()  # state.global_step is the step from here on
        hooks.phase("startup")

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hooks.phase("eval")  # evaluation takes no optimizer step: not a hang

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hooks.phase("train")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.resumed_step = int(state.global_step)
        hooks.restored(self.resumed_step - 1)  # resumed from a checkpoint of that many steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not hooks.active():
            return
        hooks.report(step=int(state.global_step) - 1)
        if getattr(control, "should_save", False):
            hooks.phase("checkpoint")  # the Trainer saves right after this step's callbacks

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if not hooks.active() or not logs:
            return
        loss = logs.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            hooks.report(loss=float(loss))


def _safetensors_ok(path: str) -> str:
    """'' when the file's header parses and its tensors end exactly at the file's end."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "shorter than its header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return "header longer than the file (truncated)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return "header is not JSON"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end != size:
        return f"{size} bytes, its header says {8 + n + end} (truncated)"
    return ""


def _torch_file_ok(path: str, crc: bool) -> str:
    """'' when a ``torch.save`` file (a zip archive) is whole: its central directory is there
    and, with ``crc``, every record matches its CRC-32."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if crc else None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"not a whole torch file ({exc})"
    except Exception as exc:  # noqa: BLE001 - zlib/struct errors of a damaged archive
        return f"damaged ({exc!r})"
    return f"record {bad} fails its CRC-32 (corrupt)" if bad else ""


def checkpoint_complete(path: str, require_optimizer: bool = True,
                        crc: bool = True) -> tuple[bool, str]:
    """``(complete, reason)`` of a Trainer checkpoint directory ``checkpoint-N``: its
    ``trainer_state.json`` (which the Trainer writes last) names step N; model weights are there
    (shards of an index included); ``optimizer.pt`` too (``require_optimizer``); every
    ``.safetensors`` file ends where its header says and every ``torch.save`` file (``.pt``,
    ``.pth``, ``.bin``) is a whole archive whose records match their CRC-32 (``crc``; reads the
    files once)."""
    m = _CKPT.match(os.path.basename(os.path.normpath(path)))
    if not os.path.isdir(path):
        return False, "not a directory"
    try:
        with open(os.path.join(path, TRAINER_STATE)) as fh:
            st = json.load(fh)
    except FileNotFoundError:
        return False, f"no {TRAINER_STATE} (the save did not finish)"
    except (OSError, ValueError) as exc:
        return False, f"{TRAINER_STATE} unreadable ({exc})"
    if m and st.get("global_step") != int(m.group(1)):
        return False, f"{TRAINER_STATE} is of step {st.get('global_step')}"
    names = set(os.listdir(path))
    weights = [w for w in WEIGHTS if w in names]
    if not weights:
        return False, "no model weights"
    for w in weights:
        if w.endswith(".index.json"):
            try:
                with open(os.path.join(path, w)) as fh:
                    shards = set(json.load(fh)["weight_map"].values())
            except (OSError, ValueError, KeyError) as exc:
                return False, f"{w} unreadable ({exc})"
            missing = sorted(shards - names)
            if missing:
                return False, f"shards missing: {missing}"
    if require_optimizer and "optimizer.pt" not in names:
        return False, "no optimizer.pt"
    for n in sorted(names):
        p = os.path.join(path, n)
        if n.endswith(".safetensors"):
            why = _safetensors_ok(p)
        elif n.endswith((".pt", ".pth", ".bin")):
            why = _torch_file_ok(p, crc)
        else:
            continue
        if why:
            return False, f"{n}: {why}"
    return True, ""


def resume_from_checkpoint(output_dir: str, require_optimizer: bool = True,
                           crc: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir`` (``checkpoint_complete``), for
    ``Trainer.train(resume_from_checkpoint=...)``; None when there is none (a first start).
    Incomplete ones are named on stderr and left where they are (the Trainer overwrites a
    directory of the same step when it gets there again)."""
    try:
        entries = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), n) for n in entries if (m := _CKPT.match(n))),
                   reverse=True)
    for _, n in steps:
        p = os.path.join(output_dir, n)
        ok, why = checkpoint_complete(p, require_optimizer, crc)
        if ok:
            return p
        print(f"trainguard: not resuming from {p}: {why}", file=sys.stderr, flush=True)
    return None

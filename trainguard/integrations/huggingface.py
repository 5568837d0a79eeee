"""trainguard for a Hugging Face ``transformers.Trainer`` (and, through the launcher's torchrun
environment, any ``accelerate`` script).

```python
from trainguard.integrations.huggingface import TrainguardCallback, resume_from_checkpoint

trainer = Trainer(model=model, args=TrainingArguments(output_dir=out, save_steps=50, ...),
                  train_dataset=ds, callbacks=[TrainguardCallback()])
trainer.train(resume_from_checkpoint=resume_from_checkpoint(out))  # None on a first start
```

``TrainguardCallback`` reports ``state.global_step`` after every optimizer step, the logged
``loss`` and the ``checkpoint`` phase while the Trainer saves, through ``trainguard.rank.hooks``.
``resume_from_checkpoint(output_dir)`` is the newest *complete* ``checkpoint-N`` there: a rank
killed while the Trainer wrote one leaves a directory that ``Trainer.train(
resume_from_checkpoint=True)`` would pick and then fail on (or load a truncated optimizer
state from); this skips it.
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainguard.rank import hooks
from trainguard.rank.framework_checkpoints import checkpoint_complete, newest_hf_checkpoint

__all__ = ["TrainguardCallback", "resume_from_checkpoint", "checkpoint_complete"]


class TrainguardCallback(TrainerCallback):
    """Progress, loss and phases of a ``transformers.Trainer`` to ``trainguard.rank.hooks``: after
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


def resume_from_checkpoint(output_dir: str, require_optimizer: bool = True,
                           crc: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir``
    (``trainguard.rank.framework_checkpoints.newest_hf_checkpoint``), for
    ``Trainer.train(resume_from_checkpoint=...)``; None when there is none (a first start).
    Incomplete ones are named on stderr and left where they are."""
    return newest_hf_checkpoint(output_dir, require_optimizer, crc)

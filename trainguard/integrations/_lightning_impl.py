"""The Lightning integration, independent of the package name (``lightning.pytorch`` or
``pytorch_lightning``): ``lightning.py`` and ``pytorch_lightning.py`` bind these to the base
classes of each."""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from trainguard.rank import hooks
from trainguard.integrations._common import ScalarReader, as_float
from trainguard.rank.verified_file import AsyncFileSaver, newest_valid, verify

LOSS_KEYS = ("loss", "train_loss")


class CallbackMixin:
    """Reports a Lightning ``Trainer``'s progress through ``trainguard.rank.hooks``: after every
    optimizer step (``trainer.global_step`` advanced) the index of the step just completed
    (``global_step - 1``, the count the optimizer hook would give) and the loss, taken from the
    training step's ``outputs`` (a tensor, or ``outputs["loss"]``) or else from
    ``trainer.callback_metrics`` (``loss_keys``). Phases: ``startup`` in ``setup``,
    ``recovery`` while a checkpoint is restored, ``checkpoint`` while one is saved (the next
    step report sets ``train`` again).

    ``resumed_step``: the ``global_step`` training started at in this process (> 0 after a
    resume). Outside ``trainguard launch`` every hook returns at once."""

    def __init__(self, loss_keys: tuple[str, ...] = LOSS_KEYS) -> None:
        super().__init__()
        self.loss_keys = tuple(loss_keys)
        self.resumed_step: int | None = None
        self._reader = ScalarReader()
        self._last_step: int | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        hooks.expect_framework_steps()  # trainer.global_step is the step from here on
        hooks.phase("startup")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        hooks.phase("eval")  # no optimizer step while validating: not a hang

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        hooks.phase("train")

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        hooks.phase("recovery")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.resumed_step = int(trainer.global_step)
        self._last_step = self.resumed_step
        hooks.restored(self.resumed_step - 1)  # resumed from a checkpoint of that many steps

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not hooks.active():
            return
        step = int(trainer.global_step)
        if step == self._last_step:
            return  # gradient accumulation: no optimizer step yet
        self._last_step = step
        hooks.report(step=step - 1, loss=self._loss(trainer, pl_module, outputs))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        hooks.phase("checkpoint")

    def _loss(self, trainer: Any, pl_module: Any, outputs: Any) -> float | None:
        value = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = self._reader.read(value)
        if loss is not None and getattr(pl_module, "automatic_optimization", False):
            # Lightning hands on the loss divided by accumulate_grad_batches
            loss *= getattr(trainer, "accumulate_grad_batches", 1) or 1
        if loss is None and value is None:
            metrics = getattr(trainer, "callback_metrics", None) or {}
            for k in self.loss_keys:
                if k in metrics:
                    loss = as_float(metrics[k])
                    if loss is not None:
                        break
        return loss


class CorruptCheckpointError(RuntimeError):
    """No valid checkpoint to load: the one asked for failed verification and no other valid
    one is in its directory."""


class CheckpointIOMixin:
    """Lightning's checkpoints off the training loop and verified on load (``trainguard.rank.verified_file``).

    ``save_checkpoint`` blocks only while the checkpoint's tensors are copied into reused host
    buffers (and while the previous write, if still running, finishes); writing, fsync, checksum
    and the atomic rename run in a background thread. ``load_checkpoint`` waits for writes in
    flight, verifies the file against its ``.tgsum`` sidecar and, when it is truncated, corrupt
    or was never committed, loads the newest valid ``*.ckpt`` of the same directory instead
    (not past the rejected file's step when that is known), saying so on stderr; when there is
    none it raises ``CorruptCheckpointError`` rather than resume from a damaged file.
    ``loaded_path`` is the file last loaded; ``saver.saves`` has the timings of every save.

    Paths with a scheme (``s3://`` …) go to Lightning's own ``TorchCheckpointIO`` unchanged.
    Sharded strategies (FSDP, DeepSpeed) write their checkpoints themselves and do not use
    this plugin."""

    _fallback_io_cls: Callable[[], Any]
    _load_fn: Callable[..., Any]

    def __init__(self) -> None:
        super().__init__()
        self.saver = AsyncFileSaver()
        self.loaded_path: str | None = None
        self.last_blocking_s: float | None = None
        self._fallback_io: Any = None

    def _remote(self, path: str) -> Any:
        if "://" not in path or path.startswith("file://"):
            return None
        if self._fallback_io is None:
            warnings.warn(f"TrainguardCheckpointIO: {path} is not a local path; saving it "
                          "synchronously and unverified with Lightning's TorchCheckpointIO",
                          stacklevel=3)
            self._fallback_io = self._fallback_io_cls()
        return self._fallback_io

    @staticmethod
    def _local(path: Any) -> str:
        path = os.fspath(path)
        return path[len("file://"):] if path.startswith("file://") else path

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not "
                            f"supported by {type(self).__name__}")
        path = os.fspath(path)
        remote = self._remote(path)
        if remote is not None:
            return remote.save_checkpoint(checkpoint, path)
        hooks.phase("checkpoint")
        meta = {k: checkpoint.get(k) for k in ("global_step", "epoch")
                if isinstance(checkpoint.get(k), int)}
        self.last_blocking_s = self.saver.save(checkpoint, self._local(path), meta)

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = os.fspath(path)
        remote = self._remote(path)
        if remote is not None:
            return remote.load_checkpoint(path, map_location=map_location,
                                          weights_only=weights_only)
        path = self._local(path)
        self.saver.wait()
        ok, why, side = verify(path)
        chosen = path
        if not ok:
            if not os.path.lexists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            max_step = (side or {}).get("meta", {}).get("global_step")
            chosen, rejected = newest_valid(os.path.dirname(os.path.abspath(path)),
                                            exclude=path, max_step=max_step)
            if chosen is None:
                others = "".join(f"\n  {p}: {r}" for p, r in rejected)
                raise CorruptCheckpointError(
                    f"refusing to load {path}: {why}; no other valid checkpoint in its "
                    f"directory{others}")
            print(f"trainguard: not loading {path}: {why}; loading {chosen}, the newest valid "
                  "checkpoint before it", file=sys.stderr, flush=True)
        self.loaded_path = chosen
        return type(self)._load_fn(chosen, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        remote = self._remote(path)
        if remote is not None:
            return remote.remove_checkpoint(path)
        self.saver.remove(self._local(path))

    def teardown(self) -> None:
        """Waits for the last write (Lightning calls this at the end of ``fit``)."""
        self.saver.wait()


def newest_checkpoint(dirpath: Any) -> str | None:
    """The newest valid checkpoint written by ``TrainguardCheckpointIO`` in ``dirpath`` (by
    its global step), for ``trainer.fit(model, ckpt_path=...)``; None when there is none (a
    first start). ``ckpt_path="last"`` works too: a ``last.ckpt`` that fails verification
    falls back the same way."""
    p, _ = newest_valid(os.fspath(dirpath))
    return p


def framework_classes(pl: Any, torch_io: type, load: Any, module: str) -> tuple[type, type]:
    """``TrainguardCallback`` and ``TrainguardCheckpointIO`` for one Lightning package
    (``lightning.pytorch`` or ``pytorch_lightning``: each Trainer accepts only its own base
    classes); ``module`` names the public module that exports them."""
    cb = type("TrainguardCallback", (CallbackMixin, pl.Callback),
              {"__doc__": CallbackMixin.__doc__, "__module__": module})
    io = type("TrainguardCheckpointIO", (CheckpointIOMixin, pl.plugins.CheckpointIO),
              {"__doc__": CheckpointIOMixin.__doc__, "__module__": module,
               "_fallback_io_cls": torch_io, "_load_fn": staticmethod(load)})
    return cb, io

"""``trainguard.integrations.lightning`` for the ``pytorch_lightning`` package name (its
``Trainer`` accepts only its own ``Callback`` and ``CheckpointIO`` classes)."""
from __future__ import annotations

import pytorch_lightning as _pl
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
from lightning_fabric.utilities.cloud_io import _load

from ._lightning_impl import (CallbackMixin, CheckpointIOMixin, CorruptCheckpointError,
                              newest_checkpoint)

__all__ = ["TrainguardCallback", "TrainguardCheckpointIO", "CorruptCheckpointError",
           "newest_checkpoint"]


class TrainguardCallback(CallbackMixin, _pl.Callback):
    __doc__ = CallbackMixin.__doc__


class TrainguardCheckpointIO(CheckpointIOMixin, _pl.plugins.CheckpointIO):
    __doc__ = CheckpointIOMixin.__doc__
    _fallback_io_cls = _TorchIO
    _load_fn = staticmethod(_load)

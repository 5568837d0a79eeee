"""``trainguard.integrations.lightning`` for the ``pytorch_lightning`` package name (its
``Trainer`` accepts only its own ``Callback`` and ``CheckpointIO`` classes)."""
from __future__ import annotations

import pytorch_lightning as _pl
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
from lightning_fabric.utilities.cloud_io import _load

from trainguard.integrations._lightning_impl import CorruptCheckpointError, framework_classes, newest_checkpoint

__all__ = ["TrainguardCallback", "TrainguardCheckpointIO", "CorruptCheckpointError",
           "newest_checkpoint"]

TrainguardCallback, TrainguardCheckpointIO = framework_classes(_pl, _TorchIO, _load, __name__)

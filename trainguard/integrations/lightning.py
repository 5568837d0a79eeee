"""trainguard for Lightning (``lightning.pytorch``; falls back to ``pytorch_lightning`` when
only that is installed — for a ``pytorch_lightning`` Trainer beside ``lightning``, use
``trainguard.integrations.pytorch_lightning``).

```python
from trainguard.integrations.lightning import TrainguardCallback, TrainguardCheckpointIO

trainer = L.Trainer(callbacks=[TrainguardCallback(), ModelCheckpoint(dirpath=d, save_last=True)],
                    plugins=[TrainguardCheckpointIO()])
trainer.fit(model, ckpt_path="last")   # after a group restart: the newest valid checkpoint
```

``TrainguardCallback``: progress (``trainer.global_step``), loss and phases to
``trainguard.rank.hooks``. ``TrainguardCheckpointIO``: Lightning's own saves staged in host memory
and written in the background (fsync, checksum, atomic rename); loads verify the checksum and
fall back to the newest valid file. ``newest_checkpoint(dirpath)``: that file, or None.
"""
from __future__ import annotations

try:
    import lightning.pytorch as _pl
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
    from lightning.fabric.utilities.cloud_io import _load
except ImportError:  # only the pytorch_lightning package name is installed
    import pytorch_lightning as _pl
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO as _TorchIO
    from lightning_fabric.utilities.cloud_io import _load

from trainguard.integrations._lightning_impl import CorruptCheckpointError, framework_classes, newest_checkpoint

__all__ = ["TrainguardCallback", "TrainguardCheckpointIO", "CorruptCheckpointError",
           "newest_checkpoint"]

TrainguardCallback, TrainguardCheckpointIO = framework_classes(_pl, _TorchIO, _load, __name__)

"""trainguard through the extension points of training frameworks.

* ``trainguard.integrations.lightning`` — ``TrainguardCallback`` (progress, loss and phases of a
  Lightning ``Trainer``) and ``TrainguardCheckpointIO`` (Lightning's own checkpoints staged in
  host memory and written, fsynced, checksummed and renamed in the background; a load verifies
  the checksum and falls back to the newest valid file). Built on ``lightning.pytorch``;
  ``trainguard.integrations.pytorch_lightning`` has the same classes for the
  ``pytorch_lightning`` package name.
* ``trainguard.integrations.huggingface`` — ``TrainguardCallback`` for a ``transformers``
  ``Trainer`` and ``resume_from_checkpoint(output_dir)``: the newest *complete*
  ``checkpoint-N`` there, for ``trainer.train(resume_from_checkpoint=...)``.

Both report through ``trainguard.rank.hooks`` (``report``, ``phase``), which is active inside a rank
started by ``trainguard launch``; elsewhere they cost nothing and change nothing. Importing this
package imports no framework: each module imports its own. See ``docs/integrations.md``.
"""
from __future__ import annotations

__all__ = ["lightning", "pytorch_lightning", "huggingface"]

"""trainguard: fault detection, attribution and recovery for distributed PyTorch training.

What a user imports::

    import trainguard

    def train(ctx: trainguard.Context) -> None:
        ...
        ctx.progress(step, loss=loss)

    trainguard.run(train)
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["run", "Context", "WorkerConfig", "RestartRequested", "JobStopped", "__version__"]


def __getattr__(name: str):
    # lazy: importing trainguard must not import torch (services do not need it)
    if name in ("run", "Context", "WorkerConfig", "RestartRequested", "JobStopped"):
        from trainguard.rank import shim as worker

        return getattr(worker, name)
    raise AttributeError(name)

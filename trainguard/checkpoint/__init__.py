"""Async, validated, resharding checkpoints for distributed PyTorch training.

``Checkpointer`` (saves and restores; imports torch), ``CheckpointConfig``, ``NodeWriter`` (the
per-node writer daemon a launcher may hold). Importing this package does not import torch:
the writer process uses ``trainguard.checkpoint.writer`` and ``.format`` alone.
"""
from __future__ import annotations

from .config import CheckpointConfig

__all__ = ["Checkpointer", "CheckpointConfig", "NodeWriter"]


def __getattr__(name: str):
    if name == "Checkpointer":
        from .checkpointer import Checkpointer

        return Checkpointer
    if name == "NodeWriter":
        from .writer import NodeWriter

        return NodeWriter
    raise AttributeError(name)

"""Async, validated, resharding checkpoints for distributed PyTorch training.

``Checkpointer`` (saves and restores; imports torch), ``CheckpointConfig``,
``CheckpointResources`` (what a process holds for one job's checkpointing: writer connection,
staging buffer, the save in flight), ``NodeWriter`` (the per-node writer daemon a launcher may
hold). Importing this package does not import torch: the writer process uses
``trainguard.checkpoint.writer`` and ``.format`` alone.

Modules, rank side: ``checkpointer`` (the class users hold), ``plan`` (``SavePlan``),
``session`` (one save in flight), ``restorer`` (newest valid checkpoint, load, post-restore
check), ``resources``, ``collectives``, ``index`` (verdicts, retention), ``statedict``,
``staging``. Writer side (torch-free): ``writer`` (its command line), ``serve`` (one
connection), ``node_writer``, ``client`` (the rank's end), ``protocol``. Shared: ``format``
(on disk), ``verify`` (the check the validator service and restore both use), ``config``.
"""
from __future__ import annotations

from trainguard.checkpoint.config import CheckpointConfig

__all__ = ["Checkpointer", "CheckpointConfig", "CheckpointResources", "NodeWriter"]


def __getattr__(name: str):
    if name == "Checkpointer":
        from trainguard.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    if name == "CheckpointResources":
        from trainguard.checkpoint.resources import CheckpointResources

        return CheckpointResources
    if name == "NodeWriter":
        from trainguard.checkpoint.node_writer import NodeWriter

        return NodeWriter
    raise AttributeError(name)

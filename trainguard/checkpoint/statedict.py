"""The state a Checkpointer saves and restores: ``{"model": …, "optimizer": …}`` as
torch.distributed.checkpoint's ``get_state_dict`` gives it — keys of the unwrapped module (DDP
and FSDP2 wrappers are seen through), so checkpoints are portable across wrappings and world
sizes. Without an optimizer, ``{"model": …}`` alone.
"""
from __future__ import annotations

from typing import Any

import torch


def get_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The current state (tensors shared with the model and optimizer, not copies)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def restore_target(model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A state dict to load into: ``get_state`` after the optimizer's state was created (a fresh
    optimizer has none, and DCP loads into existing tensors)."""
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
    return get_state(model, optimizer)


def apply_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                sd: dict[str, Any]) -> None:
    """Load ``sd`` (filled by a restore) into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, sd["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optimizer"])

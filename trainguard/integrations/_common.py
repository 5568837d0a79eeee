"""Pieces the framework integrations share."""
from __future__ import annotations

from typing import Any


class ScalarReader:
    """Turns a framework's loss (a number, a 0-d/1-element tensor) into a float without making
    the training loop wait for the device.

    A CPU tensor or a number is read at once. A tensor on a CUDA device is copied to the host
    asynchronously behind an event, and its value is taken at a later call, once the event has
    completed (``.item()`` would synchronise the stream every step): the loss reported may be a
    step old. Other devices (XLA, MPS) are not read at all — their reads synchronise too.
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, Any] | None = None  # (host tensor, cuda event)

    def read(self, value: Any) -> float | None:
        """The newest loss value available without waiting (None when none is)."""
        out = self._take()
        if value is None:
            return out
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            import torch
        except ImportError:  # pragma: no cover - torch is a dependency
            return out
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return out
        t = value.detach()
        if t.device.type == "cpu":
            return float(t.reshape(()))
        if t.device.type == "cuda" and self._pending is None:
            host = torch.empty((), dtype=t.dtype, pin_memory=True)
            host.copy_(t.reshape(()), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            self._pending = (host, ev)
        return out

    def _take(self) -> float | None:
        if self._pending is None:
            return None
        host, ev = self._pending
        if not ev.query():
            return None
        self._pending = None
        return float(host)


def as_float(value: Any) -> float | None:
    """A logged metric (number or 1-element CPU tensor) as a float; None otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        return float(value.detach().reshape(()))
    return None


__all__ = ["ScalarReader", "as_float"]

"""Staging buffers in node-local shared memory, and the torch.save templates of the writer.

A rank stages its whole local state (every tensor of its state dict, replicated ones included)
into one file ``<shm_dir>/trainguard-<job>-r<rank>.stage``, mapped once and reused by every
save (a copy into a reused buffer runs ≈ 4× faster than into fresh memory, findings.md). The
file outlives the training process, so a respawned rank can restore from it. A sidecar
``….stage.meta`` (pickle) says which save the buffer holds and where each item lies; it is
removed before staging starts and written when staging is complete, so a half-staged buffer is
never described as whole.
"""
from __future__ import annotations

import mmap
import os
import pickle
from typing import Any

import numpy as np
import torch

from trainguard.checkpoint.config import staging_path  # noqa: F401 - re-exported: the checkpointer imports it here

ALIGN = 64


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Staging:
    """One mapped staging file of ``size`` bytes; ``buf`` is a uint8 tensor over it.

    A new or grown file is pre-faulted (written once) so that the first save does not pay the
    page faults; an existing file of the right size keeps its content (a respawned rank may
    restore from it).
    """

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = max(size, ALIGN)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            old = os.fstat(fd).st_size
            if old != self.size:
                os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        if old != self.size:
            self.buf.zero_()

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        return self.buf[offset:offset + nbytes].view(dtype).view(shape)

    def close(self, unlink: bool = False) -> None:
        self.buf = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass
        if unlink:
            for p in (self.path, self.path + ".meta"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    # -- sidecar -------------------------------------------------------------------------------
    def clear_meta(self) -> None:
        try:
            os.unlink(self.path + ".meta")
        except FileNotFoundError:
            pass

    def write_meta(self, meta: dict[str, Any]) -> None:
        tmp = self.path + ".meta.part"
        with open(tmp, "wb") as fh:
            pickle.dump(meta, fh, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.path + ".meta")


def read_meta(path: str) -> dict[str, Any] | None:
    """The sidecar of staging file ``path``; None when absent or unreadable."""
    try:
        with open(path + ".meta", "rb") as fh:
            return pickle.load(fh)
    except (OSError, pickle.UnpicklingError, EOFError, ValueError):
        return None


# ---- torch.save templates --------------------------------------------------------------------
class _Recorder:
    """File-like sink for torch.save that keeps every write except the tensor's data."""

    def __init__(self, data_ptr: int, nbytes: int):
        self.data_ptr, self.nbytes = data_ptr, nbytes
        self.pre = bytearray()
        self.suf = bytearray()
        self.seen = 0
        self.pos = 0

    def write(self, b) -> int:
        m = memoryview(b).cast("B")
        n = m.nbytes
        if n and self.seen < self.nbytes:
            addr = np.frombuffer(m, dtype=np.uint8).__array_interface__["data"][0]
            if addr == self.data_ptr + self.seen:
                self.seen += n
                self.pos += n
                return n
        (self.pre if self.seen == 0 and self.nbytes else self.suf).extend(m)
        self.pos += n
        return n

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.pos


_TEMPLATES: dict[tuple[str, tuple[int, ...]], tuple[bytes, bytes]] = {}


def template(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """``(prefix, suffix)`` such that ``prefix + raw bytes + suffix`` is exactly what
    ``torch.save`` writes for a contiguous CPU tensor of ``dtype``/``shape`` with these bytes
    (zip CRC computation off, so the wrapper does not depend on the data). The data of the
    probe tensor is never touched (allocated lazily, never read). Cached per dtype and shape."""
    key = (str(dtype), tuple(shape))
    hit = _TEMPLATES.get(key)
    if hit is not None:
        return hit
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    rec = _Recorder(t.untyped_storage().data_ptr(), nbytes)
    ser = torch.serialization
    old = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        torch.save(t, rec)
    finally:
        ser.set_crc32_options(old)
    if rec.seen != nbytes:
        raise RuntimeError(f"torch.save layout not understood for {dtype} {tuple(shape)}: "
                           f"found {rec.seen} of {nbytes} data bytes")
    if nbytes == 0:  # no data write: everything is prefix
        rec.pre, rec.suf = rec.pre + rec.suf, bytearray()
    out = (bytes(rec.pre), bytes(rec.suf))
    _TEMPLATES[key] = out
    return out

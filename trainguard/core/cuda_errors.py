"""Which CUDA errors a process survives: ``STICKY_ERRORS`` (the CUDA context is lost for the
life of the process: only a new process recovers) and ``OOM_ERRORS`` (an allocation failed: the
context is intact and the process may recover in place). Pure: no torch import, no I/O.

Sources: NVIDIA CUDA Runtime API, "Data types used by CUDA Runtime", ``enum cudaError``
(docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html): for codes 700, 702, 710,
714–719 it says "This leaves the process in an inconsistent state and any further CUDA work will
return the same error. To continue using CUDA, the process must be terminated and relaunched.";
the strings are ``cudaGetErrorString``'s, which torch prints after "CUDA error: "
(c10/cuda/CUDAException.cpp). NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors) for the
errors that come from the GPU itself (uncorrectable ECC: XID 48/94/95; a GPU gone from the bus:
XID 79). PyTorch ``torch.OutOfMemoryError`` (torch/csrc/Exceptions.cpp; the caching
allocator's "CUDA out of memory. Tried to allocate", c10/cuda/CUDACachingAllocator.cpp) for OOM.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CudaError", "STICKY_ERRORS", "OOM_ERRORS", "cuda_error_is_sticky", "is_cuda_oom",
           "error_text", "recover_from_oom", "SUMMARY_LIMIT", "texts"]


@dataclass(frozen=True)
class CudaError:
    """One row: ``name`` (the ``cudaError`` enum name), ``code`` (its number), ``text`` (a
    regular expression over the message torch or the runtime prints), ``source`` (why it is
    in its table)."""

    name: str
    code: int
    text: str
    source: str


_STICKY_DOC = ("CUDA Runtime API enum cudaError: 'the process must be terminated and "
               "relaunched'")

#: errors that poison the CUDA context: the rank must leave its process (a respawn)
STICKY_ERRORS: tuple[CudaError, ...] = (
    CudaError("cudaErrorIllegalAddress", 700,
              r"an illegal memory access was encountered|cudaErrorIllegalAddress|"
              r"CUDA_ERROR_ILLEGAL_ADDRESS", _STICKY_DOC),
    CudaError("cudaErrorLaunchTimeout", 702,
              r"the launch timed out and was terminated|cudaErrorLaunchTimeout", _STICKY_DOC),
    CudaError("cudaErrorAssert", 710,
              r"device-side assert(?:ion)? triggered|cudaErrorAssert\b", _STICKY_DOC),
    CudaError("cudaErrorHardwareStackError", 714,
              r"hardware stack error|cudaErrorHardwareStackError", _STICKY_DOC),
    CudaError("cudaErrorIllegalInstruction", 715,
              r"illegal instruction was encountered|cudaErrorIllegalInstruction", _STICKY_DOC),
    CudaError("cudaErrorMisalignedAddress", 716,
              r"misaligned address|cudaErrorMisalignedAddress", _STICKY_DOC),
    CudaError("cudaErrorInvalidAddressSpace", 717,
              r"operation not supported on global/shared address space|"
              r"cudaErrorInvalidAddressSpace", _STICKY_DOC),
    CudaError("cudaErrorInvalidPc", 718,
              r"CUDA error: invalid program counter|cudaErrorInvalidPc", _STICKY_DOC),
    CudaError("cudaErrorLaunchFailure", 719,
              r"unspecified launch failure|cudaErrorLaunchFailure", _STICKY_DOC),
    # (NCCL prints the same string as "Cuda failure 'unspecified launch failure'")
    CudaError("cudaErrorECCUncorrectable", 214,
              r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable",
              "an uncorrectable ECC error in device memory (XID 48/94/95, NVIDIA XID catalog): "
              "the memory the context holds is lost; the GPU needs its pages retired or a reset"),
    CudaError("cudaErrorUnknown", 999,
              r"CUDA error: unknown error|cudaErrorUnknown\b",
              "on a training node the driver's 'unknown error' follows a GPU gone from the bus "
              "(XID 79, NVIDIA XID catalog): the device the context lives on is gone"),
)

#: allocation failures: the context is intact, in-process recovery is allowed
OOM_ERRORS: tuple[CudaError, ...] = (
    CudaError("torch.OutOfMemoryError", 2,
              r"CUDA out of memory\. Tried to allocate|OutOfMemoryError: CUDA",
              "PyTorch's caching allocator raises torch.OutOfMemoryError (a RuntimeError): the "
              "allocation failed, the context is intact"),
    CudaError("cudaErrorMemoryAllocation", 2,
              r"CUDA error: out of memory|cudaErrorMemoryAllocation",
              "CUDA Runtime API enum cudaError 2: 'unable to allocate enough memory'; not a "
              "sticky error"),
)

def texts(*names: str) -> str:
    """One regular expression matching any of the rows ``names`` (``cudaError`` enum names, of
    either table): what a log rule over the same errors matches (the detector's CUDA rows).
    Raises KeyError for a name in neither table."""
    rows = {e.name: e for e in STICKY_ERRORS + OOM_ERRORS}
    return "|".join(rows[n].text for n in names)


_STICKY = [(e, re.compile(e.text)) for e in STICKY_ERRORS]
_OOM = [(e, re.compile(e.text)) for e in OOM_ERRORS]

#: bytes of ``torch.cuda.memory_summary()`` kept in a fault's evidence
SUMMARY_LIMIT = 4096


def error_text(exc_or_text: BaseException | str) -> str:
    """The text the tables are matched against: a string as is; an exception's type name and
    message, with those of the exceptions it was raised from or during (``__cause__``,
    ``__context__``; at most 8)."""
    if isinstance(exc_or_text, str):
        return exc_or_text
    parts: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = exc_or_text
    while e is not None and id(e) not in seen and len(parts) < 8:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def sticky_error(exc_or_text: BaseException | str) -> CudaError | None:
    """The row of ``STICKY_ERRORS`` that ``exc_or_text`` matches, or None."""
    text = error_text(exc_or_text)
    return next((e for e, rx in _STICKY if rx.search(text)), None)


def cuda_error_is_sticky(exc_or_text: BaseException | str) -> bool:
    """True when ``exc_or_text`` (an exception or its printed text) is a CUDA error that leaves
    the process's CUDA context unusable (a row of ``STICKY_ERRORS``): the rank must be
    respawned, never restarted in process. An OOM is not sticky."""
    return sticky_error(exc_or_text) is not None


def is_cuda_oom(exc_or_text: BaseException | str) -> bool:
    """True when ``exc_or_text`` is a CUDA out-of-memory error (a row of ``OOM_ERRORS``) and
    no sticky error: in-process recovery is allowed once the caching allocator is emptied."""
    text = error_text(exc_or_text)
    return not cuda_error_is_sticky(text) and any(rx.search(text) for _, rx in _OOM)


def recover_from_oom(is_available: Callable[[], bool], empty_cache: Callable[[], None],
                     memory_summary: Callable[[], str],
                     limit: int = SUMMARY_LIMIT) -> str | None:
    """After a CUDA OOM: when ``is_available()`` (``torch.cuda.is_available``), read
    ``memory_summary()`` (``torch.cuda.memory_summary``: the allocator's state at the fault,
    kept for the evidence, at most ``limit`` characters) and then call ``empty_cache()``
    (``torch.cuda.empty_cache``: the cached, unused blocks go back to the driver). Returns the
    summary, or None without CUDA (nothing is called then). An error of either call is
    returned in words, never raised: the fault report must go out."""
    if not is_available():
        return None
    try:
        summary = memory_summary()[:limit]
    except Exception as exc:  # noqa: BLE001 - evidence is best effort
        summary = f"memory_summary failed: {type(exc).__name__}: {exc}"
    try:
        empty_cache()
    except Exception as exc:  # noqa: BLE001
        summary += f"\nempty_cache failed: {type(exc).__name__}: {exc}"
    return summary

"""Returning the heap memory a service freed to the OS (``Service.run`` calls it every
``Service.memory_trim_s`` seconds)."""
from __future__ import annotations

from typing import Any

_malloc_trim: Any = None  # glibc's malloc_trim once looked up; False where there is none


def release_freed_memory() -> bool:
    """Hand the heap memory freed since the last call back to the OS: glibc's
    ``malloc_trim(0)``, which returns the free top of each heap and, since glibc 2.8, the free
    pages inside it (``madvise``). Without it glibc keeps what a burst of hostile messages freed:
    on the fuzz bench (``bench/fuzz.py``, 30,000 messages) a trim at the end gave back 6 MiB of
    the attributor's 16 MiB of growth, with 2 MB of objects still live. With small objects from
    the C heap too (``PYTHONMALLOC=malloc``, as ``trainguard.stack.local`` and the Dockerfile start
    the services) it returns nearly all of it. False where the C library has no ``malloc_trim``
    (musl, macOS); a call costs well under 1 ms on a heap of tens of MiB."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL(None).malloc_trim
            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True

"""Benchmark hook for trainguard runs (put on ``PYTHONPATH`` only by ``bench/recovery.py``).

When ``$BENCH_PROGRESS`` is set, it wraps ``trainguard.rank.shim.Context.progress`` at import time so
every completed step also appends a progress record (``bench/peers/common.py`` format: rank, step,
Unix ns, pid, loss, generation, world size) — the same file-based measurement as for the peers,
with no change to the job or the library.
"""
import importlib.abc
import importlib.util
import os
import sys
import time

_PATH = os.environ.get("BENCH_PROGRESS", "")


def _patch(module) -> None:
    ctx_cls = getattr(module, "Context", None)
    if ctx_cls is None or getattr(ctx_cls, "_bench_patched", False):
        return
    orig = ctx_cls.progress
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def progress(self, step, loss=None):
        lv = float("nan") if loss is None else float(loss)
        os.write(fd, f"{self.rank} {step} {time.time_ns()} {os.getpid()} {lv:.6f} "
                     f"g{self.generation}.{os.getpid()} {self.world_size}\n".encode())
        return orig(self, step, loss)

    ctx_cls.progress = progress
    ctx_cls._bench_patched = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "trainguard.rank.shim":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_orig = spec.loader.exec_module

        def exec_module(module):
            exec_orig(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _PATH:
    sys.meta_path.insert(0, _Finder())

"""The job's own imports, pre-imported by the spares' template so that a replacement rank never
imports its framework after a fault.

Three sides of one record:

* **In a rank** (``record``; ``trainguard.rank.hooks`` calls it at the first optimizer step of local
  rank 0, once the Trainer, model and data pipeline are built): every module the rank imported
  beyond what its spare had at ``baseline`` (``sys.modules``, in import order), each marked
  ``lib`` (the standard library, an installed package, a built-in) or ``job`` (a file of the
  job's own, e.g. beside the script), written as JSON to ``TG_JOB_IMPORTS_FILE`` in the
  launcher's run directory (through a temporary file and a rename).
* **In the launcher** (``select``, pure): what of that the template may import. Never
  ``__main__`` (the script itself) nor the job's own files (their import may have effects only
  the job expects), nor a module of ``DENY`` (each row says why: it starts threads, processes or
  CUDA at import, which a forked child would not inherit or could not use).
* **In the template** (``import_all``): the chosen modules in the job's order, until a time
  budget is spent; a module that fails is skipped; one that started a thread or initialised
  CUDA is named (the launcher then stops forking from that template).

The launcher says in its log what was imported, what was skipped and why.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import sysconfig
import threading
import time
from typing import Any

__all__ = ["ENV_FILE", "DENY", "baseline", "record", "select", "import_all", "import_file"]

#: the file a rank writes its imports to (set by the launcher for local rank 0)
ENV_FILE = "TG_JOB_IMPORTS_FILE"

#: module (or package prefix) → why the template must not import it
DENY: dict[str, str] = {
    "__main__": "the script itself",
    "__mp_main__": "the script itself (multiprocessing's name for it)",
    "pycuda": "pycuda.autoinit creates a CUDA context at import: a forked rank could not use it",
    "tensorflow": "starts thread pools and may claim the GPU at import",
    "jax": "may start its backends (threads, the GPU) at import",
    "jaxlib": "may start its backends (threads, the GPU) at import",
    "ray": "connects to or starts a cluster runtime",
    "wandb": "experiment tracker: service processes and threads, per rank",
    "mlflow": "experiment tracker: patches frameworks and starts threads, per rank",
    "comet_ml": "experiment tracker: patches frameworks at import, per rank",
    "neptune": "experiment tracker: starts threads, per rank",
    "clearml": "experiment tracker: patches frameworks at import, per rank",
    "torch._inductor.async_compile": "starts its compile worker pool at import",
    "torch._inductor.compile_worker": "the compile worker pool's processes",
    "pytest": "a test harness, not the job",
    "_pytest": "a test harness, not the job",
    "IPython": "an interactive shell, not the job",
    "ipykernel": "an interactive kernel, not the job",
}

_BASE: frozenset[str] = frozenset()
_RECORDED = False


def baseline() -> None:
    """Note what this process has imported so far (the spare's own modules)."""
    global _BASE
    _BASE = frozenset(sys.modules)


def _lib_roots() -> tuple[str, ...]:
    roots = {p for k in ("stdlib", "platstdlib", "purelib", "platlib")
             if (p := sysconfig.get_paths().get(k))}
    roots |= {p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)}
    return tuple(os.path.realpath(r) + os.sep for r in roots)


def _kind(name: str, mod: Any, roots: tuple[str, ...]) -> str:
    if name.partition(".")[0] == "trainguard":
        return "lib"  # importable in the template as it is
    f = getattr(mod, "__file__", None)
    if not f:
        return "lib"  # built-in, frozen, or a namespace package
    return "lib" if os.path.realpath(f).startswith(roots) else "job"


def record(path: str | None = None) -> bool:
    """Write this process's imports beyond ``baseline`` to ``path`` (default: ``$TG_JOB_IMPORTS_FILE``),
    once per process: ``{"modules": [[name, kind], …], "rank": r, "pid": p}``. Returns True
    when written; never raises (an unwritable run directory costs only the warm imports)."""
    global _RECORDED
    path = path or os.environ.get(ENV_FILE, "")
    if _RECORDED or not path:
        return False
    _RECORDED = True
    try:
        roots = _lib_roots()
        mods = [[n, _kind(n, m, roots)] for n, m in list(sys.modules.items())
                if n not in _BASE and m is not None]
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump({"modules": mods, "rank": int(os.environ.get("RANK", "0") or 0),
                       "pid": os.getpid()}, fh)
        os.replace(tmp, path)
        return True
    except (OSError, ValueError, TypeError) as exc:
        print(f"trainguard: could not record the job's imports in {path}: {exc}",
              file=sys.stderr, flush=True)
        return False


def _denied(name: str) -> str:
    for prefix, why in DENY.items():
        if name == prefix or name.startswith(prefix + "."):
            return f"{prefix}: {why}"
    return ""


def select(entries: list[list[str]], have: set[str] | frozenset[str] = frozenset()
           ) -> tuple[list[str], dict[str, str]]:
    """``(to import, skipped)`` of a rank's record (``[[name, kind], …]``, in import order):
    modules not in ``have``, in order; ``skipped`` maps each skipped top-level package (or
    denied prefix) to why. Raises ``ValueError`` on a malformed record."""
    chosen: list[str] = []
    skipped: dict[str, str] = {}
    for e in entries:
        if not (isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str)):
            raise ValueError(f"not a [name, kind] pair: {e!r}")
        name, kind = e
        if name in have:
            continue
        top = name.partition(".")[0]
        why = _denied(name)
        if why:
            skipped.setdefault(why.partition(":")[0], why.partition(": ")[2])
        elif kind != "lib":
            skipped.setdefault(top, "the job's own code, not an installed package")
        else:
            chosen.append(name)
    return chosen, skipped


def import_all(names: list[str], budget_s: float) -> dict[str, Any]:
    """Import ``names`` in order in this process until ``budget_s`` seconds are spent. Returns
    ``{"imported": n (of ``names``, now imported that were not before), "failed": {name: error} (the first 10), "n_failed": k,
    "over_budget": m (not tried), "seconds": s, "threads": [module that started a thread],
    "cuda": bool (CUDA initialised after)}``."""
    t0 = time.monotonic()
    before = set(sys.modules)
    failed, n_failed, threads = {}, 0, []
    over = 0
    for i, name in enumerate(names):
        if time.monotonic() - t0 > budget_s:
            over = len(names) - i
            break
        if name in sys.modules:
            continue
        threads_before = threading.active_count()
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any module may fail; SystemExit too
            n_failed += 1
            if len(failed) < 10:
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]
        if threading.active_count() > threads_before:
            threads.append(name)
    imported = sum(1 for n in names if n in sys.modules and n not in before)
    cuda = False
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            cuda = bool(torch.cuda.is_initialized())
        except Exception:  # noqa: BLE001
            cuda = False
    return {"imported": imported, "failed": failed, "n_failed": n_failed, "over_budget": over,
            "seconds": round(time.monotonic() - t0, 3), "threads": threads, "cuda": cuda}


def import_file(path: str, budget_s: float) -> dict[str, Any]:
    """``import_all`` of the JSON list of module names in file ``path``; a file that cannot be
    read gives ``{"error": why}`` and imports nothing."""
    try:
        with open(path) as fh:
            names = json.load(fh)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("not a list of module names")
    except (OSError, ValueError) as exc:
        return {"error": f"{path}: {exc}"}
    return import_all(names, budget_s)

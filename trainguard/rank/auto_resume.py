"""A restarted framework job resumes from its newest complete checkpoint instead of step 0.

Inside a rank of an unmodified script (``trainguard.rank.hooks.install`` calls ``install``), the
entry points of two frameworks are wrapped once their modules are imported (at once when they
already are, e.g. in a spare warmed with the job's imports; else by a finder on
``sys.meta_path`` that patches the module right after it executes):

* Hugging Face ``transformers.Trainer.train(resume_from_checkpoint=None)``: the newest complete
  ``checkpoint-N`` of ``args.output_dir``;
* Lightning ``Trainer.fit(..., ckpt_path=None)`` (``lightning.pytorch`` and
  ``pytorch_lightning``): the newest complete ``*.ckpt`` of the Trainer's ``ModelCheckpoint``
  directories (their ``dirpath``; without one, where Lightning puts them:
  ``<default_root_dir>/checkpoints``, or ``<save_dir>/<name>/version_*/checkpoints`` of its
  first logger, every version: a restarted logger starts a new one).

"Complete" is ``trainguard.rank.framework_checkpoints``'s: every file the framework writes is
there, none is empty, archives are whole and match their CRC-32; an incomplete candidate is
named on stderr and skipped. A wrapper acts only

* in a restart generation: ``TORCHELASTIC_RESTART_COUNT`` > 0 or ``TG_GENERATION`` > 0 (the
  worker group was restarted; a first start trains from where the script says);
* when the script gave no checkpoint of its own (the argument is None; ``False``, a path, or
  ``"last"`` are the script's choice and left alone);
* on the first call in the process (a second ``fit``/``train`` of the same script is its own);
* unless ``TG_AUTO_RESUME=0`` (``trainguard launch --no-auto-resume``).

What it chose is said on stderr, which the launcher relays to its log:
``trainguard: resuming from <path> (step N) …``, or that there was none.
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
from typing import Any, Callable

__all__ = ["ENV", "wanted", "install", "lightning_dirs"]

#: ``0`` turns automatic resumption off (``trainguard launch --no-auto-resume`` sets it)
ENV = "TG_AUTO_RESUME"

_done: set[str] = set()  # "hf", "lightning": the first call of that framework was seen
_installed = False
#: told the completed step (0-based) a framework resumed from (``hooks.restored``)
_on_restored: Callable[[int], None] | None = None


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


def wanted() -> bool:
    """True in a restart generation with automatic resumption not turned off."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _int_env("TORCHELASTIC_RESTART_COUNT") > 0 or _int_env("TG_GENERATION") > 0


def _say(text: str) -> None:
    print(f"trainguard: {text}", file=sys.stderr, flush=True)


def _restored(step: int) -> None:
    if _on_restored is not None:
        _on_restored(step - 1)  # a checkpoint of `step` completed steps: 0 … step-1


def _first(framework: str) -> bool:
    if framework in _done:
        return False
    _done.add(framework)
    return True


# ---- Hugging Face ------------------------------------------------------------------------------
def _patch_hf(module: Any) -> None:
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls.train, "_tg_auto_resume", False):
        return
    orig = cls.train

    @functools.wraps(orig)
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is None and _first("hf") and wanted():
            from trainguard.rank.framework_checkpoints import newest_hf_checkpoint

            out = self.args.output_dir
            path = newest_hf_checkpoint(out) if out else None
            if path is not None:
                step = int(os.path.basename(os.path.normpath(path)).rpartition("-")[2])
                _say(f"resuming from {path} (step {step}): the worker group was restarted and "
                     f"Trainer.train was given no checkpoint ({ENV}=0 or --no-auto-resume: "
                     f"start from step 0 instead)")
                _restored(step)
                resume_from_checkpoint = path
            else:
                _say(f"no complete checkpoint-N in {out!r} to resume from: training from "
                     f"step 0")
        return orig(self, resume_from_checkpoint, *args, **kwargs)

    train._tg_auto_resume = True  # type: ignore[attr-defined]
    cls.train = train


# ---- Lightning ---------------------------------------------------------------------------------
def lightning_dirs(trainer: Any) -> list[str]:
    """Where ``trainer``'s ``ModelCheckpoint`` callbacks write (module docstring)."""
    dirs = [os.fspath(cb.dirpath) for cb in getattr(trainer, "checkpoint_callbacks", [])
            if getattr(cb, "dirpath", None)]
    if dirs or not getattr(trainer, "checkpoint_callbacks", []):
        return dirs
    root = os.fspath(getattr(trainer, "default_root_dir", "") or os.getcwd())
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers:
        return [os.path.join(root, "checkpoints")]
    import glob

    lg = loggers[0]
    save_dir = getattr(lg, "save_dir", None) or root
    name = str(getattr(lg, "name", "") or "")
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(save_dir)), glob.escape(name),
                                         "version_*", "checkpoints")))


def _patch_lightning(module: Any) -> None:
    cls = getattr(module, "Trainer", None)
    if cls is None or getattr(cls.fit, "_tg_auto_resume", False):
        return
    orig = cls.fit
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def fit(self, *args, **kwargs):
        try:
            ba = sig.bind(self, *args, **kwargs)
        except TypeError:
            return orig(self, *args, **kwargs)  # Lightning says what is wrong with the call
        if ba.arguments.get("ckpt_path") is None and _first("lightning") and wanted():
            from trainguard.rank.framework_checkpoints import newest_lightning_checkpoint

            dirs = lightning_dirs(self)
            path, step = newest_lightning_checkpoint(dirs)
            if path is not None:
                _say(f"resuming from {path} (step {step}): the worker group was restarted and "
                     f"Trainer.fit was given no ckpt_path ({ENV}=0 or --no-auto-resume: start "
                     f"from step 0 instead)")
                _restored(int(step or 0))
                ba.arguments["ckpt_path"] = path
                return orig(*ba.args, **ba.kwargs)
            _say(f"no complete checkpoint in {dirs} to resume from: training from step 0")
        return orig(self, *args, **kwargs)

    fit._tg_auto_resume = True  # type: ignore[attr-defined]
    cls.fit = fit


#: module → the patch applied right after it is imported
PATCHES: dict[str, Callable[[Any], None]] = {
    "transformers.trainer": _patch_hf,
    "lightning.pytorch.trainer.trainer": _patch_lightning,
    "pytorch_lightning.trainer.trainer": _patch_lightning,
}


class _Loader(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, inner: Any, patch: Callable[[Any], None]):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.patch(module)
        except Exception as exc:  # noqa: BLE001 - never break the job's import
            _say(f"could not wrap {module.__name__} for automatic resumption: {exc!r}")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``PATCHES``' modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


def install(on_restored: Callable[[int], None] | None = None) -> None:
    """Wrap the frameworks' entry points in this process (idempotent; cheap when neither is
    imported: one finder on ``sys.meta_path``). Installed in every rank; the wrappers decide
    at call time (``wanted``). ``on_restored(step)`` is told the completed step (0-based) a
    framework resumed from (``trainguard.rank.hooks`` passes its ``restored``)."""
    global _installed, _on_restored
    _on_restored = on_restored or _on_restored
    if _installed:
        return
    _installed = True
    for name, patch in PATCHES.items():
        mod = sys.modules.get(name)
        if mod is not None:
            patch(mod)
    sys.meta_path.insert(0, _Finder())

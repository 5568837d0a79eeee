"""Which framework checkpoint a restarted job may resume from: the newest *complete* one.

Framework-free (no ``transformers`` or ``lightning`` import), so that ``trainguard.rank.auto_resume``
and the Hugging Face and Lightning integrations share one definition of "complete":

* **Hugging Face** ``checkpoint-N`` (``checkpoint_complete``): its ``trainer_state.json`` (which
  the Trainer writes last) names step N; model weights are there (every shard of an index);
  ``optimizer.pt`` too; no file is empty (a zero-byte shard is a save killed before its first
  write); every ``.safetensors`` file ends where its header says and every ``torch.save`` file
  (``.pt``, ``.pth``, ``.bin``) is a whole zip archive whose records match their CRC-32.
* **Lightning** ``*.ckpt`` (``lightning_checkpoint_complete``): a file with trainguard's
  ``.tgsum`` sidecar (``TrainguardCheckpointIO``) must match it (size and xxh3 checksum);
  another (Lightning's own ``torch.save``) must be non-empty, a whole archive whose records
  match their CRC-32, and hold a ``global_step``.

``newest_hf_checkpoint`` and ``newest_lightning_checkpoint`` name every incomplete candidate
they skip on stderr (``trainguard: not resuming from <path>: <why>``) and leave it in place.
Both read every candidate file once (the CRC-32 check): seconds for a checkpoint of gigabytes.
"""
from __future__ import annotations

import glob
import json
import os
import re
import struct
import sys
import zipfile
from typing import Any

__all__ = ["checkpoint_complete", "newest_hf_checkpoint", "lightning_checkpoint_complete",
           "newest_lightning_checkpoint", "TRAINER_STATE", "WEIGHTS"]

_CKPT = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
           "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


def _skip(path: str, why: str) -> None:
    print(f"trainguard: not resuming from {path}: {why}", file=sys.stderr, flush=True)


def safetensors_ok(path: str) -> str:
    """'' when the file's header parses and its tensors end exactly at the file's end; else
    why not."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "shorter than its header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return "header longer than the file (truncated)"
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            return "header is not JSON"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end != size:
        return f"{size} bytes, its header says {8 + n + end} (truncated)"
    return ""


def torch_file_ok(path: str, crc: bool = True) -> str:
    """'' when a ``torch.save`` file (a zip archive) is whole: not empty, its central directory
    is there and, with ``crc``, every record matches its CRC-32; else why not."""
    try:
        if os.path.getsize(path) == 0:
            return "empty (0 bytes)"
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if crc else None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"not a whole torch file ({exc})"
    except Exception as exc:  # noqa: BLE001 - zlib/struct errors of a damaged archive
        return f"damaged ({exc!r})"
    return f"record {bad} fails its CRC-32 (corrupt)" if bad else ""


# ---- Hugging Face ------------------------------------------------------------------------------
def checkpoint_complete(path: str, require_optimizer: bool = True,
                        crc: bool = True) -> tuple[bool, str]:
    """``(complete, reason)`` of a Trainer checkpoint directory ``checkpoint-N`` (module
    docstring; ``require_optimizer``: ``optimizer.pt`` must be there; ``crc``: check the
    CRC-32 of every record of the ``torch.save`` files, reading them once)."""
    m = _CKPT.match(os.path.basename(os.path.normpath(path)))
    if not os.path.isdir(path):
        return False, "not a directory"
    try:
        with open(os.path.join(path, TRAINER_STATE)) as fh:
            st = json.load(fh)
    except FileNotFoundError:
        return False, f"no {TRAINER_STATE} (the save did not finish)"
    except (OSError, ValueError) as exc:
        return False, f"{TRAINER_STATE} unreadable ({exc})"
    if m and st.get("global_step") != int(m.group(1)):
        return False, f"{TRAINER_STATE} is of step {st.get('global_step')}"
    names = set(os.listdir(path))
    empty = sorted(n for n in names if os.path.isfile(os.path.join(path, n))
                   and os.path.getsize(os.path.join(path, n)) == 0)
    if empty:
        return False, f"empty files (0 bytes): {empty}"
    weights = [w for w in WEIGHTS if w in names]
    if not weights:
        return False, "no model weights"
    for w in weights:
        if w.endswith(".index.json"):
            try:
                with open(os.path.join(path, w)) as fh:
                    shards = set(json.load(fh)["weight_map"].values())
            except (OSError, ValueError, KeyError) as exc:
                return False, f"{w} unreadable ({exc})"
            missing = sorted(shards - names)
            if missing:
                return False, f"shards missing: {missing}"
    if require_optimizer and "optimizer.pt" not in names:
        return False, "no optimizer.pt"
    for n in sorted(names):
        p = os.path.join(path, n)
        if n.endswith(".safetensors"):
            why = safetensors_ok(p)
        elif n.endswith((".pt", ".pth", ".bin")):
            why = torch_file_ok(p, crc)
        else:
            continue
        if why:
            return False, f"{n}: {why}"
    return True, ""


def newest_hf_checkpoint(output_dir: str, require_optimizer: bool = True,
                         crc: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` under ``output_dir`` (by N), for
    ``Trainer.train(resume_from_checkpoint=...)``; None when there is none (a first start).
    Incomplete ones are named on stderr and left where they are (the Trainer overwrites a
    directory of the same step when it gets there again)."""
    try:
        entries = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = sorted(((int(m.group(1)), n) for n in entries if (m := _CKPT.match(n))),
                   reverse=True)
    for _, n in steps:
        p = os.path.join(output_dir, n)
        ok, why = checkpoint_complete(p, require_optimizer, crc)
        if ok:
            return p
        _skip(p, why)
    return None


# ---- Lightning ---------------------------------------------------------------------------------
def _lightning_meta(path: str) -> dict[str, Any] | None:
    """``global_step`` and ``epoch`` of a Lightning checkpoint file (its tensors memory-mapped,
    not read); None when it does not load or holds no ``global_step``."""
    import torch

    try:
        ck = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 - a damaged or foreign file: not a candidate
        return None
    if not isinstance(ck, dict) or not isinstance(ck.get("global_step"), int):
        return None
    return {"global_step": ck["global_step"], "epoch": ck.get("epoch")}


def lightning_checkpoint_complete(path: str, crc: bool = True
                                  ) -> tuple[bool, str, int | None]:
    """``(complete, reason, global_step)`` of one Lightning checkpoint file (module docstring).
    ``global_step`` is None when it is not complete."""
    from trainguard.rank.verified_file import read_sidecar, verify

    real = os.path.realpath(path)
    try:
        if os.path.getsize(real) == 0:
            return False, "empty (0 bytes)", None
    except OSError as exc:
        return False, f"cannot read it ({exc.strerror or exc})", None
    if read_sidecar(real) is not None:  # written by TrainguardCheckpointIO: its commit record
        ok, why, side = verify(real)
        if not ok:
            return False, why, None
        step = ((side or {}).get("meta") or {}).get("global_step")
        if isinstance(step, int):
            return True, "", step
    else:
        why = torch_file_ok(real, crc)
        if why:
            return False, why, None
    meta = _lightning_meta(real)
    if meta is None:
        return False, "does not load as a Lightning checkpoint (no global_step)", None
    return True, "", meta["global_step"]


def newest_lightning_checkpoint(dirs: list[str], crc: bool = True
                                ) -> tuple[str | None, int | None]:
    """``(path, global_step)`` of the newest complete ``*.ckpt`` in any of ``dirs`` (by global
    step, then modification time: ``last.ckpt`` and the step file of the same save tie and
    either is the same state); ``(None, None)`` when there is none."""
    found = []
    for d in dirs:
        for p in glob.glob(os.path.join(glob.escape(d), "*.ckpt")):
            try:
                found.append((os.path.getmtime(p), p))
            except OSError:
                continue
    results = []
    for mtime, p in sorted(found, reverse=True):
        ok, why, step = lightning_checkpoint_complete(p, crc)
        if ok:
            results.append((step, mtime, p))
        else:
            _skip(p, why)
    if not results:
        return None, None
    step, _, p = max(results)
    return p, step

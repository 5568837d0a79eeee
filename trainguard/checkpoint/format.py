"""On-disk format of a trainguard checkpoint (torch-free: the writer process and the validator
use it without importing torch).

A committed checkpoint is a directory ``<root>/step_<step:010d>_g<generation:04d>/`` holding a
plain torch.distributed.checkpoint (DCP) checkpoint — ``.metadata`` and one
``__<rank>_0.distcp`` per rank of the saving world (every rank writes one, possibly empty) — and
``manifest.json``, written last. ``torch.distributed.checkpoint.load`` reads the directory as it
is; trainguard's extra file is ignored by DCP.

The directory is built under ``<root>/.tmp-<name>-<nonce>/`` and renamed into place once every
file and the directory itself are fsynced: a directory with the final name and a manifest is
committed; anything else (a ``.tmp-*`` directory, a final name without a manifest) is not, and is
never restored.

``manifest.json`` (JSON object, version ``MANIFEST_FORMAT``)::

    format        "trainguard.ckpt/1"
    job, step, generation, world_size
    loss          float | null — the loss recorded at save time (post-recovery verification)
    created_ns    Unix ns of the commit
    checksum      "xxh3_64" — algorithm of every checksum below (16 lowercase hex digits)
    manifest_checksum  xxh3_64 of the manifest itself (``manifest_body_checksum``)
    files         [{"name", "bytes", "checksum", "rank"}]  — rank is null for ".metadata"
    keys          {state key: {"shape": [int], "dtype": "float32"} | {"type": "bytes"}}
                  — the global state dict (model and optimizer), flattened DCP keys
    items         [{"key", "offsets", "file", "offset", "length", "data_offset", "nbytes",
                    "dtype", "shape", "checksum", "kind"}]
                  — every write item: its DCP storage location (``offset``/``length`` of the
                  torch.save blob in ``file``), where the raw tensor bytes lie in the file
                  (``data_offset``/``nbytes``), and the xxh3_64 of those raw bytes (tensors) or of
                  the blob (``kind`` "bytes"); ``offsets`` are the chunk offsets of a shard.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

MANIFEST = "manifest.json"
METADATA = ".metadata"
MANIFEST_FORMAT = "trainguard.ckpt/1"
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{10})_g(\d{4,})$")


# Bit patterns of the values that are not finite, per floating dtype: an element is NaN or ±Inf
# exactly when ``bits & mask == value`` (bits read as an unsigned integer of ``width`` bytes,
# little-endian). IEEE 754 binary16/32/64 and bfloat16: the exponent field all ones. float8
# formats from "FP8 Formats for Deep Learning" (Micikevicius et al., 2022): e5m2 follows IEEE;
# e4m3fn has no Inf and one NaN per sign (S.1111.111); the *fnuz variants have a single NaN,
# 0x80. Complex dtypes are checked as their real components.
NONFINITE_BITS: dict[str, tuple[int, int, int]] = {
    "float64": (8, 0x7FF0000000000000, 0x7FF0000000000000),
    "complex128": (8, 0x7FF0000000000000, 0x7FF0000000000000),
    "float32": (4, 0x7F800000, 0x7F800000),
    "complex64": (4, 0x7F800000, 0x7F800000),
    "float16": (2, 0x7C00, 0x7C00),
    "complex32": (2, 0x7C00, 0x7C00),
    "bfloat16": (2, 0x7F80, 0x7F80),
    "float8_e5m2": (1, 0x7C, 0x7C),
    "float8_e4m3fn": (1, 0x7F, 0x7F),
    "float8_e4m3fnuz": (1, 0xFF, 0x80),
    "float8_e5m2fnuz": (1, 0xFF, 0x80),
}


class NonfiniteCounter:
    """Counts NaN/±Inf elements in the raw little-endian bytes of one tensor of ``dtype`` (a
    name such as ``"bfloat16"``), fed in chunks with ``update``; ``count`` is the total so far.
    Dtypes that are not floating count 0. Torch-free (numpy, imported on the first floating
    tensor); scratch arrays are sized by the largest chunk and reused. Chunks must hold whole
    elements. Rules: ``NONFINITE_BITS``."""

    def __init__(self, dtype: str):
        self.count = 0
        self._rule = NONFINITE_BITS.get(dtype)
        if self._rule is not None:
            import numpy as np

            width, mask, value = self._rule
            self._ut = np.dtype(f"<u{width}")
            self._mask, self._value = self._ut.type(mask), self._ut.type(value)
        self._scratch = None

    def update(self, chunk) -> None:
        if self._rule is None:
            return
        import numpy as np

        words = np.frombuffer(chunk, dtype=self._ut)
        n = len(words)
        if self._scratch is None or len(self._scratch[0]) < n:
            self._scratch = (np.empty(n, dtype=self._ut), np.empty(n, dtype=bool))
        tmp, hits = self._scratch[0][:n], self._scratch[1][:n]
        np.bitwise_and(words, self._mask, out=tmp)
        np.equal(tmp, self._value, out=hits)
        if hits.any():
            self.count += int(np.count_nonzero(hits))


def shard_file(rank: int) -> str:
    """Name of the DCP data file written by ``rank`` (DCP's own naming: ``__<rank>_0.distcp``)."""
    return f"__{rank}_0.distcp"


def result_file(rank: int) -> str:
    """Per-rank result note left in the temporary directory until the commit (JSON)."""
    return f"__{rank}.result.json"


def checkpoint_name(step: int, generation: int) -> str:
    """Directory name of the checkpoint of ``step`` saved in ``generation``."""
    return f"step_{int(step):010d}_g{int(generation):04d}"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(step, generation)`` of a committed directory name, None for anything else."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class Entry:
    """A directory under the checkpoint root with a committed name; ``committed`` is True when
    its manifest exists."""

    path: str
    step: int
    generation: int
    committed: bool


def list_checkpoints(root: str) -> list[Entry]:
    """Committed-name directories under ``root``, newest first (by step, then generation).
    A missing ``root`` gives ``[]``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        parsed = parse_name(n)
        if parsed is None:
            continue
        p = os.path.join(root, n)
        out.append(Entry(p, parsed[0], parsed[1], os.path.exists(os.path.join(p, MANIFEST))))
    out.sort(key=lambda e: (e.step, e.generation), reverse=True)
    return out


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``. Raises FileNotFoundError when there is
    none (the checkpoint was never committed) and ValueError when it is not a valid manifest."""
    with open(os.path.join(path, MANIFEST), "rb") as fh:
        raw = fh.read()
    try:
        m = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: manifest is not JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    for k in ("step", "world_size", "files", "items"):
        if k not in m:
            raise ValueError(f"{path}: manifest lacks {k!r}")
    return m


def manifest_body_checksum(m: dict[str, Any]) -> str:
    """xxh3_64 of the manifest's canonical JSON (sorted keys, no spaces) without its own
    ``manifest_checksum`` field: any change to the manifest, a flipped digit included, shows."""
    import xxhash

    body = {k: v for k, v in m.items() if k != "manifest_checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True,
                                               separators=(",", ":")).encode())


def fsync_dir(path: str) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary name and a rename, so that a reader sees
    the whole file or none; ``fsync=True`` also makes it durable before the rename (files of a
    checkpoint). ``fsync=False`` is for transient notes that a crash makes moot anyway (each
    fsync is a journal commit on the checkpoint disk, which the training pays for here)."""
    tmp = path + ".part"
    with open(tmp, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def plan_retention(entries: list[tuple[str, int, int, str]], keep: int) -> list[str]:
    """Which checkpoint directories retention deletes.

    ``entries``: ``[(path, step, generation, status)]`` with status ``valid`` | ``invalid`` |
    ``pending``; ``keep``: K ≥ 1. Keeps the newest K valid checkpoints and everything newer than
    the K-th newest valid one (pending ones may still turn out valid, invalid ones are kept for
    inspection until they age out); deletes everything older. So the newest valid checkpoint is
    never deleted, and nothing is deleted while fewer than K are known valid.
    """
    keep = max(1, int(keep))
    ordered = sorted(entries, key=lambda e: (e[1], e[2]), reverse=True)
    seen_valid = 0
    out: list[str] = []
    for path, _step, _gen, status in ordered:
        if seen_valid >= keep:
            out.append(path)
        elif status == "valid":
            seen_valid += 1
    return out

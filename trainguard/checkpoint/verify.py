"""The checkpoint check: shared by the validator service (``trainguard.checkpoint_validator``)
and ``Checkpointer.restore()``, so that both judge a checkpoint by one rule. Torch-free at import
(the metadata and NaN/Inf checks import torch when they run).

``validate_checkpoint(path)`` reads a committed checkpoint directory (format:
``trainguard.checkpoint.format``) and returns a ``Report``; it never raises for a bad
checkpoint — every problem becomes a reason. Checks, in order (rules from issue 4 and
docs/protocol.md):

1. the manifest exists and parses (no manifest = never committed);
   and its own checksum (``manifest_checksum``) matches; and the replicas certified the save
   (``"certified"`` not false: their state digests agreed, and the state was not stale —
   ``replicas.certify``);
2. every rank's shard file of the saving world is listed, and every listed file exists with the
   listed size and xxh3_64 checksum;
3. the DCP ``.metadata`` agrees with the manifest: the same state keys with the same global
   shapes and dtypes, and the same storage location (file, offset, length) for every item;
4. no NaN or ±Inf in any floating (or complex) tensor, optimizer state included.

``quick=True`` does 1–2 only (sizes and checksums): enough for a checkpoint the validator already
marked valid, because equal checksums mean equal bytes. Files are read in chunks into reused
buffers (not mapped), so validating does not grow the caller's resident memory; throughput is
printed by ``bench/checkpoint.py`` (``validation_gbps``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from trainguard.checkpoint import format as fmt

_FLOATING = {"float16", "bfloat16", "float32", "float64", "complex32", "complex64",
             "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


@dataclass
class Report:
    """Verdict on one checkpoint. ``bytes``: bytes read; ``duration_s``: wall seconds;
    ``gbps``: bytes / duration / 1e9. ``manifest`` is the parsed manifest (None when
    unreadable)."""

    path: str
    ok: bool
    step: int = -1
    reasons: list[str] = field(default_factory=list)
    bytes: int = 0
    duration_s: float = 0.0
    gbps: float = 0.0
    manifest: dict[str, Any] | None = None


_CHUNK = 8 << 20


def _file_checksum(path: str, buf: bytearray) -> str:
    """xxh3_64 of a whole file, read in chunks into a reused buffer (reading, unlike mapping,
    does not grow the caller's resident memory by the file size)."""
    h = xxhash.xxh3_64()
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(mv)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()


def validate_checkpoint(path: str, *, quick: bool = False, expected_step: int | None = None,
                        expected_world_size: int | None = None,
                        max_reasons: int = 20) -> Report:
    """Check the checkpoint directory ``path``; returns a ``Report`` (``ok`` and ``reasons``).

    ``expected_step`` / ``expected_world_size`` (from the ``ckpt.saved`` event) must match the
    manifest when given. At most ``max_reasons`` reasons are listed.
    """
    t0 = time.perf_counter()
    try:
        return _validate(path, t0, quick, expected_step, expected_world_size, max_reasons)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        rep = Report(path=path, ok=False)
        rep.reasons.append(f"manifest malformed ({type(exc).__name__}: {exc})")
        return _done(rep, t0, max_reasons)
    except OSError as exc:  # a file vanished or became unreadable while it was being read
        rep = Report(path=path, ok=False)
        rep.reasons.append(f"cannot read the checkpoint: {exc}")
        return _done(rep, t0, max_reasons)


def _validate(path: str, t0: float, quick: bool, expected_step: int | None,
              expected_world_size: int | None, max_reasons: int) -> Report:
    rep = Report(path=path, ok=False)
    try:
        m = fmt.read_manifest(path)
    except FileNotFoundError:
        if not os.path.isdir(path):
            rep.reasons.append("the checkpoint directory does not exist (never saved there, or "
                               "deleted by retention before it was validated)")
        else:
            rep.reasons.append("no manifest: the checkpoint was never committed (partial)")
        return _done(rep, t0)
    except (ValueError, OSError) as exc:
        rep.reasons.append(f"manifest unreadable: {exc}")
        return _done(rep, t0)
    rep.manifest = m
    rep.step = int(m.get("step", -1))
    reasons = rep.reasons
    if fmt.manifest_body_checksum(m) != m.get("manifest_checksum"):
        reasons.append("manifest checksum mismatch (the manifest was altered or damaged)")
        return _done(rep, t0, max_reasons)
    if m.get("certified") is False:  # the replicas disagreed, or the state was stale
        reasons.append("not certified at save: " + ("; ".join(m.get("certificate") or [])
                                                      or "no reason recorded"))
    world = int(m["world_size"])
    parsed = fmt.parse_name(os.path.basename(os.path.normpath(path)))
    if parsed is not None and (parsed[0] != rep.step or
                               parsed[1] != int(m.get("generation", parsed[1]))):
        reasons.append(f"manifest step {rep.step} / generation {m.get('generation')} do not "
                       f"match the directory name")
    if expected_step is not None and rep.step != expected_step:
        reasons.append(f"manifest step {rep.step} != saved step {expected_step}")
    if expected_world_size is not None and world != expected_world_size:
        reasons.append(f"manifest world size {world} != saved world size {expected_world_size}")
    if m.get("checksum", "xxh3_64") != "xxh3_64":
        reasons.append(f"unknown checksum algorithm {m.get('checksum')!r}")
        return _done(rep, t0)

    files = {f["name"]: f for f in m["files"]}
    for r in range(world):
        if fmt.shard_file(r) not in files:
            reasons.append(f"shard of rank {r} ({fmt.shard_file(r)}) missing from the manifest")
    if fmt.METADATA not in files:
        reasons.append("DCP .metadata missing from the manifest")
    sizes: dict[str, int] = {}
    buf = bytearray(_CHUNK)
    for name, f in files.items():
        p = os.path.join(path, name)
        try:
            size = os.stat(p).st_size
        except FileNotFoundError:
            reasons.append(f"{name}: file missing")
            continue
        if size != f["bytes"]:
            reasons.append(f"{name}: {size} bytes on disk, manifest says {f['bytes']} "
                           f"(truncated or overwritten)")
            continue
        sizes[name] = size
        rep.bytes += size
        got = _file_checksum(p, buf)
        if got != f["checksum"]:
            reasons.append(f"{name}: checksum {got} != manifest {f['checksum']} "
                           f"(corrupted bytes)")
    if reasons or quick:
        return _done(rep, t0, max_reasons)
    _check_metadata(m, path, reasons)
    _check_items(m, path, sizes, reasons)
    return _done(rep, t0, max_reasons)


def _done(rep: Report, t0: float, max_reasons: int = 20) -> Report:
    rep.duration_s = time.perf_counter() - t0
    rep.gbps = rep.bytes / rep.duration_s / 1e9 if rep.duration_s > 0 else 0.0
    if len(rep.reasons) > max_reasons:
        extra = len(rep.reasons) - max_reasons
        rep.reasons = rep.reasons[:max_reasons] + [f"… and {extra} more"]
    rep.ok = not rep.reasons
    return rep


def _check_metadata(m: dict, path: str, reasons: list[str]) -> None:
    import pickle

    import torch  # noqa: F401 - the pickle names torch classes
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    try:
        with open(os.path.join(path, fmt.METADATA), "rb") as fh:
            md = pickle.loads(fh.read())
        sdm = md.state_dict_metadata
        storage = md.storage_data
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a verdict
        reasons.append(f".metadata does not load: {type(exc).__name__}: {exc}")
        return
    keys = m.get("keys", {})
    if set(keys) != set(sdm):
        diff = sorted(set(keys) ^ set(sdm))[:5]
        reasons.append(f".metadata and manifest disagree on state keys (e.g. {diff})")
    for k, want in keys.items():
        got = sdm.get(k)
        if got is None:
            continue
        if "shape" in want:
            if not isinstance(got, TensorStorageMetadata):
                reasons.append(f"{k}: tensor in manifest, not in .metadata")
                continue
            gdt = str(got.properties.dtype).removeprefix("torch.")
            if list(got.size) != list(want["shape"]) or gdt != want["dtype"]:
                reasons.append(f"{k}: .metadata {list(got.size)} {gdt} != manifest "
                               f"{want['shape']} {want['dtype']}")
        elif not isinstance(got, BytesStorageMetadata):
            reasons.append(f"{k}: bytes in manifest, not in .metadata")
    if len(storage) != len(m["items"]):
        reasons.append(f".metadata has {len(storage)} storage entries, manifest "
                       f"{len(m['items'])} items")
    for it in m["items"]:
        off = it.get("offsets")
        idx = MetadataIndex(it["key"], torch.Size(off) if off is not None else None)
        si = storage.get(idx)
        if si is None:
            reasons.append(f"{it['key']}{off or ''}: no storage entry in .metadata")
            continue
        if (si.relative_path, si.offset, si.length) != (it["file"], it["offset"], it["length"]):
            reasons.append(f"{it['key']}: .metadata places it at {si.relative_path}@{si.offset}+"
                           f"{si.length}, manifest at {it['file']}@{it['offset']}+{it['length']}")


def _check_items(m: dict, path: str, sizes: dict[str, int], reasons: list[str]) -> None:
    """Ranges inside the files, then the finite check of every floating tensor: each item is
    read into one reused buffer (bounded by the largest item)."""
    import torch

    handles: dict[str, Any] = {}
    buf = bytearray(max([it["nbytes"] for it in m["items"]] + [1]))
    try:
        for it in m["items"]:
            size = sizes.get(it["file"])
            if size is None:
                reasons.append(f"{it['key']}: its file {it['file']} is not in the manifest")
                continue
            start, n = it["data_offset"], it["nbytes"]
            if start < 0 or start + n > size:
                reasons.append(f"{it['key']}: data range {start}+{n} outside {it['file']}")
                continue
            if it["kind"] != "tensor" or it.get("dtype") not in _FLOATING or n == 0:
                continue
            fh = handles.get(it["file"])
            if fh is None:
                fh = handles[it["file"]] = open(os.path.join(path, it["file"]), "rb",
                                                buffering=0)
            fh.seek(start)
            mv = memoryview(buf)[:n]
            got = 0
            while got < n:
                k = fh.readinto(mv[got:])
                if not k:
                    break
                got += k
            dtype = getattr(torch, it["dtype"])
            t = torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
            if t.is_complex():
                t = torch.view_as_real(t)
            if not _finite(t):
                bad = int((~torch.isfinite(t)).sum())
                what = "optimizer state" if it["key"].startswith("optimizer.") else "tensor"
                reasons.append(f"{it['key']}: {bad} NaN/Inf values in {what} (chunk "
                               f"{it.get('offsets')})")
    finally:
        for fh in handles.values():
            fh.close()


def _finite(t) -> bool:
    """True when every element is finite: the sum is finite unless a NaN/Inf is present (or
    the sum overflows, in which case the exact element check decides)."""
    import torch

    s = t.sum(dtype=torch.float64) if t.dtype == torch.float64 else t.sum()
    if bool(torch.isfinite(s)):
        return True
    return bool(torch.isfinite(t).all())

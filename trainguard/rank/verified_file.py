"""Single-file checkpoints written off the training loop and verified before they are loaded
(``TrainguardCheckpointIO`` of the Lightning integration).

A save has two parts:

* **Staging** (the caller waits): every tensor of the object is copied into a host buffer that
  is allocated on the first save and reused by the next ones (a copy into a reused buffer runs
  at memory speed, a fresh allocation several times slower; findings); CUDA tensors go into
  pinned buffers asynchronously and one synchronisation ends the staging. The rest of the
  object (numbers, strings, small containers) is copied as it is.
* **Writing** (a background thread): ``torch.save`` of the staged copy into
  ``<path>.tg-tmp-<pid>`` while the bytes are hashed (xxh3_64) as they pass, fsync, rename over
  ``<path>``, then the sidecar ``<path>.tgsum`` (JSON: format, size, checksum, the caller's
  metadata) through its own fsynced temporary and rename, then fsync of the directory. The
  sidecar is the commit record: a file is *valid* only when its sidecar exists, parses and
  names its exact size and checksum.

Overwriting a valid file in place (Lightning's ``last.ckpt``) first links the old version to
``<path>.tg-prev`` (with its sidecar), so that a crash between the data rename and the sidecar
rename still leaves one valid version; the link is dropped once the new version is committed.

One save is in flight at a time: the next save (and a load) first waits for the previous
write; a removal is queued behind the writes asked for before it. A failed write leaves the previous files as they were and
is reported on stderr; training goes on.
"""
from __future__ import annotations

import concurrent.futures
import copy
import glob
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from trainguard.checkpoint.format import fsync_dir, write_file_atomic

FORMAT = "trainguard.file/1"
SIDECAR = ".tgsum"
PREV = ".tg-prev"
TMP = ".tg-tmp-"
_CHUNK = 8 << 20


def sidecar_path(path: str) -> str:
    return path + SIDECAR


class _HashingWriter:
    """File-like that hashes what ``torch.save`` writes through it."""

    def __init__(self, fh):
        self._fh = fh
        self._h = xxhash.xxh3_64()
        self.nbytes = 0

    def write(self, b) -> int:
        self._h.update(b)
        n = self._fh.write(b)
        self.nbytes += n
        return n

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Stager:
    """Copies an object's tensors into host buffers kept from one save to the next (keyed by
    the tensor's place in the object, its shape and dtype)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, Any] = {}
        self.nbytes = 0

    def stage(self, obj: Any) -> Any:
        import torch

        self._cuda = False
        self.nbytes = 0
        out = self._copy(obj, (), torch)
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self, obj: Any, key: tuple, torch) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key, torch)
        if isinstance(obj, dict):
            new = copy.copy(obj)  # keeps the type and attributes (a state_dict's _metadata)
            for k, v in obj.items():
                new[k] = self._copy(v, key + (k,), torch)
            return new
        if isinstance(obj, list):
            return [self._copy(v, key + (i,), torch) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._copy(v, key + (i,), torch) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, t, key: tuple, torch):
        t = t.detach()
        plain = (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
                 and not t.is_quantized and t.device.type in ("cpu", "cuda"))
        if not plain:
            return copy.deepcopy(t)
        k = (key, t.dtype, tuple(t.shape))
        buf = self._bufs.get(k)
        if buf is None:
            cuda = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            self._bufs[k] = buf
        if t.device.type == "cuda":
            buf.copy_(t, non_blocking=True)
            self._cuda = True
        else:
            buf.copy_(t)
        self.nbytes += buf.numel() * buf.element_size()
        return buf

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def read_sidecar(path: str) -> dict | None:
    try:
        with open(sidecar_path(path), "rb") as fh:
            m = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None
    return m


def verify(path: str) -> tuple[bool, str, dict | None]:
    """``(valid, reason, sidecar)`` of the file at ``path`` (a symlink is followed)."""
    real = os.path.realpath(path)
    m = read_sidecar(real)
    if m is None:
        return False, f"no valid {SIDECAR} sidecar (never committed, or not written by trainguard)", None
    try:
        size = os.path.getsize(real)
    except OSError as exc:
        return False, f"cannot read it ({exc.strerror or exc})", m
    if size != m.get("bytes"):
        return False, f"{size} bytes, its sidecar says {m.get('bytes')} (truncated or replaced)", m
    h = xxhash.xxh3_64()
    try:
        with open(real, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    except OSError as exc:
        return False, f"cannot read it ({exc.strerror or exc})", m
    if h.hexdigest() != m.get("checksum"):
        return False, f"checksum {h.hexdigest()} != {m.get('checksum')} (corrupt)", m
    return True, "", m


def _order(m: dict) -> tuple:
    meta = m.get("meta") or {}

    def num(v: Any) -> int:
        return v if isinstance(v, int) and not isinstance(v, bool) else -1

    return num(meta.get("global_step")), num(meta.get("epoch")), num(m.get("created_ns"))


def newest_valid(dirpath: str, exclude: str | None = None, max_step: int | None = None,
                 suffix: str = ".ckpt") -> tuple[str | None, list[tuple[str, str]]]:
    """The newest valid file (by the sidecar's global step, epoch, then commit time) among
    ``*<suffix>`` and ``*<suffix>.tg-prev`` in ``dirpath``, other than ``exclude`` and not past
    ``max_step``; with the ``(path, reason)`` of every file rejected on the way."""
    found, rejected = [], []
    ex = os.path.realpath(exclude) if exclude else None
    names = glob.glob(os.path.join(glob.escape(dirpath), "*" + suffix))
    names += glob.glob(os.path.join(glob.escape(dirpath), "*" + suffix + PREV))
    for p in sorted(set(names)):
        if os.path.realpath(p) == ex:
            continue
        m = read_sidecar(os.path.realpath(p))
        if m is None:
            rejected.append((p, f"no valid {SIDECAR} sidecar"))
            continue
        if max_step is not None and _order(m)[0] > max_step:
            continue
        found.append((_order(m), p))
    for _, p in sorted(found, reverse=True):
        ok, why, _m = verify(p)
        if ok:
            return p, rejected
        rejected.append((p, why))
    return None, rejected


class AsyncFileSaver:
    """Stages an object, then writes it in a background thread (module docstring). Writes and
    removals run in the order they were asked for, one at a time."""

    def __init__(self, on_error: Callable[[str, BaseException], None] | None = None):
        self.stager = Stager()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tg-ckpt-io")
        self._lock = threading.Lock()
        self._tail: concurrent.futures.Future | None = None
        self._on_error = on_error
        self.errors: list[tuple[str, str]] = []
        self.saves: list[dict] = []  # per save: blocking_s, wait_s, stage_s, write_s, bytes

    def save(self, obj: Any, path: str, meta: dict | None = None) -> float:
        """Stage ``obj`` and start writing it to ``path``; returns the seconds the caller
        waited (for the previous write, then for the staging)."""
        t0 = time.perf_counter()
        self.wait()  # the staging buffers are the previous write's until it is done
        t1 = time.perf_counter()
        staged = self.stager.stage(obj)
        t2 = time.perf_counter()
        rec = {"path": path, "wait_s": t1 - t0, "stage_s": t2 - t1, "blocking_s": t2 - t0,
               "bytes": self.stager.nbytes}
        self.saves.append(rec)
        self._submit(self._write, staged, path, dict(meta or {}), rec)
        return t2 - t0

    def remove(self, path: str) -> None:
        """Remove ``path`` and its sidecar after the writes asked for before (a retention
        policy that drops the old file right after saving the new one never leaves neither)."""
        self._submit(self._remove, path)

    def wait(self) -> None:
        """Wait until every write and removal asked for so far is done."""
        with self._lock:
            tail = self._tail
        if tail is not None:
            concurrent.futures.wait([tail])

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)

    def _submit(self, fn, *args) -> None:
        with self._lock:
            self._tail = self._pool.submit(fn, *args)

    @staticmethod
    def _remove(path: str) -> None:
        for p in (sidecar_path(path), path):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass

    def _write(self, staged: Any, path: str, meta: dict, rec: dict) -> None:
        import torch

        t0 = time.perf_counter()
        d = os.path.dirname(os.path.abspath(path))
        tmp = f"{path}{TMP}{os.getpid()}"
        try:
            os.makedirs(d, exist_ok=True)
            for stale in glob.glob(glob.escape(path) + TMP + "*"):
                try:
                    os.remove(stale)  # left by a process killed while writing
                except OSError:
                    pass
            with open(tmp, "wb") as fh:
                w = _HashingWriter(fh)
                torch.save(staged, w)
                fh.flush()
                os.fsync(fh.fileno())
            prev = path + PREV
            kept_prev = False
            if os.path.exists(path) and not os.path.islink(path) and read_sidecar(path):
                # an in-place overwrite: keep the old version valid until the new one commits
                for p in (prev, sidecar_path(prev)):
                    if os.path.exists(p):
                        os.remove(p)
                os.link(path, prev)
                write_file_atomic(sidecar_path(prev), open(sidecar_path(path), "rb").read())
                kept_prev = True
            elif os.path.islink(path):
                os.remove(path)  # never write through a link (Lightning's save_last="link")
            os.replace(tmp, path)
            side = {"format": FORMAT, "checksum_algo": "xxh3_64", "bytes": w.nbytes,
                    "checksum": w.hexdigest(), "created_ns": time.time_ns(),
                    "file": os.path.basename(path), "meta": meta}
            write_file_atomic(sidecar_path(path), json.dumps(side, sort_keys=True).encode())
            fsync_dir(d)
            if kept_prev:
                for p in (sidecar_path(prev), prev):
                    os.remove(p)
            rec["write_s"] = time.perf_counter() - t0
        except BaseException as exc:
            try:
                os.remove(tmp)
            except OSError:
                pass
            self.errors.append((path, repr(exc)))
            print(f"trainguard: checkpoint save to {path} failed: {exc!r}; the previous "
                  "checkpoint stays, training goes on", file=sys.stderr, flush=True)
            if self._on_error is not None:
                self._on_error(path, exc)

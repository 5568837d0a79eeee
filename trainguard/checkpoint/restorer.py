"""Restore: find the newest valid checkpoint, load it, and check the training after it.

Lifecycle (collective: every rank of the checkpoint group calls ``Restorer.restore``)::

    rank 0     choose_checkpoint   newest first: skip uncommitted, marked invalid, failing the
                                   check (``verify``); the first that passes is the choice
    all ranks  broadcast           rank 0's ``Choice`` (path, step, loss, saving world size,
                                   why newer ones were passed over)
               load                from this node's staged copy when every rank's is
                                   byte-identical to the choice and the world is unchanged
                                   (all ranks agree), else with DCP from disk (any world size)
    later      recovery_check      the loss after the restore against the loss at save time
"""
from __future__ import annotations

import io
import logging
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash

from trainguard.checkpoint import collectives, statedict
from trainguard.checkpoint import format as fmt
from trainguard.checkpoint.config import DEFAULT_LOSS_TOLERANCE, CheckpointConfig
from trainguard.checkpoint.staging import read_meta, staging_path
from trainguard.checkpoint.verify import validate_checkpoint

log = logging.getLogger("trainguard.checkpoint")


@dataclass(frozen=True)
class Choice:
    """What restore loads: ``path`` (None: nothing valid), the manifest's ``step``, ``loss`` and
    ``world_size``, and ``reasons``: why each newer checkpoint was passed over."""

    path: str | None
    reasons: tuple[str, ...] = ()
    step: int | None = None
    loss: float | None = None
    world_size: int | None = None


def choose_checkpoint(root: str, index: Callable[[], dict | None],
                      reverify_valid: bool = True,
                      ended: Callable[[], dict[int, int] | None] | None = None) -> Choice:
    """The newest valid checkpoint under ``root``; reads files, no collectives.

    ``index``: returns the validator's verdicts (``index.fetch_index``) or None; called only
    when ``root`` holds checkpoints. One marked invalid is passed over; one marked valid is
    re-checked quickly (sizes and checksums) unless ``reverify_valid`` is False; one pending
    or unknown gets the validator's full check (``verify.validate_checkpoint``).

    ``ended``: returns when each past generation ended (``index.fetch_generation_ends``:
    generation → Unix ns) or None. A checkpoint of generation g whose manifest was written
    (``created_ns``) after g ended is passed over whatever its verdict: the ranks of an
    excluded or cut-off node go on until their lease runs out (``LEASE_S``), and a job on one
    node trains on alone meanwhile; what it saved then is the work of a run trainguard had
    fenced (issue 11: nothing of it is resumed from). Clocks: ``created_ns`` is the writer's,
    the end the remediator's or the new run's launcher's; a skew moves the fence by as much."""
    reasons: list[str] = []
    entries = fmt.list_checkpoints(root)
    idx = index() if entries else None
    ends = (ended() if ended is not None and entries else None) or {}
    for e in entries:
        name = os.path.basename(e.path)
        if not e.committed:
            reasons.append(f"{name}: not committed (no manifest)")
            continue
        late = _after_its_generation(e, ends)
        if late:
            reasons.append(f"{name}: {late}")
            continue
        st = idx.get(e.path) if idx is not None else None
        if st is not None and st.get("status") == "invalid":
            reasons.append(f"{name}: marked invalid by the validator: "
                           f"{'; '.join(st.get('reasons') or [])}")
            continue
        quick = st is not None and st.get("status") == "valid"
        if quick and not reverify_valid:
            try:
                manifest = fmt.read_manifest(e.path)
            except (OSError, ValueError) as exc:
                reasons.append(f"{name}: {exc}")
                continue
        else:
            rep = validate_checkpoint(e.path, quick=quick)
            if not rep.ok:
                reasons.append(f"{name}: {'; '.join(rep.reasons)}")
                continue
            manifest = rep.manifest
        return Choice(e.path, tuple(reasons), manifest["step"], manifest.get("loss"),
                      manifest["world_size"])
    return Choice(None, tuple(reasons))


def _after_its_generation(e: fmt.Entry, ends: dict[int, int]) -> str:
    """Why checkpoint ``e`` was written after its generation ended, or ""."""
    end = ends.get(e.generation)
    if end is None:
        return ""
    try:
        created = int(fmt.read_manifest(e.path).get("created_ns") or 0)
    except (OSError, ValueError, TypeError):
        return ""  # unreadable: the checks below say so
    if created <= end:
        return ""
    return (f"written by generation {e.generation} {(created - end) / 1e9:.2f} s after that "
            f"generation ended (a fenced run's remnant: an excluded or cut-off node that went "
            f"on until its lease ran out)")


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did: ``step`` and ``loss`` restored (None: nothing), ``source``
    ("disk" | "shm" | "none"), ``reason`` (why newer checkpoints were passed over, "" if none
    were), ``path``."""

    step: int | None
    loss: float | None
    source: str
    reason: str
    path: str | None

    @property
    def next_step(self) -> int:
        """The step to run next: the restored step + 1, or 0 when nothing was restored."""
        return 0 if self.step is None else self.step + 1


class Restorer:
    """Restores ``model`` (and ``optimizer``) for the rank ``rank`` of ``world_size`` in
    ``job`` from the checkpoints under ``root`` (default ``config.root``); ``group``: the
    checkpoint group (``collectives``); ``index``: the validator's verdicts
    (``choose_checkpoint``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 config: CheckpointConfig, job: str, rank: int, world_size: int, group: Any,
                 index: Callable[[], dict | None], root: str | None = None,
                 ended: Callable[[], dict[int, int] | None] | None = None):
        self.model, self.optimizer, self.config = model, optimizer, config
        self.job, self.rank, self.world_size, self.group = job, rank, world_size, group
        self.root = os.path.abspath(config.root if root is None else root)
        self.index, self.ended = index, ended
        self._staged: tuple | None = None  # (meta, mapping, manifest) of a verified copy

    def restore(self) -> RestoreResult:
        """Load the newest valid checkpoint; collective. Raises RuntimeError (DCP's) only when a
        checkpoint that verified fine fails to load into this model — e.g. a model whose state
        keys differ from the saved ones."""
        choice = None
        if self.rank == 0:
            choice = choose_checkpoint(self.root, self.index, self.config.reverify_valid,
                                       self.ended)
        choice = collectives.broadcast(choice, self.group, self.world_size)
        reason = "; ".join(choice.reasons)
        if choice.reasons:
            log.warning("restore passed over newer checkpoints: %s", reason)
        if choice.path is None:
            return RestoreResult(None, None, "none", reason, None)
        sd = statedict.restore_target(self.model, self.optimizer)
        dist = collectives.distributed(self.world_size)
        use_shm = self._shm_eligible(choice)
        if dist:
            use_shm = all(collectives.all_gather(use_shm, self.group, self.world_size))
        loaded = use_shm and self._load_shm_safe(sd, choice.path)
        if use_shm and dist:  # all from shm, or all through DCP (collective)
            loaded = all(collectives.all_gather(loaded, self.group, self.world_size))
        if not loaded:
            import torch.distributed.checkpoint as dcp

            if dist:
                dcp.load(sd, checkpoint_id=choice.path, process_group=self.group)
            else:
                dcp.load(sd, checkpoint_id=choice.path, no_dist=True)
        statedict.apply_state(self.model, self.optimizer, sd)
        return RestoreResult(int(choice.step), choice.loss, "shm" if loaded else "disk", reason,
                             choice.path)

    # ---- from this node's staged copy --------------------------------------------------------
    def _shm_eligible(self, choice: Choice) -> bool:
        try:
            return self._shm_check(choice)
        except Exception:  # noqa: BLE001 - anything odd: load from disk instead
            log.debug("staged copy not usable", exc_info=True)
            return False

    def _shm_check(self, choice: Choice) -> bool:
        """This rank's staged copy holds exactly the chosen checkpoint's bytes for every item
        of its local state, and the world is the one that saved it."""
        if not self.config.restore_from_shm or choice.world_size != self.world_size:
            return False
        spath = staging_path(self.config.shm_dir, self.job, self.rank)
        meta = read_meta(spath)
        if not meta or meta.get("step") != choice.step or \
                meta.get("world_size") != self.world_size or meta.get("rank") != self.rank:
            return False
        try:
            m = fmt.read_manifest(choice.path)
            with open(spath, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                data = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return False
        sums = {(it["key"], tuple(it["offsets"]) if it.get("offsets") is not None else None):
                it["checksum"] for it in m["items"] if it["kind"] == "tensor"}
        for k, (off, n, _dt, _shape) in meta["items"].items():
            want = sums.get(k)
            if want is None or xxhash.xxh3_64_hexdigest(memoryview(data)[off:off + n]) != want:
                return False
        self._staged = (meta, data, m)
        return True

    def _load_shm_safe(self, sd: dict[str, Any], path: str) -> bool:
        try:
            return self._load_shm(sd, path)
        except Exception:  # noqa: BLE001 - fall back to DCP from disk
            log.debug("restore from the staged copy failed", exc_info=True)
            return False
        finally:
            self._staged = None

    def _load_shm(self, sd: dict[str, Any], path: str) -> bool:
        """Fill ``sd`` from the verified staged copy; byte items come from the manifest'd
        shard files (small). Returns False (then DCP loads from disk) on any mismatch."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint._traverse import set_element

        if self._staged is None:
            return False
        meta, data, m = self._staged
        flat, mappings = flatten_state_dict(sd)
        items: dict[str, list] = {}
        for it in m["items"]:
            items.setdefault(it["key"], []).append(it)
        buf = torch.frombuffer(data, dtype=torch.uint8)
        staged: dict[str, list] = {}
        for kk, e in meta["items"].items():
            staged.setdefault(kk[0], []).append(e)
        for k, v in flat.items():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                hits = staged.get(k, [])
                if len(hits) != 1:
                    return False
                (off, n, dt, shape) = hits[0]
                if tuple(shape) != tuple(local.shape) or dt != str(local.dtype):
                    return False
                local.copy_(buf[off:off + n].view(local.dtype).view(local.shape))
            else:
                its = items.get(k)
                if not its:
                    return False
                it = its[0]
                with open(os.path.join(path, it["file"]), "rb") as fh:
                    fh.seek(it["offset"])
                    blob = fh.read(it["length"])
                if xxhash.xxh3_64_hexdigest(blob) != it["checksum"]:
                    return False
                obj = torch.load(io.BytesIO(blob), weights_only=False)
                set_element(sd, mappings[k], obj)
        return True


# ---- after the restore ---------------------------------------------------------------------
def loss_matches(loss_at_save: float | None, loss_after: float | None,
                 tolerance: float = DEFAULT_LOSS_TOLERANCE) -> bool | None:
    """The post-recovery check (schema ``recovery.verified``): True when ``loss_after`` is
    finite and ``|loss_after - loss_at_save| <= tolerance * max(1, |loss_at_save|)``; None when
    either loss is unknown. ``tolerance``: ``CheckpointConfig.loss_tolerance``."""
    if loss_at_save is None or loss_after is None:
        return None
    if not math.isfinite(loss_after):
        return False
    return abs(loss_after - loss_at_save) <= tolerance * max(1.0, abs(loss_at_save))


def recovery_check(restored_step: int | None, loss_at_save: float | None,
                   loss_after: float | None, tolerance: float) -> dict[str, Any]:
    """The fields of ``recovery.verified``: ``{"restored_step", "loss_at_save", "loss_after",
    "tolerance", "ok"}`` (``ok`` None when a loss is unknown)."""
    return {"restored_step": restored_step, "loss_at_save": loss_at_save,
            "loss_after": loss_after, "tolerance": tolerance,
            "ok": loss_matches(loss_at_save, loss_after, tolerance)}

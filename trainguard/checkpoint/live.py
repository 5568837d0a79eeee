"""Recovery from healthy peers: the state a process trains with, kept across the generations
of an in-process restart, and the collective that hands it to the ranks that lost theirs.

Lifecycle (``trainguard.run`` jobs; ``Checkpointer.restore`` runs it before any checkpoint)::

    training   LiveState.mark(step)      after each completed step (``ctx.progress``): the step,
                                         the random generators' states, the data position
    fault      the generation ends; CheckpointResources keeps the LiveState (model, optimizer)
    restore    report                    every rank: (step, digest of its state, digest of its
                                         generators) or "no state" (a replacement, or a state
                                         that moved past its last completed step)
               plan_recovery             ``replicas.plan_recovery`` on every rank's report
               peer path                 sources copy their kept state into the new model and
                                         optimizer and take their own generators back; the
                                         lowest-ranked source broadcasts its state to the
                                         receivers; every rank checks the digest of what it
                                         now holds against the agreed one
               any check fails           every rank takes the checkpoint path instead

The state moved past its step when an optimizer step started after the last ``mark`` (counted
by step hooks on the optimizer): the model then holds a step nobody reported complete.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import random
import sys
from typing import Any

import torch
import xxhash

from trainguard.checkpoint import collectives, statedict
from trainguard.checkpoint.replicas import NO_STATE, RecoveryPlan, Report, plan_recovery, state_digest

log = logging.getLogger("trainguard.checkpoint")


def capture_rng() -> dict[str, Any]:
    """The states of torch's CPU generator (and every CUDA device's, once CUDA is up), Python's
    ``random`` and, when the program imported numpy, numpy's global generator."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    return out


def apply_rng(state: dict[str, Any]) -> None:
    """Set the generators ``capture_rng`` captured (those of ``state``'s keys)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "random" in state:
        random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


def rng_digest(state: dict[str, Any] | None) -> str | None:
    """``"name=xxh3_64;…"`` of each generator's state (equal on ranks seeded alike)."""
    if state is None:
        return None
    out = []
    for k, v in sorted(state.items()):
        v = v.numpy().tobytes() if isinstance(v, torch.Tensor) else \
            [t.numpy().tobytes() for t in v] if k == "cuda" else v
        out.append(f"{k}={xxhash.xxh3_64_hexdigest(pickle.dumps(v, protocol=4))}")
    return ";".join(out)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under a DDP wrapper: holding the wrapper would hold its Reducer, and with it
    the ended generation's process group (see ``rendezvous.destroy_groups``)."""
    return getattr(model, "module", model) if type(model).__name__ == \
        "DistributedDataParallel" else model


class LiveState:
    """The model, optimizer and loop state one rank trains with. ``data``: an object with
    ``state_dict()``/``load_state_dict()`` holding the data position (a stateful loader or
    sampler), or None when the step alone says where the data is."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 data: Any = None):
        self.model, self.optimizer, self.data = _unwrap(model), optimizer, data
        self.step = NO_STATE
        self.loss: float | None = None
        self.rng: dict[str, Any] | None = None
        self.data_state: Any = None
        self._opt_started = self._opt_done = self._marked = 0
        self._hooks = []
        if optimizer is not None:
            self._hooks = [optimizer.register_step_pre_hook(self._pre),
                           optimizer.register_step_post_hook(self._post)]

    def _pre(self, *_a) -> None:
        self._opt_started += 1

    def _post(self, *_a) -> None:
        self._opt_done += 1

    def mark(self, step: int, loss: float | None = None) -> None:
        """``step`` completed: its state is what the model and optimizer hold now (≈ 0.2 ms
        here, mostly copying numpy's and Python's generator states)."""
        self.step, self.loss = int(step), loss
        self.rng = capture_rng()
        self.data_state = self.data.state_dict() if self.data is not None else None
        self._marked = self._opt_started

    def clean(self) -> bool:
        """No optimizer step started since the last ``mark``."""
        return self._opt_started == self._marked and self._opt_done == self._opt_started

    def state(self) -> dict[str, Any]:
        return statedict.get_state(self.model, self.optimizer)

    def digest(self) -> str | None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        return state_digest(flatten_state_dict(self.state())[0])

    def report(self, rank: int) -> Report:
        """What this rank offers at a recovery."""
        if self.step < 0:
            return Report(rank, why=f"rank {rank} completed no step in this process")
        if not self.clean():
            return Report(rank, why=f"rank {rank}: an optimizer step began after step "
                                    f"{self.step}")
        d = self.digest()
        if d is None:
            return Report(rank, why=f"rank {rank}: sharded state (not replicated)")
        return Report(rank, self.step, d, rng_digest(self.rng))

    def take(self, other: "LiveState") -> None:
        """Copy ``other``'s state (the previous generation's objects) into ours."""
        if other.model is not self.model:
            statedict.apply_state(self.model, self.optimizer, other.state())
        if other.rng is not None:
            apply_rng(other.rng)
        if self.data is not None and other.data_state is not None:
            self.data.load_state_dict(other.data_state)
        self.data_state = other.data_state

    def close(self) -> None:
        """Drop the optimizer hooks (the generation is over)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _broadcast_payload(payload: bytes | None, src: int, group: Any) -> bytes | None:
    """``payload`` of rank ``src`` on every rank: its length and checksum first, then the bytes
    as one uint8 tensor. None everywhere when ``src`` had nothing to send; raises ValueError on
    a rank whose copy does not match the checksum."""
    import torch.distributed as dist

    head = [(len(payload), xxhash.xxh3_64_hexdigest(payload)) if payload is not None else None]
    dist.broadcast_object_list(head, group=group, group_src=src)
    if head[0] is None:
        return None
    n, want = head[0]
    mine = payload is not None
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if mine and n else \
        torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, group=group, group_src=src)
    data = payload if mine else bytes(buf.numpy())
    if xxhash.xxh3_64_hexdigest(data) != want:
        raise ValueError(f"the state sent by rank {src} fails its checksum")
    return data


def _agree(ok: bool, err: str, group: Any, world_size: int) -> list[str]:
    """Every rank's error of a step that must succeed everywhere ([] when it did)."""
    return [e for good, e in collectives.all_gather_small((ok, err), group, world_size)
            if not good]


def peer_restore(live: LiveState, prev: LiveState | None, rank: int, world_size: int,
                 group: Any) -> RecoveryPlan:
    """Collective: restore ``live`` from healthy peers when the plan allows it. ``prev``: the
    state this process kept from its previous generation (None: a new process). Returns the
    plan followed; ``path == "checkpoint"`` means nothing was restored here (the caller loads
    the newest valid checkpoint) and its ``reason`` says why."""
    mine = prev.report(rank) if prev is not None else Report(rank, why=f"rank {rank} is new")
    reports = [Report(**r) for r in collectives.all_gather_small(
        dataclasses.asdict(mine), group, world_size)]
    plan = plan_recovery(reports, world_size)
    if plan.path != "peer":
        return plan
    ok, err = True, ""
    try:
        if rank in plan.sources:
            live.take(prev)
    except Exception as exc:  # noqa: BLE001 - any failure: every rank takes the checkpoint
        ok, err = False, f"rank {rank} could not take its kept state: {exc}"
        log.warning("peer restore: keeping the state failed", exc_info=True)
    bad = _agree(ok, err, group, world_size)
    if not bad and plan.receivers:
        ok, err = True, ""
        try:
            payload = None
            if rank == plan.src:
                bio = io.BytesIO()
                torch.save({"state": live.state(), "data": live.data_state,
                            "rng": {k: prev.rng[k] for k in plan.rng_shared}}, bio)
                payload = bio.getvalue()
            data = _broadcast_payload(payload, plan.src, group)
            if data is None:
                raise ValueError(f"rank {plan.src} sent nothing")
            if rank in plan.receivers:
                blob = torch.load(io.BytesIO(data), weights_only=False)
                statedict.apply_state(live.model, live.optimizer, blob["state"])
                apply_rng(blob["rng"])
                if live.data is not None and blob["data"] is not None:
                    live.data.load_state_dict(blob["data"])
                live.data_state = blob["data"]
        except Exception as exc:  # noqa: BLE001 - any failure: every rank takes the checkpoint
            ok, err = False, f"rank {rank}: {type(exc).__name__}: {exc}"
            log.warning("peer restore: the transfer failed", exc_info=True)
        bad = _agree(ok, err, group, world_size)
    if not bad:
        good = live.digest() == plan.digest
        bad = _agree(good, "" if good else f"rank {rank}: the state it holds now fails the "
                     f"agreed digest", group, world_size)
    if bad:
        return RecoveryPlan("checkpoint", reason="peer transfer failed: " + "; ".join(bad))
    live.mark(plan.step, prev.loss if prev is not None and rank in plan.sources else None)
    return plan

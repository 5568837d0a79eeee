"""What data-parallel replicas know about each other: the digest of the state they hold
identically, the plan of a recovery from healthy peers, and the certificate of a save.

Pure decisions (no torch at import, no collectives), table-tested in
``tests/test_checkpoint_replicas.py``:

* ``plan_recovery(reports, world_size)`` — every rank of the new generation reported
  ``(rank, step, digest)`` of the state it still holds (``NO_STATE`` when it holds none: a
  replacement from a spare, or a rank whose state moved past its last completed step). The
  newest step held by any rank is the step to resume at when every holder of that step has the
  same digest; the ranks that hold it are the sources, the others receive it. No holder, or
  holders of the newest step that disagree: the newest valid checkpoint instead.
* ``certify(digests, step, previous)`` — at a save every replica's digest of its replicated
  state: all equal, or the checkpoint is not certified and the ranks outside the majority are
  named suspects of silent data corruption (two replicas that disagree are both suspects); a
  state identical to the previous save's while the step advanced is stale.
* ``state_digest(flat)`` — xxh3_64 over every item of a flattened state dict in key order
  (tensors: dtype, shape and raw bytes; anything else: its pickle). 9 GB/s on one core here
  (../shared/findings.md): ≈ 22 ms for 200 MB.
"""
from __future__ import annotations

import ctypes
import pickle
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import xxhash

#: The step a rank reports when it holds no state to offer (a fresh process).
NO_STATE = -1


@dataclass(frozen=True)
class Report:
    """One rank's offer at a recovery: ``step`` it completed last (``NO_STATE``: none),
    ``digest`` of its model and optimizer state then (None with no state), ``rng``: digests of
    its random generators' states, ``"name=digest;…"`` (to tell which are replicated), ``why``
    it holds no state."""

    rank: int
    step: int = NO_STATE
    digest: str | None = None
    rng: str | None = None
    why: str = ""

    @property
    def holds(self) -> bool:
        return self.step >= 0 and bool(self.digest)


@dataclass(frozen=True)
class RecoveryPlan:
    """What a recovery restores. ``path``: ``"peer"`` (the state of ``sources`` at ``step``,
    sent by ``src`` to ``receivers``) or ``"checkpoint"`` (the newest valid one; ``step`` is
    then -1). ``digest``: the agreed state digest. ``rng_shared``: the random generators whose
    state every source holds alike (those the receivers get too; a generator seeded per rank,
    or one a process seeds from entropy such as Python's ``random`` unless the program seeds
    it, stays the receiver's own). ``reason``: why this path
    (and, on the peer path, what a receiver does not get)."""

    path: str
    step: int = NO_STATE
    digest: str | None = None
    src: int | None = None
    sources: tuple[int, ...] = ()
    receivers: tuple[int, ...] = ()
    rng_shared: tuple[str, ...] = ()
    reason: str = ""

    @property
    def next_step(self) -> int:
        """The step to run next on the peer path."""
        return self.step + 1


def plan_recovery(reports: list[Report], world_size: int) -> RecoveryPlan:
    """The recovery plan from every rank's ``Report`` (one per rank of the new generation).

    Rules, in order (the issue "lose no work"):

    1. no rank holds state → checkpoint ("no surviving replica");
    2. the holders of the newest step held disagree on its digest → checkpoint (they cannot all
       be right; the checkpoint was certified when it was saved);
    3. else peer: the newest step, sent by the lowest-ranked holder to every other rank that
       does not hold it (a rank one step behind — the one whose exception ended the generation
       before its optimizer step — receives it too).
    """
    if len(reports) != world_size or sorted(r.rank for r in reports) != list(range(world_size)):
        return RecoveryPlan("checkpoint", reason=f"reports of ranks "
                            f"{sorted(r.rank for r in reports)} do not cover the world of "
                            f"{world_size}")
    holders = [r for r in reports if r.holds]
    if not holders:
        whys = sorted({r.why for r in reports if r.why})
        return RecoveryPlan("checkpoint", reason="no surviving replica" +
                            (f" ({'; '.join(whys)})" if whys else ""))
    top = max(r.step for r in holders)
    at_top = sorted((r for r in holders if r.step == top), key=lambda r: r.rank)
    digests = Counter(r.digest for r in at_top)
    if len(digests) > 1:
        groups = {d: [r.rank for r in at_top if r.digest == d] for d in digests}
        return RecoveryPlan("checkpoint", step=NO_STATE, reason=(
            f"survivors disagree on the state of step {top}: "
            + "; ".join(f"ranks {v} hold {d}" for d, v in groups.items())))
    sources = tuple(r.rank for r in at_top)
    receivers = tuple(r.rank for r in sorted(reports, key=lambda r: r.rank)
                      if r.rank not in sources)
    gens = [_rng_parts(r.rng) for r in at_top]
    names = sorted(set().union(*gens))
    shared = tuple(n for n in names if len({g.get(n) for g in gens}) == 1)
    notes = [f"{len(sources)} of {world_size} ranks hold step {top}"]
    if receivers:
        notes.append(f"sent to ranks {list(receivers)}")
        own = [n for n in names if n not in shared]
        if own:
            notes.append(f"generators {own} differ between ranks: the receivers keep their own")
    return RecoveryPlan("peer", step=top, digest=at_top[0].digest, src=sources[0],
                        sources=sources, receivers=receivers, rng_shared=shared,
                        reason="; ".join(notes))


def _rng_parts(rng: str | None) -> dict[str, str]:
    """``"torch=ab;random=cd"`` → ``{"torch": "ab", "random": "cd"}``."""
    return dict(p.split("=", 1) for p in (rng or "").split(";") if "=" in p)


@dataclass(frozen=True)
class Certificate:
    """The replicas' verdict on one save: ``ok`` (certified), ``suspects`` (ranks whose digest
    is outside the majority: suspects of silent data corruption), ``stale`` (same state as the
    previous save although the step advanced), ``digest`` (the majority's), ``reasons``."""

    ok: bool
    digest: str | None = None
    suspects: tuple[int, ...] = ()
    stale: bool = False
    reasons: tuple[str, ...] = field(default_factory=tuple)


def certify(digests: list[str | None], step: int,
            previous: tuple[int, str] | None = None) -> Certificate:
    """Certify the save of ``step`` from every rank's digest of its replicated state (rank
    order; None: the rank holds no replicated state, e.g. a sharded model — nothing to compare,
    certified by the other checks alone). ``previous``: (step, digest) of the last save certified
    in this process, or None.

    A strict majority names the minority as suspects; without one (two replicas, or a split)
    every rank outside the largest group — or all of them on a tie — is a suspect."""
    known = [(r, d) for r, d in enumerate(digests) if d]
    if not known:
        return Certificate(ok=True)
    counts = Counter(d for _, d in known)
    (best, n), *rest = counts.most_common()
    reasons: list[str] = []
    suspects: tuple[int, ...] = ()
    digest: str | None = best
    if rest:
        tie = rest[0][1] == n
        suspects = tuple(r for r, d in known if tie or d != best)
        digest = None if tie else best
        reasons.append(
            f"replicas disagree on the state of step {step} (" + ", ".join(
                f"rank {r}: {d}" for r, d in known) + f"): ranks {list(suspects)} are suspects "
            f"of silent data corruption")
    stale = bool(previous and digest and previous[1] == digest and step > previous[0])
    if stale:
        reasons.append(f"stale: the state of step {step} is identical to that of step "
                       f"{previous[0]} although training advanced (optimizer not stepping, or "
                       f"a restore that did not take)")
    return Certificate(ok=not reasons, digest=digest, suspects=suspects, stale=stale,
                       reasons=tuple(reasons))


def state_digest(flat: dict[str, Any]) -> str | None:
    """xxh3_64 hex digest of a flattened state dict (``flatten_state_dict``), key order sorted;
    None when a tensor is sharded (a DTensor: not the same on every replica). Tensors on an
    accelerator are copied to host memory to be hashed."""
    import torch

    h = xxhash.xxh3_64()
    for k in sorted(flat):
        v = flat[k]
        h.update(k.encode())
        if isinstance(v, torch.Tensor):
            if hasattr(v, "to_local"):
                return None
            t = v.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            n = t.numel() * t.element_size()
            if n:
                h.update((ctypes.c_ubyte * n).from_address(t.data_ptr()))
        else:
            h.update(pickle.dumps(v, protocol=4))
    return h.hexdigest()


def manifest_fields(cert: Certificate) -> dict[str, Any]:
    """What a save's manifest records of its certificate (``verify`` rejects
    ``certified: false``)."""
    return {"state_digest": cert.digest, "certified": cert.ok,
            "certificate": list(cert.reasons), "suspects": list(cert.suspects)}

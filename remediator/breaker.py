"""The fleet breaker: a circuit breaker over node-taking actions, across every job. Pure.

Each decision that would take nodes out of service (``NODE_TAKING``: exclude — which is the
cordon and drain on Kubernetes and the exclusion on Slurm — a GPU reset, a requeue without the
node) asks the breaker first (``admit``). The breaker keeps a sliding window of the nodes taken
out (``BreakerState.taken``, one entry per node) and a limit:

    limit = max(min_nodes, floor(fraction × known nodes)), at most ``max_nodes`` when set

* an action whose nodes, added to the window's, stay within the limit passes and is counted;
* an action that would take the window past the limit is held, and the breaker trips;
* tripped, every new node-taking action is held (``held`` counts them) until a person resets
  it (``reset``); it never closes by itself. Actions let through before keep going.

Why these numbers: the anchor for node health on Kubernetes (NVIDIA NVSentinel's fault
quarantine) trips at 50 % of the nodes cordoned within 5 minutes, and its runbook reads a trip
as "the same error on all nodes": a configuration or infrastructure fault, not many broken
nodes. ``min_nodes`` (default 4) is the count floor trainguard adds: in a small fleet a single
exclusion is already a large fraction (a job of 2 nodes losing one is 50 % of the nodes known),
and independent hardware failures at a realistic rate (a few nodes an hour) never put 4 nodes
in one 5-minute window, while a bad rollout puts far more. ``max_nodes`` caps the limit for a
large fleet (a site may not want 500 of 1,000 nodes drained before anyone looks).

Modes (``BreakerConfig.mode``, env ``TG_BREAKER``): ``action`` (default) holds; ``observe``
counts and records when it would have tripped (``would_trip_ts``, a ``would_trip``
transition, then ``would_hold`` for each decision it would have held) but holds nothing; ``off`` lets everything through and counts nothing.

The decisions of observe-mode jobs (never executed) ask a shadow breaker with mode ``observe``
(``remediator.gate``): they show when it would have tripped and never count against the real
one.

``admit`` is idempotent per decision: an action whose nodes are all in the window already under
the same decision id passes again, unchanged (a remediator restarted mid-chain asks again).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.schemas.breaker import CLOSED, TRIPPED, BreakerState
from trainguard.schemas.vocabulary import Action

__all__ = ["BreakerConfig", "Request", "Outcome", "NODE_TAKING", "admit", "reset", "limit",
           "window", "BreakerError"]

#: actions that take nodes out of service (``reset_gpu`` is carried out as an exclusion; an
#: exclusion that leaves no node of the job is the requeue without the node)
NODE_TAKING: tuple[str, ...] = (Action.EXCLUDE_NODE_AND_REQUEUE, Action.RESET_GPU)

MODES = ("action", "observe", "off")


class BreakerError(ValueError):
    """A breaker request that cannot be carried out (a reset without a reason, a bad mode)."""


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return default if v in (None, "") else int(v)


@dataclass(frozen=True)
class BreakerConfig:
    """The breaker's settings (one per control plane; env overrides in brackets).

    * ``mode`` — ``action`` | ``observe`` | ``off`` (``TG_BREAKER``, default ``action``);
    * ``window_s`` — the sliding window, seconds (``TG_BREAKER_WINDOW_S``, 300: the anchor's);
    * ``fraction`` — of the known nodes (``TG_BREAKER_FRACTION``, 0.5: the anchor's);
    * ``min_nodes`` — the count floor of the limit (``TG_BREAKER_MIN_NODES``, 4; see the
      module docstring);
    * ``max_nodes`` — the count cap of the limit, None for none (``TG_BREAKER_MAX_NODES``);
    * ``fleet_nodes`` — nodes the site declares (``TG_BREAKER_FLEET_NODES``, 0: none); the
      known nodes are the larger of this and the nodes the store knows (``StateStore.
      fleet_nodes``: every job's members and spares, every node with a recorded status).
    """

    mode: str = field(default_factory=lambda: os.environ.get("TG_BREAKER", "action"))
    window_s: float = field(
        default_factory=lambda: float(os.environ.get("TG_BREAKER_WINDOW_S", "300")))
    fraction: float = field(
        default_factory=lambda: float(os.environ.get("TG_BREAKER_FRACTION", "0.5")))
    min_nodes: int = field(default_factory=lambda: _env_int("TG_BREAKER_MIN_NODES", 4) or 0)
    max_nodes: int | None = field(
        default_factory=lambda: _env_int("TG_BREAKER_MAX_NODES", None))
    fleet_nodes: int = field(
        default_factory=lambda: _env_int("TG_BREAKER_FLEET_NODES", 0) or 0)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BreakerError(f"breaker mode {self.mode!r}: one of {', '.join(MODES)} "
                               f"(TG_BREAKER)")
        if not 0 < self.fraction <= 1:
            raise BreakerError(f"breaker fraction {self.fraction}: in (0, 1] "
                               f"(TG_BREAKER_FRACTION)")
        if self.window_s <= 0:
            raise BreakerError(f"breaker window {self.window_s} s: above 0")


@dataclass(frozen=True)
class Request:
    """A decision that would take ``nodes`` out: its ``job``, ``decision_id``, ``action`` and
    ``ts`` (Unix ns)."""

    job: str
    decision_id: str
    action: str
    nodes: tuple[str, ...]
    ts: int


@dataclass(frozen=True)
class Outcome:
    """What the breaker did with a request: ``allowed``; ``transition`` — ``""`` (nothing to
    announce), ``tripped``, ``held``, ``would_trip`` (observe: the first time it would have tripped),
    ``would_hold`` (observe: a decision it would have held); ``taken`` — nodes in the window after it;
    ``limit`` / ``known`` — as computed; ``reason`` — in words."""

    allowed: bool
    transition: str = ""
    taken: int = 0
    limit: int = 0
    known: int = 0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "transition": self.transition, "taken": self.taken,
                "limit": self.limit, "known": self.known, "reason": self.reason}


def limit(cfg: BreakerConfig, known: int) -> int:
    """The most nodes the window may hold: ``max(min_nodes, floor(fraction × known))``, capped
    by ``max_nodes`` (the cap wins over the floor)."""
    n = max(cfg.min_nodes, math.floor(cfg.fraction * max(known, cfg.fleet_nodes)))
    return min(n, cfg.max_nodes) if cfg.max_nodes is not None else n


def window(state: BreakerState, cfg: BreakerConfig, now_ns: int) -> tuple[dict[str, Any], ...]:
    """The window's entries still inside ``window_s`` of ``now_ns``."""
    since = now_ns - int(cfg.window_s * 1e9)
    return tuple(t for t in state.taken if int(t.get("ts", 0)) > since)


def admit(state: BreakerState, req: Request, known: int, cfg: BreakerConfig
          ) -> tuple[BreakerState, Outcome]:
    """Ask the breaker for ``req`` with ``known`` nodes in the fleet: the new state (its
    ``version`` unchanged: the store moves it) and the ``Outcome``."""
    lim = limit(cfg, known)
    known = max(known, cfg.fleet_nodes)
    if cfg.mode == "off" or req.action not in NODE_TAKING or not req.nodes:
        return state, Outcome(True, limit=lim, known=known, reason="not counted")
    win = window(state, cfg, req.ts)
    in_win = {str(t.get("node")): t for t in win}
    if all(in_win.get(n, {}).get("decision_id") == req.decision_id for n in req.nodes):
        # this decision was let through already (asked again after a restart)
        return replace(state, taken=win), Outcome(True, taken=len(in_win), limit=lim,
                                                  known=known, reason="admitted already")
    new = sorted(set(req.nodes) - set(in_win))
    after = len(in_win) + len(new)
    words = (f"{after} node(s) taken out within {cfg.window_s:g} s, past the limit of {lim} "
             f"(max({cfg.min_nodes}, {cfg.fraction:g} × {known} known nodes)"
             + (f", at most {cfg.max_nodes}" if cfg.max_nodes is not None else "") + ")")
    if state.status == TRIPPED and cfg.mode == "action":
        return (replace(state, taken=win, held=state.held + 1),
                Outcome(False, "held", len(in_win), lim, known,
                        f"breaker tripped since {state.tripped_ts} ({state.trip_reason})"))
    taken = win + tuple({"node": n, "job": req.job, "decision_id": req.decision_id,
                         "action": str(req.action), "ts": req.ts} for n in new)
    if after <= lim:
        return replace(state, taken=taken), Outcome(True, "", after, lim, known,
                                                    f"{after} of {lim} in the window")
    if cfg.mode == "observe":  # the first time it would have tripped is kept until a reset
        if state.would_trip_ts:
            return replace(state, taken=taken), Outcome(
                True, "would_hold", after, lim, known,
                f"{words}; would have held since {state.would_trip_ts}")
        return (replace(state, taken=taken, would_trip_ts=req.ts, would_trip_reason=words),
                Outcome(True, "would_trip", after, lim, known, words))
    return (replace(state, taken=win, status=TRIPPED, tripped_ts=req.ts, trip_reason=words,
                    held=1),
            Outcome(False, "tripped", len(in_win), lim, known, words))


def reset(state: BreakerState, by: str, reason: str, ts: int) -> BreakerState:
    """Close the breaker (a person's act: ``by`` and ``reason`` are required) and empty its
    window, so the nodes taken before the reset do not count against the actions after it.
    Raises ``BreakerError`` without a reason or a name."""
    if not reason.strip():
        raise BreakerError("a breaker reset needs --reason: what was found and fixed")
    if not by.strip():
        raise BreakerError("a breaker reset needs who resets it")
    return replace(state, status=CLOSED, taken=(), tripped_ts=0, trip_reason="", held=0,
                   would_trip_ts=0, would_trip_reason="", last_reset={"by": by, "ts": ts, "reason": reason,
                               "was": state.status, "held": state.held})

"""The fleet breaker: its state as the state store keeps it, and the event of each transition.

The breaker guards node-taking actions (exclude, cordon, drain, GPU reset, requeue without a
node) across every job one control plane serves; its rule is ``remediator.breaker`` (pure),
its keys ``tg:breaker`` (hash, this state) and ``tg:breaker:audit`` (stream: trips, holds,
resets with who, when and why). ``BreakerChanged`` is published on ``tg.fleet.breaker``
(``subjects.FLEET_BREAKER``) at every transition.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from trainguard.schemas.base import Entries, Event, Items

__all__ = ["BreakerState", "BreakerChanged", "CLOSED", "TRIPPED", "decode_breaker",
           "encode_breaker"]

#: the breaker lets node-taking actions through (counting them in its window)
CLOSED = "closed"
#: the breaker holds every new node-taking action until a person resets it
TRIPPED = "tripped"


@dataclass(frozen=True)
class BreakerState:
    """The fleet breaker's state (hash ``tg:breaker``).

    * ``status`` — ``closed`` | ``tripped``;
    * ``version`` — moved by one at every write (compare-and-set: replicas never overwrite
      each other's transition);
    * ``taken`` — the node-taking actions let through in the window, oldest first:
      ``[{node, job, decision_id, action, ts (Unix ns)}]``, one entry per node;
    * ``tripped_ts`` / ``trip_reason`` — when (Unix ns) and why it tripped (0 / '' closed);
    * ``held`` — decisions held since it tripped;
    * ``would_trip_ts`` / ``would_trip_reason`` — observe mode: the last time it would have
      tripped, and why (it never holds there);
    * ``last_reset`` — ``{by, ts (Unix ns), reason}`` of the last reset, or None.
    """

    status: str = CLOSED
    version: int = 0
    taken: tuple[dict[str, Any], ...] = ()
    tripped_ts: int = 0
    trip_reason: str = ""
    held: int = 0
    would_trip_ts: int = 0
    would_trip_reason: str = ""
    last_reset: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict of every field."""
        d = dataclasses.asdict(self)
        d["taken"] = [dict(t) for t in self.taken]
        return d


_JSON_FIELDS = ("taken", "last_reset")


def encode_breaker(state: BreakerState) -> dict[str, str]:
    """Hash text of every field (lists and dicts as JSON, numbers as decimal text)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(BreakerState):
        v = getattr(state, f.name)
        if f.name in _JSON_FIELDS:
            out[f.name] = json.dumps(list(v) if f.name == "taken" else v, sort_keys=True)
        else:
            out[f.name] = str(v)
    return out


def decode_breaker(raw: dict[str, str]) -> BreakerState:
    """The state from the hash's text; an absent hash or field takes the default (a breaker
    never written is closed). Raises ``ValueError`` naming the field that cannot be read."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(BreakerState):
        text = raw.get(f.name)
        if text is None or text == "":
            continue
        try:
            if f.name in _JSON_FIELDS:
                v = json.loads(text)
                values[f.name] = tuple(v) if f.name == "taken" else v
            elif f.name in ("status", "trip_reason", "would_trip_reason"):
                values[f.name] = text
            else:
                values[f.name] = int(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"breaker field {f.name!r}: {text!r} unreadable ({exc}); delete "
                             f"the key tg:breaker to start closed") from None
    return BreakerState(**values)


class BreakerChanged(Event):
    """A transition of the fleet breaker. Subject ``tg.fleet.breaker``.

    * ``transition`` — ``tripped`` (it holds from now on), ``held`` (a decision it held),
      ``would_trip`` (observe mode: it would have tripped), ``would_hold`` (observe mode: a
      decision it would have held), ``reset`` (a person closed it);
    * ``status`` — the breaker's status after the transition;
    * ``taken`` / ``limit`` / ``known_nodes`` / ``window_s`` — nodes taken out in the window,
      the most it lets through, the nodes of the fleet it knows, the window (s);
    * ``held_action`` / ``nodes`` — the action a held decision would have taken, on which
      nodes; ``decision_id`` — that decision;
    * ``by`` / ``reason`` — who reset it and why, or why it tripped.
    """

    SCHEMA = "breaker"
    transition: str
    status: str
    taken: int = 0
    limit: int = 0
    known_nodes: int = 0
    window_s: float = 0.0
    held_action: str = ""
    nodes: Items[str] = Field(default_factory=list)
    decision_id: str = ""
    by: str = ""
    reason: str = ""
    detail: Entries[Any] = Field(default_factory=dict)

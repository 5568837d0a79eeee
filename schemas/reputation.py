"""A node's reputation: what the state store keeps about a node across jobs in the hash
``tg:rep:<node>`` and the list ``tg:rep:<node>:evidence`` (``StateStore.reputation``; written
only through ``StateStore.add_offence`` and ``StateStore.set_probation``, both atomic).

The score is stored as its value ``score`` at ``score_ns`` (Unix ns); its value at a later time
decays with a half-life (``trainguard.core.reputation.decayed``), so nothing has to rewrite the hash
for the score to fall. ``evidence`` (the list) keeps the last ``EVIDENCE_KEPT`` offences, newest
last, each ``{"key", "job", "reason", "weight", "ts_ns"}``; the members of the set
``tg:rep:<node>:keys`` are the offence keys counted already (one per job generation and node),
so an exclusion carried out twice counts once.

``status``: ``clean`` (never drained by trainguard, or forgiven), ``drained`` (taken out by
trainguard; its canary has not passed yet), ``probation`` (returned after a passed canary, until
``probation_until_ns``), ``held`` (a repeat offender: kept out, an operator's call). ``detail``:
one line on the last change; ``canary``: the last canary's result ``{"ok", "detail", "ts_ns"}``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NodeReputation", "STATUSES", "EVIDENCE_KEPT", "decode_reputation"]

STATUSES = ("clean", "drained", "probation", "held")
#: offences kept as evidence in the hash (the count ``offences`` goes on past it)
EVIDENCE_KEPT = 10


@dataclass(frozen=True)
class NodeReputation:
    """One node's reputation (see the module docstring). ``score``: offence weight at
    ``score_ns`` (Unix ns), before decay; ``offences``: offences counted, ever;
    ``probation_until_ns`` / ``updated_ns``: Unix ns (0: none)."""

    node: str
    score: float = 0.0
    score_ns: int = 0
    offences: int = 0
    status: str = "clean"
    detail: str = ""
    probation_until_ns: int = 0
    updated_ns: int = 0
    evidence: list[dict[str, Any]] = field(default_factory=list)
    canary: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "score": self.score, "score_ns": self.score_ns,
                "offences": self.offences, "status": self.status, "detail": self.detail,
                "probation_until_ns": self.probation_until_ns, "updated_ns": self.updated_ns,
                "evidence": list(self.evidence), "canary": dict(self.canary)}


def decode_reputation(node: str, raw: dict[str, str]) -> NodeReputation:
    """The hash ``tg:rep:<node>`` → ``NodeReputation`` (absent fields at their defaults).
    Raises ValueError naming the field a value of which cannot be read."""
    def num(name: str, kind: Any) -> Any:
        try:
            return kind(raw[name]) if raw.get(name, "") != "" else kind(0)
        except ValueError:
            raise ValueError(f"tg:rep:{node} field {name!r}: {raw[name]!r} is not "
                             f"{kind.__name__}") from None

    def js(name: str, default: Any) -> Any:
        try:
            return json.loads(raw[name]) if raw.get(name) else default
        except ValueError:
            raise ValueError(f"tg:rep:{node} field {name!r} is not JSON") from None

    status = raw.get("status") or "clean"
    if status not in STATUSES:
        raise ValueError(f"tg:rep:{node} status {status!r}: not one of {', '.join(STATUSES)}")
    return NodeReputation(node=node, score=num("score", float), score_ns=num("score_ns", int),
                          offences=num("offences", int), status=status,
                          detail=raw.get("detail", ""),
                          probation_until_ns=num("probation_until_ns", int),
                          updated_ns=num("updated_ns", int), evidence=js("evidence", []),
                          canary=js("canary", {}))

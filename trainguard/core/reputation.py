"""Node reputation and probation: when a node that trainguard took out of service may return.
Pure (no I/O): every controller (``trainguard.scheduler.base.NodeController.readmit``: Slurm,
Kubernetes, local) calls ``plan`` and carries out what it says.

**Score.** Every exclusion of a node is an offence of weight 1 (``offence_weight``; 2 while the
node is on probation: a fault soon after a readmission is the fault the canary missed), counted
once per job generation (``StateStore.add_offence``); a canary that fails is one more
(``ReputationConfig.canary_failure_weight``). The score decays exponentially with
``half_life_s`` (``decayed``), across jobs: it belongs to the node, not to a job.

**Half-life: 7 days** (``DEFAULT_HALF_LIFE_S``; env ``TG_REP_HALF_LIFE_S``). Long next to a
training job (hours to days), so a node's record outlives the job that saw its fault — the
point of keeping it across jobs; short next to a node's service life, so a node that was
repaired is forgiven within weeks (one offence is 0.25 after 2 weeks, 0.06 after 4) without an
operator. A week also spans a weekend, when a node that fails on Friday would otherwise come back
with a clean slate on Monday. Chosen, not measured: sites with a fleet history should fit it to
their own recurrence intervals.

**Threshold: 2.5** (``ReputationConfig.threshold``, env ``TG_REP_THRESHOLD``). With the weights
above: a node excluded once (1.0) is readmitted after its canary; excluded again within a week
of that readmission (≥ 1 × ½ + 2) it is a repeat offender; so is a node with three exclusions
within 3 days, or one exclusion and two failed canaries. A repeat offender stays out (``hold``)
with the evidence in the scheduler's reason and in the state store, until an operator repairs it
and forgives it (``StateStore.forget_reputation``) or its score decays below the threshold.

**Probation: 7 days** (``probation_s``, env ``TG_REP_PROBATION_S``) after a readmission.

``plan(view, rep, now_ns, config, canary)`` walks ``RULES`` (first match wins; each row has its
reason); ``view`` is the scheduler's state of the node (``NodeView``), as the controller read it
just now, so a readmit carried out twice does nothing the second time.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from trainguard.schemas.reputation import NodeReputation

__all__ = ["ReputationConfig", "NodeView", "Canary", "Plan", "RULES", "plan", "decayed",
           "score_now", "offence_weight", "DEFAULT_HALF_LIFE_S"]

DEFAULT_HALF_LIFE_S = 7 * 86400.0


def _env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class ReputationConfig:
    """``half_life_s`` (seconds, env ``TG_REP_HALF_LIFE_S``), ``threshold`` (score, env
    ``TG_REP_THRESHOLD``), ``probation_s`` (seconds, env ``TG_REP_PROBATION_S``),
    ``probation_weight`` (an offence's weight while on probation), ``canary_failure_weight``;
    the defaults and their reasons are the module docstring's. Raises ValueError for a
    half-life or probation not > 0 or a threshold not > 0."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    threshold: float = 2.5
    probation_s: float = 7 * 86400.0
    probation_weight: float = 2.0
    canary_failure_weight: float = 1.0

    def __post_init__(self) -> None:
        if min(self.half_life_s, self.probation_s, self.threshold) <= 0:
            raise ValueError(f"reputation: half-life {self.half_life_s} s, probation "
                             f"{self.probation_s} s and threshold {self.threshold} must be > 0")

    @classmethod
    def from_env(cls) -> "ReputationConfig":
        return cls(half_life_s=_env("TG_REP_HALF_LIFE_S", cls.half_life_s),
                   threshold=_env("TG_REP_THRESHOLD", cls.threshold),
                   probation_s=_env("TG_REP_PROBATION_S", cls.probation_s))


class NodeView(str, Enum):
    """The scheduler's state of a node, as a controller reads it before acting."""

    IN_SERVICE = "in_service"   # schedulable (Slurm: not drained; k8s: not cordoned)
    OURS = "ours"               # out of service by trainguard, no job left on it
    OURS_BUSY = "ours_busy"     # drained by trainguard, jobs still running (Slurm DRAINING)
    CANARY = "canary"           # inside trainguard's canary window (Slurm: its reservation)
    OTHER = "other"             # out of service, not by trainguard (an operator, DOWN)
    UNKNOWN = "unknown"         # the scheduler does not know the node


@dataclass(frozen=True)
class Canary:
    """A canary's outcome: ``ok``, ``detail`` (one line: what failed, or what passed), and
    ``ran``: False when the canary program never ran on the node (the scheduler could not start
    it: ``srun`` refused, the scheduler out of reach), which says nothing of the node."""

    ok: bool
    detail: str
    ran: bool = True


@dataclass(frozen=True)
class Plan:
    """What to do: ``action`` — ``none`` (already in service), ``leave`` (not trainguard's
    node to return), ``wait`` (jobs still on it), ``hold`` (repeat offender: keep out),
    ``canary`` (run it, then plan again with its result), ``keep`` (canary failed: keep out),
    ``untested`` (the canary could not run: keep out, no offence),
    ``readmit`` (return it, on probation); ``reason``; ``row`` (the rule's name); ``ok``:
    whether the node is where it should be for an operator's ``readmit`` (exit status)."""

    action: str
    reason: str
    row: str

    @property
    def ok(self) -> bool:
        return self.action in ("none", "readmit")


def decayed(score: float, score_ns: int, now_ns: int, half_life_s: float) -> float:
    """``score`` counted at ``score_ns`` (Unix ns) decayed to ``now_ns``: ``score ×
    2^(−Δt / half_life_s)`` (no decay for a ``now_ns`` before ``score_ns``)."""
    if score == 0 or score_ns <= 0:
        return score
    dt = max(0.0, (now_ns - score_ns) / 1e9)
    return score * 2.0 ** (-dt / half_life_s)


def score_now(rep: NodeReputation, now_ns: int, cfg: ReputationConfig) -> float:
    return decayed(rep.score, rep.score_ns, now_ns, cfg.half_life_s)


def offence_weight(rep: NodeReputation, now_ns: int, cfg: ReputationConfig
                   ) -> tuple[float, str]:
    """The weight of an exclusion of the node now, and why: ``probation_weight`` while it is
    on probation (``status`` probation and ``now_ns`` before ``probation_until_ns``), else 1."""
    if rep.status == "probation" and now_ns < rep.probation_until_ns:
        return cfg.probation_weight, "excluded again while on probation"
    return 1.0, "excluded"


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%MZ")


def _last(rep: NodeReputation) -> str:
    if not rep.evidence:
        return "no evidence kept"
    e = rep.evidence[-1]
    return f"{e.get('job', '?')}: {' '.join(str(e.get('reason', '')).split())}"[:160]


@dataclass(frozen=True)
class _Ctx:
    node: str
    view: NodeView
    sched: str
    score: float
    rep: NodeReputation
    cfg: ReputationConfig
    canary: Canary | None
    now_ns: int


#: (row, applies, action, reason): the first row that applies decides. Reasons are one line.
RULES: list[tuple[str, Callable[[_Ctx], bool], str, Callable[[_Ctx], str]]] = [
    ("unknown", lambda c: c.view is NodeView.UNKNOWN, "leave",
     lambda c: f"the scheduler does not know node {c.node} ({c.sched})"),
    ("in_service", lambda c: c.view is NodeView.IN_SERVICE, "none",
     lambda c: f"{c.node} is in service already ({c.sched}): nothing to readmit"),
    ("not_ours", lambda c: c.view is NodeView.OTHER, "leave",
     lambda c: f"{c.node} is out of service, not by trainguard ({c.sched}): trainguard returns "
               f"only the nodes it took out; an operator's call"),
    ("busy", lambda c: c.view is NodeView.OURS_BUSY, "wait",
     lambda c: f"{c.node} still runs jobs ({c.sched}): the canary runs once they ended"),
    ("repeat_offender", lambda c: c.score >= c.cfg.threshold, "hold",
     lambda c: f"repeat offender: score {c.score:.2f} >= {c.cfg.threshold:g} "
               f"({c.rep.offences} offences; last {_last(c.rep)})"),
    ("canary_first", lambda c: c.canary is None, "canary",
     lambda c: f"score {c.score:.2f} < {c.cfg.threshold:g}: the canary decides"),
    ("canary_not_run", lambda c: c.canary is not None and not c.canary.ran, "untested",
     lambda c: f"canary could not run, nothing learnt of the node, no offence counted: "
               f"{c.canary.detail if c.canary else ''}"),
    ("canary_failed", lambda c: c.canary is not None and not c.canary.ok, "keep",
     lambda c: f"canary failed: {c.canary.detail if c.canary else ''}"),
    ("canary_passed", lambda c: True, "readmit",
     lambda c: f"canary passed ({c.canary.detail if c.canary else ''}); on probation until "
               f"{_when(c.now_ns + int(c.cfg.probation_s * 1e9))}"),
]


def plan(view: NodeView, rep: NodeReputation, now_ns: int, cfg: ReputationConfig,
         canary: Canary | None = None, sched: str = "") -> Plan:
    """What ``readmit`` does for a node the scheduler shows as ``view`` (``sched``: its state
    in the scheduler's words, for the reason), with reputation ``rep`` at ``now_ns`` (Unix ns)
    and, once it ran, the ``canary``'s outcome. First matching row of ``RULES``."""
    ctx = _Ctx(rep.node, view, sched or view.value, score_now(rep, now_ns, cfg), rep, cfg,
               canary, now_ns)
    for row, applies, action, reason in RULES:
        if applies(ctx):
            return Plan(action, reason(ctx), row)
    raise AssertionError("the last row of RULES applies always")


def evidence(job: str, reason: str, **extra: Any) -> dict[str, Any]:
    """One offence's evidence as the state store keeps it."""
    return {"job": job, "reason": " ".join(reason.split())[:300], **extra}

"""Decision-chain events: detector → anomaly, attributor → verdict, remediator → decision,
executors → action result."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator

from trainguard.schemas.base import Entries, Event, Items
from trainguard.schemas.subjects import MAX_TOKEN_CHARS


class Culprit(BaseModel):
    """What failed: global ranks, node names, GPUs (``"<node>:<index>"`` or UUIDs). A node
    name is bounded as an event's ``node`` is (``MAX_TOKEN_CHARS``): a culprit node a verdict
    or a decision names becomes their ``node`` and a state key, so a longer one is refused at
    decode (an anomaly naming a 300-character node was accepted, then the attributor's verdict
    of it failed validation in every tick that looked at its incident)."""

    ranks: Items[int] = Field(default_factory=list)
    nodes: Items[str] = Field(default_factory=list)
    gpus: Items[str] = Field(default_factory=list)

    @field_validator("nodes")
    @classmethod
    def _node_lengths(cls, v: list[str]) -> list[str]:
        for n in v:
            if len(n) > MAX_TOKEN_CHARS:
                raise ValueError(f"culprit node name of {len(n)} characters: at most "
                                 f"{MAX_TOKEN_CHARS}")
        return v


class Anomaly(Event):
    """Something abnormal, from the detector. Subject ``tg.job.<job>.anomaly`` (or
    ``tg.node.<node>.anomaly`` for node-only signals with no job).

    * ``kind`` — detector rule: crash, hang, straggler, throughput_drop, node_lost,
      launcher_lost, gpu_fault, log_pattern, nan_loss, thermal …;
    * ``fault_class`` — a ``FaultClass`` (``schemas.vocabulary``); ``detail["layer"]`` — the
      layer the evidence names, a hint to the attributor (no action: only the remediator
      chooses one);
    * ``culprit`` — ranks/nodes/GPUs the signal points at; ``symptom`` — True when the signal is
      the kind that follows another fault (a peer's connection reset);
    * ``first_ts`` — Unix ns of the earliest evidence; ``evidence`` — lines/facts in time order;
    * ``source_event_ids`` — the events that triggered it.
    """

    SCHEMA = "anomaly"
    kind: str
    fault_class: str
    culprit: Culprit = Field(default_factory=Culprit)
    symptom: bool = False
    severity: str = "error"
    first_ts: int = 0
    evidence: Items[str] = Field(default_factory=list)
    detail: Entries[Any] = Field(default_factory=dict)
    source_event_ids: Items[str] = Field(default_factory=list)
    generation: int | None = None


class Verdict(Event):
    """The attributor's conclusion. Subject ``tg.job.<job>.verdict``.

    * ``fault_class`` / ``layer`` — the root cause and where it lives (``FaultClass``,
      ``Layer``);
    * ``confidence`` is ``high``, ``medium`` or ``low`` (``score`` 0..1 behind it);
    * ``detail`` — what the attributor found beyond the root: ``signature`` (its failure
      signature), ``repeat_offender`` (culprit nodes that failed in other jobs too: a node
      fault), ``systematic`` (the nodes of this job where the same failure happened: an
      application fault), ``step``, ``xid``, ``signal``, ``notes`` …;
    * ``action`` — advisory and unused: the attributor leaves it empty, the remediator alone
      chooses the action (``Decision.action``) from its policy table and the facts above. Kept
      because version-1 decoders require the field.
    """

    SCHEMA = "verdict"
    fault_class: str
    layer: str
    culprit: Culprit = Field(default_factory=Culprit)
    action: str = ""
    confidence: str = "medium"
    score: float = 0.5
    evidence: Items[str] = Field(default_factory=list)
    anomaly_ids: Items[str] = Field(default_factory=list)
    first_ts: int = 0
    generation: int | None = None
    detail: Entries[Any] = Field(default_factory=dict)


class Member(BaseModel):
    """One rank of the new world after a decision: the node and local rank that host it."""

    rank: int
    node: str
    local_rank: int


class Decision(Event):
    """The remediator's decision. Subject ``tg.job.<job>.decision``.

    * ``action`` — an ``Action`` (``schemas.vocabulary``), chosen by the remediator;
    * ``mode`` — ``observe`` (published and audited, never executed) or ``action``;
    * ``execute`` — True only in action mode; executors act only when it is True;
    * ``generation`` — the process-group generation ranks must join to carry this out;
    * ``ranks``/``nodes`` — what to restart or exclude; ``members`` — the new world (empty when
      the world is unchanged); ``world_size`` — size of the new world (an
      ``exclude_node_and_requeue`` with no members and world 0: no node of the job is left,
      its scheduler requeues it elsewhere);
    * ``idempotency_key`` — executors act at most once per key;
    * ``reason`` — why, in words, for the audit trail;
    * ``fault_ts``/``detected_ts`` — Unix ns of the fault and of its first anomaly (timeline);
    * ``held`` — the node-taking action this decision would have taken and did not
      (``{action, nodes, by, reason}``; ``by``: ``breaker`` — the fleet breaker is tripped —
      or ``shared_cause`` — the attributor blamed a layer many nodes share); empty: nothing held.
    """

    SCHEMA = "decision"
    action: str
    mode: str = "observe"
    execute: bool = False
    generation: int = 0
    ranks: Items[int] = Field(default_factory=list)
    nodes: Items[str] = Field(default_factory=list)
    members: Items[Member] = Field(default_factory=list)
    world_size: int = 0
    idempotency_key: str
    reason: str = ""
    verdict_id: str = ""
    fault_class: str = ""
    fault_ts: int = 0
    detected_ts: int = 0
    retries_used: int = 0
    retry_budget: int = 0
    held: Entries[Any] = Field(default_factory=dict)


class ActionResult(Event):
    """What an executor did with a decision. Subject ``tg.job.<job>.action``."""

    SCHEMA = "action.result"
    decision_id: str
    idempotency_key: str
    executor: str
    action: str
    ok: bool
    skipped: bool = False
    detail: str = ""

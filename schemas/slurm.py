"""Slurm: the per-job opt-in directive and the scheduler events of the Slurm watcher.

**The directive.** A Slurm job opts into trainguard with its comment::

    #SBATCH --comment='{"trainguard":{"mode":"action","retry_budget":3,"min_world_size":4}}'

``parse_directive`` reads it. The comment is a JSON object whose ``"trainguard"`` member is an
object of the fields of ``DIRECTIVE_FIELDS`` (all optional; ``{"trainguard":{}}`` opts in with
the defaults, i.e. observe mode). The names and meanings are those of the job record's settings
(``schemas.job.JobSettings``: ``mode``, ``retry_budget``, ``min_world_size``) and of
``trainguard launch``'s flags (``--spares``, ``--job``), so a directive says nothing a launch
could not. Other members of the comment's object are left alone (other tools may share it).

* A comment that is no JSON object, or an object without ``"trainguard"``, and does not name
  trainguard, is no directive: ``None`` (the job is not watched).
* A comment that names trainguard but is not a valid directive — bad JSON, an unknown field, a
  value of the wrong type or range — raises ``DirectiveError`` saying which field and what to
  write instead. Callers never let it crash anything: the watcher reports it
  (``JobChange.DIRECTIVE_INVALID``, a log line) and the job stays in observe mode; the launcher
  prints it and launches in observe mode.

**The events** (the Slurm watcher, ``trainguard.scheduler.slurm.watch``, diffing successive
``squeue --json`` / ``sinfo --json`` snapshots):

* ``SlurmNodeEvent`` on ``tg.node.<node>.slurm`` — a node of a watched job's allocation became
  DOWN, NOT_RESPONDING or DRAIN, or left all three (``NodeChange``);
* ``SlurmJobEvent`` on ``tg.job.<job>.slurm`` — a watched job was registered, started,
  lost nodes of its allocation, failed with NODE_FAIL, was requeued, cancelled or ended, or
  carries an invalid directive (``JobChange``).

Sources: sbatch(1) ``--comment``; squeue(1)/sinfo(1) ``--json`` (Slurm 22.05, data_parser
``openapi/v0.0.38``: ``jobs[].job_state``, ``nodes[].state`` + ``state_flags``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from pydantic import Field

from trainguard.schemas.base import Entries, Event, Items
from trainguard.schemas.subjects import token

__all__ = ["DIRECTIVE_KEY", "DIRECTIVE_FIELDS", "DirectiveField", "SlurmDirective",
           "DirectiveError", "parse_directive", "directive_or_default", "TRAINGUARD_REASON",
           "NodeChange", "JobChange", "SlurmNodeEvent", "SlurmJobEvent", "default_job_name"]

#: The member of the comment's JSON object that holds the directive.
DIRECTIVE_KEY = "trainguard"
#: How every reason trainguard gives Slurm begins (``slurm_controller.slurm_reason``): a drain
#: with it is trainguard's own exclusion, not news of a fault.
TRAINGUARD_REASON = "trainguard: "
#: sbatch(1): the comment is at most this long (characters); longer ones are cut by Slurm.
COMMENT_MAX = 8192


class DirectiveError(ValueError):
    """A comment that names trainguard but is no valid directive. ``field``: the field at fault
    (``""`` for the comment as a whole)."""

    def __init__(self, field: str, why: str):
        self.field = field
        where = f"field {field!r}" if field else "the comment"
        super().__init__(f"Slurm comment directive: {where}: {why}; write e.g. "
                         f"--comment='{{\"trainguard\":{{\"mode\":\"observe\"}}}}' (fields: "
                         f"{', '.join(DIRECTIVE_FIELDS)})")


@dataclass(frozen=True)
class DirectiveField:
    """One field of the directive: its JSON type, its check, and what it means."""

    name: str
    kind: type
    check: Any  # callable(value) -> str | None (why it is refused)
    doc: str


def _mode(v: str) -> str | None:
    return None if v in ("observe", "action") else f"{v!r} is not 'observe' or 'action'"


def _at_least(n: int):
    return lambda v: None if v >= n else f"{v} is below {n}"


def _job(v: str) -> str | None:
    try:
        token(v)
    except ValueError as exc:
        return str(exc)
    return None


#: The fields a directive may hold, by name. ``mode``, ``retry_budget`` and ``min_world_size``
#: are the job record's settings of the same name (``JobSettings``); ``spares`` and ``job`` are
#: ``trainguard launch --spares`` / ``--job``.
DIRECTIVE_FIELDS: dict[str, DirectiveField] = {f.name: f for f in (
    DirectiveField("mode", str, _mode,
                   "observe (decide, never act; the default) | action (trainguard recovers)"),
    DirectiveField("retry_budget", int, _at_least(0),
                   "recovery actions allowed per run (JobSettings.retry_budget)"),
    DirectiveField("min_world_size", int, _at_least(1),
                   "smallest world an exclusion may leave, in ranks "
                   "(JobSettings.min_world_size)"),
    DirectiveField("spares", int, _at_least(0),
                   "warm spare processes per node (trainguard launch --spares)"),
    DirectiveField("job", str, _job,
                   "the trainguard job name (trainguard launch --job); default "
                   "slurm-<SLURM_JOB_ID>"),
)}


@dataclass(frozen=True)
class SlurmDirective:
    """A parsed directive; ``None`` fields were not given (the launch's own defaults apply:
    for ``mode``, observe)."""

    mode: str | None = None
    retry_budget: int | None = None
    min_world_size: int | None = None
    spares: int | None = None
    job: str | None = None

    def given(self) -> dict[str, Any]:
        """The fields the comment set, as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def parse_directive(comment: str | None) -> SlurmDirective | None:
    """The directive in a Slurm job's ``comment``; None when the comment is none (see the
    module docstring). Raises ``DirectiveError`` for one that names trainguard but is not
    valid."""
    text = (comment or "").strip()
    if not text:
        return None
    names_us = DIRECTIVE_KEY in text.lower()
    try:
        obj = json.loads(text)
    except ValueError as exc:
        if names_us:
            raise DirectiveError("", f"not JSON ({exc})") from None
        return None
    if not isinstance(obj, dict) or DIRECTIVE_KEY not in obj:
        if names_us and not isinstance(obj, dict):
            raise DirectiveError("", f"a JSON {type(obj).__name__}, not an object with a "
                                     f"{DIRECTIVE_KEY!r} member")
        return None
    body = obj[DIRECTIVE_KEY]
    if not isinstance(body, dict):
        raise DirectiveError("", f"{DIRECTIVE_KEY!r} holds a JSON {type(body).__name__}, "
                                 f"not an object")
    unknown = sorted(set(body) - set(DIRECTIVE_FIELDS))
    if unknown:
        raise DirectiveError(unknown[0], "unknown field")
    values: dict[str, Any] = {}
    for name, value in body.items():
        f = DIRECTIVE_FIELDS[name]
        # JSON true/false are not numbers here (Python's bool is an int)
        if not isinstance(value, f.kind) or isinstance(value, bool):
            raise DirectiveError(name, f"{json.dumps(value)} is not a JSON "
                                       f"{'string' if f.kind is str else 'integer'}")
        why = f.check(value)
        if why:
            raise DirectiveError(name, why)
        values[name] = value
    return SlurmDirective(**values)


def directive_or_default(comment: str | None) -> tuple[SlurmDirective | None, str]:
    """``(directive, error)`` that never raises: a valid directive and ``""``; no directive
    and ``""``; or, for an invalid one, an observe directive (the job is watched, nothing is
    carried out) and the ``DirectiveError`` text."""
    try:
        return parse_directive(comment), ""
    except DirectiveError as exc:
        return SlurmDirective(mode="observe"), str(exc)


def default_job_name(slurm_job_id: str | int) -> str:
    """The trainguard job name of a Slurm job whose directive names none:
    ``slurm-<SLURM_JOB_ID>`` (``deploy/slurm/train.sbatch`` launches under it)."""
    return f"slurm-{slurm_job_id}"


class NodeChange(StrEnum):
    """What became true of a node (``SlurmNodeEvent.change``)."""

    DOWN = "down"                      # base state DOWN (slurmctld, an operator, SlurmdTimeout)
    NOT_RESPONDING = "not_responding"  # flag NOT_RESPONDING: slurmd missed slurmctld's pings
    DRAIN = "drain"                    # flag DRAIN: no new work; reason in ``reason``
    RESUMED = "resumed"                # none of the three any more


class JobChange(StrEnum):
    """What happened to a watched job (``SlurmJobEvent.change``)."""

    REGISTERED = "registered"          # first seen with a directive (its record written)
    STARTED = "started"                # PENDING → RUNNING: an allocation (again, after a requeue)
    NODES_LOST = "nodes_lost"          # still running, with fewer nodes (--no-kill)
    NODE_FAIL = "node_fail"            # ended with NODE_FAIL
    REQUEUED = "requeued"              # restart count up, or back to PENDING / REQUEUE*
    CANCELLED = "cancelled"            # scancel (user, operator, trainguard's stop)
    ENDED = "ended"                    # COMPLETED, FAILED, TIMEOUT, …
    DIRECTIVE_INVALID = "directive_invalid"  # the comment names trainguard but is not valid


class SlurmNodeEvent(Event):
    """A change of a Slurm node of a watched job. Subject ``tg.node.<node>.slurm``.

    ``state`` — the base state as ``sinfo --json`` gives it (``idle``, ``allocated``,
    ``mixed``, ``down``, …); ``flags`` — its state flags (``DRAIN``, ``NOT_RESPONDING``,
    ``COMPLETING``, …); ``reason`` / ``reason_by`` / ``reason_ts`` — the node's reason, who set
    it and when (Unix ns; 0 = none); ``by_trainguard`` — the reason starts with
    ``TRAINGUARD_REASON`` (trainguard's own drain); ``jobs`` / ``slurm_jobs`` — the watched
    jobs whose allocation holds (or, in the previous snapshot, held) the node: trainguard job
    names and Slurm job ids, in the same order.
    """

    SCHEMA = "slurm.node"
    change: NodeChange
    state: str = ""
    flags: Items[str] = Field(default_factory=list)
    reason: str = ""
    reason_by: str = ""
    reason_ts: int = 0
    by_trainguard: bool = False
    jobs: Items[str] = Field(default_factory=list)
    slurm_jobs: Items[str] = Field(default_factory=list)


class SlurmJobEvent(Event):
    """A change of a watched Slurm job. Subject ``tg.job.<job>.slurm`` (``job``: the trainguard
    job name, from the directive or ``default_job_name``).

    ``slurm_job_id``; ``state`` / ``previous_state`` — ``job_state`` now and in the previous
    snapshot (``""``: first seen); ``nodes`` — the allocation now; ``lost_nodes`` — nodes of the
    previous allocation not in it any more (``nodes_lost``, ``node_fail``); ``restarts`` —
    Slurm's restart count (``restart_cnt``); ``reason`` — Slurm's ``state_reason``;
    ``directive`` — the directive's fields (``SlurmDirective.given``); ``error`` — why the
    directive is invalid (``directive_invalid``).
    """

    SCHEMA = "slurm.job"
    change: JobChange
    slurm_job_id: str
    state: str = ""
    previous_state: str = ""
    nodes: Items[str] = Field(default_factory=list)
    lost_nodes: Items[str] = Field(default_factory=list)
    restarts: int = 0
    reason: str = ""
    directive: Entries[Any] = Field(default_factory=dict)
    error: str = ""

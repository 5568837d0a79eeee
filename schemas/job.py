"""The job record: what the state store keeps about a job in the hash ``tg:job:<job>``.

Three parts, each with its writers:

* **settings** (``JobSettings``) — written once per run by the launchers
  (``StateStore.register_settings`` for the first run, ``StateStore.begin_run`` for a new run);
  the remediator rewrites ``world_size`` when it excludes a node;
* **run state** — generation, status, runs, members, spare nodes, group attempt: the launchers
  and the generation bump (``StateStore.begin_run``, ``add_members``, ``add_spare``,
  ``set_group_attempt``, ``end_run``, ``bump_generation``);
* **remediation state** — retries used, the last fault and decision, the decision the watchdog
  waits on: the remediator (``StateStore.commit_decision``, ``clear_pending``);
* **scheduler state** — what Slurm says of the job's allocation (its state, nodes, partition,
  restart count, the comment's directive or why it is invalid): the Slurm watcher
  (``StateStore.register_slurm_job``; ``trainguard.scheduler.slurm.watch``), which also sets
  ``slurm_job_id`` where no launcher set it yet.

The launchers' leases are not in the hash: they are the sorted set ``tg:job:<job>:launchers``
(member = node, score = lease expiry in Unix ms).

Every field has one encoding in the hash (``FIELDS[name].codec``): ``int`` and ``float`` are
decimal text, ``str`` is the text itself, ``json`` is JSON text. A field absent from the hash
takes its default, and so does an empty value of a non-``str`` field; writing ``None`` to an
optional field deletes it. ``decode`` raises ``JobRecordError`` for a value its codec cannot read —
it never guesses.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["JobSettings", "JobRecord", "JobRecordError", "Codec", "FIELDS", "PARTS",
           "encode_fields", "decode_record", "encode_value"]


class JobRecordError(ValueError):
    """A job-hash value its field's codec cannot read: ``field``, the raw ``value``."""

    def __init__(self, name: str, value: str, codec: str, why: str):
        self.field, self.value = name, value
        super().__init__(f"job record field {name!r}: {value!r} is not {codec} ({why}); "
                         f"fix or delete the field (HDEL) and the default applies")


@dataclass(frozen=True)
class Codec:
    """How one field's value is written as hash text and read back."""

    name: str
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]


def _int(s: str) -> int:
    return int(s)


def _float(s: str) -> float:
    return float(s)


INT = Codec("int", lambda v: str(int(v)), _int)
FLOAT = Codec("float", lambda v: repr(float(v)), _float)
STR = Codec("str", str, str)
JSON = Codec("json", lambda v: json.dumps(v, default=str, sort_keys=True), json.loads)


def _f(default: Any, codec: Codec, part: str, doc: str, unit: str = "", factory: Any = None
       ) -> Any:
    meta = {"codec": codec, "part": part, "doc": doc, "unit": unit}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSettings:
    """The launch settings of a run (``trainguard launch`` flags), written once per run."""

    mode: str = _f("", STR, "settings",
                   "observe (decide, never act) | action; '' = not registered: the "
                   "remediator's Policy.default_mode (observe)")
    world_size: int = _f(0, INT, "settings",
                         "ranks in the job; 0 = not registered: the number of members. "
                         "Rewritten by the remediator when an exclusion shrinks the world",
                         "ranks")
    min_world_size: int = _f(1, INT, "settings",
                             "smallest world an exclusion may leave; below it the job stops",
                             "ranks")
    retry_budget: int | None = _f(None, INT, "settings",
                                  "recovery actions allowed per run; None = not registered: "
                                  "the remediator's Policy.default_retry_budget (10)",
                                  "actions")
    nnodes: int = _f(0, INT, "settings", "nodes the job was launched on (0 = not registered)",
                     "nodes")
    nproc_per_node: int = _f(0, INT, "settings",
                             "ranks per node (the ranks a spare node takes over)", "ranks")
    hang_timeout_s: float = _f(0.0, FLOAT, "settings",
                               "no-progress timeout of phase train; 0 = learned by the "
                               "detector from the step times", "s")
    startup_timeout_s: float = _f(0.0, FLOAT, "settings",
                                  "allowance of phase startup; 0 = the detector's default",
                                  "s")
    node_timeout_s: float = _f(0.0, FLOAT, "settings",
                               "silence after which a node is lost; 0 = the detector's "
                               "default", "s")
    slurm_job_id: str = _f("", STR, "settings",
                           "the Slurm job the run's launchers run in (their SLURM_JOB_ID; '' = "
                           "not under Slurm): what the Slurm node controller drains, requeues "
                           "and cancels for")


#: Statuses of a run that is over (``JobRecord.status``): its remains' silence, exits and late
#: anomalies decide nothing (the remediator) and count against no node (the detector's lost
#: launcher).
ENDED_STATUSES = ("stopped", "finished", "failed", "requeued")


@dataclass
class JobRecord(JobSettings):
    """The whole job record: the settings, the run state and the remediation state."""

    # ---- run state
    generation: int = _f(0, INT, "run",
                         "process-group generation in force; every recovery moves it by one")
    generation_by: str = _f("", STR, "run",
                            "the decision id whose bump made the generation in force ('' = a "
                            "launch or a bump that named none): a decision resumed after a "
                            "crash between its bump and its commit finds its bump here")
    status: str = _f("", STR, "run",
                     "running | finished | failed | stopped | requeued (by the Slurm "
                     "controller: the next launch is a new run); '' = never launched")
    runs: int = _f(0, INT, "run",
                   "launches of the job so far (a launch with no live launcher is a new run)",
                   "runs")
    run_id: str = _f("", STR, "run",
                     "the scheduler's name of the run its launchers belong to (Slurm: "
                     "'<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>'; '' = none): a launch with "
                     "another one is a new run, whatever leases the old run's launchers "
                     "still hold (a requeued job)")
    members: list[dict[str, Any]] = _f(None, JSON, "run",
                                       "the ranks of the job: [{rank, node, local_rank}] "
                                       "sorted by rank", factory=list)
    spare_nodes: list[str] = _f(None, JSON, "run",
                                "nodes registered as spares not yet in the world, sorted",
                                factory=list)
    generation_ends: dict[str, str] | None = _f(
        None, JSON, "run", "when each past generation ended: generation → Unix ns (text) at "
        "which the decision that moved past it was committed, or a new run began; a checkpoint "
        "a generation wrote after its end is a fenced run's remnant, never resumed from "
        "(``checkpoint.restorer.choose_checkpoint``); the last 64 generations")
    group_attempt: str = _f("", STR, "run",
                            "'<generation>:<n>': the newest local restart of a node's group "
                            "in observe mode (others follow it); '' = none")
    # ---- remediation state
    retries_used: int = _f(0, INT, "remediation",
                           "recovery actions taken in this run", "actions")
    last_fault: dict[str, Any] | None = _f(None, JSON, "remediation",
                                           "{fault_class, step, signature, generation, ts "
                                           "(Unix ns)} of the last fault acted on (loop check), "
                                           "and {high_water, stalled, steps}: the highest "
                                           "failing step, restarts in a row without progress, "
                                           "their failing steps (remediator.progress)")
    last_decision: dict[str, Any] | None = _f(None, JSON, "remediation",
                                              "{id, action, generation, fault_generation, key, "
                                              "execute, ts (Unix ns)} of the last decision")
    pending_decision: dict[str, Any] | None = _f(None, JSON, "remediation",
                                                 "the executed recovery decision the watchdog "
                                                 "waits on (Decision dict + deadline_ns, Unix "
                                                 "ns); None = none pending")
    # ---- scheduler state (the Slurm watcher)
    slurm_state: str = _f("", STR, "scheduler",
                          "the Slurm job's job_state as squeue last showed it (RUNNING, "
                          "PENDING, NODE_FAIL, …); '' = not watched")
    slurm_nodes: list[str] = _f(None, JSON, "scheduler",
                                "the nodes of the Slurm job's allocation, sorted (empty while "
                                "pending)", factory=list)
    slurm_partition: str = _f("", STR, "scheduler", "the Slurm partition of the job")
    slurm_restarts: int = _f(0, INT, "scheduler",
                             "Slurm's restart count of the job (restart_cnt: requeues)",
                             "requeues")
    slurm_directive: dict[str, Any] | None = _f(None, JSON, "scheduler",
                                                "the fields of the job's comment directive "
                                                "(schemas.slurm.SlurmDirective.given); None = "
                                                "none read")
    slurm_directive_error: str = _f("", STR, "scheduler",
                                    "why the comment's directive is invalid (the job stays "
                                    "observe); '' = valid or none")

    def settings(self) -> JobSettings:
        """The settings part alone."""
        return JobSettings(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(JobSettings)})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON-ready)."""
        return dataclasses.asdict(self)


#: field name → dataclasses.Field of the record (codec, part, doc and unit in ``metadata``)
FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(JobRecord)}
#: part → field names, in declaration order
PARTS: dict[str, tuple[str, ...]] = {
    p: tuple(n for n, f in FIELDS.items() if f.metadata["part"] == p)
    for p in ("settings", "run", "remediation", "scheduler")}


def encode_value(name: str, value: Any) -> str | None:
    """Hash text of ``value`` for field ``name``; None when the field is to be absent (an
    optional field set to None). Raises ``KeyError`` for a name the record does not have."""
    f = FIELDS.get(name)
    if f is None:
        raise KeyError(f"{name!r} is no job record field; known: {', '.join(FIELDS)}")
    if value is None:
        return None
    return f.metadata["codec"].encode(value)


def encode_fields(**fields: Any) -> tuple[dict[str, str], list[str]]:
    """``(to set: name → text, to delete: names)`` for the given fields (see ``encode_value``)."""
    put: dict[str, str] = {}
    drop: list[str] = []
    for k, v in fields.items():
        text = encode_value(k, v)
        if text is None:
            drop.append(k)
        else:
            put[k] = text
    return put, drop


def decode_record(raw: dict[str, str]) -> JobRecord:
    """The record from the hash's text values; absent fields take their defaults, fields the
    record does not know are ignored (a newer writer). Raises ``JobRecordError``."""
    values: dict[str, Any] = {}
    for name, text in raw.items():
        f = FIELDS.get(name)
        if f is None or (text == "" and f.metadata["codec"] is not STR):
            continue
        codec: Codec = f.metadata["codec"]
        try:
            values[name] = codec.decode(text)
        except (TypeError, ValueError) as exc:
            raise JobRecordError(name, text, codec.name, str(exc)) from None
    rec = JobRecord(**values)
    _check_shapes(rec)
    return rec


def _check_shapes(rec: JobRecord) -> None:
    """JSON fields hold what their type says (a list of member objects …)."""
    if not isinstance(rec.members, list) or not all(
            isinstance(m, dict) and isinstance(m.get("rank"), int) for m in rec.members):
        raise JobRecordError("members", json.dumps(rec.members), "a list of "
                             "{rank, node, local_rank}", "wrong shape")
    if not isinstance(rec.spare_nodes, list) or not all(
            isinstance(s, str) for s in rec.spare_nodes):
        raise JobRecordError("spare_nodes", json.dumps(rec.spare_nodes), "a list of node "
                             "names", "wrong shape")
    if not isinstance(rec.slurm_nodes, list) or not all(
            isinstance(s, str) for s in rec.slurm_nodes):
        raise JobRecordError("slurm_nodes", json.dumps(rec.slurm_nodes), "a list of node "
                             "names", "wrong shape")
    for name in ("last_fault", "last_decision", "pending_decision", "slurm_directive"):
        v = getattr(rec, name)
        if v is not None and not isinstance(v, dict):
            raise JobRecordError(name, json.dumps(v), "a JSON object", "wrong shape")

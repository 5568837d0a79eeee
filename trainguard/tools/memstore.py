"""An in-memory state store for offline replays: the ``StateStore`` methods the reducers call
(``Call("state", …)``), answered synchronously from dictionaries, with the same semantics as the
Valkey scripts of ``trainguard.clients.store`` (claim = SET NX, bump = compare-and-set, commit in one
step, history as time-ordered lists).

What the launchers write live (members, the generation a run starts at, its settings) is not in
an event stream; ``MemoryStore.seed`` and ``MemoryStore.observe`` supply it: ``seed`` takes a
snapshot of a job's record (``--job-record`` of ``trainguard replay decide``), ``observe`` folds
the facts an event carries (a ``worker.started`` or heartbeat names a member: rank, node, local
rank; its ``world_size``) into the record, as ``StateStore.add_members`` would, and the end of
a run (every rank of a node exited 0: ``finished``, as its launcher's ``end_run``).
No method does I/O or reads a clock: a time (``ts_ns``) is the caller's. So a bump keeps no
``generation_ends`` (the live store stamps it with its own clock): that field only steers which
checkpoint a new run restores from, which no replayed decision depends on.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from trainguard import schemas
from trainguard.schemas.job import FIELDS, JobRecord, _check_shapes, encode_fields
from trainguard.clients.store_decisions import settle_value

__all__ = ["MemoryStore", "MemoryController"]


class MemoryStore:
    """The state of one replay, a ``trainguard.clients.store_protocol.ReducerStore``. ``records`` — job → ``JobRecord``; ``claims`` — idempotency key
    → owner; ``audits`` — job → audit records in order; ``history`` — node → fault records
    (dicts with ``ts``, Unix ns) and ``signatures`` — signature → ``[(job, node, ts_ns)]``."""

    def __init__(self) -> None:
        self.records: dict[str, JobRecord] = {}
        self.claims: dict[str, str] = {}
        self.audits: dict[str, list[dict[str, Any]]] = {}
        self.history: dict[str, list[dict[str, Any]]] = {}
        self.signatures: dict[str, list[tuple[str, str, int]]] = {}
        #: job → decision id → decision dict (``StateStore.outbox_put`` / ``outbox_done``)
        self.outboxes: dict[str, dict[str, dict[str, Any]]] = {}
        self._seeded: dict[str, set[str]] = {}
        self._observed: set[str] = set()
        self._finished: dict[str, set[int]] = {}
        #: the fleet breaker (``StateStore.breaker``) and its trail (``breaker_audit``)
        self.breaker_states = {"": schemas.BreakerState(), "observe": schemas.BreakerState()}
        self.breaker_audits: list[dict[str, Any]] = []
        #: node → attributes (``StateStore.set_node_attrs``)
        self.node_attributes: dict[str, dict[str, str]] = {}

    # ---- seeding from a snapshot and from events --------------------------------------------
    def seed(self, job: str, fields: dict[str, Any]) -> None:
        """Set record ``fields`` of ``job`` (names of ``schemas.job.FIELDS``); a seeded field is
        not overwritten by ``observe``. Raises ``KeyError`` for an unknown field name and
        ``JobRecordError`` for a value of the wrong type."""
        encode_fields(**fields)  # checks the names (KeyError)
        rec = self._rec(job)
        for k, v in fields.items():
            setattr(rec, k, copy.deepcopy(v))
        _check_shapes(rec)  # the record module's own shape check (JobRecordError)
        self._seeded.setdefault(job, set()).update(fields)

    def observe(self, ev: schemas.Event) -> None:
        """Fold what a launcher would have registered for ``ev``'s job: a member for a
        ``worker.started`` or rank heartbeat (rank, node, local rank), the world size (unless
        seeded or already set), status ``running`` and ``runs`` 1 for a job first seen, status
        ``finished`` after a ``worker.exited`` (see ``_on_exit``)."""
        if isinstance(ev, schemas.WorkerExited) and ev.job and ev.rank is not None:
            self._on_exit(ev)
            return
        if not ev.job or not isinstance(ev, (schemas.WorkerStarted, schemas.RankHeartbeat)):
            return
        if ev.rank is None or not ev.node:
            return
        seeded = self._seeded.get(ev.job, set())
        new = ev.job not in self._observed
        self._observed.add(ev.job)
        rec = self._rec(ev.job)
        if new:
            if "generation" not in seeded:
                rec.generation = int(ev.generation)
            if "status" not in seeded:
                rec.status = "running"
            if "runs" not in seeded:
                rec.runs = 1
        if "world_size" not in seeded and not rec.world_size:
            rec.world_size = int(ev.world_size)
        if "members" in seeded:
            return
        m = {"rank": int(ev.rank), "node": ev.node, "local_rank": int(ev.local_rank)}
        if m not in rec.members:
            rec.members = sorted([x for x in rec.members if x.get("rank") != m["rank"]] + [m],
                                 key=lambda x: x["rank"])

    def _on_exit(self, ev: schemas.WorkerExited) -> None:
        """A node's launcher marks the job ``finished`` once every rank of its node finished
        (``exit_code`` 0; ``StateStore.end_run``); a stopped job stays stopped."""
        done = self._finished.setdefault(ev.job or "", set())
        if ev.exit_code == 0 and ev.signal is None:
            done.add(int(ev.rank))  # type: ignore[arg-type]
        else:
            done.discard(int(ev.rank))  # type: ignore[arg-type]
            return
        rec = self.records.get(ev.job or "")
        if rec is None or rec.status == "stopped" or "status" in self._seeded.get(ev.job, ()):
            return
        on_node = {int(m["rank"]) for m in rec.members if m.get("node") == ev.node}
        if on_node and on_node <= done:
            rec.status = "finished"

    def _rec(self, job: str) -> JobRecord:
        rec = self.records.get(job)
        if rec is None:
            rec = self.records[job] = JobRecord()
        return rec

    # ---- the StateStore methods the reducers call -------------------------------------------
    def job(self, job: str) -> JobRecord:
        """A copy of the record (every field at its default for an unknown job)."""
        return copy.deepcopy(self.records.get(job) or JobRecord())

    def job_records(self, jobs: list[str]) -> dict[str, JobRecord | str]:
        """``StateStore.job_records``: a copy of each job's record."""
        return {job: self.job(job) for job in jobs}

    def jobs(self) -> list[str]:
        return sorted(self.records)

    def claim(self, key: str, owner: str, ttl_s: int = 0) -> str | None:
        if key in self.claims:
            return self.claims[key]
        self.claims[key] = owner
        return None

    def take_claim(self, key: str, old: str, owner: str) -> str | None:
        """``key`` passes from ``old`` to ``owner`` only while ``old`` holds it (the live
        store's compare-and-set); None when it passed, else the holder now."""
        if self.claims.get(key) == old:
            self.claims[key] = owner
            return None
        return self.claims.get(key)

    def settle(self, key: str, outcome: str, ttl_s: int = 0) -> None:
        self.claims[key] = outcome

    def claimed_by(self, key: str) -> str | None:
        return self.claims.get(key)

    def bump_generation(self, job: str, expected: int, by: str = "") -> int:
        rec = self._rec(job)
        if rec.generation == int(expected):
            rec.generation += 1
            rec.generation_by = by
        return rec.generation

    def commit_decision(self, job: str, *, retries_used: int, last_decision: dict[str, Any],
                        last_fault: dict[str, Any] | None = None,
                        members: list[dict[str, Any]] | None = None,
                        world_size: int | None = None, spare_nodes: list[str] | None = None,
                        stopped: bool = False,
                        pending_decision: dict[str, Any] | None = None,
                        outbox: dict[str, Any] | None = None,
                        settles: str | None = None) -> None:
        rec = self._rec(job)
        if outbox is not None:
            self.outbox_put(job, outbox, settles)
        # through JSON, as the hash stores it: the reducers read back what Valkey would give
        fields = {"retries_used": retries_used, "last_decision": last_decision,
                  "last_fault": last_fault, "members": members, "world_size": world_size,
                  "spare_nodes": spare_nodes, "status": "stopped" if stopped else None}
        for k, v in fields.items():
            if v is not None:
                setattr(rec, k, _roundtrip(k, v))
        rec.pending_decision = (None if pending_decision is None
                                else _roundtrip("pending_decision", pending_decision))

    def outbox_put(self, job: str, decision: dict[str, Any], settles: str | None = None) -> None:
        self.outboxes.setdefault(job, {})[str(decision["event_id"])] = copy.deepcopy(decision)
        if settles is not None:
            self.claims[settles] = settle_value(str(decision["event_id"]))

    def outbox_done(self, job: str, decision_id: str) -> None:
        self.outboxes.get(job, {}).pop(decision_id, None)

    def outbox(self, jobs: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
        names = self.jobs() if jobs is None else list(jobs)
        return {j: sorted(self.outboxes[j].values(), key=lambda d: d.get("ts", 0))
                for j in names if self.outboxes.get(j)}

    def clear_pending(self, job: str) -> None:
        self._rec(job).pending_decision = None

    def audit(self, job: str, record: dict[str, Any], maxlen: int = 10000) -> str:
        rows = self.audits.setdefault(job, [])
        rows.append(json.loads(json.dumps(record, default=str)))
        return f"0-{len(rows)}"

    def audit_trail(self, job: str, count: int = 1000) -> list[dict[str, Any]]:
        return list(self.audits.get(job, [])[:count])

    # ---- the fleet breaker (``trainguard.clients.store_breaker``) -------------------------------------
    def fleet_nodes(self) -> list[str]:
        nodes: set[str] = set()
        for rec in self.records.values():
            nodes |= {str(m.get("node")) for m in rec.members if m.get("node")}
            nodes |= set(rec.spare_nodes) | set(rec.slurm_nodes)
        return sorted(nodes)

    def breaker_view(self, which: str = "") -> tuple[schemas.BreakerState, int]:
        return self.breaker_states[which], len(self.fleet_nodes())

    def put_breaker(self, state: schemas.BreakerState, expected: int,
                    which: str = "") -> int | None:
        if self.breaker_states[which].version != expected:
            return None
        self.breaker_states[which] = dataclasses.replace(state, version=expected + 1)
        return expected + 1

    def breaker_audit(self, record: dict[str, Any], maxlen: int = 10000) -> str:
        self.breaker_audits.append(json.loads(json.dumps(record, default=str)))
        return f"0-{len(self.breaker_audits)}"

    def record_fault(self, node: str, job: str, signature: str, record: dict[str, Any],
                     ts_ns: int | None = None) -> None:
        ts = int(ts_ns or 0)
        self.history.setdefault(node, []).append({**record, "job": job, "signature": signature,
                                                  "ts": ts})
        self.signatures.setdefault(signature, []).append((job, node, ts))

    def node_history(self, node: str, since_ns: int = 0) -> list[dict[str, Any]]:
        return [dict(r) for r in self.history.get(node, []) if r["ts"] >= since_ns]

    def fault_history(self, nodes: Any, signature: str, since_ns: int = 0,
                      recent_since_ns: int | None = None, attrs_at: int = 0) -> tuple:
        out = ({n: self.node_history(n, since_ns) for n in nodes},
               self.signature_history(signature, since_ns))
        if recent_since_ns is None:
            return out
        recent = self.signature_history(signature, recent_since_ns)
        return (*out, recent, dict(self.node_attributes))

    def set_node_attrs(self, node: str, attrs: dict[str, str]) -> None:
        self.node_attributes[node] = dict(attrs)

    def signature_history(self, signature: str, since_ns: int = 0) -> list[tuple[str, str]]:
        seen: dict[tuple[str, str], int] = {}
        for job, node, ts in self.signatures.get(signature, []):
            if ts >= since_ns:
                seen[(job, node)] = ts  # a sorted set keeps one entry per member
        return [k for k, _ in sorted(seen.items(), key=lambda kv: kv[1])]


def _roundtrip(name: str, value: Any) -> Any:
    return FIELDS[name].metadata["codec"].decode(FIELDS[name].metadata["codec"].encode(value))


@dataclasses.dataclass
class MemoryController:
    """The node controller of a replay: records the exclusions asked for, carries none out."""

    name: str = "local"
    excluded: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def exclude(self, node: str, job: str, reason: str) -> Any:
        from trainguard.scheduler.local import ControllerResult

        self.excluded.append((node, job))
        return ControllerResult(True, f"node {node} excluded (replay: not carried out)")

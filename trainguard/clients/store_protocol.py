"""The state store as the services' reducers see it: every method a ``Call("state", …)`` of the
detector, attributor and remediator reducers may name (``trainguard.core.reducer.store``).

Two stores satisfy ``ReducerStore``: ``trainguard.clients.store.StateStore`` (Valkey; its
methods are coroutine functions returning what is written here, which the service base awaits)
and ``trainguard.tools.memstore.MemoryStore`` (dictionaries, for offline replays; its methods
return at once). The names and parameters are one contract, checked by
``tests/test_store_protocol.py`` against both stores and against every state call the reducers
make. The Slurm watcher's
reducer (``register_slurm_job``) runs live only and is not part of it.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from trainguard.schemas.breaker import BreakerState
from trainguard.schemas.job import JobRecord


class ReducerStore(Protocol):
    """The methods, by key family. Job record: ``job``, ``job_records``, ``jobs``,
    ``bump_generation``, ``clear_pending``. Decisions: ``claim``, ``take_claim``, ``settle``,
    ``claimed_by``, ``commit_decision``, ``outbox_put``, ``outbox_done``, ``outbox``,
    ``audit``. Nodes: ``record_fault``, ``fault_history``, ``set_node_attrs``. The fleet
    breaker: ``breaker_view``, ``put_breaker``, ``breaker_audit``. What each does is said
    by ``StateStore``'s method of the same name."""

    # ---- the job record (trainguard.clients.store_jobs) ---------------------------------------
    def job(self, job: str) -> JobRecord: ...

    def job_records(self, jobs: Sequence[str]) -> dict[str, JobRecord | str]: ...

    def jobs(self) -> list[str]: ...

    def bump_generation(self, job: str, expected: int, by: str = "") -> int: ...

    def clear_pending(self, job: str) -> None: ...

    # ---- claims, outbox, audit (trainguard.clients.store_decisions) ---------------------------
    def claim(self, key: str, owner: str, ttl_s: int = ...) -> str | None: ...

    def take_claim(self, key: str, old: str, owner: str) -> str | None: ...

    def settle(self, key: str, outcome: str, ttl_s: int = ...) -> None: ...

    def claimed_by(self, key: str) -> str | None: ...

    def commit_decision(self, job: str, *, retries_used: int, last_decision: dict[str, Any],
                        last_fault: dict[str, Any] | None = None,
                        members: list[dict[str, Any]] | None = None,
                        world_size: int | None = None, spare_nodes: list[str] | None = None,
                        stopped: bool = False, pending_decision: dict[str, Any] | None = None,
                        outbox: dict[str, Any] | None = None,
                        settles: str | None = None) -> None: ...

    def outbox_put(self, job: str, decision: dict[str, Any],
                   settles: str | None = None) -> None: ...

    def outbox_done(self, job: str, decision_id: str) -> None: ...

    def outbox(self, jobs: list[str] | None = None) -> dict[str, list[dict[str, Any]]]: ...

    def audit(self, job: str, record: dict[str, Any], maxlen: int = 10000) -> str: ...

    # ---- node attributes and fault history (trainguard.clients.store_nodes) -------------------
    def record_fault(self, node: str, job: str, signature: str, record: dict[str, Any],
                     ts_ns: int | None = None) -> None: ...

    def fault_history(self, nodes: Sequence[str], signature: str, since_ns: int = 0,
                      recent_since_ns: int | None = None, attrs_at: int = 0) -> tuple: ...

    def set_node_attrs(self, node: str, attrs: dict[str, str]) -> None: ...

    # ---- the fleet breaker (trainguard.clients.store_breaker) ---------------------------------
    def breaker_view(self, which: str = "") -> tuple[BreakerState, int]: ...

    def put_breaker(self, state: BreakerState, expected: int,
                    which: str = "") -> int | None: ...

    def breaker_audit(self, record: dict[str, Any], maxlen: int = 10000) -> str: ...

"""Which checkpoints are valid, as far as a rank knows without reading them: the validator's
verdicts in the state store (``fetch_index``), or the verdicts of the writers that wrote them;
and retention by those verdicts (``doomed``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable

from trainguard.checkpoint import format as fmt

log = logging.getLogger("trainguard.checkpoint")


def _ask(redis_url: str | None, timeout_s: float, what: str,
         query: Callable[[Any], Awaitable[Any]]) -> Any:
    """``await query(StateStore)`` against the state store at ``redis_url`` in a thread of its
    own (the caller may run inside an event loop); None without a URL or when the store does
    not answer within ``timeout_s`` seconds. Never raises."""
    if not redis_url:
        return None

    async def _q():
        from trainguard.clients.store import StateStore

        s = StateStore(redis_url)
        try:
            return await asyncio.wait_for(query(s), timeout_s)
        finally:
            await s.close()

    box: dict[str, Any] = {}

    def _run() -> None:
        try:
            box["v"] = asyncio.run(_q())
        except Exception as exc:  # noqa: BLE001 - unreachable store: the caller goes without
            box["e"] = exc

    t = threading.Thread(target=_run, daemon=True)
    t.start()
    t.join(timeout_s + 1.0)
    if "v" not in box:
        log.info("state store unreachable (%s): %s", box.get("e", "timeout"), what)
        return None
    return box["v"]


def fetch_index(redis_url: str | None, job: str, timeout_s: float) -> dict[str, dict] | None:
    """``{path: {"status", "reasons", …}}`` of ``job``'s checkpoints from the state store at
    ``redis_url``; None without a URL, or when the store does not answer within ``timeout_s``
    seconds (then callers verify, or count verdicts, themselves). Never raises."""
    got = _ask(redis_url, timeout_s, "verifying checkpoints locally",
               lambda s: s.checkpoints(job))
    return None if got is None else {c["path"]: c for c in got}


def fetch_generation_ends(redis_url: str | None, job: str, timeout_s: float
                          ) -> dict[int, int] | None:
    """``job``'s ``JobRecord.generation_ends`` (generation → Unix ns it ended) from the state
    store; None without a URL or when it does not answer (then no checkpoint is fenced by
    it). Never raises."""
    return _ask(redis_url, timeout_s, "no generation fence on checkpoints",
                lambda s: s.generation_ends(job))


def doomed(root: str, keep: int, index: Any, verdicts: dict[str, str],
           store: bool = False) -> list[str]:
    """The checkpoint directories under ``root`` that retention deletes (``fmt.plan_retention``
    with K = ``keep``).

    ``index``: a callable returning ``fetch_index``'s answer, called only when there are more
    than ``keep`` committed checkpoints. With a state store, a checkpoint's status is the
    validator's verdict there; one it has not judged yet is pending (kept while newer than the
    K-th newest valid one), so that nothing is deleted before the validator has seen it.
    Without a state store, ``verdicts`` (path → "valid" | "invalid"): those of the writers that
    wrote it — sizes and checksums are theirs, and they counted NaN/Inf in every tensor while
    writing. Nothing is read back here: a validation in the training process would take the
    CPU and the GIL from the training loop. A checkpoint with no verdict (written by an
    earlier process) counts as pending.

    ``store``: the job has a state store. When it does not answer, nothing is deleted: a rank
    cut off from the control plane may be one trainguard has excluded, training on until its
    lease runs out, and the live run resumes from the checkpoints it would delete (seen on the
    cluster harness: a one-node job cut off deleted the valid checkpoints before the cut)."""
    entries = [e for e in fmt.list_checkpoints(root) if e.committed]
    if len(entries) <= keep:
        return []
    idx = index()
    if idx is None and store:
        return []
    rows = []
    for e in entries:
        st = idx.get(e.path, {}).get("status") if idx is not None else verdicts.get(e.path)
        rows.append((e.path, e.step, e.generation, st or "pending"))
    return fmt.plan_retention(rows, keep)

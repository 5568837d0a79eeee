"""What ``squeue --json`` and ``sinfo --json`` say, as typed snapshots. Pure.

``parse_squeue(text)`` → ``tuple[SlurmJob, ...]``, ``parse_sinfo(text)`` →
``tuple[SlurmNode, ...]``; both raise ``SnapshotError`` (with what was wrong) for text that is
not the JSON of those commands, and for a reply whose ``errors`` list is not empty.

Fields read (Slurm 22.05, data_parser ``openapi/v0.0.38``; captured outputs of a real
slurmctld in ``tests/fixtures/slurm/``):

* squeue: ``jobs[]``: ``job_id`` (int), ``name``, ``job_state`` (``PENDING``, ``RUNNING``,
  ``COMPLETING``, ``CANCELLED``, ``NODE_FAIL``, …), ``nodes`` (a hostlist, ``node[0-1]``;
  ``""`` while pending), ``job_resources.allocated_nodes[].nodename`` (the same, expanded;
  absent while pending), ``restart_cnt``, ``comment``, ``partition``, ``state_reason``.
* sinfo: ``nodes[]``: ``name``, ``state`` (the base state, lower case: ``idle``,
  ``allocated``, ``mixed``, ``down``, …), ``state_flags`` (``DRAIN``, ``NOT_RESPONDING``,
  ``COMPLETING``, …), ``reason``, ``reason_set_by_user``, ``reason_changed_at`` (Unix s).

Later versions name a few of these differently (24.05: ``job_state`` a list, ``state`` a list
of base state and flags); ``_states`` reads both shapes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["SlurmJob", "SlurmNode", "SnapshotError", "parse_squeue", "parse_sinfo",
           "expand_hostlist", "ENDED_STATES", "ACTIVE_STATES", "REQUEUE_STATES"]

#: Job states after which the job holds no allocation (squeue(1) JOB STATE CODES).
ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED",
                          "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT"})
#: Job states that hold an allocation.
ACTIVE_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED",
                           "SIGNALING", "STAGE_OUT", "RESIZING"})
#: Job states of a requeued job waiting for its next allocation.
REQUEUE_STATES = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


class SnapshotError(ValueError):
    """Text that is not a ``squeue --json`` / ``sinfo --json`` reply, or one with errors."""


@dataclass(frozen=True)
class SlurmJob:
    """One job of ``squeue --json``. ``nodes``: its allocation, expanded and sorted."""

    job_id: str
    name: str = ""
    state: str = ""
    nodes: tuple[str, ...] = ()
    restarts: int = 0
    comment: str = ""
    partition: str = ""
    reason: str = ""


@dataclass(frozen=True)
class SlurmNode:
    """One node of ``sinfo --json``. ``state``: base state, lower case; ``flags``: upper case,
    sorted; ``reason_ts``: Unix ns (0 = none)."""

    name: str
    state: str = ""
    flags: tuple[str, ...] = ()
    reason: str = ""
    reason_by: str = ""
    reason_ts: int = 0

    @property
    def down(self) -> bool:
        return self.state == "down" or "DOWN" in self.flags

    @property
    def not_responding(self) -> bool:
        return "NOT_RESPONDING" in self.flags

    @property
    def drained(self) -> bool:
        """DRAIN set (draining or drained)."""
        return "DRAIN" in self.flags or self.state in ("drain", "drained", "draining")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist notation expanded: ``"node[0-2,5],gpu07"`` → ``["node0", "node1",
    "node2", "node5", "gpu07"]`` (zero padding kept: ``n[08-10]`` → ``n08 n09 n10``). One
    bracket group per name (what Slurm prints for one-dimensional names). Raises
    ``SnapshotError`` for a malformed list."""
    out: list[str] = []
    depth, cur, parts = 0, "", []
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
        if depth < 0:
            raise SnapshotError(f"hostlist {text!r}: unbalanced ']'")
    if depth:
        raise SnapshotError(f"hostlist {text!r}: unbalanced '['")
    if cur:
        parts.append(cur)
    for part in (p.strip() for p in parts):
        if not part or part == "(null)":
            continue
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part:
                raise SnapshotError(f"hostlist {text!r}: cannot read {part!r}")
            out.append(part)
            continue
        pre, ranges, post = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r.strip())
            if rm is None:
                raise SnapshotError(f"hostlist {text!r}: range {r!r} is not N or N-M")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            width = len(lo) if lo.startswith("0") else 0
            if int(hi) < int(lo):
                raise SnapshotError(f"hostlist {text!r}: range {r!r} runs backwards")
            out += [f"{pre}{str(i).zfill(width)}{post}" for i in range(int(lo), int(hi) + 1)]
    return out


def _load(text: str, key: str, command: str) -> list[dict[str, Any]]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise SnapshotError(f"{command} --json printed no JSON ({exc}): {text[:200]!r}") \
            from None
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        raise SnapshotError(f"{command} --json: no {key!r} list in the reply "
                            f"({str(obj)[:200]})")
    errors = obj.get("errors") or []
    if errors:
        raise SnapshotError(f"{command} --json reported errors: {json.dumps(errors)[:300]}")
    return [x for x in obj[key] if isinstance(x, dict)]


def _states(value: Any) -> list[str]:
    """A state as a list of words: 22.05 gives a string, later versions a list."""
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list):
        return [str(v) for v in value]
    return []


def _int(value: Any, default: int = 0) -> int:
    if isinstance(value, dict):  # 23.02+: {"set": true, "number": N}
        value = value.get("number", default)
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def parse_squeue(text: str) -> tuple[SlurmJob, ...]:
    """The jobs of a ``squeue --json`` reply (see the module docstring); raises
    ``SnapshotError``."""
    jobs = []
    for j in _load(text, "jobs", "squeue"):
        if "job_id" not in j:
            raise SnapshotError(f"squeue --json: a job without job_id: {str(j)[:200]}")
        alloc = (j.get("job_resources") or {}).get("allocated_nodes")
        if isinstance(alloc, list) and alloc and all(isinstance(a, dict) for a in alloc):
            nodes = [str(a.get("nodename", "")) for a in alloc if a.get("nodename")]
        else:
            nodes = expand_hostlist(str(j.get("nodes") or ""))
        states = _states(j.get("job_state"))
        jobs.append(SlurmJob(
            job_id=str(_int(j["job_id"], -1)), name=str(j.get("name") or ""),
            state=states[0] if states else "", nodes=tuple(sorted(set(nodes))),
            restarts=_int(j.get("restart_cnt")), comment=str(j.get("comment") or ""),
            partition=str(j.get("partition") or ""), reason=str(j.get("state_reason") or "")))
    return tuple(jobs)


def parse_sinfo(text: str) -> tuple[SlurmNode, ...]:
    """The nodes of a ``sinfo --json`` reply (see the module docstring); raises
    ``SnapshotError``."""
    nodes = []
    for n in _load(text, "nodes", "sinfo"):
        if not n.get("name"):
            raise SnapshotError(f"sinfo --json: a node without name: {str(n)[:200]}")
        words = _states(n.get("state"))
        base = words[0].lower() if words else ""
        flags = {f.upper() for f in _states(n.get("state_flags"))} | {
            w.upper() for w in words[1:]}
        ts = _int(n.get("reason_changed_at"))
        nodes.append(SlurmNode(
            name=str(n["name"]), state=base, flags=tuple(sorted(flags)),
            reason=str(n.get("reason") or ""), reason_by=str(n.get("reason_set_by_user") or ""),
            reason_ts=ts * 1_000_000_000 if ts > 0 else 0))
    return tuple(nodes)

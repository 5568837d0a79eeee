"""A deterministic fault schedule: which fault, where, and when — one small YAML or JSON file
read by ``trainguard launch --faults FILE`` (rank faults, executed inside the ranks) and by the
cluster harness (``trainguard.cluster``: node faults, executed on the node's namespace).

Format (a list, or a mapping with a ``faults`` list)::

    faults:
      - {kind: sigkill,    rank: 1,     step: 40}        # SIGKILL of rank 1 when it completes step 40
      - {kind: exception,  rank: 2,     step: 60}        # a Python exception raised in its step
      - {kind: hang,       rank: 3,     at_s: 30}        # SIGSTOP at its first step ≥ 30 s after launch
      - {kind: power_off,  node: node1, step: 50}        # every process of the node SIGKILLed at once
      - {kind: partition,  node: 1,     step: 50, heal_after_s: 15}   # the node's link down, then up
      - {kind: slow_link,  node: node0, at_s: 20, rate: 1mbit, duration_s: 10}

Fields (``FIELDS``): ``kind`` (``RANK_KINDS`` | ``NODE_KINDS``; ``power-off`` and ``slow-link``
are accepted spellings), exactly one trigger — ``step`` (the step a rank completes; for a node
fault: any rank of the job, by default rank 0, or ``rank`` when given) or ``at_s`` (seconds after
the launcher, or the harness, started) — a rank fault's ``rank`` (global rank), a node fault's
``node`` (a node name or its index), ``id`` (default: its position, from 1; names the marker that
makes a fault fire once, across restarts and rollbacks), ``heal_after_s`` (partition: seconds
until the link comes back; absent: stays down), ``rate`` (slow_link: a tc rate such as
``1mbit``, default ``1mbit``), ``duration_s`` (slow_link: seconds until the link is fast again;
absent: stays slow).

Every error is a ``FaultScheduleError`` naming the file, the entry and what to write instead;
nothing in a schedule with an error is run.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Fault", "FaultScheduleError", "RANK_KINDS", "NODE_KINDS", "FIELDS", "parse", "load",
           "dumps"]

#: Faults executed inside a rank (by the shim, ``trainguard.rank.fault_inject``), with what they do.
RANK_KINDS = {
    "sigkill": "the rank SIGKILLs itself (a crash: the launcher respawns it)",
    "exception": "a Python exception is raised in the rank's step (an application fault)",
    "hang": "the rank SIGSTOPs itself (a hang: found by the missing progress)",
}
#: Faults of a whole node, executed by the cluster harness on the node's network namespace.
NODE_KINDS = {
    "power_off": "every process of the node SIGKILLed at once (the node is gone)",
    "partition": "the node's link is cut (its veth down); heal_after_s brings it back",
    "slow_link": "the node's link is rate-limited with tc tbf (rate, for duration_s)",
}
_ALIASES = {"power-off": "power_off", "poweroff": "power_off", "slow-link": "slow_link",
            "kill": "sigkill"}
#: Every field an entry may have, with its type.
FIELDS = {"id": int, "kind": str, "step": int, "at_s": float, "rank": int, "node": (str, int),
          "heal_after_s": float, "rate": str, "duration_s": float}
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")


class FaultScheduleError(ValueError):
    """A schedule that cannot be run: ``where`` (file and entry) and what is wrong."""

    def __init__(self, where: str, why: str):
        self.where, self.why = where, why
        super().__init__(f"fault schedule {where}: {why}")


@dataclass(frozen=True)
class Fault:
    """One scheduled fault (see the module docstring). ``step``/``at_s``: the trigger (one is
    None); ``node`` is a name or an index as written."""

    id: int
    kind: str
    step: int | None = None
    at_s: float | None = None
    rank: int | None = None
    node: str | int | None = None
    heal_after_s: float | None = None
    rate: str | None = None
    duration_s: float | None = None

    @property
    def on_rank(self) -> bool:
        """True for a rank fault (executed by the shim), False for a node fault."""
        return self.kind in RANK_KINDS

    def node_name(self, names: list[str]) -> str:
        """The node's name among ``names`` (an index picks by position). Raises
        FaultScheduleError for a node that is not there."""
        if isinstance(self.node, int):
            if 0 <= self.node < len(names):
                return names[self.node]
        elif self.node in names:
            return str(self.node)
        raise FaultScheduleError(f"fault {self.id}", f"node {self.node!r} is not one of "
                                 f"{', '.join(names)} (give a name or an index)")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _entry(raw: Any, pos: int, where: str) -> Fault:
    at = f"{where} entry {pos}"
    if not isinstance(raw, dict):
        raise FaultScheduleError(at, f"each fault is a mapping such as "
                                     f"{{kind: sigkill, rank: 1, step: 40}}, got {raw!r}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise FaultScheduleError(at, f"unknown field(s) {', '.join(unknown)}; known: "
                                     f"{', '.join(FIELDS)}")
    vals: dict[str, Any] = {}
    for k, v in raw.items():
        want = FIELDS[k]
        if isinstance(v, bool) or not isinstance(v, want if want is not float else (int, float)):
            name = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise FaultScheduleError(at, f"{k} must be {name}, got {v!r}")
        vals[k] = float(v) if want is float else v
    kind = _ALIASES.get(str(vals.get("kind", "")).lower(), str(vals.get("kind", "")).lower())
    if kind not in RANK_KINDS and kind not in NODE_KINDS:
        raise FaultScheduleError(at, f"kind {vals.get('kind')!r}: use one of "
                                     f"{', '.join([*RANK_KINDS, *NODE_KINDS])}")
    vals["kind"] = kind
    if ("step" in vals) == ("at_s" in vals):
        raise FaultScheduleError(at, "give exactly one trigger: step (a step the rank "
                                     "completes) or at_s (seconds after start)")
    if vals.get("step", 0) < 0 or vals.get("at_s", 0.0) < 0:
        raise FaultScheduleError(at, "step and at_s must be ≥ 0")
    if kind == "slow_link":
        vals.setdefault("rate", "1mbit")
    if kind in RANK_KINDS:
        if "rank" not in vals or vals["rank"] < 0:
            raise FaultScheduleError(at, f"a {kind} fault needs rank: a global rank ≥ 0")
        for k in ("node", "heal_after_s", "rate", "duration_s"):
            if k in vals:
                raise FaultScheduleError(at, f"{k} is for node faults; a {kind} names a rank")
    else:
        if "node" not in vals:
            raise FaultScheduleError(at, f"a {kind} fault needs node: a node name or index")
        if "heal_after_s" in vals and kind != "partition":
            raise FaultScheduleError(at, "heal_after_s is for partition faults")
        if ("rate" in vals or "duration_s" in vals) and kind != "slow_link":
            raise FaultScheduleError(at, "rate and duration_s are for slow_link faults")
        if "rate" in vals and not _RATE.match(vals["rate"]):
            raise FaultScheduleError(at, f"rate {vals['rate']!r}: give a tc rate such as "
                                         f"100kbit or 1mbit")
        for k in ("heal_after_s", "duration_s"):
            if k in vals and vals[k] <= 0:
                raise FaultScheduleError(at, f"{k} must be > 0 seconds")
    vals.setdefault("id", pos)
    return Fault(**vals)


def parse(data: Any, where: str = "<schedule>") -> list[Fault]:
    """The faults of a decoded schedule (a list, or ``{"faults": [...]}``). Raises
    FaultScheduleError (also for two entries with one ``id``)."""
    if isinstance(data, dict):
        extra = sorted(set(data) - {"faults"})
        if extra:
            raise FaultScheduleError(where, f"unknown top-level key(s) {', '.join(extra)}: "
                                            f"the file holds `faults:` and a list")
        data = data.get("faults", [])
    if data is None:
        data = []
    if not isinstance(data, list):
        raise FaultScheduleError(where, "give a list of faults (or `faults:` and a list)")
    out = [_entry(raw, i + 1, where) for i, raw in enumerate(data)]
    ids = [f.id for f in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise FaultScheduleError(where, f"id {dup[0]} is used twice: each fault needs its own")
    return out


def load(path: str) -> list[Fault]:
    """Read and check the schedule in ``path`` (``.json``, or YAML with PyYAML installed).
    Raises FaultScheduleError for a file that is missing or malformed."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise FaultScheduleError(path, f"cannot read it ({exc.strerror or exc})") from None
    if path.endswith(".json") or text.lstrip()[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FaultScheduleError(path, f"not valid JSON ({exc})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise FaultScheduleError(path, "a YAML schedule needs PyYAML (pip install pyyaml); "
                                           "or write it as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise FaultScheduleError(path, f"not valid YAML ({exc})") from None
    return parse(data, os.path.basename(path))


def dumps(faults: list[Fault]) -> str:
    """The schedule as JSON (what the launcher hands its ranks)."""
    return json.dumps({"faults": [f.to_dict() for f in faults]})

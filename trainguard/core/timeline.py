"""The timeline of one recovery: when each phase ended, from the bus events, the audit trail and
the ranks' step records; and which phase made a slow recovery slow. Pure: no I/O, no clock.

Phases, in the order recovery goes through them (``PHASES``; each mark is Unix ns):

* ``fault`` — the fault injected (a bench) or first seen (a real job: the incident's fault time);
* ``last_progress`` — the last step completed in the generation the fault hit, by the decision
  (it may come before the fault: a rank stuck in the step it was in);
* ``detected`` — the first anomaly after the fault (else the decision's ``detected_ts``);
* ``verdict`` — the verdict the recovery decision answered (else the first one after the fault);
* ``decision`` — the decision recovery followed: the executed one (action other than ``none``)
  of the highest generation after the fault (the audit trail's ``ts`` when no event has it);
* ``acted`` — the last node's executor done with it (``action.result`` of that decision, one per
  launcher; ``acted_by_node`` holds each);
* ``rendezvous`` — the last rank of the new generation past its barrier with its process groups
  formed (``recovery.resumed``'s ``rendezvous_ts``);
* ``first_step`` — the last rank's first completed step in the new generation (step records,
  else ``recovery.resumed``); ``first_step_by_rank`` holds each.

A phase's duration is its mark minus the latest earlier mark present (never negative); a
missing mark has no duration, and the next phase's duration spans it. ``slow_phase`` compares
a run's durations with the median durations of its fault path: the phase whose duration exceeds
its median by the most took the extra time.

Step records are dicts ``{"t": Unix s | "t_ns": Unix ns, "rank", "gen", "step"}`` (the cluster
harness's ``steps.jsonl``; ``steps_from_heartbeats`` builds them from rank heartbeats).
Audit records are the remediator's (``{"type": "decision", "decision_id", "ts", "generation",
"execute", "action", "verdict_id", "fault_ts", …}``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from trainguard import schemas

__all__ = ["PHASES", "Timeline", "build", "steps_from_heartbeats", "with_mark",
           "median_durations", "slow_phase", "p95", "tails", "format_timeline"]

PHASES = ("fault", "last_progress", "detected", "verdict", "decision", "acted", "rendezvous",
          "first_step")


@dataclass
class Timeline:
    """One recovery's marks (phase → Unix ns, None: not seen) and per-node / per-rank detail.
    ``generation``: the generation recovery moved to (None: no executed decision seen);
    ``decision_id``, ``action``: the decision followed."""

    marks: dict[str, int | None]
    acted_by_node: dict[str, int] = field(default_factory=dict)
    first_step_by_rank: dict[int, int] = field(default_factory=dict)
    generation: int | None = None
    decision_id: str = ""
    action: str = ""

    @property
    def fault_ns(self) -> int:
        return int(self.marks["fault"] or 0)

    def seconds(self) -> dict[str, float | None]:
        """Each mark as seconds from the fault (None where missing)."""
        f = self.fault_ns
        return {p: None if t is None else round((t - f) / 1e9, 3) for p, t in self.marks.items()}

    def durations(self) -> dict[str, float | None]:
        """Each phase's own seconds: its mark minus the latest earlier mark (see the module
        docstring); ``fault`` has none."""
        out: dict[str, float | None] = {}
        prev = self.marks["fault"]
        for p in PHASES[1:]:
            t = self.marks.get(p)
            if t is None or prev is None:
                out[p] = None
            else:
                out[p] = round(max(0, t - prev) / 1e9, 3)
                prev = max(prev, t)
        return out

    @property
    def total_s(self) -> float | None:
        """Fault → every rank's first step of the new generation, seconds."""
        return self.seconds()["first_step"]

    def to_dict(self) -> dict[str, Any]:
        f = self.fault_ns
        return {"fault_ns": f, "generation": self.generation, "decision_id": self.decision_id,
                "action": self.action, "seconds": self.seconds(), "durations": self.durations(),
                "acted_by_node": {n: round((t - f) / 1e9, 3)
                                  for n, t in sorted(self.acted_by_node.items())},
                "first_step_by_rank": {str(r): round((t - f) / 1e9, 3)
                                       for r, t in sorted(self.first_step_by_rank.items())}}


def with_mark(tl: dict[str, Any], phase: str, t_ns: int | None) -> dict[str, Any]:
    """Timeline ``tl`` (``to_dict()`` form) with ``phase``'s mark set to Unix ns ``t_ns``
    (marks read back from the dict to the millisecond), seconds and durations computed again:
    for a phase only the caller can see (a bench's own step records). Raises KeyError for an
    unknown phase."""
    if phase not in PHASES:
        raise KeyError(f"no phase {phase!r}: phases are {', '.join(PHASES)}")
    f = int(tl["fault_ns"])
    marks = {p: None if s is None else f + int(round(s * 1e9))
             for p, s in tl["seconds"].items()}
    marks[phase] = t_ns
    out = Timeline(marks, generation=tl.get("generation"),
                   decision_id=tl.get("decision_id", ""), action=tl.get("action", "")).to_dict()
    out["acted_by_node"] = dict(tl.get("acted_by_node") or {})
    out["first_step_by_rank"] = dict(tl.get("first_step_by_rank") or {})
    return out


def _t_ns(rec: dict[str, Any]) -> int:
    return int(rec["t_ns"]) if "t_ns" in rec else int(round(float(rec["t"]) * 1e9))


def steps_from_heartbeats(hbs: Iterable[schemas.RankHeartbeat]) -> list[dict[str, Any]]:
    """Step records from rank heartbeats: one per (rank, generation, step) at the heartbeat's
    ``progress_ts`` (when the step completed; the heartbeat's own ``ts`` when it has none).
    Coarser than a rank's own records: a heartbeat carries only the newest step."""
    seen: dict[tuple[int, int, int], int] = {}
    for h in hbs:
        if h.rank is None or h.step is None or h.step < 0:
            continue
        key = (h.rank, h.generation, h.step)
        t = h.progress_ts or h.ts
        if key not in seen or t < seen[key]:
            seen[key] = t
    return [{"t_ns": t, "rank": r, "gen": g, "step": s}
            for (r, g, s), t in sorted(seen.items(), key=lambda kv: kv[1])]


def _recovery_decision(decisions: list[dict[str, Any]], decision_id: str
                       ) -> dict[str, Any] | None:
    if decision_id:
        return next((d for d in decisions if d["decision_id"] == decision_id), None)
    executed = [d for d in decisions if d["execute"] and d["action"] != "none"]
    pool = executed or [d for d in decisions if d["action"] != "none"]
    return max(pool, key=lambda d: (d["generation"], d["ts"])) if pool else None


def build(fault_ns: int, events: Iterable[schemas.Event] = (),
          audit: Iterable[dict[str, Any]] = (), steps: Iterable[dict[str, Any]] = (),
          decision_id: str = "", until_ns: int | None = None) -> Timeline:
    """The timeline of the recovery from the fault at Unix ns ``fault_ns``.

    ``events``: the job's bus events (any order; those before the fault are ignored);
    ``audit``: its audit trail; ``steps``: the ranks' step records; ``decision_id``: the
    decision to follow (default: see ``decision`` in the module docstring); ``until_ns``: ignore
    what came later (the next incident's fault). Never raises for a missing phase: its mark is
    None."""
    end = math.inf if until_ns is None else until_ns
    evs = sorted((e for e in events if fault_ns <= e.ts <= end), key=lambda e: e.ts)
    decisions = [{"decision_id": e.event_id, "ts": e.ts, "generation": e.generation,
                  "execute": e.execute, "action": e.action, "verdict_id": e.verdict_id,
                  "detected_ts": e.detected_ts}
                 for e in evs if isinstance(e, schemas.Decision)]
    known = {d["decision_id"] for d in decisions}
    for a in audit:
        if a.get("type") != "decision" or a.get("decision_id") in known:
            continue
        ts = int(a.get("ts") or 0)
        if fault_ns <= ts <= end:
            decisions.append({"decision_id": a.get("decision_id", ""), "ts": ts,
                              "generation": int(a.get("generation") or 0),
                              "execute": bool(a.get("execute")), "action": a.get("action", ""),
                              "verdict_id": a.get("verdict_id", ""),
                              "detected_ts": int((a.get("decision") or {}).get("detected_ts")
                                                 or 0)})
    dec = _recovery_decision(decisions, decision_id)
    marks: dict[str, int | None] = dict.fromkeys(PHASES)
    marks["fault"] = fault_ns
    tl = Timeline(marks)
    if dec is not None:
        tl.generation, tl.decision_id, tl.action = dec["generation"], dec["decision_id"], \
            dec["action"]
        marks["decision"] = dec["ts"]
    gen = tl.generation

    verdicts = [e for e in evs if isinstance(e, schemas.Verdict)]
    v = next((x for x in verdicts if dec is not None and x.event_id == dec["verdict_id"]), None)
    if v is None and verdicts:
        v = verdicts[0]
    marks["verdict"] = v.ts if v is not None else None
    anomalies = [e.ts for e in evs if isinstance(e, schemas.Anomaly)]
    if anomalies:
        marks["detected"] = anomalies[0]
    elif dec is not None and dec["detected_ts"] and dec["detected_ts"] >= fault_ns:
        marks["detected"] = dec["detected_ts"]

    for e in evs:
        if isinstance(e, schemas.ActionResult) and dec is not None \
                and e.decision_id == dec["decision_id"] and e.node:
            tl.acted_by_node.setdefault(e.node, e.ts)
    marks["acted"] = max(tl.acted_by_node.values()) if tl.acted_by_node else None

    resumed = [e for e in evs if isinstance(e, schemas.TrainingResumed)
               and (gen is None or e.generation >= gen)]
    if gen is None and resumed:
        gen = min(e.generation for e in resumed)
        resumed = [e for e in resumed if e.generation == gen]
        tl.generation = gen
    elif resumed:
        gen_r = min(e.generation for e in resumed)
        resumed = [e for e in resumed if e.generation == gen_r]
    rdzv = [e.rendezvous_ts for e in resumed if e.rendezvous_ts]
    marks["rendezvous"] = max(rdzv) if rdzv and len(rdzv) == len(resumed) else None

    recs = sorted(steps, key=_t_ns)
    if gen is None:  # no decision nor resume seen (a scheduler alone): the step records say
        g0 = max((r["gen"] for r in recs if _t_ns(r) <= fault_ns), default=-1)
        later = [r["gen"] for r in recs if fault_ns < _t_ns(r) <= end and r["gen"] > g0]
        gen = tl.generation = min(later) if later else None
    if gen is not None:
        new = [r for r in recs if r["gen"] >= gen and fault_ns <= _t_ns(r) <= end]
        if new:
            g = min(r["gen"] for r in new)
            for r in new:
                if r["gen"] == g:
                    tl.first_step_by_rank.setdefault(int(r["rank"]), _t_ns(r))
        old = [r for r in recs if r["gen"] < gen and _t_ns(r) <= end]
    else:
        old = [r for r in recs if _t_ns(r) <= end]
    if not tl.first_step_by_rank:
        for e in resumed:
            if e.rank is not None:
                tl.first_step_by_rank.setdefault(e.rank, e.ts)
    # progress stops at the latest by the decision (what a rank of the old generation records
    # later, or one whose heartbeats still carry it, is not the progress the fault stopped)
    stop = marks["decision"]
    if stop is None and tl.first_step_by_rank:
        stop = min(tl.first_step_by_rank.values())
    old = [r for r in old if stop is None or _t_ns(r) <= stop]
    if old:
        marks["last_progress"] = _t_ns(old[-1])
    if tl.first_step_by_rank:
        marks["first_step"] = max(tl.first_step_by_rank.values())
    return tl


def median_durations(timelines: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each phase's duration over ``timelines`` (``Timeline.to_dict()`` form)."""
    out: dict[str, float | None] = {}
    for p in PHASES[1:]:
        xs = [t["durations"][p] for t in timelines if t and t["durations"].get(p) is not None]
        out[p] = round(statistics.median(xs), 3) if xs else None
    return out


def slow_phase(timeline: dict[str, Any], medians: dict[str, float | None]
               ) -> tuple[str | None, float]:
    """The phase of ``timeline`` (``to_dict()`` form) whose duration exceeds its median in
    ``medians`` by the most: ``(phase, extra seconds)``; ``(None, 0.0)`` when none exceeds."""
    best, extra = None, 0.0
    for p in PHASES[1:]:
        d, m = timeline["durations"].get(p), medians.get(p)
        if d is None or m is None:
            continue
        if d - m > extra:
            best, extra = p, round(d - m, 3)
    return best, extra


def p95(xs: Sequence[float]) -> float:
    """Nearest-rank 95th percentile of ``xs`` (non-empty; IndexError when empty)."""
    s = sorted(xs)
    return s[max(0, math.ceil(0.95 * len(s)) - 1)]


def tails(seconds: Sequence[float | None], timelines: Sequence[dict[str, Any] | None],
          factor: float = 2.0) -> dict[str, Any]:
    """Distribution of one fault path's runs: ``{"n", "recovered", "median_s", "p95_s",
    "max_s", "median_phases", "slow_runs"}``. ``seconds[i]`` is run i's figure (None: no
    recovery), ``timelines[i]`` its timeline (``to_dict()`` form, or None). ``slow_runs``: each
    run over ``factor`` × the median (or without a recovery) as ``{"run", "seconds",
    "slow_phase", "extra_s"}``, the phase named by ``slow_phase`` against the median
    timeline of the path."""
    vals = [s for s in seconds if s is not None]
    tls = [t for t in timelines if t]
    med = statistics.median(vals) if vals else None
    phases = median_durations(tls)
    slow = []
    for i, (s, t) in enumerate(zip(seconds, timelines)):
        if s is not None and med is not None and s <= factor * med:
            continue
        phase, extra = slow_phase(t, phases) if t else (None, 0.0)
        slow.append({"run": i, "seconds": s, "slow_phase": phase, "extra_s": extra})
    return {"n": len(seconds), "recovered": len(vals),
            "median_s": None if med is None else round(med, 3),
            "p95_s": round(p95(vals), 3) if vals else None,
            "max_s": round(max(vals), 3) if vals else None,
            "median_phases": phases, "slow_runs": slow}


def format_timeline(tl: dict[str, Any]) -> list[str]:
    """Markdown lines of one timeline (``to_dict()`` form): each phase, seconds from the fault
    and its own duration."""
    lines = ["| phase | s from fault | phase s |", "|---|---|---|"]
    for p in PHASES:
        s, d = tl["seconds"].get(p), tl["durations"].get(p)
        lines.append(f"| {p} | {'–' if s is None else f'{s:.3f}'} | "
                     f"{'–' if d is None else f'{d:.3f}'} |")
    if tl.get("acted_by_node"):
        lines.append("")
        lines.append("executors acted (s from fault): " + ", ".join(
            f"{n} {s:.3f}" for n, s in tl["acted_by_node"].items()))
    if tl.get("first_step_by_rank"):
        lines.append("first step per rank (s from fault): " + ", ".join(
            f"rank {r} {s:.3f}" for r, s in tl["first_step_by_rank"].items()))
    return lines

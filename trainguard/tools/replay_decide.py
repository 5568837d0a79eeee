"""Re-decide a recording: feed a recorded event stream through the current detector, attributor
and remediator reducers in virtual time, with no server, and compare the decisions.

``trainguard replay decide FILE [--policy PATH] [--set ROW=ACTION …] [--job-record PATH]
[--json]``

FILE is what ``trainguard replay record`` (or ``record --history``) writes. Every recorded
input of the chain (heartbeats, worker and log lines, checkpoints, node heartbeats, telemetry,
XIDs, kernel lines, action results, recovery events) is stepped, in file order, through
``run_offline`` of each reducer that consumes its subject, at the virtual time of its
``recv_ns``; each service also gets a ``Tick`` every ``tick_s`` (50 ms, as live) and one at
the instant of each input, before it. What a
reducer publishes goes on to the reducers that subscribe to it (anomaly → attributor, verdict
→ remediator) at the same virtual time. The recorded anomalies, verdicts and decisions are not
inputs: they are what the replay is compared with.

The calls on the state store are answered by ``trainguard.tools.memstore.MemoryStore``: claims,
the job records (seeded from ``--job-record``, a JSON object of record fields, or of job →
fields; what it leaves out comes from the recording: members from ``worker.started`` and
heartbeats, the first generation seen, the mode and retry budget of the job's first recorded
decision), the commits and generation bumps the replayed remediator makes, the cross-job history
the replayed attributor writes (empty at the start: faults other jobs left in the live store
are not in a recording), and the audit trail. The controller records exclusions only.

Decisions are compared on action, culprit (ranks, nodes) and generation, aligned per job in
order (``difflib``); where they differ, a recorded and a replayed decision of the same fault
class (in order) are a ``changed`` pair, a decision only the recording has is ``missing``, one
only the replay has is ``new``.

What a recording cannot hold: the instants of the live services' ticks. The detector evaluates
its straggler and throughput rules on its timer (``eval_s``), over the windows as they are at
that instant, so a warning flag near a threshold may differ between live and replay; the
recovery decisions (crash, exception, hang, node loss: event-driven or threshold-crossing
rules) came out the same in every recording tried.

Policy backtesting: ``--set crash=stop_job_notify_user`` (``FAULT_CLASS[/LAYER]=ACTION``) or
``--policy FILE`` (JSON: ``{"rows": [{"fault_class", "layer", "action", "source"}],
"default_mode", "default_retry_budget"}``) changes rows of ``remediator.policy_table.TABLE`` for the
replay; the report then shows what the change would have decided.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import gzip
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from trainguard import schemas
from trainguard.schemas.subjects import matches
from trainguard.attributor import incidents as att
from trainguard.detector import reducer as det
from trainguard.core.reducer import Call, Publish, Received, Tick, run_offline
from trainguard.remediator import reducer as rem
from trainguard.remediator import policy_table

from trainguard.tools.memstore import MemoryController, MemoryStore
from trainguard.tools.recording import Record, read_recording
from trainguard.tools.replay_policy import ReplayError, Row, load_policy_file, parse_row, policy_with

__all__ = ["ReplayError", "Row", "DecisionRow", "ReplayResult", "parse_row", "policy_with",
           "load_policy_file", "decide", "compare", "main"]

#: Events the chain's services publish themselves: outcomes, never inputs, of a replay.
OUTPUT_SCHEMAS = frozenset({"anomaly", "verdict", "decision"})
ATTRIBUTOR_TOPICS = ("tg.job.*.anomaly",)
REMEDIATOR_TOPICS = ("tg.job.*.verdict", "tg.job.*.action", "tg.job.*.recovery")


# ---- the replay ------------------------------------------------------------------------------
@dataclass
class DecisionRow:
    """A decision for the comparison. ``t_s``: seconds from the recording's start."""

    job: str
    action: str
    ranks: list[int]
    nodes: list[str]
    generation: int
    t_s: float = 0.0
    fault_class: str = ""
    mode: str = ""
    reason: str = ""

    @classmethod
    def of(cls, d: schemas.Decision, t_s: float) -> "DecisionRow":
        return cls(d.job or "", d.action, sorted(d.ranks), sorted(d.nodes), d.generation,
                   round(t_s, 3), d.fault_class, d.mode, d.reason)

    def key(self) -> tuple:
        return (self.job, self.action, tuple(self.ranks), tuple(self.nodes), self.generation)


@dataclass
class ReplayResult:
    """``rows``: ``{"status": same|changed|new|missing, "replayed": DecisionRow|None,
    "recorded": DecisionRow|None, "differs": [field names]}`` in replay order; ``inputs`` —
    records stepped; ``skipped`` — records that did not decode."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    inputs: int = 0
    skipped: int = 0
    anomalies: int = 0
    verdicts: int = 0
    store: MemoryStore | None = None

    @property
    def replayed(self) -> list[DecisionRow]:
        return [r["replayed"] for r in self.rows if r["replayed"] is not None]

    @property
    def changed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] != "same"]

    def to_json(self) -> dict[str, Any]:
        conv = (lambda d: None if d is None else dataclasses.asdict(d))
        return {"inputs": self.inputs, "skipped": self.skipped, "anomalies": self.anomalies,
                "verdicts": self.verdicts, "changed": len(self.changed),
                "decisions": [{**r, "replayed": conv(r["replayed"]),
                               "recorded": conv(r["recorded"])} for r in self.rows]}


def _recorded_facts(events: list[tuple[Record, schemas.Event]]) -> dict[str, dict[str, Any]]:
    """Job → record fields the recording shows: the first decision's mode and retry budget."""
    facts: dict[str, dict[str, Any]] = {}
    for _rec, ev in events:
        if isinstance(ev, schemas.Decision) and ev.job and ev.job not in facts:
            facts[ev.job] = {"mode": ev.mode, "retry_budget": ev.retry_budget}
    return facts


def decide(records: Iterable[Record], policy: policy_table.Policy | None = None,
           job_records: dict[str, dict[str, Any]] | None = None, tick_s: float = 0.05,
           tail_s: float = 2.0, detector_config: det.DetectorServiceConfig | None = None,
           remediator_config: rem.RemediatorConfig | None = None) -> ReplayResult:
    """Re-decide ``records`` (see the module docstring). ``job_records``: job → record fields
    to seed (a snapshot); ``tick_s``: period of each service's ``Tick`` (s); ``tail_s``: ticks
    go on this long after the last record (held symptoms, deadlines). Raises ``ReplayError``
    for a snapshot field the job record does not have."""
    res = ReplayResult()
    events: list[tuple[Record, schemas.Event]] = []
    for r in records:
        try:
            events.append((r, schemas.decode(r.data)))
        except schemas.DecodeError:
            res.skipped += 1
    store, ctl = MemoryStore(), MemoryController()
    res.store = store
    seeds = {j: dict(f) for j, f in _recorded_facts(events).items()}
    for job, fields in (job_records or {}).items():
        seeds.setdefault(job, {}).update(fields)
    for job, fields in seeds.items():
        try:
            store.seed(job, fields)
        except (KeyError, ValueError) as exc:
            raise ReplayError(f"job record of {job!r}: {exc}") from None
    rcfg = remediator_config or rem.RemediatorConfig(controller="local")
    if policy is not None:
        rcfg = dataclasses.replace(rcfg, policy=policy)
    states: dict[str, Any] = {
        "detector": det.DetectorState(config=detector_config or det.DetectorServiceConfig()),
        "attributor": att.AttributorState(),
        "remediator": rem.RemediatorState(config=rcfg, controller=ctl.name)}
    steps: dict[str, Callable] = {"detector": det.step, "attributor": att.step,
                                  "remediator": rem.step}
    topics = {"detector": det.TOPICS, "attributor": ATTRIBUTOR_TOPICS,
              "remediator": REMEDIATOR_TOPICS}
    targets = {"state": store, "controller": ctl}

    def replies(call: Call) -> Any:
        return getattr(targets[call.target], call.method)(*call.args, **call.kwargs)

    if not events:
        return res
    t0 = events[0][0].recv_ns
    replayed: list[DecisionRow] = []

    def run(now: float, first: list[tuple[str, Any]]) -> None:
        queue = deque(first)
        while queue:
            svc, inp = queue.popleft()
            states[svc], effects = run_offline(steps[svc], states[svc], [(now, inp)], replies)
            for eff in effects:
                if not isinstance(eff, Publish):
                    continue
                ev = eff.event
                if isinstance(ev, schemas.Anomaly):
                    res.anomalies += 1
                elif isinstance(ev, schemas.Verdict):
                    res.verdicts += 1
                elif isinstance(ev, schemas.Decision):
                    replayed.append(DecisionRow.of(ev, now))
                wall = t0 + int(now * 1e9)
                for other, subs in topics.items():
                    if any(matches(p, eff.subject) for p in subs):
                        queue.append((other, Received(eff.subject, ev, wall)))

    next_tick = 0.0

    def ticks_until(t: float) -> None:
        nonlocal next_tick
        while next_tick <= t:
            wall = t0 + int(next_tick * 1e9)
            run(next_tick, [(svc, Tick(wall)) for svc in steps])
            next_tick = round(next_tick + tick_s, 9)

    recorded: list[DecisionRow] = []
    for rec, ev in events:
        now = (rec.recv_ns - t0) / 1e9
        if ev.SCHEMA == "decision":
            recorded.append(DecisionRow.of(ev, now))
        if ev.SCHEMA in OUTPUT_SCHEMAS or rec.subject.startswith("tg.dlq."):
            continue
        ticks_until(now)
        # and a tick at the input's own instant: a threshold a live tick found (a rank silent
        # past its hang timeout) is found before the input that followed it live (the peers'
        # connection resets of the hung rank's kill), whatever the phase of the 50 ms grid
        run(now, [(svc, Tick(rec.recv_ns)) for svc in steps])
        store.observe(ev)
        first = [(svc, Received(rec.subject, ev, rec.recv_ns)) for svc, subs in topics.items()
                 if any(matches(p, rec.subject) for p in subs)]
        if first:
            res.inputs += 1
            run(now, first)
    ticks_until((events[-1][0].recv_ns - t0) / 1e9 + tail_s)
    res.rows = compare(recorded, replayed)
    return res


def compare(recorded: list[DecisionRow], replayed: list[DecisionRow]) -> list[dict[str, Any]]:
    """Align the decisions per job in order and say how each differs (module docstring)."""
    rows: list[tuple[float, dict[str, Any]]] = []
    for job in sorted({d.job for d in recorded} | {d.job for d in replayed}):
        a = [d for d in recorded if d.job == job]
        b = [d for d in replayed if d.job == job]
        sm = difflib.SequenceMatcher(a=[d.key() for d in a], b=[d.key() for d in b],
                                     autojunk=False)
        for op, i1, i2, j1, j2 in sm.get_opcodes():
            if op == "equal":
                for old, new in zip(a[i1:i2], b[j1:j2]):
                    rows.append((new.t_s, {"status": "same", "replayed": new, "recorded": old,
                                           "differs": []}))
                continue
            # pair what differs by fault class, in order: a decision of the same fault that
            # came out otherwise is "changed"; the rest is "missing" (recorded only) or "new"
            news = list(b[j1:j2])
            for old in a[i1:i2]:
                new = next((n for n in news if n.fault_class == old.fault_class), None)
                if new is None:
                    rows.append((old.t_s, {"status": "missing", "replayed": None,
                                           "recorded": old, "differs": []}))
                    continue
                news.remove(new)
                differs = [f for f in ("action", "ranks", "nodes", "generation")
                           if getattr(old, f) != getattr(new, f)]
                rows.append((new.t_s, {"status": "changed", "replayed": new, "recorded": old,
                                       "differs": differs}))
            rows += [(n.t_s, {"status": "new", "replayed": n, "recorded": None, "differs": []})
                     for n in news]
    rows.sort(key=lambda x: x[0])
    return [r for _, r in rows]


# ---- command line ----------------------------------------------------------------------------
def _fmt(d: DecisionRow | None) -> str:
    if d is None:
        return "-"
    return (f"{d.action} ranks={d.ranks} nodes={d.nodes} generation={d.generation}")


def print_result(res: ReplayResult, out=sys.stdout) -> None:
    mark = {"same": "=", "changed": "≠", "new": "+", "missing": "-"}
    for r in res.rows:
        d = r["replayed"] or r["recorded"]
        line = f"{mark[r['status']]} {d.t_s:9.3f}s {d.job} {d.fault_class or '?'}: "
        if r["status"] == "same":
            line += _fmt(r["replayed"])
        elif r["status"] == "missing":
            line += f"not decided in the replay (recorded: {_fmt(r['recorded'])})"
        elif r["status"] == "new":
            line += f"{_fmt(r['replayed'])} (not in the recording)"
        else:
            line += (f"{_fmt(r['replayed'])} (recorded: {_fmt(r['recorded'])}; differs in "
                     f"{', '.join(r['differs'])})")
        print(line, file=out)
    same = sum(1 for r in res.rows if r["status"] == "same")
    print(f"{len(res.rows)} decision(s): {same} as recorded, {len(res.changed)} differ "
          f"({res.inputs} inputs, {res.anomalies} anomalies, {res.verdicts} verdicts, "
          f"{res.skipped} undecodable)", file=out)


def _job_records(path: str | None) -> dict[str, dict[str, Any]]:
    if not path:
        return {}
    try:
        with open(path) as fh:
            obj = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"--job-record {path}: {exc}") from None
    if not isinstance(obj, dict):
        raise ReplayError(f"--job-record {path}: expected a JSON object")
    from trainguard.schemas.job import FIELDS

    if obj and not set(obj) <= set(FIELDS):  # job → fields
        if not all(isinstance(v, dict) for v in obj.values()):
            raise ReplayError(f"--job-record {path}: expected record fields, or job → fields "
                              f"(unknown fields: {', '.join(sorted(set(obj) - set(FIELDS)))})")
        return obj
    return {"*": obj}  # record fields for every job of the recording


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainguard replay decide",
                                description="Re-decide a recording with the current services "
                                            "(and a changed policy), offline.")
    p.add_argument("file", help="a recording (JSON lines of `trainguard replay record`; "
                                "gzip when it ends in .gz)")
    p.add_argument("--policy", default=None, help="JSON policy file: rows that replace "
                                                  "rows of the table")
    p.add_argument("--set", action="append", default=[], metavar="FAULT[/LAYER]=ACTION",
                   help="change one policy row (repeatable)")
    p.add_argument("--job-record", default=None,
                   help="JSON of job record fields (or job → fields) to seed the replay with")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--tick", type=float, default=0.05, help="service tick in seconds")
    args = p.parse_args(argv)
    try:
        rows, settings = load_policy_file(args.policy) if args.policy else ([], {})
        rows += [parse_row(s) for s in args.set]
        policy = policy_with(rows, **settings) if (rows or settings) else None
        opener = gzip.open if args.file.endswith(".gz") else open
        with opener(args.file, "rt") as fh:
            recs = list(read_recording(fh))
        snap = _job_records(args.job_record)
        if "*" in snap:  # fields for every job of the recording
            jobs = {schemas.subjects.untoken(r.subject.split(".")[2]) for r in recs
                    if r.subject.startswith("tg.job.")}
            snap = {j: snap["*"] for j in jobs}
        res = decide(recs, policy, snap, tick_s=args.tick)
    except (OSError, ValueError) as exc:  # ReplayError is a ValueError
        print(f"trainguard replay decide: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res.to_json(), indent=1))
    else:
        print_result(res)
    return 0

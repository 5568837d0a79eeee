"""Recovery benchmark: the same job under trainguard and its peers, one deterministic fault
schedule, figures computed from the ranks' own progress records.

    python bench/recovery.py --json results.json [--quick] [--systems trainguard,torchrun,...]
                             [--faults exception,sigkill,...] [--runs N] [--markdown PATH]

The job: the trainguard demo model (digits MLP, ``trainguard.demo.model``), 4 ranks on 2
simulated nodes, DDP over gloo, a checkpoint every ``--ckpt-every`` steps. Every rank of every
system appends ``rank step unix_ns pid loss incarnation world_size`` per completed step to the
run's progress file (``bench/peers/common.py``); every figure below is computed from that file
alone, the same way for every system (for trainguard the file is written by a hook around
``Context.progress``, ``bench/peers/tg_hook``).

Figures per (system, fault), over ``--runs`` runs (medians):

* ``median_s`` / ``max_s``: seconds from the fault (the signal sent, or the exception raised) to
  the moment every rank of the new world has completed a step computed after the fault (a step
  of a new incarnation, or a step beyond the last one the old incarnation could complete). For
  ``straggler``: seconds from the first slow step until step times are back to normal
  (5 consecutive steps ≤ 1.5× the fault-free median step time); null when they never are.
* ``steps_rolled_back``: last step completed before recovery minus the step training resumed
  from (work done again).
* ``path`` (trainguard): how the state came back after each fault, from its
  ``recovery.resumed`` events — ``peer`` (from healthy data-parallel peers) or ``checkpoint``
  (the newest valid checkpoint); ``peer+checkpoint`` when runs differed.
* ``training_goodput``: (distinct steps completed × fault-free median step time) / wall time from
  the first to the last completed step — productive step time over wall time; rolled-back work,
  restarts and slow steps all lower it.
* ``infra_goodput``: 1 − (time between each fault and its recovery) / the same wall time — the
  share of time every rank was up and training.
* ``culprit_correct``: whether the rank(s) the system named as the cause (trainguard's verdict)
  are exactly the injected ones, in every run; null for systems that name none.
* ``ratio_to_trainguard``: ``median_s`` / trainguard's ``median_s`` for the same fault, this run.
* ``p95_s`` (nearest rank) beside ``median_s`` and ``max_s``; ``timelines``: each fault's phases
  (trainguard: ``trainguard.core.timeline``, seconds from the fault: last progress, detected,
  verdict, decision, executors acted, rendezvous, first step on every rank; the whole timeline
  per run in ``detail.json``); ``median_phases``; ``slow_runs``: every run over 2 × the median
  (or without a recovery) with the phase that took the extra time against the median timeline.

Faults that need a registered spare node (``SPARE_FAULTS``; trainguard only: the peers have no
spare node to move to): ``straggler_spare`` — rank 2 slowed 3×, with a spare node;
``degrading_node`` — the simulated GPU of node 1 counts 5 corrected ECC errors per second
(``trainguard.demo.fake_pynvml``); ``degrading_memory`` — node 1 is given a memory budget 75 %
of which its processes use, and a real process started for node 1 fills the rest, at most
384 MiB (``trainguard.demo.fill``). For these ``median_s`` is the seconds
from the fault to every rank of the new world training, the slow or degrading node's ranks on
the spare (the harness's timeline: ``recovery.resumed`` of the decision's generation), and
``steps_rolled_back`` the steps lost (target 0: a planned migration before any rank dies);
``culprit_correct`` whether the decision moved exactly that node.

Peers (torchft, NVRx ``ft_launcher``) are used when they import here; when one does not, the
output says why and its rows carry ``"available": false``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "peers"))

from common import parse_line  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

SYSTEMS = ("trainguard", "torchrun", "full_restart", "torchft", "nvrx")
FAULTS = ("exception", "sigkill", "hang", "node_loss", "straggler", "five_faults",
          "straggler_spare", "degrading_node", "degrading_memory")
#: Where each single fault lands (global rank, or node for node_loss).
FAULT_TARGET = {"sigkill": {"rank": 1}, "exception": {"rank": 2}, "hang": {"rank": 3},
                "node_loss": {"node": 1}, "straggler": {"rank": 2, "factor": 3},
                "straggler_spare": {"rank": 2, "factor": 3, "harness_kind": "straggler",
                                    "spare_nodes": 1},
                "degrading_node": {"node": 1, "per_s": 5.0, "harness_kind": "ecc_degrading",
                                   "spare_nodes": 1},
                "degrading_memory": {"node": 1, "rate": 64.0,
                                     "harness_kind": "memory_fill", "spare_nodes": 1}}
#: Faults that need a registered spare node: trainguard only, timed by its harness (see above).
SPARE_FAULTS = ("straggler_spare", "degrading_node", "degrading_memory")
#: Steps a job of ``SPARE_FAULTS`` trains past the fault (≈ 6 s at ≈ 25 ms a step): a node's
#: memory filling is noticed when the fill has added memory, seconds after it began, and a
#: job that ended meanwhile would leave nothing to move.
SPARE_STEPS_AFTER = 250
#: The kinds the five-fault run cycles through, one fault every interval.
FIVE_KINDS = ("sigkill", "exception", "hang", "sigkill", "exception")
#: Step-time ratio that counts as "back to normal" after a straggler, and how many steps in a row.
NORMAL_FACTOR, NORMAL_RUN = 1.5, 5


# ---- settings -------------------------------------------------------------------------------
@dataclass
class BenchSettings:
    """Run-length settings. ``steps`` per single-fault job, fault at ``fault_step``;
    ``five_interval`` steps between the five faults; ``step_sleep_s`` seconds of pause per step
    (sets the step time, ≈ 25 ms here); ``runs`` repetitions per (system, fault)."""

    steps: int = 100
    fault_step: int = 50
    five_interval: int = 40
    step_sleep_s: float = 0.02
    ckpt_every: int = 20
    runs: int = 3
    hang_timeout_s: float = 2.0
    pg_timeout_s: float = 10.0
    deadline_s: float = 180.0


QUICK = dict(steps=80, fault_step=50, five_interval=30, runs=1, deadline_s=120.0)


def schedule(fault: str, s: BenchSettings) -> tuple[list[dict[str, Any]], int]:
    """The fault schedule of one job and its step count."""
    if fault == "five_faults":
        faults = [dict(FAULT_TARGET[k], kind=k, step=s.fault_step + i * s.five_interval)
                  for i, k in enumerate(FIVE_KINDS)]
        return faults, s.fault_step + len(FIVE_KINDS) * s.five_interval
    if fault in SPARE_FAULTS:  # a degrading node is noticed over seconds: train on past it
        return ([dict(FAULT_TARGET[fault], kind=fault, step=s.fault_step)],
                max(s.steps, s.fault_step + SPARE_STEPS_AFTER))
    return [dict(FAULT_TARGET[fault], kind=fault, step=s.fault_step)], s.steps


# ---- metrics (pure functions of the progress records) ---------------------------------------
@dataclass(frozen=True)
class Rec:
    rank: int
    step: int
    t: int  # Unix ns when the step completed
    pid: int
    loss: float
    inc: str  # incarnation: changes on every restart
    world: int


def load_progress(lines: Iterable[str]) -> tuple[list[Rec], list[dict[str, Any]]]:
    """Parse progress lines → (records sorted by time, fault events sorted by time). Fault
    markers with the same kind and time (a node loss: one per rank) become one event."""
    recs: list[Rec] = []
    marks: dict[tuple[str, int], dict[str, Any]] = {}
    for line in lines:
        p = parse_line(line)
        if p is None:
            continue
        if p[0] == "step":
            recs.append(Rec(*p[1:]))
        else:
            _, kind, rank, step, t = p
            ev = marks.setdefault((kind, t), {"kind": kind, "ranks": [], "step": step, "t_ns": t})
            if rank >= 0 and rank not in ev["ranks"]:
                ev["ranks"].append(rank)
    recs.sort(key=lambda r: r.t)
    return recs, sorted(marks.values(), key=lambda e: e["t_ns"])


def step_completions(recs: list[Rec]) -> list[tuple[int, int, str]]:
    """(Unix ns, step, incarnation) of every step that every rank of its world completed, at the
    time the last rank completed it, in time order. The incarnation key is rank 0's."""
    by: dict[tuple[int, int], dict[int, Rec]] = {}
    for r in recs:
        by.setdefault((r.step, r.world), {})[r.rank] = r  # latest execution of the step wins
    out = []
    for (step, world), ranks in by.items():
        if len(ranks) == world:
            out.append((max(r.t for r in ranks.values()), step, ranks[min(ranks)].inc))
    out.sort()
    return out


def ref_step_time(recs: list[Rec], before_ns: int | None) -> float | None:
    """Median seconds between consecutive completed steps (same incarnation, step + 1) before
    ``before_ns`` (the first fault): the job's fault-free step time."""
    comp = [c for c in step_completions(recs) if before_ns is None or c[0] <= before_ns]
    d = [(b[0] - a[0]) / 1e9 for a, b in zip(comp, comp[1:]) if b[1] == a[1] + 1 and b[2] == a[2]]
    return statistics.median(d) if d else None


def recovery(recs: list[Rec], t_f: int, faulted: Iterable[int] = ()) -> dict[str, Any] | None:
    """Fault at ``t_f`` → the time every rank of the new world completed a new step.

    A record is *new* when it comes after ``t_f`` and either its rank's incarnation changed, or
    its step is beyond ``S + 1`` (``S`` the highest step any rank completed before the fault took
    effect: the old incarnation can still finish at most step ``S + 1``, the one its collectives
    had already completed). The fault takes effect at ``t_f``, or, for ``faulted`` ranks that
    still completed steps of their incarnation after it (a node's launcher killed: its ranks die
    a moment later, when the kernel delivers their parent-death signal), at the last of those
    steps. Returns None when no complete new world appears."""
    faulted = set(faulted)
    inc_at: dict[int, str] = {}
    for r in recs:
        if r.t > t_f:
            break
        inc_at[r.rank] = r.inc
    t_eff = max([t_f] + [r.t for r in recs if r.rank in faulted and r.t > t_f
                         and r.inc == inc_at.get(r.rank)])
    s_f = max((r.step for r in recs if r.t <= t_eff), default=-1)

    def new(r: Rec) -> bool:
        return r.t > t_f and (r.inc != inc_at.get(r.rank) or r.step > s_f + 1)

    news = [r for r in recs if new(r)]
    if not news:
        return None
    world = news[0].world
    first: dict[int, Rec] = {}
    for r in news:
        if r.world == world and r.rank not in first:
            first[r.rank] = r
    if len(first) < world:  # (ranks are 0..world-1, or replica ids for torchft)
        return None
    resumed = max(r.t for r in first.values())
    old_done = max((r.step for r in recs if r.t <= resumed and not new(r)), default=-1)
    resumed_from = min(r.step for r in first.values())
    return {"resumed_ns": resumed, "recovery_s": (resumed - t_f) / 1e9,
            "steps_rolled_back": max(0, old_done - resumed_from + 1), "world_after": world}


def back_to_normal(recs: list[Rec], t_f: int, ref_s: float) -> dict[str, Any] | None:
    """Straggler from ``t_f``: seconds until ``NORMAL_RUN`` consecutive step intervals are all
    ≤ ``NORMAL_FACTOR`` × ``ref_s``, measured to the start of that run. None if never."""
    comp = [c for c in step_completions(recs) if c[0] > t_f]
    ok = 0
    for a, b in zip(comp, comp[1:]):
        if (b[0] - a[0]) / 1e9 <= NORMAL_FACTOR * ref_s:
            ok += 1
            if ok == 1:
                start = a[0]
            if ok >= NORMAL_RUN:
                return {"resumed_ns": start, "recovery_s": max(0.0, (start - t_f) / 1e9),
                        "steps_rolled_back": 0}
        else:
            ok = 0
    return None


def goodput(recs: list[Rec], downs: list[tuple[int, int]], ref_s: float | None
            ) -> tuple[float | None, float | None]:
    """(training goodput, infrastructure goodput) of one run, see the module docstring.
    ``downs``: (fault ns, recovered ns) windows."""
    if len(recs) < 2 or not ref_s:
        return None, None
    t0, t1 = recs[0].t, recs[-1].t
    wall = (t1 - t0) / 1e9
    if wall <= 0:
        return None, None
    distinct = len({r.step for r in recs})
    training = min(1.0, (distinct - 1) * ref_s / wall)
    down = sum(max(0, min(b, t1) - max(a, t0)) for a, b in downs) / 1e9
    return round(training, 4), round(max(0.0, 1.0 - down / wall), 4)


def analyse_run(lines: Iterable[str], culprits: list[list[int] | None] | None = None,
                injected: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every figure of one run from its progress lines. ``culprits``: per fault, the ranks the
    system named (None: names none). ``injected``: faults injected outside the ranks (already
    in the file as markers; used only when the file has none)."""
    recs, events = load_progress(lines)
    if not events and injected:
        events = [dict(e) for e in injected]
    first_fault = events[0]["t_ns"] if events else None
    ref = ref_step_time(recs, first_fault)
    samples, downs = [], []
    for i, ev in enumerate(events):
        if ev["kind"] == "straggler":
            r = back_to_normal(recs, ev["t_ns"], ref) if ref else None
        else:
            r = recovery(recs, ev["t_ns"], ev["ranks"] or ())
            downs.append((ev["t_ns"], r["resumed_ns"] if r else (recs[-1].t if recs else ev["t_ns"])))
        named = None if culprits is None or i >= len(culprits) else culprits[i]
        samples.append({
            "kind": ev["kind"], "ranks": ev["ranks"], "step": ev["step"], "t_ns": ev["t_ns"],
            "recovery_s": None if r is None else round(r["recovery_s"], 4),
            "steps_rolled_back": None if r is None else r["steps_rolled_back"],
            "culprit": named,
            "culprit_correct": None if culprits is None else
            (named is not None and sorted(named) == sorted(ev["ranks"]))})
    tg, ig = goodput(recs, downs, ref)
    last = max((r.step for r in recs), default=-1)
    return {"faults": samples, "ref_step_s": ref, "training_goodput": tg, "infra_goodput": ig,
            "last_step": last, "records": len(recs)}


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def aggregate(system: str, fault: str, runs: list[dict[str, Any]], names_culprit: bool
              ) -> dict[str, Any]:
    """One JSON row from the analysed runs of one (system, fault)."""
    samples = [s for r in runs for s in r["faults"]]
    rec = [s["recovery_s"] for s in samples if s["recovery_s"] is not None]
    rb = [s["steps_rolled_back"] for s in samples if s["steps_rolled_back"] is not None]
    cc = [s["culprit_correct"] for s in samples if s["culprit_correct"] is not None]
    row = {"system": system, "fault": fault, "median_s": _median(rec),
           "max_s": round(max(rec), 4) if rec else None, "runs": len(runs),
           "steps_rolled_back": _median(rb),
           "training_goodput": _median([r["training_goodput"] for r in runs
                                        if r["training_goodput"] is not None]),
           "infra_goodput": _median([r["infra_goodput"] for r in runs
                                     if r["infra_goodput"] is not None]),
           "culprit_correct": (all(cc) and len(cc) == len(samples)) if names_culprit and samples
           else None,
           "recovered": f"{len(rec)}/{len(samples)}",
           "path": "+".join(sorted({p for s in samples for p in (s.get("path") or "").split("+")
                                    if p})) or None}
    if names_culprit:
        row["culprit_correct_n"] = f"{sum(1 for c in cc if c)}/{len(samples)}"
    from trainguard.core import timeline

    dist = timeline.tails([s["recovery_s"] for s in samples],
                          [s.get("timeline") for s in samples])
    row.update(p95_s=dist["p95_s"], median_phases=dist["median_phases"],
               slow_runs=dist["slow_runs"],
               timelines=[(s.get("timeline") or {}).get("seconds") for s in samples])
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_to_trainguard`` = median_s / trainguard's median_s for the same fault."""
    tg = {r["fault"]: r["median_s"] for r in rows if r["system"] == "trainguard"}
    for r in rows:
        base = tg.get(r["fault"])
        r["ratio_to_trainguard"] = (round(r["median_s"] / base, 2)
                                    if base and r["median_s"] is not None else None)


# ---- output ---------------------------------------------------------------------------------
def _f(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return fmt.format(x) if isinstance(x, (int, float)) else str(x)


COLUMNS = ("system", "fault", "median s", "p95 s", "max s", "recovered", "rolled back", "path",
           "train goodput", "infra goodput", "culprit ok", "× trainguard")


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("available") is False:
            out.append([r["system"], r["fault"], "n/a"] + ["-"] * (len(COLUMNS) - 3))
            continue
        out.append([r["system"], r["fault"], _f(r["median_s"]), _f(r.get("p95_s")),
                    _f(r["max_s"]), r["recovered"],
                    _f(r["steps_rolled_back"], "{:g}"), _f(r.get("path")),
                    _f(r["training_goodput"], "{:.3f}"),
                    _f(r["infra_goodput"], "{:.3f}"),
                    _f(r["culprit_correct"]) if r["culprit_correct"] is None
                    else r.get("culprit_correct_n", _f(r["culprit_correct"])),
                    _f(r.get("ratio_to_trainguard"), "{:.1f}×")])
    return out


def print_table(rows: list[dict[str, Any]], file=sys.stdout) -> None:
    body = table_rows(rows)
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
              for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths)), file=file)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(b) + " |" for b in table_rows(rows)]
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------
def _csv(choices: tuple[str, ...]):
    def parse(v: str) -> list[str]:
        items = [x.strip() for x in v.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {v!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/recovery.py",
        description="Run the demo job under trainguard and its peers with one deterministic "
                    "fault schedule; print and write (JSON) seconds from fault to training "
                    "again, steps rolled back, goodput and culprit attribution.")
    p.add_argument("--json", default="", metavar="PATH",
                   help="also write the result rows here (the table is always printed)")
    p.add_argument("--quick", action="store_true",
                   help=f"shorter jobs, 1 run, trainguard on every single fault (no "
                        f"five_faults unless --faults asks) and torchrun on "
                        f"{','.join(QUICK_PEER_FAULTS)} only (unless --faults is given), 5 min "
                        f"budget ({QUICK})")
    p.add_argument("--systems", type=_csv(SYSTEMS), default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; "
                        f"--quick: trainguard,torchrun)")
    p.add_argument("--faults", type=_csv(FAULTS), default=None,
                   help=f"comma-separated subset of {','.join(FAULTS)} (default: all)")
    p.add_argument("--runs", type=int, default=None, help="runs per (system, fault) (default 3; "
                                                         "--quick 1); medians are over these")
    p.add_argument("--steps", type=int, default=None, help="steps of a single-fault job")
    p.add_argument("--five-interval", type=int, default=None, metavar="STEPS",
                   help="steps between the five faults of five_faults (default 40, about one "
                        "fault a second here; training goodput depends on it: see the README)")
    p.add_argument("--budget-min", type=float, default=None,
                   help="stop starting further peer runs after this many minutes (default "
                        "20; --quick 5); trainguard's runs and every peer's first SIGKILL run "
                        "start regardless")
    p.add_argument("--markdown", metavar="PATH", default="",
                   help="also write the table and the command as markdown")
    p.add_argument("--keep", metavar="DIR", default="",
                   help="keep every run's directory (progress files, logs) under DIR")
    a = p.parse_args(argv)
    if a.runs is not None and a.runs < 1:
        p.error("--runs must be ≥ 1")
    a.faults_given = a.faults is not None
    if a.faults is None:  # --quick: the five single faults (every recovery path), not the long run
        a.faults = [f for f in FAULTS if f != "five_faults" and f not in SPARE_FAULTS] \
            if a.quick else list(FAULTS)
    if a.systems is None:
        a.systems = ["trainguard", "torchrun"] if a.quick else list(SYSTEMS)
    if a.budget_min is None:
        a.budget_min = 5.0 if a.quick else 20.0
    return a


def settings_from(a: argparse.Namespace) -> BenchSettings:
    s = BenchSettings(**(QUICK if a.quick else {}))
    if a.runs is not None:
        s.runs = a.runs
    if a.steps is not None:
        s.steps = a.steps
        s.fault_step = min(s.fault_step, a.steps // 3)
    if a.five_interval is not None:
        s.five_interval = a.five_interval
    return s


def run_one(system: str, fault: str, s: BenchSettings, run_dir: str) -> dict[str, Any]:
    import runners

    faults, steps = schedule(fault, s)
    cfg = runners.JobConfig(steps=steps, ckpt_every=s.ckpt_every, step_sleep_s=s.step_sleep_s,
                            hang_timeout_s=s.hang_timeout_s, pg_timeout_s=s.pg_timeout_s,
                            deadline_s=s.deadline_s + (60 if fault == "five_faults" else 0))
    out = runners.RUNNERS[system](cfg, run_dir, faults).run()
    with open(out.progress) as fh:
        res = analyse_run(fh, out.culprits, out.injected)
    res["finished"] = out.finished
    res["notes"] = out.notes
    if system == "trainguard":
        _harness_fallback(res, out)
        with open(out.progress) as fh:
            recs, _ = load_progress(fh)
        for smp, inj in zip(res["faults"], out.injected):
            smp["path"] = (inj.get("harness") or {}).get("path")
            smp["timeline"] = _timeline(inj, recs)
        if fault in SPARE_FAULTS:
            _on_the_spare(res, out, faults)
    return res


def _timeline(inj: dict[str, Any], recs: list[Rec]) -> dict[str, Any] | None:
    """The harness's timeline of one fault (``trainguard.core.timeline``) with its last progress
    from the progress file: the newest step any rank completed before the decision (before
    the ranks' first new steps when there was none)."""
    from trainguard.core import timeline

    tl = (inj.get("harness") or {}).get("timeline")
    if not tl:
        return None
    sec = tl["seconds"]
    until = next((sec[p] for p in ("decision", "first_step") if sec.get(p) is not None), None)
    if until is None:
        return tl
    end = tl["fault_ns"] + int(until * 1e9)
    before = [r.t for r in recs if r.t <= end]
    return timeline.with_mark(tl, "last_progress", before[-1]) if before else tl


def _on_the_spare(res: dict[str, Any], out, faults: list[dict[str, Any]]) -> None:
    """Figures of a fault of ``SPARE_FAULTS`` from the harness's timeline: the progress file
    cannot tell a slow rank training on from one that was moved (no incarnation ends), the
    harness can (``recovery.resumed`` of the decision's generation, on every rank)."""
    for smp, inj, f in zip(res["faults"], out.injected, faults):
        h = inj.get("harness") or {}
        if h.get("resumed_ns") and h.get("injected_ns"):
            smp["recovery_s"] = round((h["resumed_ns"] - h["injected_ns"]) / 1e9, 4)
            smp["steps_rolled_back"] = h.get("steps_rolled_back")
        else:
            smp["recovery_s"] = smp["steps_rolled_back"] = None
        for k in ("detected_ns", "decided_ns"):
            if h.get(k) and h.get("injected_ns"):
                smp[k.replace("_ns", "_s")] = round((h[k] - h["injected_ns"]) / 1e9, 4)
        d = h.get("decision") or {}
        node = f"node{f['node'] if 'node' in f else f['rank'] // 2}"
        smp["action"] = d.get("action")
        smp["culprit"] = d.get("nodes")
        smp["culprit_correct"] = (d.get("action") == "exclude_node_and_requeue"
                                  and d.get("nodes") == [node])
        smp["planned"] = str(d.get("reason", "")).startswith("planned migration")


def _harness_fallback(res: dict[str, Any], out) -> None:
    """Without progress records (the hook did not load), use the harness's own timeline."""
    if res["records"]:
        return
    res["notes"].append("no progress records: figures from the harness report")
    for smp, inj in zip(res["faults"], out.injected):
        h = inj.get("harness") or {}
        if h.get("resumed_ns") and h.get("injected_ns"):
            smp["recovery_s"] = round((h["resumed_ns"] - h["injected_ns"]) / 1e9, 4)
            smp["steps_rolled_back"] = h.get("steps_rolled_back")


#: The peers' faults in the order their runs are started while the time budget lasts: SIGKILL
#: first (the headline ratio), the long five-fault jobs last.
PEER_ORDER = ("sigkill", "exception", "hang", "node_loss", "straggler", "five_faults")
#: (``SPARE_FAULTS`` are not in it: the peers do not run them.)
#: ``--quick`` runs the peers on these faults only (trainguard runs every fault).
QUICK_PEER_FAULTS = ("sigkill",)


def plan(a: argparse.Namespace, s: BenchSettings, missing: dict[str, str]
         ) -> list[tuple[str, str, int, bool]]:
    """The runs in the order they start: ``(system, fault, run index, budgeted)``.

    1. trainguard's first run of every fault, each peer's first SIGKILL run beside it;
    2. trainguard's other runs (never cut: its medians are what the targets are about);
    3. the peers' other first runs (``PEER_ORDER``), then their further runs — these only
       while ``--budget-min`` lasts (``budgeted``)."""
    peers = [x for x in a.systems if x != "trainguard" and x not in missing]
    tg = "trainguard" in a.systems and "trainguard" not in missing
    peer_faults = [f for f in PEER_ORDER if f in a.faults and
                   (not a.quick or a.faults_given or f in QUICK_PEER_FAULTS)]
    out: list[tuple[str, str, int, bool]] = []
    for fault in a.faults:
        if tg:
            out.append(("trainguard", fault, 0, False))
        if fault == "sigkill" and fault in peer_faults:
            out += [(x, fault, 0, False) for x in peers]
    if tg:
        out += [("trainguard", f, i, False) for i in range(1, s.runs) for f in a.faults]
    out += [(x, f, 0, True) for f in peer_faults if f != "sigkill" for x in peers]
    out += [(x, f, i, True) for i in range(1, s.runs) for f in peer_faults for x in peers]
    return out


def _passes(a: argparse.Namespace, s: BenchSettings, missing: dict[str, str], root: str,
            detail: dict[str, list[dict[str, Any]]], t_start: float) -> None:
    """Run the planned jobs into ``detail``; budgeted ones only while the budget lasts."""
    budget_s = a.budget_min * 60
    longest: dict[tuple[str, str], float] = {}
    skipped = 0
    for system, fault, i, budgeted in plan(a, s, missing):
        elapsed = time.monotonic() - t_start
        need = longest.get((system, fault), 40.0)
        if budgeted and elapsed + need > budget_s:
            skipped += 1
            continue
        d = os.path.join(root, f"{system}-{fault}-{i}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        t0 = time.monotonic()
        try:
            res = run_one(system, fault, s, d)
        except Exception as exc:  # noqa: BLE001 - one failed run must not end the bench
            res = {"faults": [], "training_goodput": None, "infra_goodput": None,
                   "notes": [f"runner error: {type(exc).__name__}: {exc}"],
                   "finished": False}
        dur = time.monotonic() - t0
        longest[(system, fault)] = max(dur, longest.get((system, fault), 0.0))
        detail.setdefault(f"{system}/{fault}", []).append(res)
        print(f"  {system:<12} {fault:<11} run {i + 1}/{s.runs}: recovery "
              f"{[smp['recovery_s'] for smp in res['faults']]} s, rolled back "
              f"{[smp['steps_rolled_back'] for smp in res['faults']]}, goodput "
              f"{res['training_goodput']}/{res['infra_goodput']}, finished "
              f"{res['finished']} ({dur:.0f} s)"
              + (f" — {'; '.join(res['notes'])}" if res["notes"] else ""), flush=True)
    if skipped:
        print(f"  time budget of {a.budget_min:g} min reached: {skipped} peer run(s) not "
              f"started (see each row's runs)", flush=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load0 = provenance.loadavg()
    s = settings_from(a)
    import signal

    import runners

    # A SIGTERM (e.g. from `timeout`) unwinds normally, so every runner stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cmd = "python bench/recovery.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"recovery benchmark: systems {','.join(a.systems)}; faults {','.join(a.faults)}; "
          f"{s.runs} run(s) each; {asdict(s)}", flush=True)
    missing = {}
    for system in a.systems:
        why = runners.available(system)
        if why:
            missing[system] = why
            print(f"  {system}: not available here — {why}", flush=True)
    root = a.keep or tempfile.mkdtemp(prefix="tg-bench-recovery-")
    os.makedirs(root, exist_ok=True)
    rows: list[dict[str, Any]] = []
    detail: dict[str, list[dict[str, Any]]] = {}
    t_start = time.monotonic()
    # Passes: every (system, fault) gets its first run before any gets its second, so a time
    # budget that runs out leaves fewer runs everywhere rather than missing rows. An interrupt
    # (Ctrl-C, SIGTERM) ends the passes; what ran so far is still tabled and written.
    try:
        _passes(a, s, missing, root, detail, t_start)
    except (KeyboardInterrupt, SystemExit):
        print("  interrupted: tabling the runs done so far", flush=True)
    for fault in a.faults:
        for system in a.systems:
            if system in missing:
                rows.append({"system": system, "fault": fault, "median_s": None, "max_s": None,
                             "runs": 0, "steps_rolled_back": None, "training_goodput": None,
                             "infra_goodput": None, "culprit_correct": None,
                             "recovered": "0/0", "available": False,
                             "note": missing[system]})
                continue
            runs = detail.get(f"{system}/{fault}", [])
            row = aggregate(system, fault, runs, names_culprit=(system == "trainguard"))
            notes = sorted({n for r in runs for n in r["notes"]})
            if not runs and system != "trainguard" and fault in SPARE_FAULTS:
                notes = ["not run: needs a registered spare node to move to (trainguard only)"]
            elif not runs:
                notes = ["not run: --quick runs this peer on " + ",".join(QUICK_PEER_FAULTS)
                         + " only" if a.quick and not a.faults_given else
                         "not run: the time budget (--budget-min) ran out"]
            if notes:
                row["notes"] = notes
            rows.append(row)
    add_ratios(rows)
    print(f"\nrecovery benchmark — 4 ranks (2 simulated nodes × 2), gloo, demo MLP; "
          f"{s.runs} run(s); {time.monotonic() - t_start:.0f} s total\n")
    print_table(rows)
    for r in rows:
        for sr in r.get("slow_runs") or []:
            print(f"  slow: {r['system']} {r['fault']} sample {sr['run'] + 1}: {sr['seconds']} s, "
                  f"slow phase {sr['slow_phase']} (+{sr['extra_s']} s over its median)")
    for system, why in missing.items():
        print(f"\n{system}: not run — {why}")
    run_record = provenance.record(load0)
    for r in rows:
        r["provenance"] = run_record
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    with open(os.path.join(root, "detail.json"), "w") as fh:
        json.dump({"settings": asdict(s), "rows": rows, "runs": detail,
                   "provenance": run_record}, fh, indent=2)
    print(f"\n{'rows written to ' + a.json + '; ' if a.json else ''}per-run detail in "
          f"{os.path.join(root, 'detail.json')}")
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(f"Command: `{cmd}`\n\n{markdown_table(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

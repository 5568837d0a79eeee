"""The tables of published figures, each rendered from the runs under ``docs/benchmarks/``.

``TABLES`` maps the NAME of a marked block (``<!-- figures:NAME -->``, see
``docs/render_figures.py``) to the function that renders it: a function takes ``Runs`` (the run
files, read from a repository root) and returns the block's Markdown lines. Each table gives
medians with their range (min–max) and the number of runs, and ends with ``runs_line``: one line
per run file read, with the commit the run measured, the machine (CPUs, 1-minute load averages
read during the run) and its date, as the JSON records them (``bench/provenance.py``), or "not
recorded" where it does not (runs from before the benches recorded them).

Raises ``KeyError`` / ``FileNotFoundError`` when a committed JSON lacks what a table reads.
"""
from __future__ import annotations

import datetime
import functools
import json
import pathlib
import re
import statistics
from typing import Any, Callable, Iterable

BENCH = "docs/benchmarks"


class Runs:
    """The committed run files of one table, read from ``root/docs/benchmarks``."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.used: list[str] = []

    def __call__(self, name: str) -> Any:
        if name not in self.used:
            self.used.append(name)
        return json.loads((self.root / BENCH / name).read_text())


# ---- numbers ----------------------------------------------------------------------------------

def _stats(values: Iterable[float]) -> dict:
    v = [float(x) for x in values if x is not None]
    if not v:
        raise ValueError("no values to summarise")
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def _f(x: float, nd: int) -> str:
    return f"{x:,.{nd}f}"


def med_range(s: dict, nd: int = 2, unit: str = "", scale: float = 1.0) -> str:
    """``median (min–max) unit`` of a summary ``{"median", "min", "max", "n"}``."""
    m, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    u = f" {unit}" if unit else ""
    if s.get("n", 2) == 1 or lo == hi:
        return f"{_f(m, nd)}{u}"
    return f"{_f(m, nd)} ({_f(lo, nd)}–{_f(hi, nd)}){u}"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


# ---- provenance -------------------------------------------------------------------------------

def _walk(obj: Any) -> Iterable[tuple[str, Any]]:
    """Every (key, value) of the nested dicts in ``obj``, depth first."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def provenance(data: Any) -> dict:
    """Commit, date, CPUs and 1-minute load readings of a run file, wherever it keeps them.

    Reads ``provenance`` (``bench/provenance.py``: ``commit``, ``dirty``, ``date``, ``cpus``,
    ``loadavg_start``, ``loadavg_end``) and, for runs before it, ``cpus``, any ``loadavg*`` /
    ``load_avg*`` reading and ``date`` anywhere in the file; with no date, the day of the
    earliest fault timestamp (``fault_unix_s`` / ``t_ns``). Returns ``{"commit", "date",
    "date_from", "cpus", "load"}``, ``None`` for what the file does not hold.
    """
    out: dict = {"commit": None, "date": None, "date_from": None, "cpus": None, "load": []}
    ts: list[float] = []
    commits: list[str] = []  # a file merged from runs of several commits names each
    for k, v in _walk(data):
        if k == "provenance" and isinstance(v, dict):
            if v.get("commit"):
                c = v["commit"][:7] + (" with uncommitted changes" if v.get("dirty") else "")
                if c not in commits:
                    commits.append(c)
            if v.get("date"):
                out["date"], out["date_from"] = str(v["date"])[:10], None
        elif k == "cpus" and isinstance(v, int):
            out["cpus"] = v
        elif k == "date" and isinstance(v, str) and out["date"] is None:
            out["date"] = v[:10]
        elif re.match(r"load_?avg", k):
            if isinstance(v, list) and v and isinstance(v[0], (int, float)):
                out["load"].append(float(v[0]))
            elif isinstance(v, (int, float)):
                out["load"].append(float(v))
        elif k == "fault_unix_s" and isinstance(v, (int, float)):
            ts.append(float(v))
        elif k == "t_ns" and isinstance(v, int):
            ts.append(v / 1e9)
    if commits:
        out["commit"] = ", ".join(commits)
    if out["date"] is None and ts:
        day = datetime.datetime.fromtimestamp(min(ts), datetime.timezone.utc)
        out["date"], out["date_from"] = day.strftime("%Y-%m-%d"), "from the faults' timestamps"
    return out


def runs_line(runs: Runs) -> str:
    """One line per run file the table read: commit, machine, date."""
    parts = []
    for name in runs.used:
        p = provenance(runs(name))
        commit = f"commit {p['commit']}" if p["commit"] else "commit not recorded"
        cpus = f"{p['cpus']} CPUs" if p["cpus"] else "CPUs not recorded"
        if p["load"]:
            lo, hi = min(p["load"]), max(p["load"])
            load = (f"1-min load {lo:.1f}" if round(lo, 1) == round(hi, 1)
                    else f"1-min load {lo:.1f}–{hi:.1f}")
        else:
            load = "load not recorded"
        date = p["date"] or "date not recorded"
        if p["date_from"]:
            date += f" ({p['date_from']})"
        parts.append(f"`{BENCH}/{name}`: {commit}; {cpus}, {load}; {date}")
    if len(parts) == 1:
        return "Runs: " + parts[0] + "."
    return "Runs:\n\n" + "\n".join(f"- {x}" for x in parts)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


# ---- the tables -------------------------------------------------------------------------------

PHASES = ["detected", "verdict", "decision", "acted", "rendezvous", "first_step"]


def _partition(runs: Runs, name: str = "tails-partition-30.json") -> dict:
    """The 30 partitions: seconds to training again, and how many recoveries waited for the heal
    (the runs' ``waited_for_heal``; in runs before it was recorded, training again no sooner than
    the heal, ``fault_spec.heal_after_s``)."""
    row = runs(name)[0]
    done = [r for r in row["runs"] if r["again_s"] is not None]
    heal = row["fault_spec"].get("heal_after_s")
    if any("waited_for_heal" in r for r in done):
        waited = sum(1 for r in done if r.get("waited_for_heal"))
    else:
        waited = sum(1 for r in done if heal is not None and r["again_s"] >= heal)
    return {"row": row, "again": _stats(r["again_s"] for r in done), "n": len(row["runs"]),
            "recovered": len(done), "waited": waited, "p95": row["p95_s"]}


def _checkpoint(runs: Runs, name: str = "checkpoint-200mb.json") -> dict:
    return runs(name)


def _framework(runs: Runs, name: str = "framework_restart.json") -> dict:
    d = runs(name)
    out: dict = {"rounds": d["settings"]["rounds"]}
    for r in d["runs"]:
        out.setdefault((r["job"], r["variant"]), []).append(r["kill"]["recovery_s"])
    return {k: (_stats(v) if isinstance(v, list) else v) for k, v in out.items()}


DEMO_NAMES = {"sigkill": "SIGKILL", "exception": "exception", "hang": "hang (timeout 2 s)"}


def headline(runs: Runs) -> list[str]:
    p = _partition(runs)
    ck = _checkpoint(runs)["summary"]
    fd = runs("fleet.json")
    fleet = fd["results"]
    after = runs("attribution_after.json")["splits"]
    agree = runs("attribution_label_agreement.json")
    import figure_tables_peers as peers  # its tables use this module's helpers

    crashes = [runs(n) for n in peers.CRASH_RUNS]
    waited = "none" if not p["waited"] else f"{p['waited']}"
    ref, held = after["reference"], after["heldout"]
    guard, off = fleet["guard"]["rollout"], fleet["off"]["rollout"]
    cause = guard.get("shared_cause") or {}
    named = ", ".join(f"{k}={v}" for k, v in cause.get("common", {}).items()) or "none"
    po = _partition(runs, "tails-power-off-30.json")
    demo_runs = runs("demo-3.json")
    demo = demo_runs["summary"]
    same_acc = all(r["accuracy"] is not None and abs(r["accuracy"] - r["baseline_accuracy"]) < 1e-9
                   for r in demo_runs["runs"])
    kinds = [k for k in ("sigkill", "exception", "hang") if k in demo]
    demo_s = " / ".join(med_range(_stats(x for x in demo[k]["resumed_s"] if x is not None),
                                  unit="s") for k in kinds)
    demo_ok = all(all(demo[k]["recovered"]) for k in kinds)
    rolled = max((x for k in kinds for x in demo[k]["rolled_back"] if x is not None), default=0)
    rows = [
        [f"`make demo`: {' / '.join(DEMO_NAMES.get(k, k) for k in kinds)} → every rank "
         "training again",
         f"{demo_s}; {'at most ' if rolled else ''}{rolled} steps rolled back"
         + ("; test accuracy as the fault-free run's" if same_acc else "")
         + ("" if demo_ok else "; not every fault recovered"), "–",
         str(len(demo[kinds[0]]["resumed_s"]))],
        peers.dropin_row(runs),
        peers.five_faults_row(runs),
        ["node power-off on fresh clusters, a spare node takes over ([tails](docs/benchmarks.md))",
         f"{med_range(po['again'], unit='s')}, p95 {po['p95']:.2f} s; {po['recovered']} of "
         f"{po['n']} recovered", peers.slurm_cell(runs), f"{po['n']}"],
        ["node partition on fresh clusters ([tails](docs/benchmarks.md))",
         f"{med_range(p['again'], unit='s')}, p95 {p['p95']:.2f} s; {p['recovered']} of "
         f"{p['n']} recovered, {waited} waited for the heal", "–", f"{p['n']}"],
        [f"checkpoint durable after a save, {_checkpoint(runs)['mb_per_rank']} MB a rank "
         "([checkpoints](docs/checkpoints.md))",
         f"{med_range(ck['trainguard']['durable_s'], unit='s')}, blocking "
         f"{med_range(ck['trainguard']['blocking_s'], 1, 'ms', 1e3)}",
         f"DCP `async_save` {med_range(ck['dcp_async_thread']['durable_s'], unit='s')}, blocking "
         f"{med_range(ck['dcp_async_thread']['blocking_s'], 1, 'ms', 1e3)}; `torch.save` "
         f"{med_range(ck['torch_save']['durable_s'], unit='s')}, blocking "
         f"{med_range(ck['torch_save']['blocking_s'], 0, 'ms', 1e3)}; the disk's own write "
         f"{med_range(ck['write_only']['durable_s'], unit='s')} (each system's settings: "
         "[checkpoints](docs/checkpoints.md))",
         f"{ck['trainguard']['durable_s']['n']} races"],
        [f"bad driver rollout: XID {fd['rollout']['xid']} on "
         f"{100 * fd['rollout']['fraction']:.0f} % of {fd['nodes']} nodes "
         "([fleet guard](docs/fleet-guard.md))",
         f"{guard['nodes_taken_out']} nodes taken out, {guard['jobs_stopped']} jobs stopped, "
         f"shared cause named: {named}",
         f"without the guard {off['nodes_taken_out']} nodes taken out, same run", "1 (counts)"],
        peers.chaos_row(runs),
        ["checkpoint crash-safety trials (kills, flipped bytes, full disk, NaN)",
         f"{sum(c['trials'] for c in crashes):,} trials, "
         f"{sum(c['corrupt_restores'] for c in crashes)} corrupt, "
         f"{sum(c['stale_restores'] for c in crashes)} stale, "
         f"{sum(c['restore_failures'] for c in crashes)} failed restores", "–",
         f"{len(crashes)}"],
        ["attribution of labelled real failure logs ([diagnose](docs/diagnose.md))",
         f"fault class {pct(ref['fault_class_accuracy'])} of {ref['cases']} reference logs; "
         f"held-out ({held['cases']}): fault class {pct(held['fault_class_accuracy'])}, layer "
         f"{pct(held['layer_accuracy'])}",
         f"two labellings agree on {pct(agree['layer']['agreement'])} of held-out layers",
         "exact counts"],
    ]
    return table(["what", "trainguard", "compared with", "runs"], rows) + ["", runs_line(runs)]


def tails_partition(runs: Runs, name: str = "tails-partition-30.json") -> list[str]:
    p = _partition(runs, name)
    row, a = p["row"], p["again"]
    ratio = a["max"] / a["median"]
    out = table(["runs", "recovered", "median (min–max)", "p95", "max / median",
                 "waited for the heal"],
                [[str(p["n"]), str(p["recovered"]), med_range(a, unit="s"), f"{p['p95']:.2f} s",
                  f"{ratio:.2f}", "none" if not p["waited"] else str(p["waited"])
                  if p["row"]["fault_spec"].get("heal_after_s") else "–"]])
    durs = [r["timeline"]["durations"] for r in row["runs"] if r["again_s"] is not None]
    cells = []
    for ph in PHASES:
        s = _stats(d[ph] for d in durs)
        nd = 2 if s["median"] >= 1 else 3
        cells.append(med_range(s, nd))
    out += ["", f"Each phase's own seconds over the {len(durs)} recoveries, median (min–max):", ""]
    out += table(["detected", "verdict", "decision", "executors acted", "rendezvous",
                  "first step on every rank"], [cells])
    return out + ["", runs_line(runs)]


def cluster_runs(runs: Runs, names: tuple[str, ...]) -> list[str]:
    """``bench/cluster.py`` rows of a few runs each: every run's seconds, then their median."""
    rows = []
    for name in names:
        for r in runs(name):
            got = [x["again_s"] for x in r["runs"] if x.get("again_s") is not None]
            each = ", ".join("–" if x.get("again_s") is None else f"{x['again_s']:.2f}"
                             for x in r["runs"])
            healed = [x["waited_for_heal"] for x in r["runs"] if "waited_for_heal" in x]
            if r["fault"] != "partition":
                heal = "–"
            elif healed:
                heal = f"{sum(healed)} of {len(healed)}"
            else:
                heal = "not recorded"
            missed = sum(1 for x in r["runs"] if x.get("error"))
            named = sum(1 for x in r["runs"] if x.get("culprit_correct"))
            rows.append([f"`{name}`", r["fault"].replace("_", "-"),
                         f"{len(got)} of {len(r['runs'])}", each,
                         med_range(_stats(got), unit="s") if got else "–",
                         f"{named} of {len(r['runs'])}", heal,
                         str(missed) if missed else "0"])
    head = ["run file", "fault", "recovered", "each run (s)", "median (min–max)", "node1 named",
            "waited for the heal", "fault never fired"]
    return table(head, rows) + ["", runs_line(runs)]


FAULT_NAMES = {"sigkill": "SIGKILL", "exception": "exception", "hang": "hang",
               "node_loss": "node loss"}


def tails_recovery(runs: Runs, name: str = "tails-recovery-5-detail.json") -> list[str]:
    d = runs(name)
    rows = []
    for r in d["rows"]:
        secs = [f["recovery_s"] for run in d["runs"][f"{r['system']}/{r['fault']}"]
                for f in run["faults"]]
        s = _stats(secs)
        ph = r["median_phases"]
        phases = ", ".join("–" if ph.get(k) is None or (k == "acted" and ph[k] == 0)
                           else (f"{ph[k]:.2f}" if ph[k] >= 1 else f"{ph[k]:.3f}") for k in PHASES)
        slow = ", ".join(f"run {x['run'] + 1}" for x in r["slow_runs"]) or "none"
        rows.append([FAULT_NAMES.get(r["fault"], r["fault"]), r["recovered"],
                     med_range(s, unit="s"), f"{r['p95_s']:.2f} s", phases, slow])
    return table(["fault", "recovered", "median (min–max)", "p95",
                  "median phases: detected, verdict, decision, acted, rendezvous, first step (s)",
                  "slow runs"], rows) + ["", runs_line(runs)]


CKPT_NAMES = {"trainguard": "trainguard (node writer)",
              "dcp_async_thread": "DCP `async_save`, thread, cached staging",
              "torch_save": "`torch.save`, CRC32 off, fsync",
              "write_only": "*write_only: the disk's own cost*"}


def _eff(s: dict, full: bool) -> str:
    keys = sorted(s["efficiency"], key=int)
    if full:
        return " / ".join(med_range(s["efficiency"][k]) for k in keys)
    return " / ".join(f"{s['efficiency'][k]['median']:.2f}" for k in keys)


def checkpoint_race(runs: Runs, name: str = "checkpoint-200mb.json") -> list[str]:
    d = _checkpoint(runs, name)
    keys = sorted(d["summary"]["trainguard"]["efficiency"], key=int)
    rows = []
    for system, s in d["summary"].items():
        blocking = "–" if system == "write_only" else med_range(s["blocking_s"], 1, "ms", 1e3)
        label = CKPT_NAMES.get(system, system)
        if system == "trainguard" and d.get("private_writer"):
            label = "trainguard (a private writer per rank)"
        rows.append([label, blocking, med_range(s["durable_s"], unit="s"), _eff(s, False)])
    head = ["system", "blocking per save", "durable after",
            f"efficiency (median), save every {' / '.join(keys)} steps"]
    sm = d["summary"]

    def ratio(a: str, fa: str, b: str, fb: str) -> float:
        return sm[a][fa]["median"] / sm[b][fb]["median"]

    races = f"Medians of {d['runs']} races" if d["runs"] > 1 else "One race, not a median"
    parts = [f"trainguard durable in "
             f"{ratio('trainguard', 'durable_s', 'write_only', 'durable_s'):.2f}× the disk's own time"]
    if "dcp_async_thread" in sm:
        parts[0] += (f" and {ratio('dcp_async_thread', 'durable_s', 'trainguard', 'durable_s'):.1f}× "
                     f"sooner than DCP")
    blocking = (f"blocking {ratio('trainguard', 'blocking_s', 'trainguard', 'memcpy_in_run_s'):.2f}× "
                f"the copy in the same processes")
    if "dcp_async_thread" in sm:
        blocking += f" and {ratio('trainguard', 'blocking_s', 'dcp_async_thread', 'blocking_s'):.2f}× DCP's"
    parts.append(blocking)
    if "validation_gbps" in sm["trainguard"]:
        parts.append(f"validation {sm['trainguard']['validation_gbps']['median']:.2f} GB/s")
    ratios = f"{races}: " + "; ".join(parts) + "."
    return table(head, rows) + ["", ratios, "", runs_line(runs)]


def checkpoint_full(runs: Runs) -> list[str]:
    d = _checkpoint(runs)
    keys = sorted(d["summary"]["trainguard"]["efficiency"], key=int)
    rows = []
    for system, s in d["summary"].items():
        rows.append([CKPT_NAMES.get(system, system).split(",")[0],
                     med_range(s["blocking_s"], 1 if s["blocking_s"]["median"] > 1e-3 else 2,
                               "ms", 1e3),
                     med_range(s["memcpy_in_run_s"], 1, "ms", 1e3),
                     med_range(s["durable_s"], unit="s"), _eff(s, True),
                     f"{s['peak_rss_bytes']['median'] / 1e6:.0f} MB"])
    head = ["system", "blocking per save", "the copy, same processes", "durable after",
            f"efficiency, save every {' / '.join(keys)} steps", "peak RSS"]
    v = d["summary"]["trainguard"]["validation_gbps"]
    return (table(head, rows)
            + ["", f"Median (min–max) of {d['runs']} races. Validation of the committed "
               f"checkpoint (page cache warm, one core): {med_range(v)} GB/s.", "",
               runs_line(runs)])


def attribution(runs: Runs) -> list[str]:
    before = runs("attribution_baseline.json")["splits"]
    after = runs("attribution_after.json")["splits"]
    parts = [("dev", "dev ({n})"), ("heldout_round1", "held-out, round 1 ({n})"),
             ("heldout_round2", "held-out, round 2 ({n}, after the first freeze)"),
             ("heldout_round3", "held-out, round 3 ({n}, after the second freeze)"),
             ("heldout_round4", "held-out, round 4 ({n}, after the fourth freeze)"),
             ("heldout", "**held-out, all rounds ({n})**"),
             ("reference", "reference corpus `../shared/corpus` ({n})")]
    rows = []
    for key, label in parts:
        a = after[key]
        b = before.get("heldout" if key == "heldout_round1" else key)
        if key == "heldout":
            b = None  # the baseline's held-out split is round 1 alone
        n = f"{a['cases']}" if b is None or b["cases"] == a["cases"] else \
            f"{b['cases']} at the baseline, {a['cases']} after"
        cells = []
        for field in ("fault_class_accuracy", "layer_accuracy"):
            was = "—" if b is None else pct(b[field])
            cells.append(f"{was} → **{pct(a[field])}**")
        rows.append([label.format(n=n)] + cells)
    return (table(["part", "fault class before → after", "layer before → after"], rows)
            + ["", runs_line(runs)])


def attribution_round(runs: Runs, before_name: str) -> list[str]:
    """One round of rules on one corpus: the rules before the round (``before_name``) and after
    it (``attribution_after.json``), both scored on the corpus as it is after the round."""
    before = runs(before_name)["splits"]
    after = runs("attribution_after.json")["splits"]
    names = {"dev": "dev", "heldout": "**held-out, all rounds**", "reference": "reference corpus"}
    rows = []
    for key in ["dev"] + sorted(k for k in after if k.startswith("heldout_")) + ["heldout",
                                                                                 "reference"]:
        if key not in after or key not in before:
            continue
        a, b = after[key], before[key]
        label = names.get(key, key.replace("heldout_round", "held-out, round "))
        cells = [f"{pct(b[f])} → **{pct(a[f])}**" for f in
                 ("fault_class_accuracy", "layer_accuracy", "layer_accuracy_confident")]
        rows.append([f"{label} ({a['cases']}; {a['layer_cases_confident']} medium/high)"] + cells)
    return (table(["part (cases; medium/high labels)", "fault class", "layer",
                   "layer, medium/high labels"], rows) + ["", runs_line(runs)])


def label_agreement(runs: Runs) -> list[str]:
    d = runs("attribution_label_agreement.json")
    rows = [["fault class", pct(d["fault_class"]["agreement"]), f"{d['fault_class']['kappa']:.2f}"],
            ["layer", pct(d["layer"]["agreement"]), f"{d['layer']['kappa']:.2f}"]]
    return (table(["field", f"agreement ({d['cases']} cases)", "Cohen's kappa"], rows)
            + ["", runs_line(runs)])


def fleet(runs: Runs) -> list[str]:
    d = runs("fleet.json")
    rows = []
    for arm, scheds in d["results"].items():
        for sched, r in scheds.items():
            if r["breaker_tripped_at_nodes"]:
                breaker = (f"{r['breaker_status']} (tripped at node "
                           f"{r['breaker_tripped_at_nodes']}, limit {r['breaker_limit']} of "
                           f"{r['breaker_known_nodes']})")
            else:
                breaker = r["breaker_status"]
            cause = r.get("shared_cause")
            if cause:
                named = ", ".join([cause["layer"]] + [f"{k}={v}" for k, v in
                                                      cause.get("common", {}).items()])
                named += f" ({r['verdicts_naming_shared_cause']} verdicts)"
            else:
                named = "–"
            rows.append([arm, sched, str(r["nodes_taken_out"]), str(r["jobs_stopped"]),
                         str(r["jobs_kept_training"]),
                         f"{r['decisions_held']} ({r['held_by_breaker']} / "
                         f"{r['held_by_shared_cause']})", breaker, named])
    head = ["arm", "schedule", "nodes taken out", "jobs stopped", "jobs kept training",
            "decisions held (breaker / shared cause)", "breaker", "shared cause named"]
    return table(head, rows) + ["", "One run; counts.", "", runs_line(runs)]


def framework_restart(runs: Runs, name: str = "framework_restart.json") -> list[str]:
    fw = _framework(runs, name)
    rows = []
    for job, label in (("lightning", "Lightning"), ("hf", "HF `Trainer`")):
        rows.append([label] + [med_range(fw[(job, v)], 2 if fw[(job, v)]["median"] < 1 else 1,
                                         "s") for v in ("before", "by_hand", "after")])
    head = ["job", "before (spares: torch only)", "by hand (`--warm-import <framework>`)",
            "after (job's imports recorded, auto-resume)"]
    n = fw["rounds"]
    what = (f"Median (min–max) of {n} rounds" if n > 1 else "One round, no median") + \
        ": below the 3 runs a published figure needs."
    return table(head, rows) + ["", what, "", runs_line(runs)]


def ha(runs: Runs, name: str = "ha.json") -> list[str]:
    d = runs(name)
    rows = []

    def opt(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    for r in d["rows"]:
        detected = {True: "yes", False: "no", None: "– (no bus)"}[r["detected"]]
        recovered = f"yes ({r['recovery_s']:.1f})" if r["recovered"] else "no"
        rows.append([r["stack"], r["target"], str(r["trial"]), f"{r['step_rate_before']:.1f}",
                     f"{r['step_rate_during']:.1f}", f"{r['ratio']:.2f}", opt(r["failover_s"]),
                     detected, str(r["decisions"]), str(r["carried_out"]), recovered,
                     str(r["decisions_lost"]), str(r["decisions_duplicated"])])
    ha_rows = [r for r in d["rows"] if r["stack"] == "ha"]
    summary = []
    for target in sorted({r["target"] for r in ha_rows}):
        f = [r["failover_s"] for r in ha_rows if r["target"] == target and r["failover_s"]]
        if f:
            trials = f"over {len(f)} trials" if len(f) > 1 else "one trial"
            summary.append(f"{target} {med_range(_stats(f), unit='s')}, {trials}")
    head = ["stack", "target", "trial", "steps/s before", "during", "ratio", "failover s",
            "rank fault detected", "decided", "carried out", "recovered (s after the fault)",
            "lost", "duplicated"]
    return (table(head, rows) + ["", "Replicated stack's failover, median (min–max): "
                                 + "; ".join(summary) + ".", "", runs_line(runs)])


#: NAME in the markers → the function rendering its block from the committed runs.
TABLES: dict[str, Callable[[Runs], list[str]]] = {
    "headline": headline,
    "tails-partition": tails_partition,
    "tails-partition-busy": functools.partial(tails_partition, name="tails-partition-30-busy.json"),
    "tails-power-off": functools.partial(tails_partition, name="tails-power-off-30.json"),
    "tails-recovery": tails_recovery,
    "tails-recovery-30": functools.partial(tails_recovery, name="tails-recovery-30-detail.json"),
    "checkpoint-race": checkpoint_race,
    "checkpoint": checkpoint_full,
    "attribution": attribution,
    "attribution-round4": functools.partial(attribution_round,
                                            before_name="attribution_round4_before.json"),
    "label-agreement": label_agreement,
    "fleet": fleet,
    "framework-restart": framework_restart,
    "ha": ha,
    "ha-after-merge": functools.partial(ha, name="ha-after-merge.json"),
    "ha-rendezvous": functools.partial(ha, name="ha-rendezvous.json"),
    "framework-restart-busy": functools.partial(framework_restart,
                                                name="framework_restart_busy.json"),
    "checkpoint-private-writer": functools.partial(
        checkpoint_race, name="checkpoint-200mb-private-writer.json"),
    "tails-short": functools.partial(cluster_runs, names=(
        "tails-partition-first-after-boot.json", "tails-after-trigger-fix.json")),
}

# the tables of runs beside peers, under chaos and at scale (they use the helpers above)
import figure_tables_peers  # noqa: E402

TABLES.update(figure_tables_peers.TABLES)

"""The tables of figures measured beside peers and under chaos, rendered from ``docs/benchmarks/``:
the drop-in bench (``bench/dropin.py``: unmodified scripts under trainguard, torchrun and NVRx
``ft_launcher``), the five-fault run (``bench/recovery.py --faults five_faults``), the chaos bench
(``bench/chaos.py``: the control plane killed during faults), Slurm's own requeue
(``bench/cluster.py --systems slurm``), the hostile-input, detector-throughput and scale benches.

Each function takes ``figure_tables.Runs`` and returns Markdown lines (``figure_tables.TABLES``
holds them under their block names). Raises ``KeyError`` / ``FileNotFoundError`` when a committed
JSON lacks what a table reads.
"""
from __future__ import annotations

from typing import Any

from figure_tables import Runs, _stats, med_range, runs_line, table

from trainguard.core import timeline

CHAOS_RUNS = ("chaos-100-seed0.json", "chaos-100-seed1.json", "chaos-100-seed2.json")


def _s(x: float | None, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f} s"


def chaos_summary(runs: Runs, names: tuple[str, ...] = CHAOS_RUNS) -> dict[str, Any]:
    """The chaos runs together: trials, faults injected and recovered, decisions lost,
    duplicate actions, whole-job restarts, every recovery's seconds, the steady-outage step-rate
    ratios and the accuracies."""
    ds = [runs(n) for n in names]
    secs = [t["recovery_s"] for d in ds for t in d["per_trial"] if t.get("recovery_s") is not None]
    return {"runs": ds, "n": len(ds), "trials": sum(d["trials"] for d in ds),
            "faults": sum(d["faults"] for d in ds), "recovered": sum(d["recovered"] for d in ds),
            "lost": sum(d["decisions_lost"] for d in ds),
            "dups": sum(d["duplicate_actions"] for d in ds),
            "restarts": sum(d["full_restarts"] for d in ds),
            "seconds": _stats(secs),
            "p95": timeline.p95(secs),
            "ratio": _stats(d["throughput_ratio"] for d in ds),
            "same_accuracy": all(d["accuracy"] == d["baseline_accuracy"] for d in ds)}


def chaos(runs: Runs, names: tuple[str, ...] = CHAOS_RUNS) -> list[str]:
    c = chaos_summary(runs, names)
    rows = []
    for d in c["runs"]:
        r, b = d["recovery_s"], d["training_blocked_s"]
        slow = d["recovery_tails"]["all"]["slow_runs"]
        phases: dict[str, int] = {}
        for x in slow:
            if x.get("slow_phase"):
                phases[x["slow_phase"]] = phases.get(x["slow_phase"], 0) + 1
        named = ", ".join(f"{k} {v}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
        rows.append([str(d["seed"]), f"{d['recovered']} of {d['faults']}"
                     + (f" ({d['trials'] - d['faults']} not injected)"
                        if d["trials"] != d["faults"] else ""),
                     str(d["decisions_lost"]), str(d["duplicate_actions"]),
                     str(d["full_restarts"]),
                     f"{_s(r['median'])} / {_s(r['p95'])} / {_s(r['max'])}",
                     f"{len(slow)}" + (f" ({named})" if named else ""),
                     f"{d['throughput_ratio']:.3f}", f"{b['outside']:.2f} s"])
    return table(["seed", "faults recovered", "decisions lost", "duplicate actions",
                  "whole-job restarts", "recovery median / p95 / max",
                  "trials over 2 × median (slow phase: count)",
                  "step rate in steady outages / without", "training blocked outside faults"],
                 rows) + ["", runs_line(runs)]


DEMO_FAULTS = {"sigkill": "SIGKILL", "exception": "Python exception", "hang": "hang (SIGSTOP)"}


def demo(runs: Runs, name: str = "demo-3.json") -> list[str]:
    """``make demo``'s faults over its runs: detected, decided, every rank training again
    (seconds from the injection), steps rolled back, how many recovered."""
    d = runs(name)
    rows = []
    for k, label in DEMO_FAULTS.items():
        s = d["summary"].get(k)
        if not s:
            continue
        cells = [med_range(_stats(x for x in s[f] if x is not None), 3, "s")
                 for f in ("detected_s", "decided_s", "resumed_s")]
        rolled = [x for x in s["rolled_back"] if x is not None]
        rows.append([label, *cells, f"{max(rolled) if rolled else '–'}",
                     f"{sum(bool(x) for x in s['recovered'])} of {len(s['recovered'])}"])
    acc = ", ".join(f"{100 * r['accuracy']:.2f} %" for r in d["runs"])
    base = ", ".join(f"{100 * r['baseline_accuracy']:.2f} %" for r in d["runs"])
    return table(["fault", "detected", "decided", "every rank training again",
                  "steps rolled back (max)", "recovered"], rows) + [
        "", f"Test accuracy per run {acc}; the fault-free runs with the same seeds {base}.",
        "", runs_line(runs)]


CRASH_RUNS = ("checkpoint-crash-1000-seed1.json", "checkpoint-crash-1000-seed2.json",
              "checkpoint-crash-1000-seed3.json")


def crash_safety(runs: Runs, names: tuple[str, ...] = CRASH_RUNS) -> list[str]:
    """Each crash-safety run: trials by fault, corrupt / stale / failed restores."""
    rows = []
    for n in names:
        d = runs(n)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(d["by_fault"].items()))
        rows.append([n.rsplit("seed", 1)[-1].split(".")[0], f"{d['trials']:,}", kinds,
                     str(d["corrupt_restores"]), str(d["stale_restores"]),
                     str(d["restore_failures"]), f"{d['seconds']:.0f} s"])
    return table(["seed", "trials", "faults", "corrupt restores", "stale restores",
                  "failed restores", "wall"], rows) + ["", runs_line(runs)]


JOB_NAMES = {"plain": "plain DDP script (own snapshot)", "lightning": "Lightning `Trainer.fit`",
             "hf": "Hugging Face `Trainer.train`"}
LAUNCHERS = (("trainguard", "trainguard"), ("torchrun", "torchrun"), ("nvrx", "`ft_launcher`"))


def _kill_cell(row: dict, sy: str) -> str:
    xs = row.get(f"kill_{sy}_samples") or []
    if not xs:
        h = row.get(f"hang_{sy}") or {}
        return "not run" if str(h.get("by", "")).startswith("not run") else "–"
    t = row.get(f"kill_{sy}_tails") or {}
    cell = med_range(_stats(xs), 2, "s") + (" (1 run)" if len(xs) == 1 else "")
    if t.get("n") and t["recovered"] < t["n"]:
        cell += f", {t['n'] - t['recovered']} of {t['n']} never"
    return cell


def _hang_cell(row: dict, sy: str) -> str:
    h = row.get(f"hang_{sy}") or {}
    if h.get("detected") is None:
        return "not run"
    n_ok, n = (int(x) for x in h["detected"].split("/"))
    if not n_ok:
        return f"never ({h['detected']} in {h['waited_s']:g} s)"
    again = h.get("training_again_s")
    return (f"{h['detected']} in {h['detected_s']:.2f} s"
            + (f", training again {again:.2f} s" if again is not None else ""))


def dropin(runs: Runs, name: str = "dropin-3.json") -> list[str]:
    """Per job: SIGKILL → every rank training again per launcher (median (range) over the
    rounds), torchrun / trainguard, hang detection, fault-free step rate ratio."""
    d = runs(name)
    rows = []
    for r in d["rows"]:
        ratio = r.get("kill_ratio_torchrun_over_trainguard")
        samples = r.get("rate_samples") or {}
        spread = ", ".join(f"{sy} {min(v):.0f}–{max(v):.0f}" for sy, v in samples.items()
                           if v and None not in v)
        rows.append([JOB_NAMES.get(r["job"], r["job"]),
                     *(_kill_cell(r, sy) for sy, _ in LAUNCHERS),
                     f"{ratio:.0f}×" if ratio else "–",
                     _hang_cell(r, "trainguard"),
                     "; ".join(f"{label}: {_hang_cell(r, sy)}" for sy, label in LAUNCHERS[1:]),
                     (f"{r['rate_ratio']:.2f} ({spread} steps/s)" if r.get("rate_ratio")
                      else "–")])
    return table(["job", "SIGKILL → training again: trainguard", "torchrun", "`ft_launcher`",
                  "torchrun / trainguard", "hang (SIGSTOP): trainguard", "the peers",
                  "fault-free step rate, trainguard / torchrun"], rows) + [
        "", f"{d['settings']['rounds']} rounds; every launch's timelines, p95, max and slow "
        "runs are in the JSON.", "", runs_line(runs)]



SYSTEM_NAMES = {"trainguard": "trainguard", "torchrun": "torchrun `--max-restarts`",
                "full_restart": "full job restart", "torchft": "torchft 0.2.0",
                "nvrx": "NVRx 0.4.1 `ft_launcher`"}


def five_faults(runs: Runs, name: str = "recovery-five-faults-3-detail.json") -> list[str]:
    """Per system over the runs of ``bench/recovery.py --faults five_faults``: seconds per
    fault (median (range), p95), steps rolled back per fault, training goodput per run
    (median (range)) and its ratio to the best peer's."""
    d = runs(name)
    good: dict[str, dict] = {}
    rows_by = {r["system"]: r for r in d["rows"] if r["fault"] == "five_faults"}
    for sy in rows_by:
        g = [x["training_goodput"] for x in d["runs"].get(f"{sy}/five_faults", [])
             if x.get("training_goodput") is not None]
        if g:
            good[sy] = _stats(g)
    peers = {sy: g["median"] for sy, g in good.items() if sy != "trainguard"}
    best = max(peers, key=peers.get) if peers else None
    rows = []
    for sy in SYSTEM_NAMES:
        r = rows_by.get(sy)
        if r is None:
            continue
        secs = [f["recovery_s"] for x in d["runs"].get(f"{sy}/five_faults", [])
                for f in x["faults"] if f.get("recovery_s") is not None]
        rb = sorted({f["steps_rolled_back"] for x in d["runs"].get(f"{sy}/five_faults", [])
                     for f in x["faults"] if f.get("steps_rolled_back") is not None})
        g = good.get(sy)
        vs = ("(best peer)" if sy == best else
              f"{g['median'] / peers[best]:.2f}×" if g and best and sy == "trainguard" else "")
        rows.append([SYSTEM_NAMES[sy],
                     f"{med_range(_stats(secs), 2, 's')}, p95 {_s(r.get('p95_s'))}" if secs
                     else "–", r["recovered"],
                     ", ".join(str(x) for x in rb) or "–",
                     med_range(g, 3) if g else "–", vs])
    return table(["system", "seconds per fault", "faults recovered", "steps rolled back",
                  "training goodput", "× best peer"], rows) + [
        "", f"{d['settings'].get('runs', '?')} runs of each system; each fault's timeline is in "
        "the JSON.", "", runs_line(runs)]


def _cluster_row(runs: Runs, name: str, fault: str) -> dict | None:
    return next((r for r in runs(name) if r["fault"] == fault), None)


def slurm_alone(runs: Runs, tg: str = "tails-power-off-30.json",
                slurm: str = "cluster-slurm-power-off-3.json") -> list[str]:
    """A node powered off: trainguard's runs (a spare node takes over) beside Slurm alone
    (``sbatch --requeue``): runs, recovered, seconds to every rank training again."""
    rows, med = [], {}
    for label, name in (("trainguard (a spare node takes over)", tg),
                        ("Slurm alone (`sbatch --requeue`, SlurmdTimeout 10 s)", slurm)):
        r = _cluster_row(runs, name, "power_off")
        done = [x["again_s"] for x in r["runs"] if x.get("again_s") is not None]
        st = _stats(done)
        med[name] = st["median"]
        rows.append([label, str(len(r["runs"])), str(len(done)), med_range(st, 2, "s"),
                     _s(r.get("p95_s")),
                     ", ".join(f"{x.get('steps_rolled_back', 0):g}" for x in r["runs"])
                     if len(r["runs"]) <= 5 else f"median {r.get('steps_rolled_back', 0):g}"])
    ratio = med[slurm] / med[tg]
    return table(["system", "runs", "recovered", "fault → every rank training again",
                  "p95", "steps rolled back (per run, or the median)"], rows) + [
        "", f"Slurm alone takes {ratio:.0f}× trainguard's median.", "", runs_line(runs)]



FUZZ_RUNS = ("fuzz-100k-seed0.json", "fuzz-100k-seed1.json", "fuzz-100k-seed2.json")


def fuzz(runs: Runs, names: tuple[str, ...] = FUZZ_RUNS) -> list[str]:
    """Each hostile-input run: deaths, lost and missing dead letters, RSS growth per service
    from the 10 % mark to the end, the real fault's recovery."""
    rows = []
    services: list[str] = []
    for n in names:
        d = runs(n)
        services = services or sorted(d["rss"])
        acct = d.get("accounting", {})
        lost = sum(r.get("lost", 0) for r in acct.values())
        missing = sum(r.get("dlq_missing", 0) for r in acct.values())
        growth = [f"{100 * d['rss'][sv]['growth']:+.1f} %" if d["rss"][sv]["growth"] is not None
                  else "–" for sv in services]
        rf = d.get("real_fault") or {}
        rows.append([n.rsplit("seed", 1)[-1].split(".")[0], str(len(d.get("deaths", []))),
                     str(lost), str(missing), *growth,
                     (_s(rf.get("recovery_s")) if rf.get("recovered") else "not recovered")
                     if rf else "–"])
    return table(["seed", "service deaths", "lost", "dead letters missing",
                  *[f"RSS growth: {sv}" for sv in services], "real SIGKILL recovered in"],
                 rows) + ["", runs_line(runs)]


DETECTOR_RUNS = ("detector-10k-0.json", "detector-10k-1.json", "detector-10k-2.json")


def detector(runs: Runs, names: tuple[str, ...] = DETECTOR_RUNS) -> list[str]:
    """The detector's ingest and latency over its runs, median (range)."""
    ds = [runs(n) for n in names]

    def st(key: str) -> dict:
        return _stats(d[key] for d in ds if d.get(key) is not None)

    rows = [["heartbeats/s ingested (offered up to 100,000/s)", med_range(st("ingest_per_s"), 0)],
            ["heartbeat → anomaly p50 at 10,000/s", med_range(st("latency_p50_ms"), 1, "ms")],
            ["heartbeat → anomaly p99 at 10,000/s", med_range(st("latency_p99_ms"), 1, "ms")],
            ["detector state per tracked rank", med_range(st("bytes_per_rank_state"), 0, "B")]]
    return table(["what", f"median (range) of {len(ds)} runs"], rows) + ["", runs_line(runs)]


def startup(runs: Runs, name: str = "startup-5.json") -> list[str]:
    """Launch → every rank's first step, per launcher (``bench/startup.py``), median (range)."""
    d = runs(name)
    rows = []
    for sy, xs in d["samples"].items():
        ok = [x for x in xs if x is not None]
        s = d["summary"][sy]
        over = s.get("over_torchrun_s")
        rows.append([f"`{sy}`" if sy == "torchrun" else f"trainguard ({sy})",
                     med_range(_stats(ok), 2, "s"), f"{len(ok)} of {len(xs)}",
                     "–" if over is None else f"{over:+.2f} s"])
    return table(["launcher", "launch → every rank's first step", "started", "over torchrun"],
                 rows) + ["", runs_line(runs)]


LCKPT_RUNS = ("lightning-checkpoint-io-0.json", "lightning-checkpoint-io-1.json",
              "lightning-checkpoint-io-2.json")


def lightning_checkpoint(runs: Runs, names: tuple[str, ...] = LCKPT_RUNS) -> list[str]:
    """Lightning's checkpoint writers over the runs of ``bench/integrations_checkpoint.py``:
    how long ``save_checkpoint`` blocks, until the file is written, a step's time while a
    background write runs against alone; median (range) over the runs' medians."""
    ds = [runs(n) for n in names]
    rows = []
    for w in ds[0]["writers"]:
        vals = [d["writers"][w] for d in ds]

        def st(key: str) -> dict:
            return _stats(v[key] for v in vals if v.get(key) is not None)

        during = ("–" if "step_during_write_s" not in vals[0] else
                  f"{med_range(st('step_during_write_s'), 0, 'ms', 1e3)} (alone "
                  f"{med_range(st('step_alone_s'), 0, 'ms', 1e3)})")
        rows.append([f"`{w}`", med_range(st("blocking_s"), 2, "s"),
                     med_range(st("until_written_s"), 2, "s"),
                     "yes" if w.startswith("Trainguard") else "no", during])
    return table(["writer", "training loop blocked", "until the file is written",
                  "fsync, checksum", "a training step during the write"], rows) + [
        "", f"A {ds[0]['state_mb']} MB checkpoint dict (weights and AdamW moments); "
        f"{len(ds)} runs.", "", runs_line(runs)]

# ---- headline rows (README) --------------------------------------------------------------------

def chaos_row(runs: Runs) -> list[str]:
    """The README's row of the chaos bench."""
    c = chaos_summary(runs)
    return [f"control plane killed during faults: NATS, Valkey, a service or an agent SIGKILLed "
            f"in each of {c['trials']} trials "
            "([chaos](docs/benchmarks.md#the-control-plane-under-chaos))",
            f"{c['recovered']} of {c['faults']} faults recovered, {c['lost']} decisions lost, "
            f"{c['dups']} duplicate actions; {med_range(c['seconds'], unit='s')}, p95 "
            f"{c['p95']:.2f} s; step rate during outages {med_range(c['ratio'], 3)} of normal",
            "–", f"{c['n']}"]

def dropin_row(runs: Runs, name: str = "dropin-3.json") -> list[str]:
    """The README's row of the drop-in bench: SIGKILL → training again per job and launcher."""
    d = runs(name)
    by = {r["job"]: r for r in d["rows"]}
    jobs = [j for j in ("plain", "lightning", "hf") if j in by]

    def cell(sy: str) -> str:
        return " / ".join(_kill_cell(by[j], sy) for j in jobs)

    return ["unmodified DDP script / Lightning / HF `Trainer`, SIGKILL of rank 1 → every rank "
            "training again ([drop-in](docs/benchmarks.md#unmodified-training-code))",
            cell("trainguard"),
            f"torchrun {cell('torchrun')}; NVRx `ft_launcher` {cell('nvrx')}; same run",
            f"{d['settings']['rounds']} rounds"]


def five_faults_row(runs: Runs, name: str = "recovery-five-faults-3-detail.json") -> list[str]:
    """The README's row of the five-fault run: training goodput, trainguard and the best peer."""
    d = runs(name)
    good = {}
    for key, xs in d["runs"].items():
        sy, fault = key.split("/")
        g = [x["training_goodput"] for x in xs if x.get("training_goodput") is not None]
        if fault == "five_faults" and g:
            good[sy] = _stats(g)
    peers = {sy: g for sy, g in good.items() if sy != "trainguard"}
    best = max(peers, key=lambda sy: peers[sy]["median"])
    tg = good["trainguard"]
    return ["five faults in one run (SIGKILL, exception, hang, SIGKILL, exception), training "
            "goodput ([five faults](docs/benchmarks.md#five-faults-every-system-in-one-run))",
            f"{med_range(tg, 3)}", f"best peer ({SYSTEM_NAMES[best]}) "
            f"{med_range(peers[best], 3)}: trainguard {tg['median'] / peers[best]['median']:.1f}×; "
            "same runs", f"{d['settings']['runs']}"]


def slurm_cell(runs: Runs, name: str = "cluster-slurm-power-off-3.json") -> str:
    """Slurm alone on the same power-off: its median (range) and run count."""
    r = _cluster_row(runs, name, "power_off")
    done = [x["again_s"] for x in r["runs"] if x.get("again_s") is not None]
    return (f"Slurm `--requeue` alone {med_range(_stats(done), 1, 's')} "
            f"({len(done)} of {len(r['runs'])} runs)")

TABLES = {"chaos": chaos, "demo": demo, "dropin": dropin, "five-faults": five_faults,
          "startup": startup, "slurm-alone": slurm_alone, "fuzz": fuzz,
          "lightning-checkpoint": lightning_checkpoint, "crash-safety": crash_safety}

"""``make demo``'s job, run ``--runs`` times: per fault, seconds from injection to detection,
decision and every rank training again, steps rolled back, and the accuracy against a fault-free
run of the same seed.

    python bench/demo.py --runs 3 --json docs/benchmarks/demo-3.json

Each run is ``trainguard demo --report FILE`` in a process of its own (a fresh embedded stack);
the JSON keeps every run's report (``trainguard.demo.harness.Demo.run``'s) and the provenance
(``bench/provenance.py``). Exit status 1 when a run fails or a fault is not recovered.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402


def seconds(fault: dict, key: str) -> float | None:
    """``fault[key] - fault['injected_ns']`` in seconds, or None when either is missing."""
    a, b = fault.get("injected_ns"), fault.get(key)
    return round((b - a) / 1e9, 4) if a and b else None


def summary(reports: list[dict]) -> dict[str, dict]:
    """Per fault kind: the seconds of every run (``detected_s``, ``decided_s``, ``resumed_s``),
    the steps rolled back and whether each recovered."""
    out: dict[str, dict] = {}
    for rep in reports:
        for f in rep["faults"]:
            row = out.setdefault(f["kind"], {"detected_s": [], "decided_s": [], "resumed_s": [],
                                             "rolled_back": [], "recovered": []})
            row["detected_s"].append(seconds(f, "detected_ns"))
            row["decided_s"].append(seconds(f, "decided_ns"))
            row["resumed_s"].append(seconds(f, "resumed_ns"))
            row["rolled_back"].append(f.get("steps_rolled_back"))
            row["recovered"].append(bool(f.get("recovered")))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", required=True, help="write the runs and their summary here")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be at least 1")
    load = provenance.loadavg()
    reports, ok = [], True
    with tempfile.TemporaryDirectory(prefix="tg-bench-demo-") as tmp:
        for i in range(a.runs):
            path = os.path.join(tmp, f"run-{i}.json")
            r = subprocess.run([sys.executable, "-m", "trainguard.cli", "demo", "--report", path],
                               capture_output=True, text=True)
            if r.returncode != 0 or not os.path.exists(path):
                print(f"run {i + 1}: failed (exit {r.returncode})\n{r.stderr[-2000:]}",
                      file=sys.stderr)
                ok = False
                continue
            rep = json.load(open(path))
            rep.pop("run_dir", None)
            reports.append(rep)
            line = ", ".join(f"{f['kind']} {seconds(f, 'resumed_ns')} s" for f in rep["faults"])
            print(f"run {i + 1}/{a.runs}: {line}; accuracy {rep['accuracy']} "
                  f"(fault-free {rep['baseline_accuracy']})", flush=True)
    summ = summary(reports)
    ok = ok and all(all(r["recovered"]) for r in summ.values())
    with open(a.json, "w") as fh:
        json.dump({"runs": reports, "summary": summ, "provenance": provenance.record(load)},
                  fh, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

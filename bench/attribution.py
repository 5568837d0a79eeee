"""Attribution accuracy over labelled corpora of real failure logs.

    python bench/attribution.py [--corpus PATH ...] [--json PATH]

Runs ``trainguard diagnose``'s code (detector rules + attributor decide) on each case's excerpt
and compares with the labels. Two corpus formats are read:

* ``bench/corpus/real_logs.jsonl`` (the default): fields ``excerpt``, ``fault_class``, ``layer``,
  ``confidence``, ``split`` (``dev`` / ``heldout``);
* the reference corpus ``../shared/corpus/failure_logs.jsonl``: ``log_excerpt`` and no split (its
  cases are scored as the split ``reference``).

Per split it reports

* fault-class accuracy over every case;
* layer accuracy over every case (``unknown`` is a label like the others: a verdict that names a
  layer the thread never established is a miss);
* layer accuracy over the cases labelled with confidence medium or high (the figure the reference
  corpus's bench has always reported);
* every miss.

``score(cases)`` is what the floor test (``tests/test_attribution_corpus.py``) calls. The
committed figures live in ``docs/benchmarks/attribution_*.json`` and ``docs/diagnose.md``.
Exit status: 0, or 2 when a corpus file is missing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.tools.diagnose import diagnose_lines  # noqa: E402
sys.path.append(str(Path(__file__).resolve().parent))  # bench/: provenance
import provenance  # noqa: E402

REAL = ROOT / "bench" / "corpus" / "real_logs.jsonl"
#: the reference corpus beside the checkout (../shared, or ../../shared from a worktree)
REFERENCE = next((d / "shared" / "corpus" / "failure_logs.jsonl" for d in (ROOT.parent,
                  ROOT.parent.parent) if (d / "shared" / "corpus" / "failure_logs.jsonl").exists()),
                 ROOT.parent / "shared" / "corpus" / "failure_logs.jsonl")


def load(path: Path) -> list[dict[str, Any]]:
    """The cases of a corpus file, each with ``excerpt`` and ``split`` filled in.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: a line that is not JSON, or a case without an excerpt or fault class
            (the message names the line).
    """
    cases = []
    for n, ln in enumerate(path.read_text().splitlines(), 1):
        if not ln.strip():
            continue
        try:
            c = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        c.setdefault("excerpt", c.get("log_excerpt"))
        c.setdefault("split", "reference")
        if not c.get("excerpt") or not c.get("fault_class"):
            raise ValueError(f"{path}:{n}: a case needs an excerpt and a fault_class")
        cases.append(c)
    return cases


def verdict(case: dict[str, Any]) -> tuple[str | None, str, str]:
    """(fault class, layer, confidence word) that diagnose gives the case's excerpt; (None,
    "unknown", "none") when it finds nothing abnormal."""
    v = diagnose_lines(case["excerpt"].splitlines(), case.get("id", ""))
    if v is None:
        return None, "unknown", "none"
    return str(v.fault_class), str(v.layer), str(v.confidence)


def groups(case: dict[str, Any]) -> list[str]:
    """The report groups a case counts in: its split, and for a held-out case also its round
    (``heldout_round1``: gathered with the dev split, before any rule was written;
    ``heldout_round2`` / ``heldout_round3`` / ``heldout_round4``: gathered after the first /
    second / fourth round of rules was frozen)."""
    if case["split"] == "heldout" and "round" in case:
        return ["heldout", f"heldout_round{case['round']}"]
    return [case["split"]]


def score(cases: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Accuracy per split: ``{split: {cases, fault_class_accuracy, layer_accuracy,
    layer_cases_confident, layer_accuracy_confident, misses}}`` (accuracies are fractions)."""
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "cases": 0, "fc_ok": 0, "layer_ok": 0, "conf_n": 0, "conf_ok": 0, "misses": []})
    for c in cases:
        fc, layer, conf = verdict(c)
        fc_hit = fc == c["fault_class"]
        layer_hit = layer == c["layer"]
        for group in groups(c):
            s = acc[group]
            s["cases"] += 1
            s["fc_ok"] += fc_hit
            s["layer_ok"] += layer_hit
            if c.get("confidence") in ("medium", "high"):
                s["conf_n"] += 1
                s["conf_ok"] += layer_hit
            if not (fc_hit and layer_hit):
                s["misses"].append(
                    f"{c['id']}: got {fc}/{layer} ({conf}), label {c['fault_class']}/"
                    f"{c['layer']} ({c.get('confidence', '?')})")
    out = {}
    for split, s in sorted(acc.items()):
        out[split] = {
            "cases": s["cases"],
            "fault_class_accuracy": s["fc_ok"] / s["cases"],
            "layer_accuracy": s["layer_ok"] / s["cases"],
            "layer_cases_confident": s["conf_n"],
            "layer_accuracy_confident": s["conf_ok"] / s["conf_n"] if s["conf_n"] else 0.0,
            "misses": s["misses"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", action="append", default=[],
                   help=f"a corpus file (repeatable; default {REAL.relative_to(ROOT)} and, when "
                        f"present, {REFERENCE})")
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    p.add_argument("--quiet", action="store_true", help="print the summary lines only")
    args = p.parse_args(argv)
    paths = [Path(c) for c in args.corpus] or [REAL] + ([REFERENCE] if REFERENCE.exists() else [])
    cases: list[dict[str, Any]] = []
    for path in paths:
        if not path.exists():
            print(f"corpus {path} not found: pass --corpus PATH", file=sys.stderr)
            return 2
        cases += load(path)
    t0 = time.perf_counter()
    result = score(cases)
    dt = time.perf_counter() - t0
    print(f"{len(cases)} cases, {dt * 1000 / max(1, len(cases)):.2f} ms per case")
    for split, r in result.items():
        print(f"{split:10s} n={r['cases']:3d}  fault class {r['fault_class_accuracy']:6.1%}  "
              f"layer {r['layer_accuracy']:6.1%}  layer (medium/high labels, "
              f"n={r['layer_cases_confident']}) {r['layer_accuracy_confident']:6.1%}")
        if not args.quiet:
            for m in r["misses"]:
                print("    miss " + m)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "corpora": [str(p) for p in paths], "splits": result,
            "ms_per_case": dt * 1000 / max(1, len(cases)),
            "provenance": provenance.record()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

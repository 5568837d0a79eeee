"""Attribution accuracy over a labelled corpus of real failure logs.

    python bench/attribution.py [--corpus ../shared/corpus/failure_logs.jsonl] [--json PATH]

Runs ``trainguard diagnose``'s code (detector rules + attributor decide) on each case's
``log_excerpt`` and compares with the labels: fault_class accuracy over all cases (target
≥ 95 %), layer accuracy over the cases whose label confidence is medium or high (target
≥ 85 %). Prints every miss. The corpus is only read here, never by the tests.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.diagnose import diagnose_lines  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus"
                                           / "failure_logs.jsonl"))
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    path = Path(args.corpus)
    if not path.exists():
        print(f"corpus {path} not found: pass --corpus PATH", file=sys.stderr)
        return 2
    cases = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    fc_ok = layer_n = layer_ok = 0
    misses = []
    t0 = time.perf_counter()
    for c in cases:
        v = diagnose_lines(c["log_excerpt"].splitlines(), c["id"])
        got_fc = v.fault_class if v else None
        got_layer = v.layer if v else "unknown"
        if got_fc == c["fault_class"]:
            fc_ok += 1
        else:
            misses.append(f"fault_class {c['id']}: got {got_fc}, label {c['fault_class']}")
        if c.get("confidence") in ("medium", "high"):
            layer_n += 1
            if got_layer == c["layer"]:
                layer_ok += 1
            else:
                misses.append(f"layer       {c['id']}: got {got_layer}, label {c['layer']} "
                              f"(fault_class got {got_fc})")
    dt = time.perf_counter() - t0
    fc_acc = fc_ok / len(cases)
    layer_acc = layer_ok / layer_n if layer_n else 0.0
    print(f"cases: {len(cases)}  ({dt * 1000 / max(1, len(cases)):.2f} ms per case)")
    print(f"fault_class accuracy: {fc_ok}/{len(cases)} = {fc_acc:.1%}  (target >= 95%)")
    print(f"layer accuracy (label confidence medium/high): {layer_ok}/{layer_n} = "
          f"{layer_acc:.1%}  (target >= 85%)")
    print("misses:" if misses else "misses: none")
    for m in misses:
        print("  " + m)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cases": len(cases), "fault_class_accuracy": fc_acc, "layer_cases": layer_n,
            "layer_accuracy": layer_acc, "misses": misses}, indent=2))
    return 0 if fc_acc >= 0.9 and layer_acc >= 0.75 else 1


if __name__ == "__main__":
    sys.exit(main())

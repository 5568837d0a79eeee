"""Agreement of two labellings of the held-out corpus: percent and Cohen's kappa, per field.

    python bench/label_agreement.py [--first bench/corpus/real_logs.jsonl]
                                    [--second bench/corpus/heldout_second_labels.jsonl] [--json PATH]

The first labelling is the corpus's own (``fault_class``, ``layer``: read with the thread). The
second (``heldout_second_labels.jsonl``: ``id``, ``fault_class``, ``layer``) was made in a separate
pass from each excerpt alone, shuffled, with the labelling guide of ``bench/corpus/README.md`` and
without the first labels, reasons or threads in view. Kappa is Cohen's (1960): (p_o - p_e) /
(1 - p_e), p_e from the two labellings' marginal frequencies.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parent))  # bench/: provenance
import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIRST = ROOT / "bench" / "corpus" / "real_logs.jsonl"
SECOND = ROOT / "bench" / "corpus" / "heldout_second_labels.jsonl"
FIELDS = ("fault_class", "layer")


def cohen_kappa(a: list[str], b: list[str]) -> float:
    """Cohen's kappa of two equal-length label lists; 1.0 when both use one same label only.

    Raises:
        ValueError: lists of different lengths, or empty.
    """
    if len(a) != len(b) or not a:
        raise ValueError("two non-empty label lists of the same length are needed")
    n = len(a)
    p_o = sum(x == y for x, y in zip(a, b)) / n
    ca, cb = Counter(a), Counter(b)
    p_e = sum(ca[k] * cb[k] for k in set(ca) | set(cb)) / (n * n)
    return 1.0 if p_e == 1.0 else (p_o - p_e) / (1 - p_e)


def agreement(first: dict[str, dict], second: dict[str, dict]) -> dict:
    """Per field: cases, percent agreement, kappa and the disagreements (id: first vs second),
    over the ids the second labelling covers.

    Raises:
        KeyError: an id of the second labelling that the first does not have.
    """
    ids = sorted(second)
    out: dict = {"cases": len(ids)}
    for f in FIELDS:
        a = [first[i][f] for i in ids]
        b = [second[i][f] for i in ids]
        out[f] = {"agreement": sum(x == y for x, y in zip(a, b)) / len(ids),
                  "kappa": cohen_kappa(a, b),
                  "disagreements": [f"{i}: {x} vs {y}" for i, x, y in zip(ids, a, b) if x != y]}
    return out


def diagnose_agreement(first: dict[str, dict], second: dict[str, dict]) -> dict:
    """How often diagnose's verdict on each doubly labelled case matches the ``first`` and the
    ``second`` labelling: ``{"first": {fault_class, layer}, "second": {…}}`` (fractions)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from attribution import verdict  # noqa: E402 - bench/attribution.py, beside this file
    ids = sorted(second)
    got = {i: verdict(first[i]) for i in ids}
    return {name: {f: sum(got[i][k] == lab[i][f] for i in ids) / len(ids)
                   for k, f in enumerate(FIELDS)}
            for name, lab in (("first", first), ("second", second))}


def _read(path: Path) -> dict[str, dict]:
    return {c["id"]: c for c in (json.loads(ln) for ln in path.read_text().splitlines()
                                 if ln.strip())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--first", default=str(FIRST))
    p.add_argument("--second", default=str(SECOND))
    p.add_argument("--json", default="")
    p.add_argument("--with-diagnose", action="store_true",
                   help="also report how often diagnose's verdict agrees with each labelling")
    args = p.parse_args(argv)
    first, second = _read(Path(args.first)), _read(Path(args.second))
    res = agreement(first, second)
    if args.with_diagnose:
        res["diagnose"] = diagnose_agreement(first, second)
    print(f"{res['cases']} held-out cases labelled twice")
    for f in FIELDS:
        r = res[f]
        print(f"{f:12s} agreement {r['agreement']:6.1%}  Cohen's kappa {r['kappa']:.3f}")
        for d in r["disagreements"]:
            print("    " + d)
    for name, r in res.get("diagnose", {}).items():
        print(f"diagnose vs {name:6s} labelling: fault class {r['fault_class']:6.1%}  "
              f"layer {r['layer']:6.1%}")
    if args.json:
        res["provenance"] = provenance.record()
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

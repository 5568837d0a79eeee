"""The demo's report on the terminal: one line per fault as it is recovered, and the table of
every fault (seconds from injection to detection, decision and training again; steps rolled
back; the path; the decision) with the final test accuracy next to a fault-free run's."""
from __future__ import annotations

from typing import Any


def seconds(a: int | None, b: int | None) -> str:
    """``b - a`` (Unix ns) in seconds, right-aligned in 7 characters; ``-`` when either is
    missing."""
    return f"{(b - a) / 1e9:7.3f}" if a and b else "      -"


def fault_line(r: dict[str, Any]) -> str:
    """The line said once fault ``r`` (a row of ``RecoveryTiming.timeline``) was recovered."""
    d = r.get("decision") or {}
    return (f"{r['kind']} rank {r['rank']}: detected +{seconds(r['injected_ns'], r['detected_ns']).strip()}s, "
            f"decided +{seconds(r['injected_ns'], r['decided_ns']).strip()}s "
            f"({d.get('action', '-')}{'' if d.get('executed', True) else ', not executed'}), "
            f"training again +{seconds(r['injected_ns'], r['resumed_ns']).strip()}s, "
            f"rolled back {r['steps_rolled_back']} steps ({r.get('path') or '-'} path)")


def print_report(rep: dict[str, Any]) -> None:
    """Print the table of report ``rep`` (``Demo.run``'s) on stdout."""
    print()
    print(f"trainguard demo — mode {rep['mode']}, {rep['world_size']} ranks, "
          f"{rep['steps']} steps, {rep['wall_s']} s")
    hdr = (f"{'fault':<10} {'rank':>4} {'node':<6} {'step':>5} {'detect s':>9} "
           f"{'decide s':>9} {'resume s':>9} {'rolled back':>11} {'path':<10} "
           f"{'decision':<28} recovered")
    print(hdr)
    print("-" * len(hdr))
    for r in rep["faults"]:
        d = r.get("decision") or {}
        act = d.get("action", "-")
        if d.get("action") == "none":
            act += " (flagged)"
        elif not d.get("executed", True):
            act += " (observe)"
        print(f"{r['kind']:<10} {r['rank']:>4} {r['node']:<6} {r['step']:>5} "
              f"{seconds(r['injected_ns'], r['detected_ns']):>9} "
              f"{seconds(r['injected_ns'], r['decided_ns']):>9} "
              f"{seconds(r['injected_ns'], r['resumed_ns']):>9} "
              f"{str(r['steps_rolled_back']):>11} {str(r.get('path') or '-'):<10} "
              f"{act:<28} {r['recovered']}")
    acc, base = rep["accuracy"], rep["baseline_accuracy"]
    acc_s = f"{acc * 100:.2f} %" if acc is not None else "n/a (training did not finish)"
    print(f"\ntest accuracy {acc_s}; fault-free run with the same seed {base * 100:.2f} %"
          + (f" (difference {abs(acc - base) * 100:.2f} pp)" if acc is not None else ""))

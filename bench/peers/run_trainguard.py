"""Run one benchmark job under trainguard through its demo harness and write the harness report.

    python bench/peers/run_trainguard.py '<DemoConfig fields as JSON>'

Only DemoConfig fields that this version of the harness knows are passed (others are reported
and dropped), so the benchmark keeps working while the harness grows.
"""
from __future__ import annotations

import dataclasses
import json
import sys


def main() -> int:
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo

    conf = json.loads(sys.argv[1])
    known = {f.name for f in dataclasses.fields(DemoConfig)}
    dropped = sorted(set(conf) - known)
    if dropped:
        print(f"run_trainguard: this harness has no {dropped}; dropped", flush=True)
    rep = Demo(DemoConfig(**{k: v for k, v in conf.items() if k in known})).run()
    return 0 if rep.get("accuracy") is not None else 1


if __name__ == "__main__":
    sys.exit(main())

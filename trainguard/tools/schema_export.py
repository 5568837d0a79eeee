"""``trainguard schemas --out DIR``: write the JSON Schema of every event type."""
from __future__ import annotations

import argparse

from trainguard import schemas


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainguard schemas")
    # not "schemas/": a folder of that name in a job's directory would shadow the package
    p.add_argument("--out", default="trainguard-schemas",
                   help="directory to write <schema>.json into (default: ./trainguard-schemas)")
    args = p.parse_args(argv)
    try:
        paths = schemas.export_json_schemas(args.out)
    except OSError as exc:
        raise SystemExit(f"trainguard schemas: cannot write to {args.out!r}: {exc.strerror or exc}"
                         f"; give --out a writable directory") from None
    for path in paths:
        print(path)
    return 0

"""``trainguard schemas --out DIR``: write the JSON Schema of every event type."""
from __future__ import annotations

import argparse

import schemas


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainguard schemas")
    p.add_argument("--out", default="schemas/json", help="directory to write <schema>.json into")
    args = p.parse_args(argv)
    for path in schemas.export_json_schemas(args.out):
        print(path)
    return 0

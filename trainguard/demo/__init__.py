"""The demo job (``trainguard demo``): see ``trainguard.demo.harness``."""
from __future__ import annotations


def main(argv: list[str]) -> int:
    from trainguard.demo.harness import main as _main

    return _main(argv)

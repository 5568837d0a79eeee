"""``python -m trainguard.demo.fill --mb N``: a real process that fills a node's memory.

The demo's ``memory_fill`` fault starts it for a simulated node (``TG_NODE=<node>`` in its
environment, so the node's agent counts it: ``agents.host.NodeMemory``). It allocates
``--mb`` MiB of anonymous memory at ``--rate`` MiB/s, in chunks it writes to so that every page
is resident (``bytearray(b"\\x01") * n``, not a lazily mapped zero page), holds it for
``--hold`` seconds and exits. It stops by itself whatever happens to whoever started it: after
``--hold`` seconds at the top, after ``--max-s`` seconds in all, or as soon as its parent is
gone. Bounded: ``--mb`` is at most ``MAX_MB``.

Prints one line per second to stdout (seconds since start and MiB held) and one when it exits,
saying why.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

MiB = 1024 * 1024
#: The most this may ever hold: a few hundred MiB leaves any machine that runs the tests safe.
MAX_MB = 512
CHUNK_MB = 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.demo.fill")
    p.add_argument("--mb", type=int, required=True, help=f"MiB to hold (≤ {MAX_MB})")
    p.add_argument("--rate", type=float, default=32.0, help="MiB per second while filling")
    p.add_argument("--hold", type=float, default=15.0, help="seconds to hold it, then exit")
    p.add_argument("--max-s", type=float, default=90.0, help="seconds in all, at most")
    a = p.parse_args(argv)
    if not 0 < a.mb <= MAX_MB or a.rate <= 0:
        p.error(f"--mb must be 1..{MAX_MB} and --rate > 0")
    parent = os.getppid()
    t0 = time.monotonic()
    held: list[bytearray] = []
    full_at = None
    last_print = -1
    why = ""
    mb_held = 0
    while True:
        now = time.monotonic() - t0
        if now > a.max_s:
            why = f"--max-s {a.max_s:g} s reached"
        elif os.getppid() != parent:
            why = "its parent is gone"
        want = min(a.mb, int(a.rate * now) + CHUNK_MB)
        while mb_held < want:
            n = min(CHUNK_MB, want - mb_held)
            held.append(bytearray(b"\x01") * (n * MiB))
            mb_held += n
        if full_at is None and mb_held >= a.mb:
            full_at = now
        if full_at is not None and now - full_at >= a.hold:
            why = f"held {a.hold:g} s"
        if why:
            break
        if int(now) != last_print:
            last_print = int(now)
            print(f"{now:.1f} s: {mb_held} MiB", flush=True)
        time.sleep(0.05)
    print(f"{time.monotonic() - t0:.1f} s: {mb_held} MiB; exiting: {why}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

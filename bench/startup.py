"""Start-up: seconds from the launch command to every rank's first completed step, for the same
unmodified script under ``trainguard launch --standalone`` (the embedded stack included) and
``torchrun --standalone``, alternating, in one run.

    python bench/startup.py [--runs 5] [--job plain] [--json PATH]
                            [--trainguard BIN ...] [--names NAME ...]

``--trainguard`` may name several ``trainguard`` executables (e.g. two checkouts, to compare a
change: ``--names before after``); each is launched with ``--standalone --nproc-per-node 2``
and, like torchrun, no stack configured. The script is ``bench/dropin_jobs/<job>.py`` with its
records file (``records.py``): rank r's first line is its first step. Every launch is ended
with SIGTERM once both ranks have stepped, and waited for. Rounds alternate the order.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance, dropin
import provenance  # noqa: E402
from dropin import JOBS, JOBS_DIR, read_records, startup  # noqa: E402

BIN = os.path.dirname(sys.executable)


def launch(cmd: list[str], cwd: str, env: dict[str, str], timeout_s: float = 180.0
           ) -> float | None:
    """Run ``cmd`` in ``cwd`` until both ranks recorded a step; the start-up seconds (None:
    not in ``timeout_s``)."""
    t0 = time.time_ns()
    with open(os.path.join(cwd, "launcher.log"), "w") as log:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and p.poll() is None:
            s = startup(read_records(os.path.join(cwd, "records.txt")), t0)
            if s is not None:
                return s
            time.sleep(0.01)
        return None
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/startup.py", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--job", choices=sorted(JOBS), default="plain")
    ap.add_argument("--trainguard", nargs="+", default=[os.path.join(BIN, "trainguard")])
    ap.add_argument("--names", nargs="+", default=None)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    names = a.names or [f"trainguard{i or ''}" for i in range(len(a.trainguard))]
    if len(names) != len(a.trainguard):
        ap.error("--names must name every --trainguard")
    script, args, _warm = JOBS[a.job]
    script = os.path.join(JOBS_DIR, script)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_MODE", "TG_JOB")}
    env.update(PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    common = ["--standalone", "--nproc-per-node", "2"]
    systems = {n: [os.path.abspath(b), "launch", *common, script, *args]
               for n, b in zip(names, a.trainguard)}
    systems["torchrun"] = [os.path.join(BIN, "torchrun"), *common, script, *args]
    load0 = provenance.loadavg()
    samples: dict[str, list[float | None]] = {n: [] for n in systems}
    root = tempfile.mkdtemp(prefix="tg-startup-")
    order = list(systems)
    for i in range(a.runs):
        for name in (order if i % 2 == 0 else order[::-1]):
            d = os.path.join(root, f"{name}-{i}")
            os.makedirs(d)
            s = launch(systems[name], d, env)
            samples[name].append(s)
            print(f"  {name:12} run {i + 1}: {s} s", flush=True)
    summary = {}
    for name, xs in samples.items():
        ok = [x for x in xs if x is not None]
        summary[name] = {"median_s": round(statistics.median(ok), 3) if ok else None,
                         "min_s": min(ok, default=None), "max_s": max(ok, default=None),
                         "n": len(xs), "started": len(ok)}
    tr = summary["torchrun"]["median_s"]
    for name in names:
        m = summary[name]["median_s"]
        summary[name]["over_torchrun_s"] = round(m - tr, 3) if m is not None and tr else None
    out = {"job": a.job, "runs": a.runs, "samples": samples, "summary": summary,
           "commands": {n: " ".join(c) for n, c in systems.items()}, "run_dir": root,
           "provenance": provenance.record(load0)}
    for name, s in summary.items():
        extra = "" if name == "torchrun" else f" = torchrun + {s['over_torchrun_s']} s"
        print(f"{name:12} median {s['median_s']} s (min {s['min_s']}, max {s['max_s']}){extra}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

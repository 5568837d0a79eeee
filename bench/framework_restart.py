"""Framework jobs restarted as a group: SIGKILL → every rank training again, before and after
the spares pre-import the job's own modules and restarted Trainers resume by themselves.

    python bench/framework_restart.py --json PATH [--rounds N] [--jobs lightning,hf]

The Lightning and Hugging Face jobs of ``bench/dropin.py`` (2 ranks, gloo, the same services;
observe mode with ``--max-restarts 3``: the launcher restarts the group as torchrun does), each launched under three settings of trainguard, interleaved (the order
alternates per round, so a drift of the shared machine's load cancels out):

* ``before``: an unmodified job as trainguard ran it until now: the spares pre-import torch and
  trainguard only (``--no-job-imports``, no ``--warm-import``); the script's own resume
  (``last.ckpt`` / ``get_last_checkpoint``);
* ``by_hand``: as ``bench/dropin.py`` runs it: ``--warm-import <the framework's module>``
  named by hand, ``--no-job-imports``, the script's own resume;
* ``after``: nothing named by hand: the ranks record their imports, the template imports
  them (``trainguard.rank.job_imports``), and the scripts run with ``--no-own-resume``: the
  restarted Trainer resumes through ``trainguard.rank.auto_resume``.

Each run is ``bench/dropin.py``'s ``run_one`` without the hang phase: the fault-free rate over a
short window once the launcher's other processes are idle (the template done importing, the
spares renewed), then SIGKILL of rank 1 and the seconds until every rank completed a step in a
new process; with the step it resumed at and whether the processes that became the restarted
ranks had the framework imported before the script imported it (``records.py``'s ``.starts``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import dropin  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

VARIANTS = ("before", "by_hand", "after")
_COMMAND = dropin.command  # dropin's own, wrapped per variant


def variant_command(variant: str):
    """``dropin.command`` for one variant (trainguard only)."""
    def command(system, job, tg_job, stack, nvrx_python):
        cmd, env = _COMMAND(system, job, tg_job, stack, nvrx_python)
        # observe mode's group restart (torchrun's --max-restarts 3 of TORCHRUN_ARGS): the
        # worker-restart tier without a decision in between, so that runs of several jobs on
        # one node against one stack are not stopped by the attributor's cross-job history
        # (the same node crashing in two jobs is a repeat offender: excluded)
        cmd[cmd.index("--mode") + 1] = "observe"
        if variant != "by_hand":  # nothing named by hand
            i = cmd.index("--warm-import")
            del cmd[i:i + 2]
        if variant == "after":
            return cmd + ["--no-own-resume"], env
        cmd.insert(cmd.index("launch") + 1, "--no-job-imports")
        return cmd, env

    return command


def starts(path: str) -> list[list[int]]:
    try:
        with open(path) as fh:
            return [[int(x) for x in ln.split()] for ln in fh if len(ln.split()) == 4]
    except FileNotFoundError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/framework_restart.py")
    p.add_argument("--json", default="")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--jobs", default="lightning,hf")
    p.add_argument("--window", type=float, default=3.0)
    p.add_argument("--keep", default="")
    a = p.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    s = dropin.Settings(window_s=a.window, rounds=a.rounds, hang=False)
    root = a.keep or tempfile.mkdtemp(prefix="tg-bench-fw-")
    from trainguard.stack.local import Stack as TgStack

    load0 = os.getloadavg()
    tg = TgStack(services=("agent", "detector", "attributor", "remediator"),
                 agent_nodes=("node0",), rendezvous=True, log_dir=os.path.join(root, "stack"))
    tg.start(timeout=180)
    stack = dropin.Stack(tg.nats_url, tg.redis_url, tg.rdzv_endpoint)
    runs = []
    try:
        for rnd in range(a.rounds):
            for j, job in enumerate(jobs):
                order = VARIANTS if (rnd + j) % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    dropin.command = variant_command(variant)
                    sub = os.path.join(root, variant)
                    os.makedirs(sub, exist_ok=True)
                    r = dropin.run_one("trainguard", job, rnd, s, stack, sub, sys.executable)
                    d = os.path.join(sub, f"{job}-trainguard-{rnd}")
                    st = starts(os.path.join(d, "records.txt.starts"))
                    row = {"job": job, "variant": variant, "round": rnd, **asdict(r),
                           "restarted_ranks_found_framework_imported":
                               sorted({x[3] == 1 for x in st if x[2] >= 1}) or None,
                           "load_avg_1m_after": os.getloadavg()[0]}
                    runs.append(row)
                    k = r.kill or {}
                    print(f"  {job:<9} {variant:<6} round {rnd + 1}: SIGKILL→training "
                          f"{k.get('recovery_s')} s, resumed at step {k.get('resumed_step')}, "
                          f"warm {row['restarted_ranks_found_framework_imported']}, "
                          f"rate {r.rate and round(r.rate, 2)} steps/s ({r.wall_s:.0f} s)"
                          + (f" — {'; '.join(r.notes)}" if r.notes else ""), flush=True)
    finally:
        tg.stop()
    summary = {}
    for job in jobs:
        for v in VARIANTS:
            ks = [x["kill"]["recovery_s"] for x in runs
                  if x["job"] == job and x["variant"] == v and x["kill"]]
            summary[f"{job}_{v}_s"] = dropin._median(ks)
    out = {"what": "SIGKILL of rank 1 → every rank training again, trainguard observe mode "
                   "--max-restarts 3 (the launcher's group restart), 2 ranks, gloo; before: spares with torch only (--no-job-imports), the "
                   "script's own resume; by_hand: --warm-import <framework>, "
                   "--no-job-imports, the script's own resume; after: job imports recorded "
                   "and pre-imported, auto-resume (--no-own-resume)",
           "conditions": {"cpus": os.cpu_count(), "load_avg_at_start": load0,
                          "host": platform.node(), "python": platform.python_version(),
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "note": "a shared machine, other work running (see load averages)"},
           "settings": asdict(s), "summary": summary, "runs": runs,
           "provenance": provenance.record(list(load0))}
    print(json.dumps(summary, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

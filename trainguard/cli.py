"""``trainguard`` command line: up, launch, demo, diagnose, replay, report, schemas,
slurm-watch, status, breaker, node.

Each subcommand lives in its own module and is imported only when used (start-up stays fast).
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "up": ("trainguard.stack.up", "Start NATS, Valkey and every service locally; Ctrl-C stops all."),
    "credentials": ("trainguard.stack.credentials", "Give one job's workers their own user on a "
                                              "running `trainguard up`."),
    "launch": ("trainguard.launch.launcher", "Start the ranks of one node (torchrun-compatible)."),
    "demo": ("trainguard.demo", "Train a real model under injected faults and report recovery."),
    "diagnose": ("trainguard.tools.diagnose", "Attribute saved job logs / dmesg offline."),
    "replay": ("trainguard.tools.replay", "Record events, replay them into the bus, or re-decide "
                                    "them offline."),
    "report": ("trainguard.tools.report", "Continuity report and timeline of a job (history + audit)."),
    "schemas": ("trainguard.tools.schema_export", "Export the event JSON Schemas."),
    "slurm-watch": ("trainguard.scheduler.slurm.watch.__main__", "Watch Slurm (squeue/sinfo) for the jobs "
                                                       "that opted in; publish its signals."),
    "status": ("trainguard.tools.status", "The control plane at a glance: the fleet breaker "
                                        "and every job."),
    "breaker": ("trainguard.tools.breaker", "The fleet breaker over node-taking actions: "
                                          "status, reset --reason."),
    "node": ("trainguard.tools.node", "Node reputation: readmit a drained node after its canary, "
                                    "the probation loop, show, forgive."),
}


def usage() -> str:
    lines = ["usage: trainguard <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"trainguard: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

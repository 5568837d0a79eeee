"""``python -m trainguard.cluster``: a cluster on this machine until Ctrl-C (root or
CAP_NET_ADMIN).

    python -m trainguard.cluster --nodes 3 [--slurm] [--faults schedule.yaml --job JOB]

Prints the nodes (name, address, how to run a command on one), the ``export`` line of the
``worker`` role (what ``trainguard launch`` on a node needs) and, with ``--slurm``,
``SLURM_CONF``; with ``--faults`` it carries out the schedule's node faults on the job's step
records once a job writes them (``trainguard/cluster/train.py --records <run dir>/<job>``).
Everything is removed on exit.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from trainguard.core.fault_schedule import FaultScheduleError, load

from trainguard.cluster.harness import Cluster, ClusterConfig, FaultRunner
from trainguard.cluster.net import NetError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.cluster",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slurm", action="store_true", help="also run slurmctld and a slurmd per node")
    p.add_argument("--faults", default="", help="a fault schedule whose node faults to carry out")
    p.add_argument("--job", default="", help="the job whose step records trigger --faults")
    p.add_argument("--run-dir", default="", help="logs, records, checkpoints (default: temp)")
    a = p.parse_args(argv)
    if a.nodes < 1:
        p.error(f"--nodes must be ≥ 1, got {a.nodes}")
    faults = []
    if a.faults:
        if not a.job:
            p.error("--faults needs --job: node faults are triggered by that job's steps")
        try:
            faults = load(a.faults)
        except FaultScheduleError as exc:
            p.error(str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        c = Cluster(ClusterConfig(nodes=a.nodes, slurm=a.slurm, run_dir=a.run_dir)).start()
    except (NetError, RuntimeError) as exc:
        print(f"python -m trainguard.cluster: {exc}", file=sys.stderr)
        return 1
    try:
        for n in c.net.nodes:
            print(f"{n.name}  {n.addr}  run: {' '.join(c.net.argv(n, ['bash']))}")
        env = c.worker_env()
        print("export " + " ".join(f"{k}={v}" for k, v in env.items()) +
              " GLOO_SOCKET_IFNAME=eth0")
        if c.slurm is not None:
            print(f"export SLURM_CONF={c.slurm.conf}")
        print(f"run directory {c.run_dir}; Ctrl-C stops everything", flush=True)
        if faults:
            FaultRunner(c, a.job, faults, timeout_s=10 ** 9).start()
        stop.wait()
    finally:
        c.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

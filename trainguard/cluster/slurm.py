"""A real Slurm on the one-machine cluster: ``slurmctld`` on the host side of the bridge, one
``slurmd`` in each node's namespace, configured and started in seconds.

``SlurmCluster(net, workdir)`` writes ``slurm.conf`` and ``cgroup.conf`` into ``workdir`` (state,
spool, logs and pid files there too: nothing outside it), with ``auth/none`` and ``cred/none``
(no munge key to share: every daemon runs as root on this machine), ``proctrack/pgid``,
``task/none``, ``select/cons_tres`` over CPUs, one partition ``tg`` with every node, the
controller's and the daemons' ports free ports of this machine, and the nodes' addresses on the
bridge (``NodeAddr``). ``start()`` returns once every node is ``idle``; ``env`` is what a Slurm
client needs (``SLURM_CONF``); ``stop()`` cancels what runs and ends the daemons. Raises
``SlurmUnavailable`` where Slurm's daemons are not installed (``apt-get install slurm-wlm``).

Sources: slurm.conf(5) and cgroup.conf(5) of Slurm 22.05 (Debian 12's ``slurm-wlm``).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Sequence

from trainguard.stack.process import die_with_parent, free_port

from trainguard.cluster.net import ClusterNet

__all__ = ["SlurmCluster", "SlurmUnavailable", "slurm_unavailable_reason"]

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel", "squeue")


class SlurmUnavailable(RuntimeError):
    """Slurm's daemons or clients are not installed here."""


def slurm_unavailable_reason() -> str | None:
    """None when slurmctld, slurmd and the clients are on PATH; else what is missing."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y "
            f"slurm-wlm") if missing else None


class SlurmCluster:
    """Slurm over the nodes of ``net`` (started), state in ``workdir`` (see module docstring).
    ``slurmd_timeout_s``: Slurm's ``SlurmdTimeout`` (seconds without an answer before a node is
    set DOWN and its jobs requeued or killed)."""

    def __init__(self, net: ClusterNet, workdir: str, slurmd_timeout_s: int = 10,
                 cpus: int | None = None):
        why = slurm_unavailable_reason()
        if why:
            raise SlurmUnavailable(why)
        self.net, self.dir = net, os.path.abspath(workdir)
        self.slurmd_timeout_s = slurmd_timeout_s
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.ctld: subprocess.Popen | None = None
        self.slurmd: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """Our environment plus ``SLURM_CONF`` (for sbatch, scontrol, sinfo, the remediator)."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def write_config(self) -> None:
        os.makedirs(os.path.join(self.dir, "state"), exist_ok=True)
        d = self.dir
        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={self.cpus} State=UNKNOWN"
                          for n in self.net.nodes)
        conf = f"""# written by trainguard.cluster.slurm
ClusterName=trainguard
SlurmctldHost={socket.gethostname().split('.')[0]}({self.net.host_addr})
SlurmctldPort={free_port(self.net.host_addr)}
SlurmdPort={free_port(self.net.host_addr)}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
SlurmctldTimeout=10
MessageTimeout=5
KillWait=2
InactiveLimit=0
MinJobAge=30
{nodes}
PartitionName=tg Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        with open(self.conf, "w") as fh:
            fh.write(conf)
        # 22.05 autodetects the cgroup version from /sys/fs/cgroup: a hybrid v1 layout needs it
        # named (nothing here constrains jobs with cgroups: proctrack/pgid, task/none)
        with open(os.path.join(d, "cgroup.conf"), "w") as fh:
            fh.write("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                     "CgroupAutomount=no\n")

    def start(self, timeout: float = 30.0) -> "SlurmCluster":
        os.makedirs(self.dir, exist_ok=True)
        self.write_config()
        log = open(os.path.join(self.dir, "slurmctld.out"), "ab")
        # SIGTERM when this process dies, even by SIGKILL (the namespaces' processes go with
        # ``cleanup_leftovers``; slurmctld runs on the host side and would be left)
        self.ctld = subprocess.Popen(["slurmctld", "-D", "-i", "-f", self.conf],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        log.close()
        for n in self.net.nodes:
            self.start_slurmd(n.name)
        self.wait_state(self.net.names, ("idle",), timeout)
        return self

    def start_slurmd(self, node: str) -> None:
        """(Re)start the slurmd of ``node`` (after ``power_on``)."""
        log = open(os.path.join(self.dir, f"slurmd-{node}.out"), "ab")
        self.slurmd[node] = self.net.popen(node, ["slurmd", "-D", "-f", self.conf, "-N", node],
                                           env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
        log.close()

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0,
            env: dict[str, str] | None = None) -> str:
        """A Slurm client command's output (``env``: added to ``self.env``; sbatch exports it
        to the job). Raises RuntimeError on failure when ``check``."""
        p = subprocess.run(argv, capture_output=True, text=True, env={**self.env, **(env or {})},
                           timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: "
                               f"{(p.stderr or p.stdout).strip()[:400]}")
        return p.stdout

    def node_states(self) -> dict[str, str]:
        """Node name → Slurm state as ``sinfo`` prints it (``idle``, ``alloc``, ``drain``, …)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def wait_state(self, nodes: Sequence[str], states: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        got: dict[str, str] = {}
        while time.monotonic() < deadline:
            got = self.node_states()
            if all(got.get(n, "").rstrip("*~#") in states for n in nodes):
                return
            if self.ctld is not None and self.ctld.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes not {'/'.join(states)} in {timeout:.0f} s: {got}; "
                           f"logs in {self.dir}")

    def reasons(self) -> dict[str, str]:
        """``sinfo -R``: node → drain/down reason."""
        out = self.run("sinfo", "-R", "-h", "-N", "-o", "%N|%E", check=False)
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def sbatch(self, script: str | None, *opts: str, env: dict[str, str] | None = None) -> str:
        """Submit ``script`` (None: ``opts`` hold ``--wrap``) with ``env`` added to the job's
        environment; returns the Slurm job id."""
        out = self.run("sbatch", "--parsable", *opts, *([script] if script else []), env=env)
        return out.strip().split(";")[0]

    def job_state(self, job_id: str) -> dict[str, str]:
        from trainguard.scheduler.slurm.commands import parse_scontrol

        return parse_scontrol(self.run("scontrol", "show", "job", "-o", job_id, check=False))

    def kill_slurmd(self, node: str) -> float:
        """SIGKILL the slurmd of ``node`` (the node and its jobs run on); returns Unix s."""
        t = time.time()
        p = self.slurmd.get(node)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        return t

    def stop(self) -> None:
        """Cancel every job, end slurmd and slurmctld (SIGTERM, then SIGKILL). Idempotent."""
        if self.ctld is not None and self.ctld.poll() is None:
            subprocess.run(["scancel", "--full", "--partition", "tg"], env=self.env,
                           capture_output=True, timeout=15)
        for proc in [*self.slurmd.values(), self.ctld]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.slurmd.values(), self.ctld]:
            if proc is None:
                continue
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.slurmd.clear()
        self.ctld = None

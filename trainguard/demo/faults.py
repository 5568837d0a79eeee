"""Injecting the demo's faults into a running job: a signal to a rank (``sigkill``, ``hang`` by
SIGSTOP), an exception the rank raises itself (its marker file), a straggler, the loss of a
node (its launcher and agent killed), a driver XID line in a simulated node's kernel log, and a
degrading simulated node (``SIM_FAULTS``: ECC errors, a memory fill by ``trainguard.demo.fill``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from trainguard import schemas
from trainguard.demo.config import SIM_FAULTS


class FaultInjection:
    """The fault-injecting steps of ``trainguard.demo.harness.Demo``, which provides ``cfg`` (a
    ``DemoConfig``), ``stack`` (a started ``Stack``), ``rec`` (a ``Recorder``), ``launchers``
    (the launcher processes by node rank), ``log_dir``, ``fills`` and ``degraded``."""

    def wait_step(self, rank: int, step: int, timeout: float) -> schemas.RankHeartbeat | None:
        """The heartbeat of ``rank`` once it trains at ``step`` or later; None when every
        launcher ended first or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = self.rec.heartbeat(rank)
            if hb is not None and hb.step >= step and hb.phase == "train":
                return hb
            if all(p.poll() is not None for p in self.launchers):
                return None
            time.sleep(0.005)
        return None

    def inject(self, f: dict[str, Any]) -> int | None:
        """Inject fault ``f``; returns the Unix ns of injection (None if it could not be)."""
        cfg = self.cfg
        if f["kind"] == "exception":
            marker = os.path.join(cfg.run_dir, f"fault-{f['id']}.injected")
            deadline = time.monotonic() + cfg.recovery_timeout_s + 240
            while time.monotonic() < deadline and not os.path.exists(marker):
                if all(p.poll() is not None for p in self.launchers):
                    break
                time.sleep(0.005)
            if not os.path.exists(marker):
                return None
            time.sleep(0.01)
            return int(open(marker).read().strip())
        # the first fault also waits for the job to start (slow on a loaded host)
        hb = self.wait_step(f["rank"], f["step"], cfg.recovery_timeout_s + 240)
        if hb is None:
            return None
        if f["kind"] == "node_loss":
            # the node's launcher (its ranks and spares die with it) and its agent
            ts = time.time_ns()
            self.launchers[f["node"]].kill()
            self.stack.kill_service(f"agent-node{f['node']}")
            return ts
        if f["kind"] == "xid":
            # a real-format driver line in the node's kernel log, as the agent reads it
            node = f.get("node", f["rank"] // cfg.nproc_per_node)
            xid = int(f.get("xid", 79))
            ts = time.time_ns()
            with open(self.stack.kernel_log_path(f"node{node}"), "a") as fh:
                fh.write(f"[{time.monotonic():12.6f}] NVRM: Xid (PCI:0000:3b:00): {xid}, "
                         f"pid={hb.pid}, name=python, GPU has fallen off the bus.\n")
            return ts
        if f["kind"] in SIM_FAULTS:
            return self.inject_degradation(f)
        if f["kind"] == "straggler":
            node, local = f["rank"] // cfg.nproc_per_node, f["rank"] % cfg.nproc_per_node
            path = os.path.join(cfg.run_dir, f"slow-node{node}-{local}")
            with open(path, "w") as fh:
                fh.write(str(f.get("factor", 3)))
            return time.time_ns()
        sig = signal.SIGKILL if f["kind"] == "sigkill" else signal.SIGSTOP
        ts = time.time_ns()
        os.kill(hb.pid, sig)
        return ts

    def inject_degradation(self, f: dict[str, Any]) -> int:
        """A fault of ``SIM_FAULTS`` into simulated node ``node<f["node"]>``; the Unix ns it
        began. Raises ValueError when the stack has no simulated hardware (``sim_dir``)."""
        sim = getattr(self.stack, "sim_dir", None)
        if sim is None:
            raise ValueError(f"a {f['kind']} fault needs a stack with simulated node hardware "
                             f"(Stack(sim_dir=...))")
        node = f"node{f['node']}"
        if f["kind"] == "ecc_degrading":
            from trainguard.demo.fake_pynvml import set_ecc_rate

            ts = time.time_ns()
            set_ecc_rate(str(sim), node, float(f.get("per_s", 5.0)))
            self.degraded.append(node)
            return ts
        from trainguard.agents.host import NodeMemory

        budget = self.stack.memory_budget_path(node)
        used = NodeMemory(node, str(budget)).used_bytes()
        total = int(used / float(f.get("start_ratio", 0.75)))
        mb = max(1, min(int(f.get("max_mb", 384)), (total - used) // 2**20))
        f.update(used_mib=round(used / 2**20), budget_mib=round(total / 2**20), fill_mib=mb)
        ts = time.time_ns()
        budget.write_text(str(total))
        log = open(os.path.join(self.log_dir, f"fill-{node}.log"), "a")
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.demo.fill", "--mb", str(mb),
             "--rate", str(f.get("rate", 32.0)), "--hold", str(f.get("hold_s", 20.0)),
             "--max-s", str(f.get("max_s", 60.0))],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TG_NODE": node})
        self.fills.append((proc, node))
        self.say(f"{node}: budget {f['budget_mib']} MiB ({f['used_mib']} in use), filling "
                 f"{mb} MiB (pid {proc.pid})")
        return ts

    def clear_degradation(self) -> None:
        """End what ``inject_degradation`` began: the fill processes stopped, the budgets
        removed, the ECC counts no longer rising (a stack shared by later runs is healthy)."""
        for proc, node in self.fills:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(FileNotFoundError):
                self.stack.memory_budget_path(node).unlink()
        self.fills = []
        if self.degraded:
            from trainguard.demo.fake_pynvml import set_ecc_rate

            for node in self.degraded:
                set_ecc_rate(str(self.stack.sim_dir), node, 0.0)
        self.degraded = []

"""Node exclusion through Slurm, for the *training job's* Slurm allocation.

The Slurm job id comes from the job record (``slurm_job_id``: the ``SLURM_JOB_ID`` its
launchers registered), never from the remediator's own environment (the remediator runs outside
the job). Every action re-reads Slurm's state first and does nothing when it is already
satisfied, so a decision carried out twice (a remediator restarted between the command and its
record, two decisions for one generation) drains, requeues or cancels once; the detail says
``already …`` then.

* ``exclude(node, job, reason)`` — ``scontrol update nodename=<node> state=drain
  reason="trainguard: <evidence>"`` (shown by ``sinfo -R``), then, by ``SlurmConfig.requeue``:
  ``auto`` (default) requeues only when the job cannot go on in place (its record says it
  stopped or failed, or the world it is left with is below its minimum), ``always`` requeues
  on every exclusion (a job restarted from its checkpoint on a fresh allocation), ``never``.
  A requeue is ``scontrol requeue <id>`` and then ``scontrol update jobid=<id>
  excnodelist=<node,…>`` so the next allocation leaves the node out.
* ``stop(job, reason)`` — ``scancel <id>`` unless the job has ended already.

Commands are argv lists (no shell); each is bounded by ``SlurmConfig.timeout_s``. An external
failure is a ``ControllerResult`` with ``ok`` False and what to do, never an exception.
"""
from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from .controller_base import ControllerResult, NodeController

__all__ = ["SlurmConfig", "SlurmController", "slurm_drain_command", "slurm_requeue_command",
           "parse_scontrol", "SLURM_REASON_MAX", "ENDED_STATES", "REQUEUED_STATES"]

#: Slurm drain reasons are shown by ``sinfo -R``; keep them short and on one line.
SLURM_REASON_MAX = 120
#: Job states after which there is nothing to cancel (``squeue``/``scontrol`` JobState).
ENDED_STATES = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")
#: Job states that mean a requeue has happened (or is under way).
REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING")


@dataclass
class SlurmConfig:
    """``scontrol``/``scancel`` paths (default: found on PATH); ``requeue`` (env
    ``TG_SLURM_REQUEUE``: ``auto`` | ``always`` | ``never``, see the module docstring);
    ``slurm_job_id`` overrides the job record's (tests, a job registered without it; empty: the
    record's); ``timeout_s`` bounds each command (seconds)."""

    scontrol: str = field(default_factory=lambda: shutil.which("scontrol") or "scontrol")
    scancel: str = field(default_factory=lambda: shutil.which("scancel") or "scancel")
    requeue: str = field(default_factory=lambda: os.environ.get("TG_SLURM_REQUEUE", "auto"))
    slurm_job_id: str = ""
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.requeue not in ("auto", "always", "never"):
            raise ValueError(f"TG_SLURM_REQUEUE={self.requeue!r}: use auto, always or never")


def slurm_drain_command(node: str, reason: str, scontrol: str = "scontrol") -> list[str]:
    """argv that drains ``node`` with ``reason`` (one line, at most ``SLURM_REASON_MAX``
    characters; Slurm shows it in ``sinfo -R``)."""
    one_line = " ".join(reason.split())[:SLURM_REASON_MAX] or "trainguard"
    return [scontrol, "update", f"nodename={node}", "state=drain", f"reason=trainguard: {one_line}"]


def slurm_requeue_command(job_id: str, scontrol: str = "scontrol") -> list[str]:
    """argv that requeues Slurm job ``job_id`` (it restarts without the drained node)."""
    return [scontrol, "requeue", str(job_id)]


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show … -o`` one-line output → its ``Key=Value`` pairs (a value runs to the
    next `` Key=``; ``Reason=`` may hold spaces and is kept whole)."""
    out: dict[str, str] = {}
    key = None
    for tok in text.strip().split(" "):
        k, sep, v = tok.partition("=")
        if sep and k and (k[0].isupper() or k in ("nodename",)) and k.replace("_", "").isalnum():
            key = k
            out[key] = v
        elif key is not None:
            out[key] += " " + tok
    return out


class SlurmController(NodeController):
    """Drain, requeue and cancel for the training job's Slurm id (see the module docstring)."""

    name = "slurm"

    def __init__(self, state=None, config: SlurmConfig | None = None):
        super().__init__(state)
        self.config = config or SlurmConfig()

    def commands(self, node: str, reason: str, job_id: str = "") -> list[list[str]]:
        """The commands of an exclusion that requeues (drain; requeue when ``job_id``)."""
        job_id = job_id or self.config.slurm_job_id
        cmds = [slurm_drain_command(node, reason, self.config.scontrol)]
        if job_id:
            cmds.append(slurm_requeue_command(job_id, self.config.scontrol))
        return cmds

    async def _run(self, cmd: list[str]) -> tuple[int, str]:
        """``(exit status, output)``; raises OSError / asyncio.TimeoutError."""
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.config.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        return proc.returncode or 0, out.decode(errors="replace").strip()

    async def _show(self, what: str, ident: str) -> dict[str, str]:
        rc, out = await self._run([self.config.scontrol, "show", what, "-o", ident])
        return parse_scontrol(out) if rc == 0 else {}

    async def _job_id(self, job: str) -> tuple[str, Any]:
        record = None
        if self.state is not None:
            try:
                record = await self.state.job(job)
            except Exception:  # noqa: BLE001 - a record we cannot read: no id from it
                record = None
        jid = self.config.slurm_job_id or (record.slurm_job_id if record is not None else "")
        return str(jid), record

    def _missing(self) -> str | None:
        exe = self.config.scontrol
        if os.path.exists(exe) or shutil.which(exe):
            return None
        return f"scontrol not found ({exe})"

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        jid, record = await self._job_id(job)
        missing = self._missing()
        if missing:
            return ControllerResult(False, f"{missing}: run the remediator on a Slurm "
                                           f"login/controller node or drain {node} by hand",
                                    self.commands(node, reason, jid))
        done: list[Any] = []
        try:
            state = (await self._show("node", node)).get("State", "")
            drain = slurm_drain_command(node, reason, self.config.scontrol)
            if "DRAIN" in state:
                done.append({"skipped": drain, "why": f"already drained ({state})"})
                said = f"{node} already drained"
            else:
                rc, out = await self._run(drain)
                done.append(drain)
                if rc != 0:
                    return ControllerResult(False, f"{' '.join(drain)} exited {rc}: {out[:300]}",
                                            done)
                said = f"drained {node}"
            if not jid:
                return ControllerResult(True, f"{said}; no Slurm job id in the job record of "
                                              f"{job!r} (launched outside Slurm): nothing to "
                                              f"requeue", done)
            if not self._should_requeue(record):
                return ControllerResult(True, f"{said}; Slurm job {jid} goes on in place "
                                              f"(requeue={self.config.requeue})", done)
            ok, detail = await self._requeue(jid, node, done)
            return ControllerResult(ok, f"{said}; {detail}", done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)

    def _should_requeue(self, record: Any) -> bool:
        if self.config.requeue != "auto":
            return self.config.requeue == "always"
        if record is None:
            return False
        return record.status in ("stopped", "failed") or (
            0 < record.world_size < record.min_world_size)

    async def _requeue(self, jid: str, node: str, done: list[Any]) -> tuple[bool, str]:
        job = await self._show("job", jid)
        st = job.get("JobState", "")
        cmd = slurm_requeue_command(jid, self.config.scontrol)
        if st in REQUEUED_STATES:
            done.append({"skipped": cmd, "why": f"job {jid} is {st} already"})
            return True, f"Slurm job {jid} already requeued ({st})"
        if st in ENDED_STATES:
            done.append({"skipped": cmd, "why": f"job {jid} ended ({st})"})
            return False, f"Slurm job {jid} ended ({st}): nothing to requeue; submit it again"
        rc, out = await self._run(cmd)
        done.append(cmd)
        if rc != 0:
            return False, f"{' '.join(cmd)} exited {rc}: {out[:300]}"
        exc = [n for n in (job.get("ExcNodeList", "(null)"), node) if n and n != "(null)"]
        upd = [self.config.scontrol, "update", f"jobid={jid}", f"excnodelist={','.join(exc)}"]
        rc, out = await self._run(upd)
        done.append(upd)
        return True, (f"requeued Slurm job {jid} without {node}" if rc == 0 else
                      f"requeued Slurm job {jid} ({node} is drained, so it is not chosen; "
                      f"excnodelist not set: {out[:200]})")

    async def stop(self, job: str, reason: str) -> ControllerResult:
        jid, _ = await self._job_id(job)
        if not jid:
            return ControllerResult(True, f"no Slurm job id in the job record of {job!r}: "
                                          f"nothing to cancel")
        missing = self._missing()
        if missing:
            return ControllerResult(False, f"{missing}: cancel Slurm job {jid} by hand "
                                           f"(scancel {jid})")
        cmd = [self.config.scancel, jid]
        try:
            st = (await self._show("job", jid)).get("JobState", "")
            if st in ENDED_STATES:
                return ControllerResult(True, f"Slurm job {jid} already ended ({st})",
                                        [{"skipped": cmd, "why": st}])
            rc, out = await self._run(cmd)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"{' '.join(cmd)}: {exc or 'timed out'}", [cmd])
        return ControllerResult(rc == 0, f"cancelled Slurm job {jid}: {reason}"[:300] if rc == 0
                                else f"{' '.join(cmd)} exited {rc}: {out[:300]}", [cmd])

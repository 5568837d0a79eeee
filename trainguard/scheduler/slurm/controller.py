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
  A requeue (``requeue_commands``) is, for a node trainguard found unreachable
  (``UNREACHABLE_FAULTS``), first ``scontrol update nodename=<node> state=down reason=…``, so
  that Slurm ends the job's part there at once instead of holding the requeued job COMPLETING
  until ``SlurmdTimeout``; then ``scontrol requeue <id>``; ``scontrol update jobid=<id>
  excnodelist=<node,…>`` so the next allocation leaves the node out; and, once the job is
  PENDING (``SlurmConfig.release_wait_s``), ``scontrol update jobid=<id> starttime=now``:
  Slurm 22.05 makes a requeued batch job eligible only about 2 minutes later
  (``EligibleTime``), and sets that when the job has left COMPLETING on every node, so a
  release before then is undone. The requeued job's launchers then start a new run of the job
  (``StateStore.begin_run``: another ``<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>``) that resumes
  from the newest valid checkpoint.
* ``stop(job, reason, generation)`` — for a stop decision of ``generation``: ``squeue`` first
  (``stop_plan``: nothing when the job ended or Slurm no longer knows it, nor when a later
  generation is in force — a new run of the job), then ``scontrol update jobid=<id>
  admincomment="trainguard: <reason>"`` (``Comment`` when that is refused) and ``scancel <id>``.

Readmission (``NodeController.readmit``: the policy and the reputation are the base class's; the
hooks are here). Slurm 22.05 starts no job on a DRAIN node, not even one in a reservation that
holds it (tried on the harness: ``srun -w NODE --reservation=R`` waits with "Required node not
available"), so the canary runs in a window no other job can enter: ``scontrol create
reservation reservationname=tg-canary-<node> nodes=<node> starttime=now duration=UNLIMITED
users=<us> flags=maint,ignore_jobs``, then ``state=resume`` (the node is IDLE+MAINT+RESERVED:
only the reservation's users can start jobs there), then ``srun -w <node> -N1 -n1
--reservation=tg-canary-<node>`` of the canary program (``trainguard.agents.canary``). Passed: the
reservation is deleted and the node is in service. Failed: ``state=drain`` with the evidence as
the reason, then the reservation is deleted. A readmit killed inside the window leaves the node
reserved (``duration=UNLIMITED``: it never expires into service unchecked); the next readmit
sees the reservation (``NodeView.CANARY``) and goes on from there.

Commands are argv lists (no shell); each is bounded by ``SlurmConfig.timeout_s``. An external
failure is a ``ControllerResult`` with ``ok`` False and what to do, never an exception.
"""
from __future__ import annotations

import asyncio
import os
import pwd
import shlex
import shutil
from dataclasses import dataclass, field
from typing import Any

from trainguard.scheduler.base import (LOCAL_CANARY, CanaryNotRun, ControllerResult, NodeController,
                              run_canary_command)
from trainguard.core.reputation import NodeView
from trainguard.scheduler.slurm.commands import (ENDED_STATES, REQUEUED_STATES, SCANCEL_ENDED,  # noqa: F401
                             SLURM_REASON_MAX, UNREACHABLE_FAULTS, parse_scontrol,
                             parse_squeue_state, requeue_commands, slurm_drain_command,
                             slurm_reason, slurm_requeue_command, slurm_squeue_command,
                             slurm_stop_commands, stop_plan)

__all__ = ["SlurmConfig", "SlurmController", "slurm_drain_command", "slurm_requeue_command",
           "slurm_squeue_command", "slurm_stop_commands", "slurm_reason", "parse_squeue_state",
           "stop_plan", "parse_scontrol", "SLURM_REASON_MAX", "ENDED_STATES", "REQUEUED_STATES",
           "SCANCEL_ENDED", "UNREACHABLE_FAULTS", "requeue_commands"]

@dataclass
class SlurmConfig:
    """``scontrol``/``scancel``/``squeue`` paths (default: found on PATH); ``requeue`` (env
    ``TG_SLURM_REQUEUE``: ``auto`` | ``always`` | ``never``, see the module docstring);
    ``slurm_job_id`` overrides the job record's (tests, a job registered without it; empty: the
    record's); ``timeout_s`` bounds each command (seconds)."""

    scontrol: str = field(default_factory=lambda: shutil.which("scontrol") or "scontrol")
    scancel: str = field(default_factory=lambda: shutil.which("scancel") or "scancel")
    squeue: str = field(default_factory=lambda: shutil.which("squeue") or "squeue")
    requeue: str = field(default_factory=lambda: os.environ.get("TG_SLURM_REQUEUE", "auto"))
    slurm_job_id: str = ""
    timeout_s: float = 30.0
    #: readmission: ``srun`` path; the canary program as run on the node (env
    #: ``TG_SLURM_CANARY_CMD``, shell words; default this Python's ``-m trainguard.agents.canary
    #: --json``: the node needs trainguard at the same path); ``canary_timeout_s`` bounds the
    #: whole ``srun`` (seconds); ``reservation_prefix`` names the canary's reservation.
    srun: str = field(default_factory=lambda: shutil.which("srun") or "srun")
    canary_cmd: list[str] = field(default_factory=lambda: shlex.split(
        os.environ.get("TG_SLURM_CANARY_CMD", "")) or list(LOCAL_CANARY))
    canary_timeout_s: float = 300.0
    reservation_prefix: str = "tg-canary-"
    #: seconds a requeue waits for the job to be PENDING to release Slurm's hold on it (its
    #: other nodes end their part within ``KillWait``, 30 s by default)
    release_wait_s: float = 45.0

    def __post_init__(self) -> None:
        if self.requeue not in ("auto", "always", "never"):
            raise ValueError(f"TG_SLURM_REQUEUE={self.requeue!r}: use auto, always or never")


class SlurmController(NodeController):
    """Drain, requeue and cancel for the training job's Slurm id (see the module docstring)."""

    name = "slurm"
    cancels_jobs = True

    def __init__(self, state=None, config: SlurmConfig | None = None):
        super().__init__(state)
        self.config = config or SlurmConfig()

    @property
    def requeues_jobs(self) -> bool:  # type: ignore[override]
        """Whether an exclusion below the job's minimum world requeues it (not ``never``)."""
        return self.config.requeue != "never"

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
            if not self._should_requeue(record, await self._excluded(record, node)):
                return ControllerResult(True, f"{said}; Slurm job {jid} goes on in place "
                                              f"(requeue={self.config.requeue})", done)
            lost = ((record.last_fault or {}).get("fault_class") in UNREACHABLE_FAULTS
                    if record is not None else False)
            # first: the run is over, so what its remains do meanwhile (the survivors' ranks
            # and launchers ended by Slurm) decides nothing; the requeued launchers' new run
            # sets it running again (StateStore.begin_run)
            await self._mark(job, "requeued")
            ok, detail = await self._requeue_once(job, record, jid, node, reason, lost,
                                                   done)
            if not ok:
                await self._mark(job, "running")
            return ControllerResult(ok, f"{said}; {detail}", done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)

    async def _mark(self, job: str, status: str) -> None:
        if self.state is not None:
            try:
                await self.state.end_run(job, status)
            except Exception:  # noqa: BLE001 - bookkeeping: the requeue itself goes on
                pass

    def _should_requeue(self, record: Any, out: set[str] | frozenset[str] = frozenset()
                        ) -> bool:
        """``auto``: the job cannot go on in place — its record says it stopped or failed,
        the world it is left with is below its minimum, or every member's node is ``out``
        (excluded: a decision that leaves no world keeps the record's members as they were)."""
        if self.config.requeue != "auto":
            return self.config.requeue == "always"
        if record is None:
            return False
        nodes = {m.get("node") for m in record.members or []}
        return record.status in ("stopped", "failed") or bool(nodes and nodes <= set(out)) or (
            0 < record.world_size < record.min_world_size)

    async def _excluded(self, record: Any, node: str) -> set[str]:
        """``node`` and the job's member nodes trainguard holds excluded (``tg:node:<n>``)."""
        out = {node}
        if record is None or self.state is None:
            return out
        for n in {m.get("node") for m in record.members or []} - out:
            try:
                if (await self.state.node(n)).get("status") == "excluded":
                    out.add(n)
            except Exception:  # noqa: BLE001 - unreadable: counted in service
                pass
        return out

    async def _requeue_once(self, job: str, record: Any, jid: str, node: str, reason: str,
                            lost: bool, done: list[Any]) -> tuple[bool, str]:
        """One requeue per generation of the trainguard job: before requeueing, the claim
        ``<job>:g<generation>:slurm-requeue:<id>`` records Slurm's ``Restarts`` count of the
        job; a controller restarted after the requeue finds the claim and a higher count (the
        requeue happened: Slurm counts it at once, while the job may still be COMPLETING) and
        does not requeue again — it only sets ``ExcNodeList`` when the first try did not get
        that far. A claim with the same count: the first try died before requeueing."""
        if self.state is None:
            return await self._requeue(jid, node, reason, lost, done)
        gen = record.generation if record is not None else "?"
        seen = await self._show("job", jid)
        restarts = seen.get("Restarts", "")
        held = await self.state.claim(f"{job}:g{gen}:slurm-requeue:{jid}", f"restarts={restarts}")
        before = (held or "").partition("=")[2]
        if not (before.isdigit() and restarts.isdigit() and int(restarts) > int(before)):
            return await self._requeue(jid, node, reason, lost, done)
        cmd = slurm_requeue_command(jid, self.config.scontrol)
        done.append({"skipped": cmd, "why": f"requeued already for generation {gen} (Restarts "
                                            f"{before} -> {restarts})"})
        exc = [n for n in seen.get("ExcNodeList", "(null)").split(",") if n and n != "(null)"]
        if node in exc:
            return True, f"Slurm job {jid} already requeued for generation {gen} without {node}"
        upd = [self.config.scontrol, "update", f"jobid={jid}",
               f"excnodelist={','.join([*exc, node])}"]
        rc, out = await self._run(upd)
        done.append(upd)
        return True, (f"Slurm job {jid} already requeued for generation {gen}; "
                      + (f"now without {node}" if rc == 0 else f"excnodelist not set: {out[:200]}"))

    async def _requeue(self, jid: str, node: str, reason: str, lost: bool,
                       done: list[Any]) -> tuple[bool, str]:
        job = await self._show("job", jid)
        st = job.get("JobState", "")
        if st in ENDED_STATES:
            done.append({"skipped": slurm_requeue_command(jid, self.config.scontrol),
                         "why": f"job {jid} ended ({st})"})
            return False, f"Slurm job {jid} ended ({st}): nothing to requeue; submit it again"
        node_state = (await self._show("node", node)).get("State", "") if lost else ""
        plan = requeue_commands(jid, node, job, node_state, reason, lost,
                                scontrol=self.config.scontrol)
        requeue = slurm_requeue_command(jid, self.config.scontrol)
        said = [f"Slurm job {jid} already requeued ({st})"
                if next(w for c, w in plan if c == requeue) else
                f"requeued Slurm job {jid} without {node}"]
        for cmd, skip in plan:
            if "starttime=now" in cmd and not skip:
                said.append(await self._release(jid, cmd, done))
                continue
            if any(c.startswith("excnodelist=") for c in cmd) and not skip:
                said.append(await self._exclude_job(jid, node, cmd, done))
                continue
            if skip:
                done.append({"skipped": cmd, "why": skip})
                continue
            if cmd == requeue and lost:
                # a job with no node left but the one just set DOWN fails NODE_FAIL there, and
                # Slurm requeues a --requeue job itself (seen on the harness: a one-node job)
                now_st = (await self._show("job", jid)).get("JobState", "")
                if now_st in REQUEUED_STATES:
                    done.append({"skipped": cmd, "why": f"Slurm requeued job {jid} itself when "
                                                        f"{node} went DOWN ({now_st})"})
                    said[0] = f"Slurm requeued job {jid} itself ({node} DOWN)"
                    continue
            rc, out = await self._run(cmd)
            done.append(cmd)
            if rc != 0 and cmd == requeue and "pending execution" in out:
                said[0] = f"Slurm requeued job {jid} itself ({out[:100]})"
                continue  # the same, seen a moment later: the exclusion and release go on
            if rc != 0 and cmd == requeue:
                return False, f"{' '.join(cmd)} exited {rc}: {out[:300]}"
            if rc != 0:  # said, and the requeue goes on
                said.append(f"{' '.join(cmd[2:])} refused: {out[:150]}")
            elif "state=down" in cmd:
                said.append(f"{node} set DOWN (unreachable)")
        return True, "; ".join(said)

    async def _exclude_job(self, jid: str, node: str, cmd: list[str], done: list[Any]) -> str:
        """Set requeued job ``jid``'s ``ExcNodeList`` (``cmd``) so that it holds ``node``, and
        read it back; what it did. Slurm 22.05 takes the update only from a pending job
        (``ESLURM_JOB_NOT_PENDING``): a job already COMPLETING when it was requeued (its node
        set DOWN first) stays non-pending until every node has finished it (seen on the
        harness: the job requeued with ``ExcNodeList=(null)``). So it waits, up to
        ``release_wait_s``, for the job to leave COMPLETING, then updates, and tries again
        until ``scontrol show job`` lists the node. The job is held (``EligibleTime``) until
        ``_release``, after this, so no allocation starts without the exclusion."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.release_wait_s
        out, tries = "", 0
        await self._completed(jid, deadline)
        while True:
            tries += 1
            rc, out = await self._run(cmd)
            done.append(cmd)
            job = await self._show("job", jid)
            if rc == 0 and node in job.get("ExcNodeList", "(null)").split(","):
                return f"excluding {node}" + (f" (taken at try {tries})" if tries > 1 else "")
            if job.get("JobState", "") in ENDED_STATES or loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        return f"{' '.join(cmd[2:])} refused after {tries} tries: {out[:150]}"

    async def _completed(self, jid: str, deadline: float) -> str:
        """Job ``jid``'s state once it is no longer COMPLETING, or at ``deadline`` (event-loop
        time), polled every 50 ms (a requeued job is held from the moment it leaves
        COMPLETING)."""
        loop = asyncio.get_running_loop()
        while True:
            st = (await self._show("job", jid)).get("JobState", "")
            if st != "COMPLETING" or loop.time() > deadline:
                return st
            await asyncio.sleep(0.05)

    async def _release(self, jid: str, cmd: list[str], done: list[Any]) -> str:
        """Release Slurm's hold on requeued job ``jid`` (``cmd``: ``starttime=now``) once it is
        PENDING, waiting up to ``release_wait_s`` for it to leave COMPLETING; what it did."""
        st = await self._completed(jid, asyncio.get_running_loop().time()
                                   + self.config.release_wait_s)
        if st != "PENDING":
            done.append({"skipped": cmd, "why": f"job {jid} is {st}"})
            return f"hold not released (job {st})"
        rc, out = await self._run(cmd)
        done.append(cmd)
        return "eligible now" if rc == 0 else f"hold not released: {out[:150]}"

    async def _squeue_state(self, jid: str) -> str:
        """The job's state as ``squeue`` gives it now (``GONE``: Slurm no longer knows it);
        raises OSError / asyncio.TimeoutError."""
        rc, out = await self._run(slurm_squeue_command(jid, self.config.squeue))
        return parse_squeue_state(rc, out)

    async def stop(self, job: str, reason: str, generation: int | None = None
                   ) -> ControllerResult:
        """Cancel the training job's Slurm job for a stop decision of ``generation`` (None:
        any), recording ``reason`` on it (``AdminComment``, else ``Comment``: shown by
        ``scontrol show job``); see ``stop_plan`` for when nothing is done."""
        jid, record = await self._job_id(job)
        if not jid:
            return ControllerResult(True, f"no Slurm job id in the job record of {job!r} "
                                          f"(launched outside Slurm): nothing to cancel")
        cmds = slurm_stop_commands(jid, reason, self.config.scontrol, self.config.scancel)
        missing = self._missing()
        if missing:
            return ControllerResult(False, f"{missing}: cancel Slurm job {jid} by hand "
                                           f"({' '.join(cmds[-1])})", cmds)
        in_force = record.generation if record is not None else None
        done: list[Any] = []
        try:
            plan, why = stop_plan(await self._squeue_state(jid), in_force, generation, jid)
            if plan == "skip":
                return ControllerResult(True, why, [{"skipped": c, "why": why} for c in cmds])
            comment, cancel = cmds[0], cmds[-1]
            shown = await self._show("job", jid)  # a first try that died after the comment
            if slurm_reason(reason) in (shown.get("AdminComment"), shown.get("Comment")):
                rc, out = 0, ""
                done.append({"skipped": comment, "why": "the reason is on the job already"})
            else:
                rc, out = await self._run(comment)
                done.append(comment)
            noted = rc == 0
            if not noted:  # AdminComment is for Slurm operators: the job's own Comment then
                user = [*comment[:-1], comment[-1].replace("admincomment=", "comment=", 1)]
                rc, out = await self._run(user)
                done.append(user)
                noted = rc == 0
            rc, out = await self._run(cancel)
            done.append(cancel)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)
        if rc != 0:
            if any(m in out for m in SCANCEL_ENDED):  # it ended between squeue and scancel
                return ControllerResult(True, f"Slurm job {jid} already ended ({out[:200]})",
                                        done)
            return ControllerResult(False, f"{' '.join(cancel)} exited {rc}: {out[:300]}", done)
        said = "" if noted else " (reason not recorded on the job: scontrol update refused)"
        return ControllerResult(True, f"cancelled Slurm job {jid}{said}: {reason}"[:300], done)

    # ---- readmission hooks (the policy and the reputation: NodeController.readmit) -----------
    def reservation(self, node: str) -> str:
        """The name of ``node``'s canary reservation."""
        return f"{self.config.reservation_prefix}{node}"

    async def _reserved(self, node: str) -> bool:
        rc, out = await self._run([self.config.scontrol, "show", "reservation", "-o",
                                   self.reservation(node)])
        return rc == 0 and out.startswith("ReservationName=")

    async def node_view(self, node: str) -> tuple[NodeView, str]:
        """``scontrol show node``: DRAIN with a ``trainguard:`` reason is ours (busy while
        jobs still run on it), any other DRAIN or DOWN is not; a node resumed inside its canary
        reservation is ``CANARY`` (an interrupted readmit). Raises OSError when slurmctld
        cannot be asked."""
        rc, out = await self._run([self.config.scontrol, "show", "node", "-o", node])
        if rc != 0:
            if "not found" in out or "Invalid node name" in out:
                return NodeView.UNKNOWN, out[:200]
            raise OSError(f"scontrol show node {node} exited {rc}: {out[:200]}")
        n = parse_scontrol(out)
        state, reason = n.get("State", ""), n.get("Reason", "")
        flags = state.split("+")
        words = f"State={state}" + (f" Reason={reason}" if reason else "")
        if "DRAIN" in flags:
            if not reason.startswith("trainguard:"):
                return NodeView.OTHER, words
            if flags[0] in ("ALLOCATED", "MIXED", "COMPLETING") or "COMPLETING" in flags:
                return NodeView.OURS_BUSY, words
            return NodeView.OURS, words
        if await self._reserved(node):
            return NodeView.CANARY, f"{words} in reservation {self.reservation(node)}"
        if flags[0] in ("DOWN", "FAIL", "FUTURE", "UNKNOWN"):
            return NodeView.OTHER, words
        return NodeView.IN_SERVICE, words

    async def _mutate(self, cmd: list[str], done: list[Any]) -> None:
        rc, out = await self._run(cmd)
        done.append(cmd)
        if rc != 0:
            raise OSError(f"{' '.join(cmd)} exited {rc}: {out[:200]}")

    def canary_argv(self, node: str) -> list[str]:
        """The ``srun`` of the canary on ``node`` inside its reservation."""
        minutes = max(1, int(self.config.canary_timeout_s // 60) + 1)
        return [self.config.srun, "-w", node, "-N1", "-n1",
                f"--reservation={self.reservation(node)}",
                "--immediate=60", f"--time={minutes}", "--job-name=trainguard-canary",
                *self.config.canary_cmd]

    async def canary(self, node: str) -> tuple[bool, str]:
        """Open the canary window (reservation, then resume; each only when not so already)
        and ``srun`` the canary program on ``node`` (see the module docstring)."""
        done: list[Any] = []
        try:
            if not await self._reserved(node):
                user = pwd.getpwuid(os.getuid()).pw_name
                await self._mutate([self.config.scontrol, "create", "reservation",
                                    f"reservationname={self.reservation(node)}", f"nodes={node}",
                                    "starttime=now", "duration=UNLIMITED", f"users={user}",
                                    "flags=maint,ignore_jobs"], done)
            if "DRAIN" in (await self._show("node", node)).get("State", ""):
                await self._mutate([self.config.scontrol, "update", f"nodename={node}",
                                    "state=resume"], done)
            ok, detail = await run_canary_command(self.canary_argv(node), node,
                                                  self.config.canary_timeout_s, launched=True)
        except (OSError, asyncio.TimeoutError) as exc:
            raise CanaryNotRun(f"Slurm: {exc or 'timed out'}") from exc
        return ok, f"srun on {node}: {detail}"

    async def return_to_service(self, node: str, why: str) -> ControllerResult:
        """Resume ``node`` (when still drained) and delete its canary reservation."""
        done: list[Any] = []
        try:
            if "DRAIN" in (await self._show("node", node)).get("State", ""):
                await self._mutate([self.config.scontrol, "update", f"nodename={node}",
                                    "state=resume"], done)
            if await self._reserved(node):
                await self._mutate([self.config.scontrol, "delete",
                                    f"reservationname={self.reservation(node)}"], done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)
        return ControllerResult(True, f"resumed {node}", done)

    async def keep_out(self, node: str, why: str) -> ControllerResult:
        """Drain ``node`` with ``why`` as its reason (a drained node's reason is replaced),
        then delete its canary reservation, in that order: no moment in service."""
        done: list[Any] = []
        try:
            await self._mutate(slurm_drain_command(node, why, self.config.scontrol), done)
            if await self._reserved(node):
                await self._mutate([self.config.scontrol, "delete",
                                    f"reservationname={self.reservation(node)}"], done)
        except (OSError, asyncio.TimeoutError) as exc:
            return ControllerResult(False, f"Slurm: {exc or 'timed out'}", done)
        if self.state is not None:
            await self.state.set_node(node, "excluded", why[:500])
        return ControllerResult(True, f"{node} drained: {slurm_reason(why)}", done)

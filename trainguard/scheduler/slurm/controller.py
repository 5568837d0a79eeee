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

Commands are argv lists (no shell); each is bounded by ``SlurmConfig.timeout_s``
(``runner.SlurmRunner``). An external failure is a ``ControllerResult`` with ``ok`` False and
what to do, never an exception. The requeue steps are ``requeue.SlurmRequeue``'s, the
readmission hooks ``readmission.SlurmReadmission``'s, the pure commands and plans
``commands``'.
"""
from __future__ import annotations

import asyncio
from typing import Any

from trainguard.core.reputation import NodeView
from trainguard.scheduler.base import ControllerResult, NodeController
from trainguard.scheduler.slurm.commands import (SCANCEL_ENDED, UNREACHABLE_FAULTS,
                                                 should_requeue, slurm_drain_command,
                                                 slurm_reason, slurm_requeue_command,
                                                 slurm_stop_commands, stop_plan)
from trainguard.scheduler.slurm.config import SlurmConfig
from trainguard.scheduler.slurm.readmission import SlurmReadmission
from trainguard.scheduler.slurm.requeue import SlurmRequeue
from trainguard.scheduler.slurm.runner import SlurmRunner


class SlurmController(NodeController):
    """Drain, requeue and cancel for the training job's Slurm id (see the module docstring)."""

    name = "slurm"
    cancels_jobs = True

    def __init__(self, state=None, config: SlurmConfig | None = None):
        super().__init__(state)
        self.config = config or SlurmConfig()

    @property
    def slurm(self) -> SlurmRunner:
        """Runs this controller's Slurm commands."""
        return SlurmRunner(self.config)

    @property
    def _requeue(self) -> SlurmRequeue:
        return SlurmRequeue(self.slurm, self.state)

    @property
    def _readmission(self) -> SlurmReadmission:
        return SlurmReadmission(self.slurm, self.state)

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

    async def _job_id(self, job: str) -> tuple[str, Any]:
        record = None
        if self.state is not None:
            try:
                record = await self.state.job(job)
            except Exception:  # noqa: BLE001 - a record we cannot read: no id from it
                record = None
        jid = self.config.slurm_job_id or (record.slurm_job_id if record is not None else "")
        return str(jid), record

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        await self.record(node, job, reason)
        jid, record = await self._job_id(job)
        missing = self.slurm.missing()
        if missing:
            return ControllerResult(False, f"{missing}: run the remediator on a Slurm "
                                           f"login/controller node or drain {node} by hand",
                                    self.commands(node, reason, jid))
        done: list[Any] = []
        try:
            state = (await self.slurm.show("node", node)).get("State", "")
            drain = slurm_drain_command(node, reason, self.config.scontrol)
            if "DRAIN" in state:
                done.append({"skipped": drain, "why": f"already drained ({state})"})
                said = f"{node} already drained"
            else:
                rc, out = await self.slurm.run(drain)
                done.append(drain)
                if rc != 0:
                    return ControllerResult(False, f"{' '.join(drain)} exited {rc}: {out[:300]}",
                                            done)
                said = f"drained {node}"
            if not jid:
                return ControllerResult(True, f"{said}; no Slurm job id in the job record of "
                                              f"{job!r} (launched outside Slurm): nothing to "
                                              f"requeue", done)
            gone = await self._requeue.excluded(record, node)
            if not should_requeue(self.config.requeue, record, gone):
                return ControllerResult(True, f"{said}; Slurm job {jid} goes on in place "
                                              f"(requeue={self.config.requeue})", done)
            lost = ((record.last_fault or {}).get("fault_class") in UNREACHABLE_FAULTS
                    if record is not None else False)
            # first: the run is over, so what its remains do meanwhile (the survivors' ranks
            # and launchers ended by Slurm) decides nothing; the requeued launchers' new run
            # sets it running again (StateStore.begin_run)
            await self._mark(job, "requeued")
            ok, detail = await self._requeue.once(job, record, jid, node, reason, lost, done)
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
        missing = self.slurm.missing()
        if missing:
            return ControllerResult(False, f"{missing}: cancel Slurm job {jid} by hand "
                                           f"({' '.join(cmds[-1])})", cmds)
        in_force = record.generation if record is not None else None
        done: list[Any] = []
        try:
            plan, why = stop_plan(await self.slurm.squeue_state(jid), in_force, generation, jid)
            if plan == "skip":
                return ControllerResult(True, why, [{"skipped": c, "why": why} for c in cmds])
            comment, cancel = cmds[0], cmds[-1]
            shown = await self.slurm.show("job", jid)  # a first try that died after the comment
            if slurm_reason(reason) in (shown.get("AdminComment"), shown.get("Comment")):
                rc, out = 0, ""
                done.append({"skipped": comment, "why": "the reason is on the job already"})
            else:
                rc, out = await self.slurm.run(comment)
                done.append(comment)
            noted = rc == 0
            if not noted:  # AdminComment is for Slurm operators: the job's own Comment then
                user = [*comment[:-1], comment[-1].replace("admincomment=", "comment=", 1)]
                rc, out = await self.slurm.run(user)
                done.append(user)
                noted = rc == 0
            rc, out = await self.slurm.run(cancel)
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
    async def node_view(self, node: str) -> tuple[NodeView, str]:
        """``SlurmReadmission.node_view``; raises OSError when slurmctld cannot be asked."""
        return await self._readmission.node_view(node)

    async def canary(self, node: str) -> tuple[bool, str]:
        """``SlurmReadmission.canary``; raises ``CanaryNotRun`` when Slurm could not run it."""
        return await self._readmission.canary(node)

    async def return_to_service(self, node: str, why: str) -> ControllerResult:
        return await self._readmission.return_to_service(node, why)

    async def keep_out(self, node: str, why: str) -> ControllerResult:
        return await self._readmission.keep_out(node, why)

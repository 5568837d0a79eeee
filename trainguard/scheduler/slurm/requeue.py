"""A requeue of the training job's Slurm job after an exclusion, once per generation of the
trainguard job: set an unreachable node DOWN, ``scontrol requeue``, the node in the job's
``ExcNodeList``, and Slurm's hold released once the job is PENDING (see
``trainguard.scheduler.slurm.controller`` for why each step; ``requeue_commands`` plans them).
"""
from __future__ import annotations

import asyncio
from typing import Any

from trainguard.scheduler.slurm.commands import (ENDED_STATES, REQUEUED_STATES, requeue_commands,
                                                 slurm_requeue_command)
from trainguard.scheduler.slurm.config import SlurmConfig
from trainguard.scheduler.slurm.runner import SlurmRunner


class SlurmRequeue:
    """The requeue steps of ``SlurmController.exclude``: ``slurm`` runs the commands; ``state``
    (a ``StateStore``, or None) holds the claim that makes a requeue happen once and the node
    statuses. Each step appends what it ran (or skipped, with why) to ``done`` and says what
    it did; a command that cannot run raises OSError / asyncio.TimeoutError."""

    def __init__(self, slurm: SlurmRunner, state: Any = None):
        self.slurm = slurm
        self.state = state

    @property
    def config(self) -> SlurmConfig:
        return self.slurm.config

    async def excluded(self, record: Any, node: str) -> set[str]:
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

    async def once(self, job: str, record: Any, jid: str, node: str, reason: str,
                   lost: bool, done: list[Any]) -> tuple[bool, str]:
        """One requeue per generation of the trainguard job: before requeueing, the claim
        ``<job>:g<generation>:slurm-requeue:<id>`` records Slurm's ``Restarts`` count of the
        job; a controller restarted after the requeue finds the claim and a higher count (the
        requeue happened: Slurm counts it at once, while the job may still be COMPLETING) and
        does not requeue again — it only sets ``ExcNodeList`` when the first try did not get
        that far. A claim with the same count: the first try died before requeueing."""
        if self.state is None:
            return await self.requeue(jid, node, reason, lost, done)
        gen = record.generation if record is not None else "?"
        seen = await self.slurm.show("job", jid)
        restarts = seen.get("Restarts", "")
        held = await self.state.claim(f"{job}:g{gen}:slurm-requeue:{jid}", f"restarts={restarts}")
        before = (held or "").partition("=")[2]
        if not (before.isdigit() and restarts.isdigit() and int(restarts) > int(before)):
            return await self.requeue(jid, node, reason, lost, done)
        cmd = slurm_requeue_command(jid, self.config.scontrol)
        done.append({"skipped": cmd, "why": f"requeued already for generation {gen} (Restarts "
                                            f"{before} -> {restarts})"})
        exc = [n for n in seen.get("ExcNodeList", "(null)").split(",") if n and n != "(null)"]
        if node in exc:
            return True, f"Slurm job {jid} already requeued for generation {gen} without {node}"
        upd = [self.config.scontrol, "update", f"jobid={jid}",
               f"excnodelist={','.join([*exc, node])}"]
        rc, out = await self.slurm.run(upd)
        done.append(upd)
        return True, (f"Slurm job {jid} already requeued for generation {gen}; "
                      + (f"now without {node}" if rc == 0 else f"excnodelist not set: {out[:200]}"))

    async def requeue(self, jid: str, node: str, reason: str, lost: bool,
                      done: list[Any]) -> tuple[bool, str]:
        """Requeue Slurm job ``jid`` without ``node`` (``requeue_commands``); False when the
        job ended or the requeue was refused."""
        job = await self.slurm.show("job", jid)
        st = job.get("JobState", "")
        if st in ENDED_STATES:
            done.append({"skipped": slurm_requeue_command(jid, self.config.scontrol),
                         "why": f"job {jid} ended ({st})"})
            return False, f"Slurm job {jid} ended ({st}): nothing to requeue; submit it again"
        node_state = (await self.slurm.show("node", node)).get("State", "") if lost else ""
        plan = requeue_commands(jid, node, job, node_state, reason, lost,
                                scontrol=self.config.scontrol)
        requeue = slurm_requeue_command(jid, self.config.scontrol)
        said = [f"Slurm job {jid} already requeued ({st})"
                if next(w for c, w in plan if c == requeue) else
                f"requeued Slurm job {jid} without {node}"]
        for cmd, skip in plan:
            if "starttime=now" in cmd and not skip:
                said.append(await self.release(jid, cmd, done))
                continue
            if any(c.startswith("excnodelist=") for c in cmd) and not skip:
                said.append(await self.exclude_job(jid, node, cmd, done))
                continue
            if skip:
                done.append({"skipped": cmd, "why": skip})
                continue
            if cmd == requeue and lost:
                # a job with no node left but the one just set DOWN fails NODE_FAIL there, and
                # Slurm requeues a --requeue job itself (seen on the harness: a one-node job)
                now_st = (await self.slurm.show("job", jid)).get("JobState", "")
                if now_st in REQUEUED_STATES:
                    done.append({"skipped": cmd, "why": f"Slurm requeued job {jid} itself when "
                                                        f"{node} went DOWN ({now_st})"})
                    said[0] = f"Slurm requeued job {jid} itself ({node} DOWN)"
                    continue
            rc, out = await self.slurm.run(cmd)
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

    async def exclude_job(self, jid: str, node: str, cmd: list[str], done: list[Any]) -> str:
        """Set requeued job ``jid``'s ``ExcNodeList`` (``cmd``) so that it holds ``node``, and
        read it back; what it did. Slurm 22.05 takes the update only from a pending job
        (``ESLURM_JOB_NOT_PENDING``): a job already COMPLETING when it was requeued (its node
        set DOWN first) stays non-pending until every node has finished it (seen on the
        harness: the job requeued with ``ExcNodeList=(null)``). So it waits, up to
        ``release_wait_s``, for the job to leave COMPLETING, then updates, and tries again
        until ``scontrol show job`` lists the node. The job is held (``EligibleTime``) until
        ``release``, after this, so no allocation starts without the exclusion."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.release_wait_s
        out, tries = "", 0
        await self.completed(jid, deadline)
        while True:
            tries += 1
            rc, out = await self.slurm.run(cmd)
            done.append(cmd)
            job = await self.slurm.show("job", jid)
            if rc == 0 and node in job.get("ExcNodeList", "(null)").split(","):
                return f"excluding {node}" + (f" (taken at try {tries})" if tries > 1 else "")
            if job.get("JobState", "") in ENDED_STATES or loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        return f"{' '.join(cmd[2:])} refused after {tries} tries: {out[:150]}"

    async def completed(self, jid: str, deadline: float) -> str:
        """Job ``jid``'s state once it is no longer COMPLETING, or at ``deadline`` (event-loop
        time), polled every 50 ms (a requeued job is held from the moment it leaves
        COMPLETING)."""
        loop = asyncio.get_running_loop()
        while True:
            st = (await self.slurm.show("job", jid)).get("JobState", "")
            if st != "COMPLETING" or loop.time() > deadline:
                return st
            await asyncio.sleep(0.05)

    async def release(self, jid: str, cmd: list[str], done: list[Any]) -> str:
        """Release Slurm's hold on requeued job ``jid`` (``cmd``: ``starttime=now``) once it is
        PENDING, waiting up to ``release_wait_s`` for it to leave COMPLETING; what it did."""
        st = await self.completed(jid, asyncio.get_running_loop().time()
                                   + self.config.release_wait_s)
        if st != "PENDING":
            done.append({"skipped": cmd, "why": f"job {jid} is {st}"})
            return f"hold not released (job {st})"
        rc, out = await self.slurm.run(cmd)
        done.append(cmd)
        return "eligible now" if rc == 0 else f"hold not released: {out[:150]}"

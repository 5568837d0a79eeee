"""The one interface of node controllers (local, Slurm, Kubernetes) and what they return.

A controller is what the remediator calls to take a node out of service, to stop a job through
the scheduler where the scheduler holds the job (``cancels_jobs``: Slurm) and, where the
scheduler recreates a job's pods (``restarts_pods``: Kubernetes), to replace the one pod whose
launcher was lost (``restart_pod``). ``exclude``, ``stop`` and ``restart_pod`` are coroutines
returning a ``ControllerResult``; they never raise for an external failure (``ok`` False,
``detail`` says what to do), and they re-read the scheduler's state before acting, so that doing
one twice is harmless (the detail says ``already …``).

Reputation and readmission are the base class's, the same for every scheduler: ``record`` (which
every ``exclude`` calls) counts the offence against the node's reputation in the state store,
once per job generation; ``readmit(node)`` reads the scheduler's view of the node
(``node_view``) and its reputation, asks the pure policy (``trainguard.core.reputation.plan``) and
carries out its answer through three scheduler hooks: ``canary`` (run the health canary on the
node), ``return_to_service`` and ``keep_out`` (the evidence in the scheduler's reason).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from trainguard.core.reputation import (Canary, NodeView, ReputationConfig, evidence,
                                   offence_weight, plan)
from trainguard.schemas.reputation import NodeReputation

__all__ = ["ControllerResult", "NodeController", "CanaryFn", "CanaryNotRun", "LOCAL_CANARY"]

#: A canary: ``await canary(node) -> (passed, one-line detail)``; it raises ``CanaryNotRun``
#: when the canary program could not be started on the node.
CanaryFn = Callable[[str], Awaitable[tuple[bool, str]]]


#: The first line the canary program (``trainguard.agents.canary``) prints, before any check: it runs
#: on the node. A scheduler's failure to start it prints no such line (``run_canary_command``).
CANARY_STARTED = "canary started"


class CanaryNotRun(Exception):
    """The canary program never ran on the node (the scheduler refused or could not be
    reached): no verdict on the node, so no offence; the node stays out of service."""


#: The health canary program (``trainguard.agents.canary``) as run on a node.
LOCAL_CANARY = [sys.executable, "-m", "trainguard.agents.canary", "--json"]


@dataclass
class ControllerResult:
    """``ok``; ``detail`` (one line for the action result and the audit trail); ``commands``:
    the commands or requests issued, and ``{"skipped": …, "why": …}`` for those already
    satisfied."""

    ok: bool
    detail: str = ""
    commands: list[Any] = field(default_factory=list)


class NodeController:
    """Base: ``name`` identifies it in ``action.result.executor`` (``controller:<name>``);
    ``state`` is the ``trainguard.clients.store.StateStore`` (or None) where exclusions are recorded and
    job records are read."""

    name = "base"
    #: Whether ``restart_pod`` can replace a job's pod on a node (its scheduler recreates it).
    restarts_pods = False
    #: Whether ``stop`` ends the job in its scheduler (Slurm: ``scancel``); the remediator
    #: calls ``stop`` for an executed stop decision only then.
    cancels_jobs = False
    #: Whether ``exclude`` requeues the job in its scheduler without the node when the world it
    #: leaves is below the job's ``min_world_size`` (Slurm); the policy then excludes instead
    #: of stopping the job.
    requeues_jobs = False

    def __init__(self, state: Any = None, reputation: ReputationConfig | None = None):
        self.state = state
        self.reputation = reputation or ReputationConfig.from_env()

    async def record(self, node: str, job: str, reason: str) -> None:
        """``tg:node:<node>`` status ``excluded`` with ``<job>: <reason>``, and one offence
        against ``node``'s reputation, keyed by the job's generation in force (an exclusion
        carried out again for it counts once)."""
        if self.state is None:
            return
        await self.state.set_node(node, "excluded", f"{job}: {reason}"[:500])
        try:
            gen = (await self.state.job(job)).generation
        except Exception:  # noqa: BLE001 - an unreadable record: counted under the job alone
            gen = "?"
        now = time.time_ns()
        rep = await self.state.reputation(node)
        weight, why = offence_weight(rep, now, self.reputation)
        await self.state.add_offence(node, f"{job}:g{gen}", weight, self.reputation.half_life_s,
                                     evidence(job, reason, why=why), "drained",
                                     f"{why} by {job}: {reason}", now)

    # ---- readmission: one implementation, scheduler hooks below -------------------------------
    #: Seconds a readmit holds its node's lock (``StateStore.readmit_lock``) at most: a readmit
    #: killed inside its canary frees the node for the next one after this.
    readmit_lock_s = 900.0

    async def readmit(self, node: str, canary: CanaryFn | None = None,
                      now_ns: int | None = None) -> ControllerResult:
        """Return ``node`` to service only when the policy says so (``trainguard.core.reputation``):
        a node trainguard took out, with no job left on it, whose score is below the threshold
        and whose canary (``canary``, default ``self.canary``) passes; it is then on
        probation. A failing canary is an offence and keeps the node out, the reason in the
        scheduler; a canary that could not run (``CanaryNotRun``) keeps it out with no
        offence; a repeat offender is kept out without a canary. One readmit of a node at a
        time: a second one, while the first holds the node's lock, does nothing and says so.
        ``ok`` is True when the node is in service at the end. Never raises for a scheduler
        failure."""
        if self.state is None:
            return await self._readmit(node, canary, now_ns)
        lock = self.state.readmit_lock(node, self.readmit_lock_s)
        try:
            got = await lock.acquire()
        except Exception as exc:  # noqa: BLE001 - no state store: no readmit
            return ControllerResult(False, f"{self.name}: cannot lock node {node}: {exc}")
        if not got:
            return ControllerResult(False, f"another readmit of {node} is under way (lock "
                                           f"{lock.name}): nothing done")
        try:
            return await self._readmit(node, canary, now_ns)
        finally:
            try:
                await lock.release()
            except Exception:  # noqa: BLE001 - expired (held past readmit_lock_s): nothing held
                pass

    async def _readmit(self, node: str, canary: CanaryFn | None,
                       now_ns: int | None) -> ControllerResult:
        now = now_ns or time.time_ns()
        cfg = self.reputation
        rep = await self.state.reputation(node) if self.state is not None else NodeReputation(node)
        try:
            view, sched = await self.node_view(node)
        except Exception as exc:  # noqa: BLE001 - nothing known: nothing done
            return ControllerResult(False, f"{self.name}: cannot read node {node}: {exc}")
        p = plan(view, rep, now, cfg, sched=sched)
        if p.action in ("none", "leave", "wait"):
            return ControllerResult(p.ok, f"{p.row}: {p.reason}")
        if p.action == "hold":
            res = await self.keep_out(node, p.reason)
            await self._set_rep(node, "held", p.reason)
            return ControllerResult(False, f"kept {node} out ({p.row}): {p.reason}"
                                           + ("" if res.ok else f"; {res.detail}"), res.commands)
        ran = True
        try:
            ok, detail = await (canary or self.canary)(node)
        except CanaryNotRun as exc:
            ok, detail, ran = False, str(exc), False
        except Exception as exc:  # noqa: BLE001 - a canary that raises has not passed
            ok, detail = False, f"canary raised {type(exc).__name__}: {exc}"
        result = Canary(bool(ok), " ".join(str(detail).split())[:400], ran)
        p = plan(view, rep, now, cfg, result, sched)
        shown = {"ok": result.ok, "detail": result.detail, "ts_ns": now}
        if p.action == "readmit":
            res = await self.return_to_service(node, p.reason)
            if res.ok:
                await self._set_rep(node, "probation", p.reason, now + int(cfg.probation_s * 1e9),
                                    shown)
                if self.state is not None:
                    await self.state.set_node(node, "healthy", f"readmitted: {p.reason}"[:500])
                return ControllerResult(True, f"{p.reason}; {res.detail}", res.commands)
            p = plan(view, rep, now, cfg, Canary(False, f"{result.detail}; but {res.detail}"),
                     sched)
        score = ""
        if p.action == "untested":
            await self._set_rep(node, "drained", p.reason, canary=shown)
        elif self.state is not None:
            _, s = await self.state.add_offence(
                node, f"canary:{now}", cfg.canary_failure_weight, cfg.half_life_s,
                evidence("canary", p.reason), "drained", p.reason, now)
            score = f" (score {s:.2f})"
            await self._set_rep(node, "drained", p.reason + score, canary=shown)
        res = await self.keep_out(node, p.reason + score)
        return ControllerResult(False, f"kept {node} out: {p.reason}{score}"
                                       + ("" if res.ok else f"; {res.detail}"), res.commands)

    async def _set_rep(self, node: str, status: str, detail: str, until_ns: int | None = None,
                       canary: dict[str, Any] | None = None) -> None:
        if self.state is not None:
            await self.state.set_probation(node, status, detail, until_ns, canary)

    async def node_view(self, node: str) -> tuple[NodeView, str]:
        """The scheduler's state of ``node`` now and its words for it. Default (no
        scheduler): the state store's ``tg:node:<node>`` — ``excluded`` is trainguard's."""
        st = (await self.state.node(node)) if self.state is not None else {}
        if st.get("status") == "excluded":
            return NodeView.OURS, f"excluded: {st.get('reason', '')}"[:200]
        return NodeView.IN_SERVICE, st.get("status") or "no record"

    async def canary(self, node: str) -> tuple[bool, str]:
        """The health canary on ``node``; default: the canary program (``LOCAL_CANARY``) here,
        for a controller whose nodes are this machine (local stack)."""
        return await run_canary_command(LOCAL_CANARY, node, 300.0)

    async def return_to_service(self, node: str, why: str) -> ControllerResult:
        """Give ``node`` back to the scheduler (its canary passed: ``why``)."""
        return ControllerResult(True, f"{node} marked healthy in the state store")

    async def keep_out(self, node: str, why: str) -> ControllerResult:
        """Keep ``node`` out of service with ``why`` as the scheduler's reason."""
        if self.state is not None:
            await self.state.set_node(node, "excluded", why[:500])
        return ControllerResult(True, f"{node} kept excluded in the state store")

    async def exclude(self, node: str, job: str, reason: str) -> ControllerResult:
        """Take ``node`` out of service for ``job`` (``reason``: the decision's evidence)."""
        raise NotImplementedError

    async def stop(self, job: str, reason: str, generation: int | None = None
                   ) -> ControllerResult:
        """End ``job`` through the scheduler for a stop decision of ``generation`` (None: any;
        a later generation in force is a new run the stop was not about); by default there is
        nothing to end (the launchers stop their ranks on the stop decision themselves)."""
        return ControllerResult(True, f"{self.name}: nothing to cancel for {job!r} (its "
                                      f"launchers stop on the decision)")

    async def restart_pod(self, node: str, job: str, before_ns: int = 0) -> ControllerResult:
        """Replace ``job``'s pod on ``node`` (one created before ``before_ns``, Unix ns; 0: any)
        so that its scheduler recreates it; by default there are no pods to replace."""
        return ControllerResult(False, f"{self.name}: no pod to restart for {job!r} on "
                                       f"{node}: start its launcher there again")


async def run_canary_command(argv: list[str], node: str, timeout_s: float,
                             env: dict[str, str] | None = None,
                             launched: bool = False) -> tuple[bool, str]:
    """Run a canary ``argv`` (no shell; env ``TG_NODE`` = ``node``) within ``timeout_s``
    seconds: passed on exit status 0. The detail is the failed checks of the last JSON line
    the canary program printed (``trainguard.agents.canary --json``), else the end of its output.
    ``launched``: ``argv`` starts the canary through a scheduler (``srun``); a failure whose
    output lacks the canary's ``CANARY_STARTED`` line is the scheduler's, not the node's, and
    raises ``CanaryNotRun``. Raises OSError when ``argv[0]`` cannot be started."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env={**(env or os.environ), "TG_NODE": node}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"canary on {node} still running after {timeout_s:.0f} s: killed"
    text = out.decode(errors="replace")
    detail = f"exit {proc.returncode}: " + canary_summary(text)
    if launched and proc.returncode != 0 and CANARY_STARTED not in text:
        raise CanaryNotRun(f"{os.path.basename(argv[0])} did not start the canary: {detail}")
    return proc.returncode == 0, detail


def canary_summary(text: str) -> str:
    """One line from a canary's output: the ``summary`` of its last JSON line
    (``trainguard.agents.canary``), else the last 200 characters."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return str(json.loads(line).get("summary", line))[:300]
            except ValueError:
                continue
    return " ".join(text.split())[-200:] or "no output"

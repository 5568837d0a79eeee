"""The run loop of one node's launcher: a state enum, typed events, and the steps that answer them.

``RunLoop`` owns the lifecycle of this node's launch — its state (``LaunchState``), the
generation and world size it runs at, the observe-mode group attempt and torchrun's restart
count — and nothing else: the processes are a ``ProcessPool`` (``trainguard.launch.pool``), the
job's record in the state store is a ``JobLease`` (``trainguard.launch.lease``), and what a
decision means for this node's ranks is ``trainguard.core.recovery_plan.plan_node``. Every step runs on the
launcher's main thread (the children's PR_SET_PDEATHSIG is tied to the thread that forked them);
the other threads only post events. ``tests/test_launcher_loop.py`` drives the loop with a stub
pool, lease and bus: no processes, no servers.
"""
from __future__ import annotations

import logging
import queue
import sys
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, Protocol

from trainguard import schemas
from trainguard.schemas import subjects

from trainguard.core.recovery_plan import EXIT_STOPPED, LocalRank, plan_node

if TYPE_CHECKING:
    from trainguard.launch.config import LaunchConfig

__all__ = ["LaunchState", "RankExited", "DecisionReceived", "GroupRestarted", "RefillPool",
           "RenewSpares",
           "StopRequested", "LeaseRenewalFailed", "LeaseLost", "RunLoop"]

log = logging.getLogger("trainguard.launch.launcher")

#: Exit status of a launcher whose ranks failed and were not recovered (as torchrun's).
EXIT_FAILED = 1


class LaunchState(StrEnum):
    """Where one node's launch is, as torch.distributed.elastic's ``WorkerState``::

        INIT ──first ranks started──► HEALTHY ──a rank failed (action mode)──► UNHEALTHY
                                       ▲   │                                     │
                                       │   │ a group restart (observe mode,      │
                                       │   │ --max-restarts left, or another     │
                                       │   ▼ node restarted its group)           │
                                       └── RESTARTING ◄──── an executed decision ◄┘
                                                            that kills, starts or
                                                            re-ranks ranks here (from
                                                            HEALTHY too)

        HEALTHY ── every rank exited 0 or 3 ─────────────────► SUCCEEDED (the last 0: exit 0)
                                                             | STOPPED   (the last 3: exit 3)
        HEALTHY | UNHEALTHY ── stop decision (exit 3), this node excluded (exit 0),
                               stop request (SIGTERM 143, SIGINT 130) ──► STOPPING ──► STOPPED
        HEALTHY ── a rank failed, observe mode, restarts spent ──► STOPPING ──► FAILED (exit 1)
        any non-terminal ── lease lost (not renewed for LEASE_S: fenced; action mode only)
                                                                 ──► STOPPING ──► FAILED

    RESTARTING and STOPPING last one step of the loop (ranks killed, replacements started);
    SUCCEEDED, STOPPED and FAILED end it. A failed rank stays this node's until a decision
    replaces it, so UNHEALTHY ends only by a decision or a stop. The launcher shuts down
    (``Launcher.shutdown``) whatever the final state.
    """

    INIT = "init"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (LaunchState.SUCCEEDED, LaunchState.STOPPED, LaunchState.FAILED)


# ---- events (posted by the pool's, the lease's and the bus's threads, and signal handlers) ------

@dataclass(frozen=True)
class RankExited:
    """A rank's process ended. ``proc`` is the pool's handle (``local_rank``, ``rank``, ``pid``,
    ``generation``, ``returncode``: negative for a signal, ``expected_exit``: killed on
    purpose)."""

    proc: Any


@dataclass(frozen=True)
class DecisionReceived:
    """A remediator decision arrived on ``tg.job.<job>.decision``."""

    decision: schemas.Decision


@dataclass(frozen=True)
class GroupRestarted:
    """Observe mode on several nodes: the job record says another node restarted its worker
    group at ``attempt`` (``JobLease.sync_attempt``)."""

    attempt: int


@dataclass(frozen=True)
class RefillPool:
    """Top the warm spare pool up (``refill_delay_s`` after a spare became a rank)."""


@dataclass(frozen=True)
class RenewSpares:
    """The spares' template imported the job's modules (``trainguard.rank.job_imports``): replace
    the idle spares forked before it did."""


@dataclass(frozen=True)
class RunOnLoop:
    """Call ``fn()`` on the loop's thread, the launcher's main thread: a child started there
    outlives the thread that asked for it (``PR_SET_PDEATHSIG`` fires when the creating thread
    ends, not the process)."""

    fn: Callable[[], None]


@dataclass(frozen=True)
class StopRequested:
    """Stop this node's launch with exit ``status`` (SIGTERM: 143, SIGINT: 130)."""

    status: int


@dataclass(frozen=True)
class LeaseRenewalFailed:
    """A renewal of this launcher's lease failed (``error``); the lease lasts ``LEASE_S``, so
    one failure changes nothing but a warning."""

    error: str


@dataclass(frozen=True)
class LeaseLost:
    """No renewal of this launcher's lease was acknowledged for ``silent_s`` seconds (more than
    ``LEASE_S``): the lease has run out in the store, the node may be excluded and its ranks
    placed elsewhere (a network partition): in action mode this node fences itself — its ranks
    stop, and no decision reaches them any more. In observe mode it is said and training goes
    on (no decision is executed, so nothing can have moved the ranks); posted again after a
    renewal succeeded and the lease ran out once more."""

    silent_s: float


class Pool(Protocol):
    """What the loop needs of the processes (``trainguard.launch.pool.ProcessPool``)."""

    def ranks(self) -> list[LocalRank]: ...
    def current(self, local_rank: int) -> Any: ...
    def spawn(self, local_rank: int, rank: int, *, generation: int, world_size: int,
              attempt: int, restart_count: int, decision: schemas.Decision | None = None,
              refill: bool = True) -> Any: ...
    def fill(self) -> None: ...
    def renew_spares(self) -> None: ...
    def kill(self, local_rank: int) -> None: ...
    def kill_all(self) -> None: ...
    def stop_ranks(self, wait_s: float) -> None: ...
    def rerank(self, local_rank: int, rank: int) -> None: ...
    def forget(self, local_rank: int) -> None: ...
    def advance_generation(self, generation: int) -> None: ...


class Lease(Protocol):
    """What the loop needs of the job's record (``trainguard.launch.lease.JobLease``)."""

    def publish_attempt(self, generation: int, attempt: int) -> None: ...


class Bus(Protocol):
    def publish(self, subject: str, event: schemas.Event) -> None: ...


class RunLoop:
    """One node's launch after registration: ``start(generation)`` starts the first ranks,
    ``run()`` answers events until a terminal state and returns the exit status; ``handle``
    is one step (what tests call).

    Attributes: ``state`` and ``history`` (every state entered, in order), ``generation`` and
    ``world_size`` (of the newest executed decision), ``attempt`` (observe-mode group restarts:
    part of the rendezvous prefix), ``restart_count`` (``TORCHELASTIC_RESTART_COUNT``),
    ``exit_status`` (None until terminal).
    """

    def __init__(self, cfg: "LaunchConfig", pool: Pool, lease: Lease, bus: Bus,
                 events: "queue.Queue | None" = None):
        self.cfg, self.pool, self.lease, self.bus = cfg, pool, lease, bus
        self.events: queue.Queue = events if events is not None else queue.Queue()
        self.state = LaunchState.INIT
        self.history: list[LaunchState] = [LaunchState.INIT]
        self.generation = 0
        self.world_size = cfg.world_size
        self.attempt = 0
        self.restart_count = 0
        self.seen_keys: set[str] = set()
        self.exit_status: int | None = None
        self.fenced = False  # the lease was lost: write nothing more to the job's record
        #: Unix ns this run started: a decision stored before it is an earlier run's
        self.started_ns = time.time_ns()
        #: called (on the loop's thread) when a rank fails: an embedded stack whose services
        #: wait for the first steps starts them now (``Launcher.when_training``)
        self.on_fault: Callable[[], None] = lambda: None
        self._steps: dict[type, Callable[[Any], None]] = {
            RankExited: self._on_rank_exited, DecisionReceived: self._on_decision,
            GroupRestarted: self._on_group_restarted, RefillPool: lambda ev: self.pool.fill(),
            RenewSpares: self._on_renew_spares, RunOnLoop: lambda ev: ev.fn(),
            StopRequested: self._on_stop, LeaseRenewalFailed: self._on_lease_renewal_failed,
            LeaseLost: self._on_lease_lost}

    # ---- the loop -----------------------------------------------------------------------------
    def post(self, event: object) -> None:
        """Queue ``event`` for the loop (any thread)."""
        self.events.put(event)

    def start(self, generation: int) -> None:
        """INIT → HEALTHY: start this node's ranks at ``generation`` (none on a spare node),
        then the warm spares."""
        cfg = self.cfg
        self.generation = generation
        if not cfg.spare_node:
            for lr in range(cfg.nproc_per_node):
                self._spawn(lr, cfg.node_rank * cfg.nproc_per_node + lr, generation, refill=False)
        self.pool.fill()
        self._to(LaunchState.HEALTHY)

    def run(self) -> int:
        """Answer events until a terminal state; returns the exit status."""
        while not self.state.terminal:
            try:
                event = self.events.get(timeout=self.cfg.monitor_interval_s)
            except queue.Empty:
                continue
            self.handle(event)
        return self.exit_status or 0

    def handle(self, event: object) -> None:
        """One step: the answer to ``event``."""
        self._steps[type(event)](event)

    def _to(self, state: LaunchState) -> None:
        self.state = state
        self.history.append(state)

    def _say(self, text: str) -> None:
        print(f"trainguard launch [{self.cfg.node}]: {text}", file=sys.stderr, flush=True)

    def _spawn(self, local_rank: int, rank: int, generation: int,
               decision: schemas.Decision | None = None, refill: bool = True) -> None:
        self.pool.spawn(local_rank, rank, generation=generation, world_size=self.world_size,
                        attempt=self.attempt, restart_count=self.restart_count,
                        decision=decision, refill=refill)

    def _end(self, state: LaunchState, status: int, kill: bool = True) -> None:
        """Through STOPPING (ranks killed) to terminal ``state`` with exit ``status``."""
        if kill:
            self._to(LaunchState.STOPPING)
            self.pool.kill_all()
        self.exit_status = status
        self._to(state)

    # ---- steps --------------------------------------------------------------------------------
    def _on_rank_exited(self, ev: RankExited) -> None:
        cfg, proc = self.cfg, ev.proc
        rc = proc.returncode
        sig = -rc if rc is not None and rc < 0 else None
        code = rc if rc is not None and rc >= 0 else None
        self.bus.publish(subjects.job(cfg.job, "worker"), schemas.WorkerExited(
            job=cfg.job, node=cfg.node, rank=proc.rank, local_rank=proc.local_rank or 0,
            pid=proc.pid, generation=proc.generation, exit_code=code, signal=sig,
            expected=proc.expected_exit or rc in (0, EXIT_STOPPED)))
        if self.pool.current(proc.local_rank) is not proc or proc.expected_exit:
            return  # replaced or killed on purpose: its exit is not a new fault
        if rc in (0, EXIT_STOPPED):
            self.pool.forget(proc.local_rank)
            if not self.pool.ranks():
                self._end(LaunchState.SUCCEEDED if rc == 0 else LaunchState.STOPPED,
                          0 if rc == 0 else EXIT_STOPPED, kill=False)
            return
        self.on_fault()
        self._say(f"rank {proc.rank} (pid {proc.pid}) exited with "
                  f"{'signal ' + str(sig) if sig else 'status ' + str(code)}")
        if cfg.mode == "action":
            self._to(LaunchState.UNHEALTHY)  # the remediator decides; the decision comes here
            return
        # observe mode: what torchrun does — restart the worker group up to --max-restarts
        # times, then stop; the decisions trainguard would take are published meanwhile
        if self.attempt < cfg.max_restarts:
            self._say(f"rank {proc.rank} failed (exit={code} signal={sig}); observe mode: "
                      f"restarting the worker group (restart {self.attempt + 1} of "
                      f"--max-restarts {cfg.max_restarts})")
            self._restart_group()
            return
        print(f"trainguard launch: rank {proc.rank} failed (exit={code} signal={sig}); "
              f"observe mode: stopping this node", file=sys.stderr)
        self._end(LaunchState.FAILED, EXIT_FAILED)

    def _restart_group(self, attempt: int | None = None) -> None:
        """Observe mode's torchrun-style restart: stop every local rank, then start them all
        again (from warm spares) at ``attempt`` (default: the next one), a new store prefix.
        The attempt is written to the job record, where every other node's launcher sees it
        and restarts its group too (``GroupRestarted``), as torchrun's agents all restart."""
        self._to(LaunchState.RESTARTING)
        self.attempt = self.attempt + 1 if attempt is None else attempt
        if attempt is None and self.cfg.nnodes > 1:
            self.lease.publish_attempt(self.generation, self.attempt)
        self.pool.stop_ranks(wait_s=5.0)
        self.restart_count += 1
        for r in sorted(self.pool.ranks(), key=lambda r: r.local_rank):
            self._spawn(r.local_rank, r.rank, self.generation)
        self._to(LaunchState.HEALTHY)

    def _on_group_restarted(self, ev: GroupRestarted) -> None:
        if ev.attempt > self.attempt and self.pool.ranks():
            self._say(f"another node restarted the worker group (attempt {ev.attempt}): "
                      f"restarting this node's ranks too")
            self._restart_group(ev.attempt)

    def _on_decision(self, ev: DecisionReceived) -> None:
        d, cfg = ev.decision, self.cfg
        if d.idempotency_key in self.seen_keys:
            return
        self.seen_keys.add(d.idempotency_key)
        if d.ts and d.ts < self.started_ns and not (d.execute and d.generation > self.generation):
            return  # made before this run started (read back from the stream): nothing to do
        if d.execute and d.generation <= self.generation:
            # decided for a generation this run is already past: e.g. the hang of the ranks of
            # a launcher that was killed, decided while this launch waited out its lease
            self._say(f"ignoring a stale decision ({d.action}, which would start generation "
                      f"{d.generation}): this run is already at generation {self.generation}")
            return
        how = "(executing)" if d.execute else "(flag only)" if d.action == "none" else \
            "(observe mode: not executed)"
        self._say(f"decision {d.action} {how} generation {d.generation} ranks {d.ranks} "
                  f"nodes {d.nodes}: {d.reason}")
        if not d.execute:
            return
        if d.world_size:
            self.world_size = d.world_size
        self.generation = max(self.generation, d.generation)
        # every executed decision moves the whole job to its generation (in-process restarts
        # too): a later exit must be reported in the generation the rank was in
        self.pool.advance_generation(d.generation)
        plan = plan_node(d, cfg.node, self.pool.ranks(), cfg.min_world_size)
        if plan.empty:
            return  # nothing for this node
        for lr in plan.kill:
            self.pool.kill(lr)
        if plan.exit_status is not None:
            self._end(LaunchState.STOPPED, plan.exit_status)
        else:
            self._to(LaunchState.RESTARTING)
            for lr, rank in plan.rerank.items():
                self.pool.rerank(lr, rank)
            for lr in set(plan.kill) - {x for x, _ in plan.start}:
                self.pool.forget(lr)  # this node no longer runs that local rank
            if plan.start:
                self.restart_count += 1
            for lr, rank in plan.start:
                self._spawn(lr, rank, d.generation, decision=d)
            if plan.why:  # what this node did, which may differ from the decision's words
                self._say(f"generation {d.generation} on this node: {plan.why}")
            self._to(LaunchState.HEALTHY)
        self.bus.publish(subjects.job(cfg.job, "action"), schemas.ActionResult(
            job=cfg.job, node=cfg.node, decision_id=d.event_id,
            idempotency_key=d.idempotency_key, executor=f"launcher-{cfg.node}", action=d.action,
            ok=True, detail=plan.why, trace=d.child_trace()))

    def _on_renew_spares(self, ev: RenewSpares) -> None:
        if not self.state.terminal and self.state != LaunchState.STOPPING:
            self.pool.renew_spares()

    def _on_stop(self, ev: StopRequested) -> None:
        self._say(f"stopping (exit status {ev.status}): ranks and spares stopped, staging "
                  f"buffers freed; launch the job again under its name to resume")
        self._end(LaunchState.STOPPED, ev.status)

    def _on_lease_renewal_failed(self, ev: LeaseRenewalFailed) -> None:
        log.warning("cannot renew this launcher's lease on job %s: %s", self.cfg.job, ev.error)

    def _on_lease_lost(self, ev: LeaseLost) -> None:
        if self.state.terminal:
            return
        if self.cfg.mode != "action":
            # observe mode executes no decision, so nothing can have moved this node's ranks
            # elsewhere: fencing would protect nothing, and a control plane out of reach (a
            # stack restarted) must not stop a job that runs as it would under torchrun
            self._say(f"this launcher's lease was not renewed for {ev.silent_s:.1f} s (the state "
                      f"store is out of reach or refuses this launcher's credentials); observe "
                      f"mode executes no decision, so nothing moved this node's ranks: training "
                      f"goes on, and the lease is renewed once the store answers")
            return
        self._say(f"fenced: this launcher's lease was not renewed for {ev.silent_s:.1f} s (the "
                  f"state store is out of reach or refuses this launcher's credentials, e.g. "
                  f"revoked), so the job may have moved this node's ranks elsewhere: stopping "
                  f"every rank here (exit status {EXIT_FAILED})")
        self.fenced = True
        self._end(LaunchState.FAILED, EXIT_FAILED)

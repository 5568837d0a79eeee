"""One node launcher's hold on its job in the state store, and its heartbeat.

A ``JobLease`` registers the run (``register``: the job's settings, a new run or this node's part
of the current one, its ranks in ``members`` or itself in ``spare_nodes``; see docs/protocol.md,
"Job registration"), renews the launcher's lease every 2 s from the heartbeat thread (which also
publishes the launcher's node heartbeat, role launcher, on ``tg.node.<node>.launcher.<job>``:
a subject of its job's, which a job's own NATS user may publish, unlike the node agent's
``tg.node.<node>.heartbeat``), writes and reads the observe-mode group attempt
(``group_attempt``), records how the run ended here, and ends the lease. Everything talks to the
store on the bus client's event loop, through one connection; what the run loop must know comes
back as events (``GroupRestarted``, ``LeaseRenewalFailed``, and ``LeaseLost`` when no renewal
was acknowledged for ``LEASE_S``: the node is fenced).
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from redis.exceptions import RedisError

from trainguard import schemas
from trainguard.schemas import JobSettings, subjects

from trainguard.security.credentials import redact
from trainguard.launch.loop import GroupRestarted, LeaseLost, LeaseRenewalFailed
from trainguard.clients.store import StateStore
from trainguard.clients.store_runs import LauncherConflict, RankConflict

if TYPE_CHECKING:
    from trainguard.launch.config import LaunchConfig

__all__ = ["JobLease", "run_id"]


def run_id(env: dict[str, str] | None = None) -> str:
    """The scheduler's name of the run this launcher belongs to: under Slurm
    ``<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>`` (a requeued job keeps its id and counts its
    restarts; ``SLURM_RESTART_COUNT`` is unset before the first), else "" (runs are told apart by
    the launchers' leases alone). See ``StateStore.begin_run``."""
    env = os.environ if env is None else env
    jid = env.get("SLURM_JOB_ID", "")
    return f"{jid}.{env.get('SLURM_RESTART_COUNT') or 0}" if jid else ""


class JobLease:
    """This node's launcher's part of the job record. ``post`` queues an event for the run loop.

    Raises ``SystemExit`` from ``register`` with what to do when the store does not answer or a
    live launcher of this job already runs on this node (``LauncherConflict``)."""

    #: Seconds a launcher's lease on its job's run lasts without renewal (renewed every 2 s):
    #: a launch more than this after the last launcher of a run died is a new run.
    LEASE_S = 10.0
    #: Seconds between renewals (and, in observe mode on several nodes, group-attempt reads).
    RENEW_S = 2.0

    def __init__(self, cfg: "LaunchConfig", bus: Any, post: Callable[[object], None]):
        self.cfg, self.bus, self.post = cfg, bus, post
        self._st: StateStore | None = None  # the lease's connection, on the bus thread
        self._stop = threading.Event()
        self.renewed_at = time.monotonic()  # the last lease write the store acknowledged
        self._lost = False

    def _store(self) -> StateStore:
        """The launcher's one state-store connection; used on the bus thread only."""
        if self._st is None:
            self._st = StateStore(self.cfg.redis_url)
        return self._st

    def register(self) -> int:
        """Register the job's settings and this node's part of its run; returns the run's
        generation."""
        cfg = self.cfg
        settings = JobSettings(mode=cfg.mode, world_size=cfg.world_size,
                               min_world_size=cfg.min_world_size, retry_budget=cfg.retry_budget,
                               nnodes=cfg.nnodes, nproc_per_node=cfg.nproc_per_node,
                               hang_timeout_s=cfg.hang_timeout_s,
                               startup_timeout_s=cfg.startup_timeout_s,
                               node_timeout_s=cfg.node_timeout_s,
                               slurm_job_id=os.environ.get("SLURM_JOB_ID", ""))
        generation = 0

        async def _reg() -> None:
            nonlocal generation
            st = self._store()
            await st.register_settings(cfg.job, settings)
            # a launcher of this node that died keeps its lease for up to LEASE_S: wait that
            # out; a live one renews it (its expiry moves), and this launch is refused
            expiry = None
            while True:
                try:
                    generation, new_run = await st.begin_run(
                        cfg.job, cfg.node, self.LEASE_S, settings, run_id=run_id())
                    break
                except LauncherConflict as exc:
                    now = time.monotonic()
                    if expiry is not None and now + exc.remaining_s > expiry + 0.5:
                        raise  # renewed: that launcher is alive
                    if expiry is None:
                        expiry = now + exc.remaining_s
                        print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} has a "
                              f"launcher on this node (lease runs out in "
                              f"{exc.remaining_s:.1f} s); waiting to see whether it is alive",
                              file=sys.stderr, flush=True)
                    await asyncio.sleep(min(max(exc.remaining_s, 0.05), 2.5))
            if new_run:
                print(f"trainguard launch [{cfg.node}]: job {cfg.job!r} ran before: this "
                      f"is a new run of it, at generation {generation} (it resumes "
                      f"from its newest valid checkpoint)", file=sys.stderr, flush=True)
            if cfg.spare_node:
                await st.add_spare(cfg.job, cfg.node)
            else:
                try:
                    await st.add_members(cfg.job, [
                        {"rank": cfg.node_rank * cfg.nproc_per_node + lr, "node": cfg.node,
                         "local_rank": lr} for lr in range(cfg.nproc_per_node)])
                except RankConflict:
                    await st.end_launcher(cfg.job, cfg.node)  # the lease begin_run gave us
                    raise

        try:
            self.bus.call(_reg(), timeout=self.LEASE_S + 20.0)
        except LauncherConflict as exc:
            raise SystemExit(f"trainguard launch: {exc}") from None
        except (ConnectionError, OSError, RedisError, TimeoutError) as exc:
            raise SystemExit(f"trainguard launch: cannot register job {cfg.job!r} in the state "
                             f"store at {redact(cfg.redis_url)} ({type(exc).__name__}: {exc}): start "
                             f"one with `trainguard up` or set REDIS_URL / --redis-url") from None
        self.renewed_at = time.monotonic()  # begin_run wrote the lease
        return generation

    def renew(self) -> None:
        """Renew this launcher's lease without waiting: a slow state store must not delay the
        node heartbeat sent from the same thread. A failure posts ``LeaseRenewalFailed``."""
        fut = asyncio.run_coroutine_threadsafe(
            self._store().renew_launcher(self.cfg.job, self.cfg.node, self.LEASE_S),
            self.bus.loop)

        sent = time.monotonic()

        def _done(f) -> None:
            if not f.cancelled() and f.exception() is not None:
                self.post(LeaseRenewalFailed(str(f.exception())))
            elif not f.cancelled():
                self.renewed_at = max(self.renewed_at, sent)

        fut.add_done_callback(_done)

    def publish_attempt(self, generation: int, attempt: int) -> None:
        """Write this node's group restart (``group_attempt = "<generation>:<attempt>"``)."""
        asyncio.run_coroutine_threadsafe(
            self._store().set_group_attempt(self.cfg.job, generation, attempt), self.bus.loop)

    def sync_attempt(self, generation: int, attempt: int) -> None:
        """Observe mode on several nodes: read the job's group attempt (``<generation>:<n>``);
        a newer one of this generation means another node restarted its group: so does this
        one (``GroupRestarted``)."""
        async def _read() -> None:
            job = await self._store().job(self.cfg.job)
            gen, _, n = job.group_attempt.partition(":")
            if gen == str(generation) and n.isdigit() and int(n) > attempt:
                self.post(GroupRestarted(int(n)))

        asyncio.run_coroutine_threadsafe(_read(), self.bus.loop)

    def mark_status(self, status: str) -> None:
        """Record how the job ended here: ``finished`` (every local rank finished, so late
        anomalies such as a node lost after the end decide nothing) or ``failed`` (this node
        stopped on a failure it did not recover from in action mode). A job
        already ``stopped`` by a decision keeps that status."""
        async def _mark() -> None:
            await self._store().end_run(self.cfg.job, status)

        try:
            self.bus.call(_mark(), timeout=5.0)
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass

    def end(self) -> None:
        """Give the lease up (the next launch of the job on this node needs not wait it out)."""
        async def _end() -> None:
            st = self._store()
            try:
                await st.end_launcher(self.cfg.job, self.cfg.node)
            finally:
                await st.close()

        try:
            self.bus.call(_end(), timeout=5.0)
        except Exception:  # noqa: BLE001 - the lease then expires on its own
            pass

    # ---- heartbeat ----------------------------------------------------------------------------
    def start_heartbeat(self, position: Callable[[], tuple[int, int]]) -> None:
        """Start the heartbeat thread: a node heartbeat (``subjects.launcher``) every
        ``heartbeat_interval_s``, the lease renewed every ``RENEW_S`` and, in observe mode
        with restarts on several nodes, the group attempt read at ``position()`` (the run's
        generation and attempt)."""
        threading.Thread(target=self._heartbeat, args=(position,), daemon=True).start()

    def stop_heartbeat(self, ending: bool = False) -> None:
        """Stop the heartbeat thread. ``ending``: the launch ends on purpose (its ranks
        finished, a decision stopped the job, a failure it does not recover from here): publish
        its last beat marked ``ending``, so its silence from now on is no lost launcher."""
        self._stop.set()
        if not ending:
            return
        cfg = self.cfg
        self.bus.publish(subjects.launcher(cfg.node, cfg.job), schemas.NodeHeartbeat(
            node=cfg.node, job=cfg.job, role="launcher", seq=-1, pid=os.getpid(),
            interval_s=cfg.heartbeat_interval_s, ending=True))

    def _heartbeat(self, position: Callable[[], tuple[int, int]]) -> None:
        cfg = self.cfg
        seq = 0
        last_lease = time.monotonic()
        while not self._stop.is_set():
            seq += 1
            silent = time.monotonic() - self.renewed_at
            if silent <= self.LEASE_S:
                self._lost = False  # renewed again (observe mode goes on through a lapse)
            elif not self._lost:
                # fenced: the lease ran out in the store (a partition, a store out of reach),
                # so the job may have moved this node's ranks elsewhere already
                self._lost = True
                self.post(LeaseLost(silent))
            if time.monotonic() - last_lease >= self.RENEW_S:
                last_lease = time.monotonic()
                self.renew()
                if cfg.mode != "action" and cfg.max_restarts and cfg.nnodes > 1:
                    self.sync_attempt(*position())
            self.bus.publish(subjects.launcher(cfg.node, cfg.job), schemas.NodeHeartbeat(
                node=cfg.node, job=cfg.job, role="launcher", seq=seq, pid=os.getpid(),
                interval_s=cfg.heartbeat_interval_s))
            self._stop.wait(cfg.heartbeat_interval_s)

"""The rank runtime every trainguard-aware process shares: the bus connection, the heartbeat
thread, the decision inbox and the generation (``_Runtime``). ``trainguard.run``'s shim
(``trainguard.rank.shim``) and the hooks of an unchanged script (``trainguard.rank.hooks``) both build
on it; it imports neither."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

from trainguard import schemas
from trainguard.core.cuda_errors import cuda_error_is_sticky, is_cuda_oom, recover_from_oom
from trainguard.core.recovery_plan import RankAction
from trainguard.schemas import subjects

from trainguard.rendezvous import store as rendezvous
from trainguard.rank.checkpoint_requests import CheckpointRequests
from trainguard.rank.state import (COLLECTIVE_ERROR_MARKERS, DecisionInbox, JobStopped, RestartRequested,
                         WorkerConfig, _Progress)

__all__ = ["_Runtime"]

log = logging.getLogger("trainguard.rank.shim")


class _Runtime:
    """Process-lifetime state of the shim: bus, heartbeat thread, decisions, generation."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.p = _Progress()
        self.bus = None
        self.store = None
        self.socks: rendezvous.GroupSockets | None = None
        self.ckpt_group = None
        self.inbox = DecisionInbox(cfg)
        self.abort_requested = threading.Event()
        self._stop = threading.Event()
        self.restarts = 0
        self.last_fault_ts = 0
        self.last_step_before_fault = -1
        self.pending_resume: dict[str, Any] | None = None
        self.current_decision_id = ""
        self.rendezvous_ts = 0  # Unix ns: this generation's groups formed (recovery.resumed)
        # trainguard.checkpoint.CheckpointResources of the Checkpointers this process made
        # (Context.checkpointer): one per process, reused by every generation
        self.ckpt_resources = None
        self.requests = CheckpointRequests(
            cfg.job, cfg.rank, cfg.world_size, cfg.generation, None, self.publish,
            self.abort_requested.is_set, self._set_phase)

    def _set_phase(self, name: str) -> None:
        self.p.phase = name

    # ---- bus ----------------------------------------------------------------------------------
    def start(self, decisions: bool = True) -> None:
        """Start the bus client (with ``NATS_URL``) and the heartbeat thread; ``decisions``:
        also follow the job's decisions (a rank that restarts in process)."""
        if self.cfg.nats_url:
            from trainguard.clients.threaded_bus import ThreadedBus

            self.bus = ThreadedBus(self.cfg.nats_url, f"rank-{self.cfg.job}-{self.cfg.rank}",
                                   dead_letters=subjects.job_dead_letter(
                                       self.cfg.job, f"rank-{self.cfg.rank}"))
            if decisions:
                # last_stored: a rank that starts late (a spare still warming when the
                # decision came) learns from the stream the generation the job moved to
                self.bus.subscribe(subjects.job(self.cfg.job, "decision"), self._on_decision,
                                   last_stored=True)
                self.bus.subscribe(subjects.job(self.cfg.job, "control"), self._on_control)
            self.bus.start()  # connects in the background: training never waits for the bus
        threading.Thread(target=self._beat, name="tg-heartbeat", daemon=True).start()

    def publish(self, subject: str, event: schemas.Event) -> None:
        if self.bus is not None:
            self.bus.publish(subject, event)

    def _ids(self) -> dict[str, Any]:
        return {"job": self.cfg.job, "node": self.cfg.node, "rank": self.cfg.rank}

    def _beat(self) -> None:
        subj = None
        while not self._stop.is_set():
            if subj is None or not subj.endswith(f".{self.cfg.rank}.hb"):
                subj = subjects.rank_hb(self.cfg.job, self.cfg.rank)
            p = self.p
            self.publish(subj, schemas.RankHeartbeat(
                **self._ids(), local_rank=self.cfg.local_rank, world_size=self.cfg.world_size,
                generation=self.cfg.generation, pid=os.getpid(), step=p.step, loss=p.loss,
                step_time_s=p.step_time_s, progress_ts=p.progress_ts, phase=p.phase,
                collective_seq=p.collective_seq,
                collectives_completed=p.collectives_completed, compute_s=p.compute_s,
                interval_s=self.cfg.heartbeat_interval_s))
            self._stop.wait(self.cfg.heartbeat_interval_s)

    def _on_decision(self, subject: str, ev: schemas.Event) -> None:
        if not isinstance(ev, schemas.Decision) or not self.inbox.offer(ev):
            return  # not for this rank (executor.plan_rank), or seen before
        # a healthy rank still in a collective must leave it: shut its sockets down
        self.abort_requested.set()
        if self.socks is not None:
            self.socks.abort()

    def _on_control(self, subject: str, ev: schemas.Event) -> None:
        if isinstance(ev, schemas.CheckpointRequest):
            self.requests.offer(ev)

    def newer_decision(self) -> schemas.Decision | None:
        """The newest executed decision for a generation after ours, if any."""
        return self.inbox.newer()

    def await_decision(self, timeout_s: float) -> schemas.Decision | None:
        return self.inbox.wait(timeout_s)

    # ---- groups -------------------------------------------------------------------------------
    def join(self) -> None:
        """Barrier at the current generation, then form the groups. Restarts the barrier at a
        newer generation when a newer decision arrives meanwhile, and once on a new store
        connection when the old one failed (the store's host died: the relay reaches a
        standby). Raises ``RendezvousError``, or torch's store error when the new connection
        fails too."""
        cfg = self.cfg
        if cfg.world_size > 1 or cfg.rdzv_endpoint:
            if self.store is None:
                if not cfg.rdzv_endpoint:
                    raise rendezvous.RendezvousError(
                        "no rendezvous endpoint: set TG_RDZV_ENDPOINT (or MASTER_ADDR and "
                        "MASTER_PORT), e.g. by starting the ranks with `trainguard launch`")
                self.store = rendezvous.connect_store(cfg.rdzv_endpoint)
        reconnected = False
        while True:
            self.p.phase = "recovery" if self.restarts else "startup"
            try:
                if self.store is not None:
                    rendezvous.barrier(self.store, cfg.job, cfg.generation, cfg.rank,
                                       cfg.world_size, cfg.rendezvous_timeout_s,
                                       superseded=lambda: self.newer_decision() is not None)
                    self.ckpt_group, self.socks = rendezvous.form_groups(
                        self.store, cfg.job, cfg.generation, cfg.rank, cfg.world_size,
                        cfg.backend, cfg.pg_timeout_s)
                self.rendezvous_ts = time.time_ns()
                if self.newer_decision() is None:
                    self.abort_requested.clear()
                rq = self.requests
                rq.store, rq.rank, rq.world_size, rq.generation = (
                    self.store, cfg.rank, cfg.world_size, cfg.generation)
                rq.current = None  # a request of an ended generation is not carried over
                return
            except rendezvous.Superseded:
                self._apply(self.newer_decision())
            except rendezvous.RendezvousError:
                raise
            except RuntimeError as exc:  # torch's DistStoreError / DistNetworkError
                if reconnected or self.store is None:
                    raise
                # the store's host went away under this connection: a new one through the
                # relay, which moves to a standby when the store does not answer
                reconnected = True
                # worded so that no detector rule reads it as a failed rendezvous: the
                # reconnect is the recovery, not a fault
                log.warning("rank %d: its store connection closed under it at generation %d "
                            "(%s): connecting again", cfg.rank, cfg.generation,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                rendezvous.destroy_groups()  # a group half-formed on the old store
                self.store = rendezvous.connect_store(cfg.rdzv_endpoint)

    def check_abort(self) -> None:
        """Raise ``RestartRequested`` when a decision asked this rank to leave its generation."""
        if self.abort_requested.is_set():
            raise RestartRequested("a decision asked this rank to restart")

    def abort(self) -> None:
        if self.socks is not None:
            self.socks.abort()
            self.socks.clear()
        rendezvous.destroy_groups()
        self.ckpt_group = None

    def _apply(self, d: schemas.Decision) -> None:
        """Take the generation, rank and world size a decision assigns to this rank
        (``executor.plan_rank``); raises ``JobStopped`` when it stops the job or excludes it."""
        plan = self.inbox.plan(d)
        if plan.action is RankAction.STOP:
            raise JobStopped(plan.why)
        cfg = self.cfg
        cfg.rank, cfg.world_size, cfg.generation = plan.rank, plan.world_size, plan.generation
        self.current_decision_id = d.event_id

    # ---- fault handling -----------------------------------------------------------------------
    def on_fault(self, exc: BaseException) -> None:
        """Report the fault, abort the groups, wait for the decision and apply it. Re-raises
        ``exc`` in observe mode, when the job is to stop, and after a sticky CUDA error
        (``core.cuda_errors.cuda_error_is_sticky``: the CUDA context is lost for the life of
        the process, so the rank leaves it and its launcher starts it again, whatever the
        decision says)."""
        cfg = self.cfg
        self.last_fault_ts = time.time_ns()
        self.last_step_before_fault = self.p.step
        if not isinstance(exc, RestartRequested):
            text, symptom = self.report_fault(exc, self.p.step)
            # shown in the launcher's output too — on stdout: the launcher republishes a rank's
            # stderr lines on the bus, and this fault is already there (with its generation)
            print(f"trainguard: rank {cfg.rank} generation {cfg.generation} step {self.p.step}: "
                  f"{'collective failed (a peer faulted)' if symptom else 'fault'}:\n{text}",
                  file=sys.stdout, flush=True)
        if cuda_error_is_sticky(exc):
            print(f"trainguard: rank {cfg.rank}: the CUDA context is lost (a sticky CUDA "
                  f"error): this process ends, its launcher starts the rank again",
                  file=sys.stdout, flush=True)
            raise exc
        self.abort()  # after the report: the root cause goes on the bus first
        if self.ckpt_resources is not None:
            # a save of the ended generation may wait for a dead rank's shard: drop it
            self.ckpt_resources.abandon_inflight()
        self.p.phase = "recovery"
        if cfg.mode != "action":
            raise exc
        d = self.newer_decision() or self.await_decision(cfg.decision_timeout_s)
        if d is None:
            log.warning("no decision arrived within %.0f s (is the remediator running, and "
                        "the bus reachable?): restarting in process at generation %d on this "
                        "rank's own authority", cfg.decision_timeout_s, cfg.generation + 1)
            cfg.generation += 1
        else:
            self._apply(d)
        self.restarts += 1
        self.pending_resume = {"fault_ts": self.last_fault_ts,
                               "last_step": self.last_step_before_fault}

    def report_fault(self, exc: BaseException, step: int | None) -> tuple[str, bool]:
        """Publish ``exc`` on ``tg.job.<job>.log``: stream ``exception`` for a root cause,
        ``stderr`` for a collective error caused by a peer (``COLLECTIVE_ERROR_MARKERS``).
        After a CUDA OOM the frames of the traceback are cleared (their tensors freed), the
        caching allocator is emptied and its memory summary follows the traceback in the line
        (``cuda_oom_summary``). Returns the traceback text and whether it was such a symptom."""
        text = "".join(traceback.format_exception(exc)).strip()
        symptom = any(m in text for m in COLLECTIVE_ERROR_MARKERS)
        line = text[-4000:]
        summary = cuda_oom_summary(exc)
        if summary:
            line = f"{line}\n{summary}"
        self.publish(subjects.job(self.cfg.job, "log"), schemas.LogLine(
            **self._ids(), stream="stderr" if symptom else "exception", line=line,
            step=step, generation=self.cfg.generation, source="shim"))
        return text, symptom

    def finish(self) -> None:
        self.p.phase = "done"
        rendezvous.destroy_groups()
        self._stop.set()
        if self.bus is not None:
            self.publish(subjects.rank_hb(self.cfg.job, self.cfg.rank), schemas.RankHeartbeat(
                **self._ids(), generation=self.cfg.generation, pid=os.getpid(), step=self.p.step,
                phase="done", world_size=self.cfg.world_size, local_rank=self.cfg.local_rank))
            self.bus.close(timeout=2.0)


def cuda_oom_summary(exc: BaseException) -> str | None:
    """For a CUDA OOM (``core.cuda_errors.is_cuda_oom``) in a process that has loaded torch:
    clear the frames of ``exc``'s traceback (the failed step's tensors are freed), then
    ``recover_from_oom`` with torch's ``cuda.is_available``, ``cuda.empty_cache`` and
    ``cuda.memory_summary``. Returns the summary (at most 4 KB), or None: not an OOM, no torch,
    no CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not is_cuda_oom(exc):
        return None
    traceback.clear_frames(exc.__traceback__)
    return recover_from_oom(torch.cuda.is_available, torch.cuda.empty_cache,
                            torch.cuda.memory_summary)

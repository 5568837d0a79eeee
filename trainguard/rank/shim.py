"""The worker-side shim: ``trainguard.run(train_fn)`` and the ``Context`` it hands to it.

What it does inside every rank:

* joins the job's process group for the current generation (rendezvous store outside the ranks);
* publishes a ``rank.heartbeat`` every ``heartbeat_interval_s`` from a background thread (step,
  loss, step time, phase, generation) — a rank blocked in a collective keeps beating, a stopped or
  dead rank falls silent; publishing never blocks training (``ThreadedBus``);
* on a fault in ``train_fn`` (an exception, or a collective error caused by a peer's fault) it
  reports the fault, shuts down its process-group sockets so every peer's pending collective fails
  within milliseconds (see ``trainguard.rendezvous.store``), waits for the remediator's decision, joins
  the decided generation and calls ``train_fn`` again in the same interpreter — imports, data and
  warm caches are kept (in-process restart);
* marks each completed step (``ctx.progress``) for the Checkpointer, whose ``restore()`` then
  takes the state from healthy peers (``trainguard.checkpoint.live``): no step lost;
* in observe mode it never restarts: the exception propagates as it would without trainguard;
* honours checkpoint requests (``tg.job.<job>.control``, ``schemas.CheckpointRequest``): every
  rank saves the same step at a step boundary and may hold there (``trainguard.rank.checkpoint_requests``).

Environment (set by ``trainguard launch``; torchrun's variables work too): ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``TG_JOB``, ``TG_NODE``, ``TG_GENERATION``,
``TG_MODE``, ``NATS_URL``, ``REDIS_URL``, ``TG_RDZV_ENDPOINT`` (else ``MASTER_ADDR:MASTER_PORT``),
``TG_CKPT_DIR``.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Callable

from trainguard import schemas
from trainguard.schemas import subjects

from trainguard.rank import fault_inject
from trainguard.rank.runtime import _Runtime  # noqa: F401 - the runtime run() drives
from trainguard.rank.state import (  # noqa: F401 - JobStopped and RestartRequested: public here
    JobStopped, RestartRequested, WorkerConfig)

log = logging.getLogger("trainguard.rank.shim")


class Context:
    """What ``train_fn`` receives. Valid for one generation: after an in-process restart
    ``train_fn`` is called again with a new Context.

    Attributes: ``rank``, ``local_rank``, ``world_size``, ``generation``, ``job``, ``node``,
    ``restarts`` (in-process restarts of this process so far), ``ckpt_group`` (a gloo group for
    checkpoint collectives, None when not distributed), ``device``.
    """

    def __init__(self, rt: _Runtime):
        self._rt = rt
        cfg = rt.cfg
        self.job, self.node = cfg.job, cfg.node
        self.rank, self.local_rank = cfg.rank, cfg.local_rank
        self.world_size, self.generation = cfg.world_size, cfg.generation
        self.restarts = rt.restarts
        self.ckpt_group = rt.ckpt_group
        self._ckpt = None
        self._first_progress = True
        self._verify_loss: float | None = None
        import torch

        self.device = (torch.device("cuda", cfg.local_rank) if cfg.backend == "nccl"
                       else torch.device("cpu"))

    def progress(self, step: int, loss: float | None = None) -> None:
        """Record that ``step`` completed (``loss`` its loss). Cheap: no I/O on this thread.

        Raises ``RestartRequested`` when a decision asked this rank to leave the generation.
        """
        rt = self._rt
        if self._ckpt is not None:  # first: the step is complete even when a decision ends it
            self._ckpt.mark(step, loss)
        rt.check_abort()
        p = rt.p
        p.advance(step, loss)
        p.arrived = False
        p.collective_seq += 1
        fault_inject.at_step(rt.cfg.rank, step)  # `trainguard launch --faults`
        if self._first_progress:
            self._first_progress = False
            self._report_resume(step, loss)
        if rt.requests.current is not None or rt.requests._queue:
            rt.requests.at_boundary(step, p.step_time_s, self._ckpt)

    def _report_resume(self, step: int, loss: float | None) -> None:
        rt, cfg = self._rt, self._rt.cfg
        info = rt.pending_resume or {}
        rt.pending_resume = None
        restored = self._ckpt.restored_step if self._ckpt is not None else None
        restored = -1 if restored is None else int(restored)
        if not info and restored < 0:
            return  # a first start from scratch: nothing was resumed
        last = info.get("last_step", -1)
        ck = self._ckpt
        rt.publish(subjects.job(cfg.job, "recovery"), schemas.TrainingResumed(
            **rt._ids(), generation=cfg.generation, world_size=cfg.world_size,
            restored_step=restored, resumed_step=step,
            steps_rolled_back=max(0, last - restored) if last >= 0 else 0,
            fault_ts=info.get("fault_ts", 0),
            restore_source=getattr(ck, "restore_source", "none") or "none",
            decision_id=rt.current_decision_id,
            path=getattr(ck, "recovery_path", "checkpoint"),
            reason=(getattr(ck, "recovery_reason", "") or "")[:500],
            rendezvous_ts=rt.rendezvous_ts))
        saved_loss = getattr(self._ckpt, "restored_loss", None)
        if saved_loss is not None and loss is not None:
            check = self._ckpt.recovery_check(float(loss))  # config.loss_tolerance
            rt.publish(subjects.job(cfg.job, "recovery"), schemas.RecoveryVerified(
                **rt._ids(), generation=cfg.generation, restored_step=restored,
                loss_at_save=saved_loss, loss_after=float(loss),
                tolerance=check["tolerance"], ok=bool(check["ok"])))

    def ddp(self, model, **kwargs: Any):
        """``DistributedDataParallel(model, **kwargs)`` with a communication hook that records
        when this rank reaches its first gradient collective of each step (``compute_s`` in the
        heartbeat: the straggler signal in synchronous training). Returns ``model`` unchanged
        when not distributed."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not dist.is_initialized():
            return model
        net = DDP(model, **kwargs)
        p = self._rt.p

        def _arrival(state, bucket):
            if not p.arrived:
                p.arrived = True
                if p._last_mono:
                    p.compute_s = time.monotonic() - p._last_mono
            return allreduce_hook(state, bucket)

        net.register_comm_hook(None, _arrival)
        return net

    def _checkpoint_wait(self) -> None:
        """Called while a save waits for the previous one: the rank is busy, not hung; a
        decision that ends this generation ends the wait too."""
        self._rt.p.phase = "checkpoint"
        self._rt.check_abort()

    def phase(self, name: str) -> None:
        """Tell the detector what the rank is doing (``schemas.PHASES``): e.g. ``"checkpoint"``
        or ``"compile"`` get longer hang allowances. Raises ``ValueError`` for a name longer
        than ``schemas.worker.MAX_PHASE_CHARS`` (64) characters."""
        from trainguard.schemas.worker import MAX_PHASE_CHARS

        if len(name) > MAX_PHASE_CHARS:
            raise ValueError(f"phase name of {len(name)} characters: at most {MAX_PHASE_CHARS}")
        self._rt.p.phase = name

    def checkpointer(self, model, optimizer=None, data=None, **config: Any):
        """An async, validated, resharding ``trainguard.checkpoint.Checkpointer`` bound to this
        rank and generation. ``config`` fields go to ``CheckpointConfig`` (``root`` defaults to
        ``$TG_CKPT_DIR/<job>`` or ``./checkpoints/<job>``). ``data``: an object with
        ``state_dict()``/``load_state_dict()`` for the data position (a stateful loader), kept
        and sent with the state on the peer path. Its ``restore()`` takes the state from
        healthy peers when a complete replica survived the fault (no step lost), else from the
        newest valid checkpoint; ``ctx.progress(step)`` marks each completed step for it."""
        from trainguard.checkpoint import CheckpointConfig, Checkpointer, CheckpointResources

        rt, cfg = self._rt, self._rt.cfg
        config.setdefault("root", os.path.join(cfg.ckpt_dir or "checkpoints", cfg.job))
        if rt.ckpt_resources is None:
            rt.ckpt_resources = CheckpointResources()
        self._ckpt = Checkpointer(model, optimizer, config=CheckpointConfig(**config),
                                  job=cfg.job, rank=cfg.rank, world_size=cfg.world_size,
                                  generation=cfg.generation, group=rt.ckpt_group, bus=rt.bus,
                                  redis_url=cfg.redis_url or None,
                                  interrupt=self._checkpoint_wait,
                                  resources=rt.ckpt_resources, data=data)
        return self._ckpt

    def log(self, line: str, stream: str = "stdout") -> None:
        """Publish a line to ``tg.job.<job>.log`` (for the detector's log patterns)."""
        rt = self._rt
        rt.publish(subjects.job(rt.cfg.job, "log"), schemas.LogLine(
            **rt._ids(), stream=stream, line=line, step=rt.p.step,
            generation=rt.cfg.generation))


def run(train_fn: Callable[[Context], Any], config: WorkerConfig | None = None) -> Any:
    """Run ``train_fn(ctx)`` under trainguard in this rank; returns what it returns.

    Joins the bus (when ``NATS_URL`` is set — without it the shim still forms groups and
    restarts on its own), forms the process group of the current generation, calls
    ``train_fn``; on a fault restarts in process as decided by the remediator. Raises
    ``JobStopped`` (exit status 3) when the job is stopped; in observe mode re-raises the fault.
    """
    from trainguard.rank import hooks

    hooks.handover()  # this shim replaces the hooks a spare installed for a plain script
    hooks.tell_launcher("restart in_process")
    cfg = config or WorkerConfig.from_env()
    # imports are loaded for good: freezing them keeps the full garbage collection of each
    # in-process restart (see rendezvous.destroy_groups) at ≈ 0.2 ms instead of ≈ 180 ms
    gc.freeze()
    rt = _Runtime(cfg)
    rt.start()
    while True:
        rt.join()
        ctx = Context(rt)
        try:
            result = train_fn(ctx)
        except (KeyboardInterrupt, JobStopped):
            rt.abort()
            rt.finish()
            raise
        except BaseException as exc:  # noqa: BLE001 - every fault goes through recovery
            if isinstance(exc, SystemExit) and not exc.code:
                rt.finish()
                raise
            try:
                rt.on_fault(exc)
            except BaseException:
                rt.finish()
                raise
            continue
        if ctx._ckpt is not None:
            ctx._ckpt.finalize()
        rt.finish()
        return result

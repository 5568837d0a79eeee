"""trainguard inside a rank whose script nobody rewrote (a torchrun script, Lightning, Hugging Face).

The warm spare that becomes a rank calls ``install()`` before it runs the script. From then on:

* **Rendezvous per generation.** ``init_process_group("env://")`` (the default) connects, as under
  torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True``, to the store at ``MASTER_ADDR:MASTER_PORT``
  (trainguard's rendezvous store), but under the key prefix ``<job>/g<generation>/a<attempt>``:
  a restarted group never reads the addresses of the attempt that died (torchrun's shared store
  does, pytorch/pytorch#135712; findings), and two jobs on one store never meet.
* **Progress without code changes.** A global optimizer step hook counts steps and times them;
  the time from the end of the last step to the end of a ``DistributedDataParallel`` forward is
  ``compute_s`` (the straggler signal). A heartbeat thread publishes them (``rank.heartbeat``)
  every ``TG_HEARTBEAT_INTERVAL_S`` (0.1 s). Frameworks report their own global step and loss
  through ``report`` (``trainguard.integrations``).
* **Collectives entered and completed.** Every collective the script calls through
  ``torch.distributed`` (``all_reduce``, ``broadcast``, ``barrier``, … ``COUNTED``) and every
  gradient bucket DDP reduces (a communication hook that does what DDP's built-in allreduce
  does; a hook the script registers itself is called from it) counts as entered when it starts
  and as completed when it returns or its future completes: ``collective_seq`` and
  ``collectives_completed`` in the heartbeat. The detector names the rank behind (fewest
  entered) of a stalled job; ranks with more entered than completed wait inside a collective
  for it and are not culprits. Cost: ``bench/collective_counting.py``.
* **The fault first.** An exception that ends the script is published (``log.line``
  stream=exception, or stderr for a collective error caused by a peer) before the process exits.
* **Resumed.** The first step after a group restart publishes ``recovery.resumed``. A
  Lightning or Hugging Face ``Trainer`` whose script gives no checkpoint to resume from resumes
  from its newest complete one in a restart generation (``trainguard.rank.auto_resume``).
* **Warm replacements.** At the first optimizer step, local rank 0 records the modules the job
  imported (``trainguard.rank.job_imports``) for the launcher, whose spares' template imports them:
  a replacement rank never imports its framework after a fault.

Nothing here changes what the script computes; the hooks cost a few microseconds per step.
When ``trainguard.run`` takes over the rank, it calls ``handover()`` and the shim's own
heartbeat replaces this one.

Public API for frameworks: ``active()``, ``expect_framework_steps()``, ``report(step, loss)``,
``phase(name)``, ``restart_count()``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from trainguard.rank import fault_inject

#: The one instance in this process (None when not installed or handed over).
_RT: "_PlainRuntime | None" = None
_ENV_HANDLER: Any = None  # torch's own env:// handler, kept to be restored


def active() -> bool:
    """True inside a rank started by ``trainguard launch`` whose hooks are installed."""
    return _RT is not None


def restart_count() -> int:
    """How many times this rank's worker group was restarted before this start (0 on the
    first start; ``TORCHELASTIC_RESTART_COUNT`` under torchrun and trainguard)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def report(step: int | None = None, loss: float | None = None) -> None:
    """Record a framework's own global step (``step``, completed) and loss. Once called with a
    step, the framework's count replaces the optimizer-hook count. Never blocks; a no-op when
    not ``active()``."""
    rt = _RT
    if rt is not None:
        rt.progress(step, loss, framework=True)


def expect_framework_steps() -> None:
    """A framework will report its own global steps (``report(step=…)``, from the callbacks of
    ``trainguard.integrations``): from now on optimizer steps no longer count steps (the
    collectives they run are still counted), and ``recovery.resumed`` carries the framework's
    first step after a restart, not the optimizer count of this process. Call it before the first step (a callback's setup).
    No-op when not ``active()``."""
    rt = _RT
    if rt is not None:
        rt.framework_steps = True


def restored(step: int) -> None:
    """A framework restored its own checkpoint of completed step ``step`` (0-based: the
    Trainer's ``global_step - 1``): ``recovery.resumed`` of this start names it as
    ``restored_step`` (else -1: the script restored something trainguard does not see). A
    negative ``step`` (a fresh start) is ignored. No-op when not ``active()``."""
    rt = _RT
    if rt is not None and step >= 0:
        rt.restored_step = int(step)


def phase(name: str) -> None:
    """Tell the detector what the rank does now (``schemas.PHASES``: startup, train, compile,
    checkpoint, recovery, eval, done); slow phases get longer hang allowances. No-op when
    inactive."""
    rt = _RT
    if rt is not None:
        rt.p.phase = name


def store_prefix(env: dict[str, str] | None = None) -> str:
    """The rendezvous key prefix of this rank's worker group: ``<job>/g<generation>/a<attempt>``
    (``TG_JOB``, ``TG_GENERATION``: the decided generation in action mode; ``TG_ATTEMPT``: the
    launcher's torchrun-style group restarts in observe mode)."""
    e = os.environ if env is None else env
    return (f"{e.get('TG_JOB', 'default')}/g{e.get('TG_GENERATION', '0')}/"
            f"a{e.get('TG_ATTEMPT', '0')}")


def _prefixed_env_handler(url: str, **kwargs: Any):
    """torch's env:// rendezvous handler, its store under ``store_prefix()``."""
    import torch.distributed as dist

    for store, rank, world_size in _ENV_HANDLER(url, **kwargs):
        yield dist.PrefixStore(store_prefix(), store), rank, world_size


def install() -> None:
    """Install the hooks in this process (idempotent). Reads the launcher's environment
    (``trainguard.rank.shim.WorkerConfig.from_env``); starts the heartbeat and, with ``NATS_URL``,
    the bus client in the background."""
    global _RT, _ENV_HANDLER
    if _RT is not None:
        return
    import importlib

    from trainguard.rank import auto_resume, job_imports

    job_imports.baseline()  # what the spare brought: the rest is the job's (job_imports.record)
    # a restarted Lightning / HF job resumes from its newest checkpoint, and says which
    auto_resume.install(on_restored=restored)
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook as register_step_post_hook

    from trainguard.rank.state import WorkerConfig

    # (the module, not the function torch.distributed exports under the same name)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    if _ENV_HANDLER is None:
        _ENV_HANDLER = rdzv._rendezvous_handlers["env"]
        rdzv._rendezvous_handlers["env"] = _prefixed_env_handler
    rt = _PlainRuntime(WorkerConfig.from_env())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the spare imported torch before it was assigned
    _RT = rt
    if not getattr(DDP, "_tg_hooked", False):
        DDP.__init__ = _wrap_ddp_init(DDP.__init__)
        DDP._tg_hooked = True
    rt.hook_handle = register_step_post_hook(_on_optimizer_step)
    rt.p.collectives_completed = 0
    _count_collectives()
    rt.start()


def handover() -> None:
    """``trainguard.run`` takes this rank over: stop this heartbeat (the shim beats itself) and
    restore torch's env:// handler. No-op when not installed."""
    global _RT
    rt, _RT = _RT, None
    if rt is None:
        return
    if rt.hook_handle is not None:
        rt.hook_handle.remove()
    _restore_env_handler()
    import threading

    # in the background: the shim starts now, and a bus still connecting may take a while
    threading.Thread(target=rt.close, args=(False,), daemon=True).start()


def _restore_env_handler() -> None:
    global _ENV_HANDLER
    if _ENV_HANDLER is not None:
        import importlib

        rdzv = importlib.import_module("torch.distributed.rendezvous")
        rdzv._rendezvous_handlers["env"] = _ENV_HANDLER
        _ENV_HANDLER = None


def finish(exc: BaseException | None = None) -> None:
    """The script ended (``exc`` when it raised): publish the fault first, then a last heartbeat
    (phase done on success), and flush the bus (≤ 2 s). No-op when inactive."""
    global _RT
    rt, _RT = _RT, None
    if rt is None:
        return
    if exc is not None and not (isinstance(exc, SystemExit) and not exc.code):
        rt.report_fault(exc, rt.p.step if rt.p.step >= 0 else None)
        rt.close(final=False)
    else:
        rt.close(final=True)


def tell_launcher(line: str) -> None:
    """Send one line to this rank's launcher over the pipe it passed (``TG_LAUNCHER_FD``); a
    no-op without one. Used by ``trainguard.run``: ``"restart in_process"`` tells the launcher
    that this rank rejoins in process, so a peer's fault need not restart it."""
    fd = os.environ.get("TG_LAUNCHER_FD", "")
    if fd.isdigit():
        try:
            os.write(int(fd), (line.strip() + "\n").encode())
        except OSError:
            pass  # the launcher is gone: nothing to tell


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    rt = _RT
    if rt is not None:
        rt.progress(None, None, framework=False)


def _wrap_ddp_init(init):
    import torch

    @torch.compiler.disable
    def _post(module, inputs, output):
        rt = _RT
        if rt is not None and rt.p._last_mono:
            rt.p.compute_s = time.monotonic() - rt.p._last_mono

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.register_forward_hook(_post)
        _install_bucket_hook(self)

    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    return __init__


# ---- collectives entered and completed -------------------------------------------------------
#: The collectives of ``torch.distributed`` whose calls are counted (the script's own calls;
#: torch's internal ones, e.g. DDP's start-up broadcast, run the same way on every rank).
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
           "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
           "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor",
           "scatter", "scatter_object_list", "monitored_barrier")
_ORIGINAL: dict[str, Any] = {}  # name -> torch.distributed's own function


def _completed(_fut: Any = None) -> None:
    rt = _RT
    if rt is not None:
        rt.p.collectives_completed += 1


def _counted(name: str, fn: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        rt = _RT
        if rt is None:
            return fn(*args, **kwargs)
        rt.p.collective_seq += 1
        work = None
        try:
            work = fn(*args, **kwargs)
            return work
        finally:
            fut = None
            if work is not None and hasattr(work, "get_future"):
                try:
                    fut = work.get_future()
                except RuntimeError:  # a backend without futures: count it done now
                    fut = None
            if fut is None:
                _completed()
            else:
                fut.add_done_callback(_completed)

    counted.__name__ = counted.__qualname__ = name
    counted.__wrapped__ = fn  # type: ignore[attr-defined]
    counted.__doc__ = fn.__doc__
    return counted


def _count_collectives() -> None:
    """Wrap ``COUNTED`` in the ``torch.distributed`` namespace (once per process)."""
    import torch.distributed as dist

    for name in COUNTED:
        fn = getattr(dist, name, None)
        if fn is None or name in _ORIGINAL:
            continue
        _ORIGINAL[name] = fn
        setattr(dist, name, _counted(name, fn))


class _BucketHook:
    """State of the communication hook of one DDP module: its process group and the hook the
    script registered itself (None: DDP's own allreduce)."""

    __slots__ = ("pg", "user")

    def __init__(self, pg: Any):
        self.pg = pg
        self.user: tuple[Any, Any] | None = None


def _bucket_hook(state: _BucketHook, bucket):
    """DDP's built-in gradient allreduce (average: divide by the world, sum), counted; or the
    script's own hook, whose collectives the ``torch.distributed`` wrappers count."""
    if state.user is not None:
        return state.user[1](state.user[0], bucket)
    import torch.distributed as dist

    pg = state.pg if state.pg is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(pg.size())
    rt = _RT
    if rt is not None:
        rt.p.collective_seq += 1
    fut = _ORIGINAL.get("all_reduce", dist.all_reduce)(tensor, group=pg,
                                                       async_op=True).get_future()

    def done(f):
        _completed()
        return f.value()[0]

    return fut.then(done)


def _install_bucket_hook(ddp: Any) -> None:
    """Register the counting hook on ``ddp``; ``register_comm_hook`` and the built-in hooks the
    script registers afterwards are called from it (DDP allows one hook per module)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import torch.distributed as dist

    from torch.nn.parallel import DistributedDataParallel as cls

    if not getattr(cls, "_tg_comm_hooked", False):
        register, builtin = cls.register_comm_hook, cls._register_builtin_comm_hook

        def register_comm_hook(self, state, hook):
            st = getattr(self, "_tg_bucket_hook", None)
            if st is None or st.user is not None:
                return register(self, state, hook)  # not ours, or a second hook: DDP decides
            self._check_comm_hook(hook)
            st.user = (state, hook)

        def _register_builtin_comm_hook(self, comm_hook_type):
            st = getattr(self, "_tg_bucket_hook", None)
            by_type = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                       dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
            if st is None or st.user is not None or comm_hook_type not in by_type:
                return builtin(self, comm_hook_type)
            st.user = (st.pg, by_type[comm_hook_type])

        register_comm_hook.__doc__ = register.__doc__
        cls.register_comm_hook = register_comm_hook
        cls._register_builtin_comm_hook = _register_builtin_comm_hook
        cls._tg_comm_hooked = True
        cls._tg_register_comm_hook = register
    st = _BucketHook(getattr(ddp, "process_group", None))
    try:
        cls._tg_register_comm_hook(ddp, st, _bucket_hook)
    except (RuntimeError, ValueError, AttributeError):
        return  # a DDP variant without comm hooks: its buckets go uncounted
    ddp._tg_bucket_hook = st


from trainguard.rank.runtime import _Runtime  # noqa: E402 - after the public API


class _PlainRuntime(_Runtime):
    """The shim's heartbeat and bus without its in-process restart: a rank of an unmodified
    script is restarted with its whole worker group by the launcher."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.hook_handle: Any = None
        self.framework_steps = False
        self.resume_pending = restart_count() > 0  # the first step after a group restart
        self.restored_step = -1  # what a framework said it restored (``restored``)
        self.opt_steps = 0

    def start(self, decisions: bool = False) -> None:
        super().start(decisions=False)  # the launcher carries out decisions for this rank

    def progress(self, step: int | None, loss: float | None, framework: bool) -> None:
        p = self.p
        if framework:
            if step is None:
                if loss is not None:
                    p.loss = float(loss)
                return
            self.framework_steps = True
        else:
            self.opt_steps += 1
            if self.opt_steps == 1:
                from trainguard.rank import job_imports

                job_imports.record()  # the model, Trainer and data pipeline are built by now
            if self.framework_steps:
                return  # the framework's own step count is the one reported
            # counted on from the checkpoint a framework said it restored (``restored``: an
            # automatic resume), else from 0 (what a plain script restored is not known)
            step = self.opt_steps - 1 + (self.restored_step + 1 if self.restored_step >= 0 else 0)
        p.advance(int(step), p.loss if loss is None else loss)  # a loss stays until the next
        fault_inject.at_step(self.cfg.rank, int(step))  # `trainguard launch --faults`
        if self.resume_pending:
            self.resume_pending = False
            self._resumed(int(step))

    def _resumed(self, step: int) -> None:
        from trainguard import schemas
        from trainguard.schemas import subjects

        cfg, e = self.cfg, os.environ
        self.publish(subjects.job(cfg.job, "recovery"), schemas.TrainingResumed(
            **self._ids(), generation=cfg.generation, world_size=cfg.world_size,
            restored_step=self.restored_step, resumed_step=step,
            fault_ts=int(e.get("TG_FAULT_TS", 0) or 0),
            restore_source="script", decision_id=e.get("TG_DECISION_ID", "")))

    def close(self, final: bool) -> None:
        from trainguard import schemas
        from trainguard.schemas import subjects

        self._stop.set()
        if self.bus is None:
            return
        if final:
            self.p.phase = "done"
            self.publish(subjects.rank_hb(self.cfg.job, self.cfg.rank), schemas.RankHeartbeat(
                **self._ids(), generation=self.cfg.generation, pid=os.getpid(),
                step=self.p.step, phase="done", world_size=self.cfg.world_size,
                local_rank=self.cfg.local_rank))
        try:
            self.bus.close(timeout=2.0)
        except Exception:  # noqa: BLE001 - exiting anyway; the bus may be gone
            print("trainguard: could not flush the bus at exit", file=sys.stderr)

"""A warm spare worker process: ``python -m trainguard.launch.spare``.

Started by the launcher ahead of need, it imports torch and everything a rank touches, and
warms the lazily-initialised parts (a one-rank gloo group, DDP, an optimizer step — findings: a
process that only imported torch still pays ≈ 2 s on its first optimizer and DDP), then waits for
an assignment: one JSON line on stdin ``{"env": {...}, "argv": [script, args...], "cwd": …}``.
It then becomes the rank by running the script as ``__main__`` — so a respawn costs no
interpreter or torch start-up. Before the script runs it installs ``trainguard.rank.hooks`` (progress,
per-generation rendezvous and fault reports for a script that never calls ``trainguard.run``).
Extra modules to import ahead: env ``TG_WARM_IMPORTS`` (comma-separated). As the launcher's
template (``--fork-server``) it also imports, on request, the modules the job's ranks imported
(``trainguard.rank.job_imports``), so that the spares forked afterwards have them.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import sys



def warm() -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainguard.rank.hooks  # noqa: F401
    import trainguard.rank.shim  # noqa: F401
    import trainguard.rendezvous.store

    for name in ("trainguard.checkpoint.checkpointer", "torch.distributed.checkpoint",
                 "trainguard.clients.store", "trainguard.clients.threaded_bus",
                 "trainguard.checkpoint.verify"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for name in filter(None, os.environ.get("TG_WARM_IMPORTS", "").split(",")):
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            print(f"trainguard.launch.spare: cannot pre-import {name}: {exc}", file=sys.stderr)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    model = DDP(torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    # drop DDP (its Reducer) while the group is still registered, then the group itself through
    # its Python binding, which releases the GIL while gloo joins its workers: the other order
    # deadlocks now and then (pytorch/pytorch#56297; see trainguard.rendezvous.store.destroy_groups)
    del model, opt
    gc.collect()  # DDP's hooks form reference cycles: free its Reducer now, not later
    dist.destroy_process_group()
    trainguard.rendezvous.store.unwrap_rank_excepthook()  # its "[rank0]" label is no rank's


def _working_dir_off_path() -> bool:
    """``python -m trainguard.launch.spare`` put the working directory first on ``sys.path``; a rank
    started by torchrun has only its script's directory there (a ``random.py`` in the job
    directory must not shadow the standard library). Kept when trainguard itself is run from
    there (a checkout, not installed). Returns True when it was taken off."""
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cwd = os.getcwd()
    if cwd == home:
        return False
    keep = [p for p in sys.path if os.path.abspath(p or ".") != cwd]
    dropped = len(keep) != len(sys.path)
    sys.path[:] = keep
    return dropped


def _exit_now(status: int) -> None:
    """Exit with ``status`` after the program's ``atexit`` handlers and a flush, without the
    interpreter's finalization: a daemon thread still inside torch's C++ code then (the bus
    flush of the fault report, gloo's) made glibc abort the process ("FATAL: exception not
    rethrown", exit -6 instead of 1) on a loaded machine."""
    import atexit

    import io

    try:
        atexit._run_exitfuncs()
    finally:
        # what finalization would still have written: the buffers of files the program left
        # open (its own log or metrics file), then the standard streams
        for f in [o for o in gc.get_objects() if isinstance(o, io.IOBase)] + [sys.stdout,
                                                                               sys.stderr]:
            try:
                if not f.closed and f.writable():
                    f.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream
                pass
        os._exit(status)


def main() -> None:
    # a Ctrl-C at the terminal reaches the whole process group: the launcher stops the job and
    # its spares; an unassigned spare has nothing to say (it printed a KeyboardInterrupt
    # traceback per spare), so it ignores SIGINT until it becomes a rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the rank's script gets its own directory on the path, as with torchrun
    cwd_dropped = _working_dir_off_path()
    # `--fork-server FD`: this process is the launcher's template (trainguard.launch.forkserver): it
    # warms once and forks each spare, which goes on below
    template_fd = int(sys.argv[2]) if sys.argv[1:2] == ["--fork-server"] else None
    try:
        warm()
    except BaseException as exc:  # the template says why before it goes (spares start cold)
        if template_fd is None:
            raise
        from trainguard.launch import forkserver

        forkserver.failed(template_fd, f"{type(exc).__name__}: {exc}")
        raise
    # what is loaded now lives as long as the process: keep it out of the collector's scans,
    # so that the full collection of an in-process restart costs ≈ 0.2 ms, not ≈ 180 ms (and
    # a forked spare shares those pages with its template instead of copying them)
    gc.freeze()
    if template_fd is not None:
        from trainguard.launch import forkserver

        import torch

        if torch.cuda.is_initialized():  # a forked child cannot use CUDA set up before the fork
            forkserver.failed(template_fd, "CUDA was initialised while warming (a module of "
                                           "TG_WARM_IMPORTS?): a forked rank could not use it")
            return
        if not forkserver.serve(template_fd):
            return  # the launcher is gone
        del sys.argv[1:3]
    line = sys.stdin.readline()
    if not line:
        return  # the launcher closed our stdin: not needed
    assignment = json.loads(line)
    os.environ.update({k: str(v) for k, v in assignment.get("env", {}).items()})
    if assignment.get("cwd"):
        os.chdir(assignment["cwd"])
    sys.argv = list(assignment["argv"])
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank: as under torchrun
    script = sys.argv[0]
    if not assignment.get("module"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    elif cwd_dropped:  # `python -m` semantics for the job's module: its directory first
        sys.path.insert(0, os.getcwd())
    from trainguard.rank import hooks

    hooks.install()  # rendezvous per generation, progress, the fault first (trainguard.rank.hooks)
    try:
        if assignment.get("module"):
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except Exception as exc:
        # the traceback first, as the interpreter would print it: the fault report and the
        # bus flush after it take up to 2 s, and a decision may stop this process before that
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.stderr.flush()
        hooks.finish(exc)
        _exit_now(1)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: their own exit
        hooks.finish(exc)
        raise
    hooks.finish()


if __name__ == "__main__":
    main()

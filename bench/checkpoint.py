"""Checkpoint cost, side by side, in a fair race: trainguard, DCP async_save, torch.save (and on
request DCP save and DCP async_save with a process), and the disk's own cost — 2 ranks with
gloo, a state of ``--mb`` MB per rank (default 200).

    python bench/checkpoint.py --runs 3 --json PATH   # 200 MB per rank, 3 whole races
    python bench/checkpoint.py --quick --json PATH    # 20 MB per rank, fewer repetitions

The race: a reference run first (the copy of the state into reused buffers, the training
step, the disk's own write time of the state); then ``--runs`` whole races, each running every
system once, in fresh rank processes, the order rotated by one system per race (the first
system of race 1 is the second of race 2 …), the page cache put in the same state before each
system (``reset_page_cache``: sync, then drop_caches where allowed). Every figure is reported
per race and as median, min and max over the races (``summary``); ``targets`` checks the
issue's goals on the medians; ``settings`` says what each system was given.

Per system: ``blocking_s`` (median seconds the training loop is blocked per save, each save
beside a reference copy of the state in the same processes, each right after a training step
and a barrier, in alternating order: ``memcpy_in_run_s``, and ``blocking_vs_copy`` their
ratio), ``durable_s`` (median seconds from the call until the
checkpoint is durable / committed), ``efficiency`` (save interval in steps → time of the same
steps without saves / with saves, measured in alternating windows without and with saves,
``--rounds`` rounds; the intervals are 1×, 3× and 10× the disk's own write time of the state in
steps, unless ``--intervals`` gives them), ``peak_rss_bytes`` (rank 0 and its child processes;
for trainguard, which writes through a node writer daemon as ``trainguard launch`` runs it,
rank 0's share of the daemon and its writers: their unique memory divided by the 2 ranks they
serve), ``validation_gbps`` (trainguard: the validator's check of the committed checkpoint,
page cache warm as for the validator right after a save).

``write_only`` is the floor, not a checkpointer: at each save a helper process that already
holds the state's bytes in shared memory writes them to a file and fsyncs it, nothing else (no
staging copy, no checksum, no metadata). Its efficiency is what writing this many bytes to this
disk costs the training by itself; no checkpointer that writes them can do better.

``efficiency_ceiling`` (top level): at each interval, the efficiency a checkpointer would reach
if a save cost the training nothing but one copy of the state into reused buffers:
interval time / (interval time + the reference copy).

A training step here updates every parameter (as an optimizer does) and does a fixed matmul
workload and a gloo all-reduce.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SYSTEMS = ("torch_save", "dcp_sync", "dcp_async_thread", "dcp_async_process", "trainguard",
           "write_only")
DEFAULT_SYSTEMS = ("trainguard", "dcp_async_thread", "torch_save", "write_only")


def rank_main(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import warnings

    # DCP warns at every save that overwrites one of the bench's three rotating directories
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", a.port, a.world, a.rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world)
    ckg = dist.new_group(backend="gloo")
    n_t = 16
    per = a.mb * 1_000_000 // 4 // n_t
    model = torch.nn.Module()
    if a.fsdp:  # the same bytes per rank as FSDP2 shards of a model world-size times larger
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):  # no full-size copy ever exists (it would set the peak RSS)
            for i in range(n_t):
                model.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(per * a.world)))
        fully_shard(model, mesh=init_device_mesh("cpu", (a.world,)))
        model.to_empty(device="cpu")
        params = [p.to_local() for p in model.parameters()]
        with torch.no_grad():
            for p in params:
                p.normal_()
    else:
        for i in range(n_t):  # rank-specific keys: each rank owns its 200 MB (like a shard)
            model.register_parameter(f"r{a.rank}_p{i}", torch.nn.Parameter(torch.randn(per)))
        params = list(model.parameters())
    state_bytes = sum(p.numel() * 4 for p in params)
    w = torch.randn(256, 256)
    red = torch.zeros(1024)

    def step() -> None:
        with torch.no_grad():
            for p in params:
                p.mul_(0.999999)
            x = w
            for _ in range(a.matmuls):
                x = torch.tanh(x @ w)
            dist.all_reduce(red)

    def timed_copy(bufs) -> float:
        """Seconds to copy the state into ``bufs`` (reused buffers), both ranks at once."""
        dist.barrier()
        t0 = time.perf_counter()
        for b, p in zip(bufs, params):
            b.copy_(p.detach())
        return time.perf_counter() - t0

    def memcpy_s() -> float:
        """Median seconds of the reference copy (the first copy, which faults the buffers in,
        is left out)."""
        bufs = [torch.empty_like(p) for p in params]
        return statistics.median([timed_copy(bufs) for _ in range(6)][1:])

    root = os.path.join(a.dir, a.system)
    os.makedirs(root, exist_ok=True)
    out: dict = {"system": a.system, "state_bytes": state_bytes}
    if a.system == "memcpy":
        step()
        out["rss_before_copies"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["memcpy_s"] = memcpy_s()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        out["step_s"] = (time.perf_counter() - t0) / 5
        anon = _smaps_rollup().get("rssanon", 0)
        import torch.distributed.checkpoint  # noqa: F401 - what any DCP-format saver imports

        out["dcp_import_bytes"] = _smaps_rollup().get("rssanon", 0) - anon
        floor = _FloorWriter(params, a.rank)
        writes = []
        for i in range(3):  # the disk's own time for this state: sets the save intervals
            dist.barrier()
            t0 = time.perf_counter()
            floor.start(os.path.join(root, f"w{i}_r{a.rank}.bin"))
            floor.wait()
            writes.append(time.perf_counter() - t0)
        floor.close()
        out["write_s"] = statistics.median(writes)
        if not a.intervals:  # 1x, 3x, 10x the disk's own write time, in steps
            k = torch.tensor([max(1, round(out["write_s"] / out["step_s"]))])
            dist.broadcast(k, 0)
            out["intervals"] = [int(k), 3 * int(k), 10 * int(k)]
        _finish(a, out)
        return
    import torch.distributed.checkpoint as dcp

    seq = [0]
    pending = [None]
    ck = None
    if a.system == "trainguard":
        from trainguard.checkpoint import CheckpointConfig, Checkpointer

        # certify=False: the bench's ranks hold different tensors (shards), not replicas whose
        # digests should agree (with it, every save here would be marked uncertified)
        # staging in a directory of its own under /dev/shm: a test session on the same machine
        # removes every /dev/shm/trainguard-* file created while it ran (tests/conftest.py),
        # which took this bench's staging buffers from under its saves
        shm = os.path.join("/dev/shm", f"tg-bench-{a.port}")
        os.makedirs(shm, exist_ok=True)
        nice = {} if a.writer_nice is None else {"writer_nice": a.writer_nice}
        ck = Checkpointer(model, None, config=CheckpointConfig(root=root, keep=2, certify=False,
                                                               shm_dir=shm, **nice),
                          job=f"bench-{os.getpid() if a.rank == 0 else 'x'}-{a.port}",
                          rank=a.rank, world_size=a.world, group=ckg)
        ck.job = f"bench{a.port}"
    if a.system == "dcp_async_process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    stager = None
    if a.system in ("dcp_async_thread", "dcp_async_process"):
        # DCP's best settings on a CPU build: one stager kept across saves, so that its
        # StateDictStager reuses the staging buffers (cached) instead of allocating them per
        # save; pinned memory, non-blocking copies and async staging need an accelerator here
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=(
            a.system == "dcp_async_process"), use_async_staging=False,
            use_non_blocking_copy=False))
    if a.system == "torch_save":
        # its fastest setting: no CRC32 over every byte in the zip writer
        torch.serialization.set_crc32_options(False)
    floor = _FloorWriter(params, a.rank) if a.system == "write_only" else None

    def save() -> tuple[float, callable]:
        """Start a save; returns (blocking seconds, wait-until-durable function)."""
        seq[0] += 1
        path = os.path.join(root, f"s{seq[0] % 3}")
        t0 = time.perf_counter()
        if a.system == "torch_save":
            p = os.path.join(path + f"_r{a.rank}.pt")
            with open(p, "wb") as fh:
                torch.save(model.state_dict(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            return time.perf_counter() - t0, lambda: None
        if a.system == "dcp_sync":
            shutil.rmtree(path, ignore_errors=True) if a.rank == 0 else None
            dcp.save({"model": model.state_dict()}, checkpoint_id=path, process_group=ckg)
            return time.perf_counter() - t0, lambda: None
        if a.system in ("dcp_async_thread", "dcp_async_process"):
            if pending[0] is not None:
                pending[0].result()
            kw = {"async_stager": stager}
            if a.system == "dcp_async_process":
                kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
            f = dcp.async_save({"model": model.state_dict()}, checkpoint_id=path,
                               process_group=ckg, **kw)
            f = getattr(f, "upload_completion", f)  # an AsyncSaveResponse with async staging
            pending[0] = f
            return time.perf_counter() - t0, lambda: f.result()
        if floor is not None:
            floor.wait()
            floor.start(path + f"_r{a.rank}.bin")
            return time.perf_counter() - t0, floor.wait
        ck.save(seq[0])
        return ck.stats["blocking_s"], lambda: ck.wait()

    def wait_all() -> None:
        if pending[0] is not None:
            pending[0].result()
            pending[0] = None
        if ck is not None:
            ck.wait()
        if floor is not None:
            floor.wait()

    # warm-up, then durable (blocking is measured at the end, each save beside a reference copy)
    b, wfn = save()
    wfn()
    out["first_blocking_s"] = b
    durs = []
    for _ in range(a.reps):
        dist.barrier(group=ckg)
        t0 = time.perf_counter()
        b, wfn = save()
        wfn()
        durs.append(time.perf_counter() - t0)
    out["durable_s"] = statistics.median(durs)
    intervals = a.intervals
    out["intervals"] = intervals
    # efficiency: windows of the same steps without (A) and with (B) saves, A B A B
    eff = {}
    for interval in intervals:
        saves = max(1, min(a.saves_per_window, a.max_window_steps // interval))
        n = interval * saves
        base = with_saves = 0.0
        for _round in range(a.rounds):
            wait_all()
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(n):
                step()
            base += time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(n):
                if i % interval == 0:
                    save()
                step()
            with_saves += time.perf_counter() - t0
        eff[str(interval)] = round(base / with_saves, 4)
    out["efficiency"] = eff
    # memory before the validation below maps the checkpoint files (the validator service
    # does that in its own process)
    out["peak_rss_self_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["children_uss_bytes"] = _tree_uss(os.getpid(), False)  # private writer, DCP process
    if a.node_writer_pid and a.rank == 0:  # trainguard: this rank's share of the node writer
        out["node_writer_uss_bytes"] = _tree_uss(a.node_writer_pid, True)
        out["children_uss_bytes"] += out["node_writer_uss_bytes"] // a.world
    out["memory_now"] = _smaps_rollup()
    if ck is not None and a.rank == 0:
        ck.wait()
        from trainguard.checkpoint_validator.validate import validate_checkpoint

        from trainguard.checkpoint import format as fmt

        newest = fmt.list_checkpoints(ck.root)[0].path
        validate_checkpoint(newest)  # page cache warm, as for the validator after a save
        rep = validate_checkpoint(newest)
        out["validation_ok"] = rep.ok
        out["validation_gbps"] = rep.gbps
        out["skipped"] = ck.stats["skipped"]
    wait_all()
    # blocking: each save beside a reference copy of the same state in these processes (both
    # ranks at once, after the peak RSS was taken), so that the ratio compares the two at the
    # same moment; the machine's drift between runs (±30 % here) would otherwise swamp it. Both
    # in the same place: right after a training step and a barrier, as a save comes in
    # training, their order alternating. On a shared machine a task that has just slept (as
    # after the wait for a save to be durable) runs ahead of one that has been running: a copy
    # measured right after that wait, the save then after the copy and a barrier, gave the
    # copy that lead and the save none (blocking 1.2-1.6x the copy under 4 busy processes on
    # the 2 cores, 0.9-1.1x with the same idle time before each)
    bufs = [torch.empty_like(p) for p in params]
    copies, blocks = [], []
    for i in range(2 * a.reps + 1):
        for op in ("copy", "save") if i % 2 == 0 else ("save", "copy"):
            step()
            if op == "copy":
                copies.append(timed_copy(bufs))
                continue
            dist.barrier()
            b, wfn = save()
            wfn()
            blocks.append(b)
    del bufs
    out["memcpy_in_run_s"] = statistics.median(copies[1:])
    out["blocking_s"] = statistics.median(blocks[1:])
    out["blocking_samples_s"], out["memcpy_in_run_samples_s"] = blocks[1:], copies[1:]
    if ck is not None:
        ck.finalize()
    if floor is not None:
        floor.close()
    if stager is not None:
        stager.close()
    _finish(a, out)


_FLOOR_HELPER = r"""
import os, sys
src = sys.argv[1]
for line in sys.stdin:
    dst = line.strip()
    fin = os.open(src, os.O_RDONLY)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    n = os.fstat(fin).st_size
    while n > 0:
        n -= os.sendfile(out, fin, None, min(n, 1 << 30))
    os.fsync(out)
    os.close(out)
    os.close(fin)
    sys.stdout.write("done\n")
    sys.stdout.flush()
"""


class _FloorWriter:
    """The disk's own cost: a helper process that writes the state's bytes (put into a
    /dev/shm file once, before any measurement) to a file and fsyncs it, per save."""

    def __init__(self, params, rank: int):
        self.src = f"/dev/shm/tg-bench-floor-{os.getpid()}-r{rank}"
        with open(self.src, "wb") as fh:
            for p in params:
                fh.write(p.detach().numpy().tobytes())
        self.proc = subprocess.Popen([sys.executable, "-c", _FLOOR_HELPER, self.src],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.busy = False

    def start(self, dst: str) -> None:
        self.proc.stdin.write(dst + "\n")
        self.proc.stdin.flush()
        self.busy = True

    def wait(self) -> None:
        if self.busy:
            self.proc.stdout.readline()
            self.busy = False

    def close(self) -> None:
        self.wait()
        self.proc.stdin.close()
        self.proc.wait()
        os.unlink(self.src)


def _smaps_rollup() -> dict[str, int]:
    """This process's memory now, by kind (bytes): ``rss``, ``anonymous`` (private heap: tensors,
    Python objects), ``shmem`` (shared memory mapped in: the /dev/shm staging buffer),
    ``file`` (mapped files: libraries, page cache of mapped checkpoints)."""
    want = {"Rss": "rss", "Anonymous": "anonymous", "Shared_Clean": "shared_clean",
            "Shared_Dirty": "shared_dirty", "Private_Dirty": "private_dirty"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in want:
                    out[want[k]] = int(v.split()[0]) * 1024
    except OSError:
        pass
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("RssShmem:", "RssFile:", "RssAnon:")):
                    k, _, v = line.partition(":")
                    out[k.lower()] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _tree_uss(pid: int, include_root: bool) -> int:
    """Unique memory (bytes) of the descendants of process ``pid`` (and of ``pid`` itself when
    ``include_root``): a private writer, DCP's checkpoint process, a node writer and its
    writers. Shared pages (the /dev/shm staging buffer, counted in the rank's own RSS; the
    imports a node writer's children share with it) are left out."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for c in root.children(recursive=True) + ([root] if include_root else []):
        try:
            total += c.memory_full_info().uss
        except psutil.Error:
            pass
    return total


def _finish(a, out: dict) -> None:
    import torch.distributed as dist

    self_rss = out.get("peak_rss_self_bytes") or \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["peak_rss_bytes"] = self_rss + out.get("children_uss_bytes", 0)
    out["peak_rss_self_bytes"] = self_rss
    dist.barrier()
    if a.rank == 0:
        with open(a.out, "w") as fh:
            json.dump(out, fh)
    dist.destroy_process_group()
    os._exit(0)


def run_system(system: str, args, tmp: str, intervals: list[int]) -> dict:
    from trainguard.stack.process import free_port

    port = free_port()
    out = os.path.join(tmp, f"{system}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", "--system", system,
           "--port", str(port), "--mb", str(args.mb), "--dir", tmp, "--out", out,
           "--reps", str(args.reps), "--matmuls", str(args.matmuls),
           "--saves-per-window", str(args.saves_per_window),
           "--max-window-steps", str(args.max_window_steps), "--rounds", str(args.rounds),
           "--intervals", ",".join(map(str, intervals))] + (["--fsdp"] if args.fsdp else []) \
        + ([] if args.writer_nice is None else ["--writer-nice", str(args.writer_nice)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("TG_CKPT_WRITER", None)
    nw = None
    if system == "trainguard" and not args.private_writer:  # as `trainguard launch` runs it
        from trainguard.checkpoint import NodeWriter

        nw = NodeWriter(os.path.join(tmp, "node-writer.sock"),
                        nice=args.writer_nice or 0).start()
        env["TG_CKPT_WRITER"] = nw.socket_path
        cmd += ["--node-writer-pid", str(nw.proc.pid)]
    try:
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env) for r in range(2)]
        for p in procs:
            p.wait(timeout=1800)
    finally:
        if nw is not None:
            nw.close()
            nw.proc.wait(60)
    with open(out) as fh:
        res = json.load(fh)
    shutil.rmtree(os.path.join(tmp, system), ignore_errors=True)
    shutil.rmtree(os.path.join("/dev/shm", f"tg-bench-{port}"), ignore_errors=True)
    return res


def reset_page_cache(tmp: str) -> str:
    """Put the page cache in the same state before every system: write back everything dirty
    (``sync``), then drop the clean page cache (``/proc/sys/vm/drop_caches``, root only); where
    that is not allowed, drop this bench's own files from the cache (``posix_fadvise``
    DONTNEED after the sync). Returns which of the two was done."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "sync + drop_caches=1"
    except OSError:
        pass
    for d, _, files in os.walk(tmp):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "sync + fadvise DONTNEED on the bench's files"


FIGURES = ("blocking_s", "durable_s", "memcpy_in_run_s", "blocking_vs_copy", "peak_rss_bytes",
           "children_uss_bytes", "validation_gbps", "first_blocking_s")


def _spread(values: list[float]) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def summarize(runs: list[dict], systems: list[str], intervals: list[int]) -> dict:
    """Per system: median, min and max over the runs of every figure (efficiency per
    interval)."""
    out = {}
    for s in systems:
        rs = [r["results"][s] for r in runs if s in r["results"]]
        fig = {f: _spread([r.get(f) for r in rs]) for f in FIGURES}
        fig["efficiency"] = {str(i): _spread([r["efficiency"].get(str(i)) for r in rs])
                             for i in intervals}
        out[s] = fig
    return out


def verdicts(summary: dict, intervals: list[int]) -> dict:
    """The issue's targets, on the medians of the runs (None where a system did not run)."""
    tg, dcp, floor = (summary.get(k) for k in ("trainguard", "dcp_async_thread", "write_only"))
    if not tg:
        return {}
    med = lambda d, f: (d or {}).get(f, {}) and d[f]["median"]  # noqa: E731
    out: dict = {
        "blocking_le_1.2x_copy": med(tg, "blocking_vs_copy") <= 1.2,
        "validation_ge_1_gbps": (med(tg, "validation_gbps") or 0) >= 1.0,
    }
    if floor:
        out["durable_le_1.2x_write_only"] = med(tg, "durable_s") <= 1.2 * med(floor, "durable_s")
    if dcp:
        out["durable_le_dcp_async"] = med(tg, "durable_s") <= med(dcp, "durable_s")
        out["blocking_le_dcp_async"] = med(tg, "blocking_s") <= med(dcp, "blocking_s")
        out["efficiency_ge_dcp_async"] = {
            str(i): tg["efficiency"][str(i)]["median"] >= dcp["efficiency"][str(i)]["median"]
            for i in intervals}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="20 MB per rank, fewer repetitions")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"any of {', '.join(SYSTEMS)}")
    p.add_argument("--runs", type=int, default=1,
                   help="whole races: every system once per run, the order rotated by one "
                        "system each run")
    p.add_argument("--dir", default="", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--matmuls", type=int, default=20)
    p.add_argument("--saves-per-window", type=int, default=2,
                   help="saves per measured window (fewer when the window would pass "
                        "--max-window-steps)")
    p.add_argument("--max-window-steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1,
                   help="windows without and with saves per interval (A B, A B …)")
    p.add_argument("--intervals", default="",
                   help="save intervals in steps (default: 1x, 3x and 10x the disk's own "
                        "write time of the state, measured first)")
    p.add_argument("--fsdp", action="store_true",
                   help="the state as FSDP2 shards (fully_shard) instead of plain tensors")
    p.add_argument("--private-writer", action="store_true",
                   help="trainguard: a writer process per rank instead of the node writer")
    p.add_argument("--writer-nice", type=int, default=None,
                   help="trainguard: niceness of its writer processes (default: the node "
                        "writer at 0, a private writer at CheckpointConfig's writer_nice, 10; "
                        "`trainguard launch` starts its node writer at writer_nice)")
    # internal (rank processes)
    p.add_argument("--rank-main", action="store_true")
    p.add_argument("--system")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int)
    p.add_argument("--out")
    p.add_argument("--node-writer-pid", type=int, default=0)
    a = p.parse_args()
    load0 = provenance.loadavg()
    if a.rank_main:
        a.intervals = [int(x) for x in a.intervals.split(",") if x]
        rank_main(a)
        return
    if a.quick:
        a.mb, a.reps = min(a.mb, 20), 2
    systems = [s for s in a.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    tmp = a.dir or tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir=os.getcwd())
    os.makedirs(tmp, exist_ok=True)
    try:
        load0 = os.getloadavg()
        cache = reset_page_cache(tmp)
        given = [int(x) for x in a.intervals.split(",") if x]
        ref = run_system("memcpy", a, tmp, given)
        intervals = given or ref["intervals"]
        print(f"state {ref['state_bytes'] / 1e6:.0f} MB per rank; memcpy into reused buffers "
              f"{ref['memcpy_s'] * 1e3:.1f} ms; training step {ref['step_s'] * 1e3:.1f} ms; "
              f"the disk's own write {ref['write_s']:.2f} s; intervals {intervals} steps; "
              f"page cache before each system: {cache}", flush=True)
        runs = []
        for run in range(a.runs):
            order = systems[run % len(systems):] + systems[:run % len(systems)]
            results = {}
            for s in order:
                reset_page_cache(tmp)
                load = os.getloadavg()
                r = run_system(s, a, tmp, intervals)
                r["loadavg_before"], r["loadavg_after"] = load, os.getloadavg()
                r["blocking_vs_copy"] = r["blocking_s"] / r["memcpy_in_run_s"]
                results[s] = r
                print(f"run {run + 1}/{a.runs} {s:18s} blocking {r['blocking_s'] * 1e3:7.1f} ms "
                      f"(copy {r['memcpy_in_run_s'] * 1e3:5.1f} ms)  durable "
                      f"{r['durable_s']:6.2f} s  efficiency "
                      f"{ {k: round(v, 3) for k, v in r['efficiency'].items()} }  peak RSS "
                      f"{r['peak_rss_bytes'] / 1e6:6.0f} MB"
                      + (f"  validation {r['validation_gbps']:.2f} GB/s"
                         if "validation_gbps" in r else ""), flush=True)
            runs.append({"order": order, "results": results})
        summary = summarize(runs, systems, intervals)
        checks = verdicts(summary, intervals)
        print("median [min–max] over the runs:")
        for s, f in summary.items():
            g = lambda k, m=1.0: f"{f[k]['median'] * m:.3g} [{f[k]['min'] * m:.3g}–" \
                f"{f[k]['max'] * m:.3g}]" if f[k] else "-"  # noqa: E731
            eff = ", ".join(f"{i}: {v['median']:.3f} [{v['min']:.3f}–{v['max']:.3f}]"
                            for i, v in f["efficiency"].items() if v)
            print(f"  {s:18s} blocking {g('blocking_s', 1e3)} ms  durable {g('durable_s')} s  "
                  f"peak RSS {g('peak_rss_bytes', 1e-6)} MB  efficiency {eff}", flush=True)
        print(f"targets (medians): {checks}", flush=True)
        out = {"mb_per_rank": a.mb, "world_size": 2, "fsdp": a.fsdp, "runs": a.runs,
               "private_writer": a.private_writer, "writer_nice": a.writer_nice,
               "argv": sys.argv[1:], "memcpy_s": ref["memcpy_s"],
               "step_s": ref["step_s"], "write_s": ref["write_s"], "intervals": intervals,
               "baseline_peak_rss_bytes": ref["rss_before_copies"],
               "state_bytes": ref["state_bytes"], "dcp_import_bytes": ref["dcp_import_bytes"],
               "conditions": {"page_cache_before_each_system": cache,
                              "cpus": os.cpu_count(), "loadavg_at_start": load0,
                              "loadavg_at_end": os.getloadavg(),
                              "order": "each run rotates the system order by one",
                              "processes": "each system in fresh rank processes"},
               "settings": SETTINGS, "summary": summary, "targets": checks,
               "per_run": [{"order": r["order"], "systems": {
                   s: {k: v for k, v in x.items() if k not in ("memory_now",)}
                   for s, x in r["results"].items()}} for r in runs]}
        if "trainguard" in summary:
            tgm = summary["trainguard"]
            extra = tgm["peak_rss_bytes"]["median"] - ref["rss_before_copies"]
            out["trainguard_extra_rss_ratio"] = extra / ref["state_bytes"]
            out["efficiency_ceiling"] = {
                str(i): round(i * ref["step_s"] / (i * ref["step_s"] + ref["memcpy_s"]), 4)
                for i in intervals}
        out["provenance"] = provenance.record(load0)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=2)
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)


#: what each system is given (reported in the JSON)
SETTINGS = {
    "trainguard": "Checkpointer defaults (xxh3_64 checksums, NaN/Inf count, fsync on) except "
                  "certify=False (the bench's ranks hold shards, not replicas); written through "
                  "a node writer (nice 0 unless --writer-nice; `trainguard launch` starts it at "
                  "writer_nice, 10), or with --private-writer a writer process per rank (at "
                  "CheckpointConfig.writer_nice, 10, unless --writer-nice)",
    "dcp_async_thread": "torch.distributed.checkpoint.async_save, thread executor, one "
                        "DefaultStager kept across saves (cached staging buffers; pinned memory, "
                        "non-blocking copies and async staging need an accelerator), "
                        "FileSystemWriter defaults (one file per rank, sync_files=True)",
    "dcp_async_process": "as dcp_async_thread with the process executor and shared-memory "
                         "staging",
    "dcp_sync": "torch.distributed.checkpoint.save, FileSystemWriter defaults",
    "torch_save": "torch.save of the state dict to one file per rank, CRC32 off, fsync",
    "write_only": "the floor: a helper process writes the state's bytes from shared memory "
                  "to a file with sendfile and fsyncs it",
}


if __name__ == "__main__":
    main()

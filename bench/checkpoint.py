"""Checkpoint cost, side by side: torch.save (sync), DCP save (sync), DCP async_save (thread and
process), trainguard, and the disk's own cost — 2 ranks with gloo, a state of ``--mb`` MB per rank
(default 200).

    python bench/checkpoint.py --json PATH            # ≈ 200 MB per rank (≈ 15 minutes)
    python bench/checkpoint.py --quick --json PATH    # 20 MB per rank, fewer steps

Per system, in fresh rank processes: ``blocking_s`` (median seconds the training loop is blocked
per save, each save right after a reference copy of the state in the same processes),
``durable_s`` (median seconds from the call until the checkpoint is durable / committed),
``efficiency`` (save interval in steps → time of the same steps without saves / with saves,
measured in alternating windows without and with saves, two rounds; the three intervals are
1×, 3× and 10× trainguard's durable time in steps, found by the first trainguard run),
``peak_rss_bytes`` (rank 0 and its child processes; for trainguard, which writes through a node
writer daemon as ``trainguard launch`` runs it, rank 0's share of the daemon and its writers:
their unique memory divided by the 2 ranks they serve), ``validation_gbps``
(trainguard: the validator's check of the committed checkpoint). ``memcpy_s`` is the reference
copy of the state into reused buffers, in a run of its own; ``memcpy_in_run_s`` the same copy
made just before each measured save of a system's run (its median), which trainguard's blocking
ratio divides by.

``write_only`` is the floor, not a checkpointer: at each save a helper process that already
holds the state's bytes in shared memory writes them to a file and fsyncs it, nothing else (no
staging copy, no checksum, no metadata). Its efficiency is what writing this many bytes to this
disk costs the training by itself; no checkpointer that writes them can do better.

``efficiency_ceiling`` (top level): at each interval, the efficiency a checkpointer would reach
if a save cost the training nothing but one copy of the state into reused buffers (the
issue's staging requirement): interval time / (interval time + the same-run copy). No system
that stages the state can do better; the 99 % target is above it when the copy takes more than
1 % of the interval.

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SYSTEMS = ("torch_save", "dcp_sync", "dcp_async_thread", "dcp_async_process", "trainguard",
           "write_only")


def rank_main(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist

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
        _finish(a, out)
        return
    import torch.distributed.checkpoint as dcp

    seq = [0]
    pending = [None]
    ck = None
    if a.system == "trainguard":
        from trainguard.checkpoint import CheckpointConfig, Checkpointer

        ck = Checkpointer(model, None, config=CheckpointConfig(root=root, keep=2),
                          job=f"bench-{os.getpid() if a.rank == 0 else 'x'}-{a.port}",
                          rank=a.rank, world_size=a.world, group=ckg)
        ck.job = f"bench{a.port}"
    if a.system == "dcp_async_process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
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
            kw = {}
            if a.system == "dcp_async_process":
                kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
            f = dcp.async_save({"model": model.state_dict()}, checkpoint_id=path,
                               process_group=ckg, **kw)
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
    if not intervals:  # first trainguard run: 1x, 3x, 10x its durable time, in steps
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        k = torch.tensor([max(1, round(out["durable_s"] / ((time.perf_counter() - t0) / 5)))])
        dist.broadcast(k, 0)
        intervals = [int(k), 3 * int(k), 10 * int(k)]
    out["intervals"] = intervals
    # efficiency: windows of the same steps without (A) and with (B) saves, A B A B
    eff = {}
    for interval in intervals:
        saves = max(1, min(a.saves_per_window, a.max_window_steps // interval))
        n = interval * saves
        base = with_saves = 0.0
        for _round in range(2):
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
    # blocking: each save right after the reference copy of the same state in these processes
    # (both ranks at once, after the peak RSS was taken), so that the ratio compares the two at
    # the same moment; the machine's drift between runs (±30 % here) would otherwise swamp it
    bufs = [torch.empty_like(p) for p in params]
    copies, blocks = [], []
    for _ in range(a.reps + 1):
        copies.append(timed_copy(bufs))
        dist.barrier(group=ckg)
        b, wfn = save()
        wfn()
        blocks.append(b)
    del bufs
    out["memcpy_in_run_s"] = statistics.median(copies[1:])
    out["blocking_s"] = statistics.median(blocks[1:])
    if ck is not None:
        ck.finalize()
    if floor is not None:
        floor.close()
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
    from trainguard.embedded import free_port

    port = free_port()
    out = os.path.join(tmp, f"{system}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", "--system", system,
           "--port", str(port), "--mb", str(args.mb), "--dir", tmp, "--out", out,
           "--reps", str(args.reps), "--matmuls", str(args.matmuls),
           "--saves-per-window", str(args.saves_per_window),
           "--max-window-steps", str(args.max_window_steps),
           "--intervals", ",".join(map(str, intervals))] + (["--fsdp"] if args.fsdp else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("TG_CKPT_WRITER", None)
    nw = None
    if system == "trainguard" and not args.private_writer:  # as `trainguard launch` runs it
        from trainguard.checkpoint import NodeWriter

        nw = NodeWriter(os.path.join(tmp, "node-writer.sock")).start()
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
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="20 MB per rank, fewer repetitions")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dir", default="", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--matmuls", type=int, default=20)
    p.add_argument("--saves-per-window", type=int, default=3,
                   help="saves per measured window (fewer when the window would pass "
                        "--max-window-steps)")
    p.add_argument("--max-window-steps", type=int, default=300)
    p.add_argument("--fsdp", action="store_true",
                   help="the state as FSDP2 shards (fully_shard) instead of plain tensors")
    p.add_argument("--private-writer", action="store_true",
                   help="trainguard: a writer process per rank instead of the node writer")
    # internal (rank processes)
    p.add_argument("--rank-main", action="store_true")
    p.add_argument("--system")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int)
    p.add_argument("--out")
    p.add_argument("--intervals", default="")
    p.add_argument("--node-writer-pid", type=int, default=0)
    a = p.parse_args()
    if a.rank_main:
        a.intervals = [int(x) for x in a.intervals.split(",") if x]
        rank_main(a)
        return
    if a.quick:
        a.mb, a.reps = min(a.mb, 20), 2
    tmp = a.dir or tempfile.mkdtemp(prefix="tg-bench-ckpt-", dir=os.getcwd())
    os.makedirs(tmp, exist_ok=True)
    try:
        ref = run_system("memcpy", a, tmp, [])
        print(f"state {ref['state_bytes'] / 1e6:.0f} MB per rank; memcpy into reused buffers "
              f"{ref['memcpy_s'] * 1e3:.1f} ms; training step {ref['step_s'] * 1e3:.1f} ms",
              flush=True)
        systems = [s for s in a.systems.split(",") if s]
        unknown = sorted(set(systems) - set(SYSTEMS))
        if unknown:
            raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        intervals = [int(x) for x in a.intervals.split(",") if x]
        if not intervals and "trainguard" not in systems:
            raise SystemExit("give --intervals (save intervals in steps) or include trainguard, "
                             "whose durable time sets them")
        results = {}
        # trainguard first: its durable time sets the intervals (1x, 3x, 10x, in steps)
        for s in sorted(systems, key=lambda x: x != "trainguard"):
            results[s] = r = run_system(s, a, tmp, intervals)
            if not intervals:
                intervals = r["intervals"]
                print(f"trainguard durable {r['durable_s']:.2f} s ≈ {intervals[0]} steps; "
                      f"intervals {intervals}", flush=True)
            print(f"{s:18s} blocking {r['blocking_s'] * 1e3:8.1f} ms  durable "
                  f"{r['durable_s']:6.2f} s  efficiency "
                  f"{ {k: f'{v:.3f}' for k, v in r['efficiency'].items()} }  peak RSS "
                  f"{r['peak_rss_bytes'] / 1e6:6.0f} MB"
                  + (f"  validation {r['validation_gbps']:.2f} GB/s"
                     if "validation_gbps" in r else ""), flush=True)
        out = {"mb_per_rank": a.mb, "world_size": 2, "fsdp": a.fsdp, "memcpy_s": ref["memcpy_s"],
               "step_s": ref["step_s"], "intervals": intervals,
               "baseline_peak_rss_bytes": ref["rss_before_copies"],
               "systems": [{"system": s, "blocking_s": r["blocking_s"],
                            "durable_s": r["durable_s"], "efficiency": r["efficiency"],
                            "validation_gbps": r.get("validation_gbps"),
                            "peak_rss_bytes": r["peak_rss_bytes"],
                            "memcpy_in_run_s": r["memcpy_in_run_s"],
                            "children_uss_bytes": r.get("children_uss_bytes"),
                            "memory_at_end": r.get("memory_now"),
                            "first_blocking_s": r["first_blocking_s"]}
                           for s, r in results.items()]}
        out["dcp_import_bytes"] = ref["dcp_import_bytes"]
        tg = results.get("trainguard")
        if tg:
            extra = tg["peak_rss_bytes"] - ref["rss_before_copies"]
            out["trainguard_blocking_vs_memcpy"] = tg["blocking_s"] / tg["memcpy_in_run_s"]
            out["trainguard_extra_rss_ratio"] = extra / ref["state_bytes"]
            out["trainguard_extra_rss_ratio_beyond_dcp_import"] = \
                (extra - ref["dcp_import_bytes"]) / ref["state_bytes"]
            staging = (tg.get("memory_now") or {}).get("rssshmem", 0)
            writer = tg.get("children_uss_bytes") or 0
            out["trainguard_memory"] = {  # rank 0's extra host memory, by part (bytes)
                "staging": staging, "dcp_import": ref["dcp_import_bytes"],
                "writer_share": writer,
                "rest": extra - staging - ref["dcp_import_bytes"] - writer}
            out["efficiency_ceiling"] = {
                str(i): round(i * ref["step_s"] / (i * ref["step_s"] + tg["memcpy_in_run_s"]), 4)
                for i in intervals}
            print("trainguard extra memory by part: " + ", ".join(
                f"{k} {v / 1e6:.0f} MB" for k, v in out["trainguard_memory"].items()),
                flush=True)
            print(f"efficiency ceiling of any staging checkpointer (interval / (interval + one "
                  f"copy)) = {out['efficiency_ceiling']}", flush=True)
            print(f"trainguard blocking / memcpy in the same processes "
                  f"({tg['memcpy_in_run_s'] * 1e3:.1f} ms) = "
                  f"{out['trainguard_blocking_vs_memcpy']:.2f}; "
                  f"extra host memory = {out['trainguard_extra_rss_ratio']:.2f} × state "
                  f"({out['trainguard_extra_rss_ratio_beyond_dcp_import']:.2f} × beyond the "
                  f"{ref['dcp_import_bytes'] / 1e6:.0f} MB that importing DCP costs)", flush=True)
        floor = results.get("write_only")
        if tg and floor:
            out["trainguard_efficiency_vs_write_only"] = {
                k: round(tg["efficiency"][k] / floor["efficiency"][k], 4)
                for k in tg["efficiency"] if k in floor["efficiency"]}
            print(f"trainguard efficiency / the disk's own (write_only) = "
                  f"{out['trainguard_efficiency_vs_write_only']}", flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=2)
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Crash harness for trainguard checkpoints: faults at random moments, then restore and judge.

    python bench/checkpoint_crash.py --trials 1000 --json crash.json

Each trial forks a rank (from this process, torch already imported: ≈ 20 ms) that restores,
trains two steps and saves after each, with the node writer daemon (``NodeWriter``, the
"launcher" part that holds the writer processes) serving it. One fault per trial, chosen at
random: SIGKILL of the rank, of its writer process, or of the node writer with all its writers,
at a random moment during the saves; a flipped byte or a truncated file in the newest committed
checkpoint; a disk filled to a random level (the checkpoint root is a small tmpfs when one can
be mounted); NaN in the model before a save. Then this process restores with a fresh
Checkpointer (no state store: it verifies manifests itself; from /dev/shm when the staged copy
matches) and compares with the truth:

* corrupt restore — the restored state differs from the reference state of the restored step
  (a deterministic replay), or comes from a checkpoint the harness damaged or poisoned;
* stale restore — an older checkpoint was restored although a newer committed, undamaged one
  exists;
* restore failure — restore raised, or found nothing although a good checkpoint exists.

Prints a summary and writes JSON ``{"trials", "corrupt_restores", "stale_restores",
"restore_failures", "by_fault", "restore_sources", "seconds"}``. Target: 0 corrupt and 0 stale.

Replica faults (``--flip-trials N --clean-saves M``, JSON key ``"replicas"``): 3 forked ranks
on a gloo group hold identical replicas (same model, same data) and save after every step;
before N of the saves, chosen at random among N + M, one random rank flips one random bit of
one random parameter (silent data corruption in one replica; flipped back after the save).
Each save's certificate is judged: a flip must be detected at that save with the flipped rank
as the one suspect, and its checkpoint must fail ``verify``; a clean save must be certified
(a false alarm otherwise). Target: N of N detected, 0 false alarms.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from trainguard.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402
from trainguard.checkpoint import format as fmt  # noqa: E402
from trainguard.checkpoint.writer import NodeWriter  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

FAULTS = ("kill_rank", "kill_writer", "kill_launcher", "flip", "truncate", "fill", "nan")
JOB = f"crash-{os.getpid()}"  # two harnesses on one machine (a test run and a bench) share no staging buffer


def build(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def train_step(m, opt, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
    loss = torch.nn.functional.mse_loss(m(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def state_hash(m, opt) -> str:
    h = xxhash.xxh3_64()
    for v in m.state_dict().values():
        h.update(v.detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            h.update(st[k].detach().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


class Reference:
    """State hash after each step of the fault-free run (step s trains on data seed s)."""

    def __init__(self) -> None:
        self.m, self.opt = build()
        self.hashes: list[str] = []

    def at(self, step: int) -> str:
        while len(self.hashes) <= step:
            train_step(self.m, self.opt, len(self.hashes))
            self.hashes.append(state_hash(self.m, self.opt))
        return self.hashes[step]


def child(root: str, generation: int, poison: bool) -> None:
    m, opt = build(seed=generation + 1)
    c = Checkpointer(m, opt, config=CheckpointConfig(root=root, keep=3, commit_timeout_s=2.0,
                                                     writer_nice=0),
                     job=JOB, rank=0, world_size=1, generation=generation)
    start = c.restore()
    if start == 0:  # nothing restored: start from the reference initialisation
        m0, _ = build(seed=0)
        m.load_state_dict(m0.state_dict())
    for s in (start, start + 1):
        loss = train_step(m, opt, s)
        if poison:
            with torch.no_grad():
                next(m.parameters()).view(-1)[3] = float("nan")
        c.save(s, loss=loss)
    c.wait(10)
    os._exit(0)


def mount_tmpfs(size: str) -> tuple[str, bool]:
    d = tempfile.mkdtemp(prefix="tg-crash-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", d],
                       capture_output=True)
    return d, r.returncode == 0


def writers_of(nw: NodeWriter) -> list[psutil.Process]:
    try:
        return psutil.Process(nw.proc.pid).children()
    except (psutil.Error, AttributeError):
        return []


def quiesce(nw: NodeWriter, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while writers_of(nw) and time.monotonic() < end:
        time.sleep(0.005)


def _kill(proc) -> None:
    """SIGKILL a writer process (``psutil.Process``) that may have ended on its own already
    (its save done between the listing and the kill)."""
    import psutil

    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def run(trials: int, seed: int, verbose: bool = False) -> dict:
    torch.set_num_threads(1)
    rnd = random.Random(seed)
    root, is_tmpfs = mount_tmpfs("2m")
    sock = os.path.join(tempfile.mkdtemp(prefix="tg-crash-sock-"), "writer.sock")
    nw = NodeWriter(sock).start()
    os.environ["TG_CKPT_WRITER"] = sock
    ref = Reference()
    damaged: set[str] = set()
    poisoned_gens: set[int] = set()
    out = {"trials": 0, "corrupt_restores": 0, "stale_restores": 0, "restore_failures": 0,
           "by_fault": {f: 0 for f in FAULTS}, "restore_sources": {}, "tmpfs": is_tmpfs,
           "problems": []}
    faults = [f for f in FAULTS if is_tmpfs or f != "fill"]
    shm = f"/dev/shm/trainguard-{JOB}-r0.stage"
    for p in (shm, shm + ".meta"):
        if os.path.exists(p):
            os.unlink(p)
    t_start = time.perf_counter()
    dur = 0.15
    try:
        for trial in range(trials):
            fault = rnd.choice(faults)
            gen = trial + 1
            filler = os.path.join(root, "filler")
            if fault in ("flip", "truncate"):
                committed = [e for e in fmt.list_checkpoints(root) if e.committed]
                if committed:
                    e = committed[0]
                    names = sorted(os.listdir(e.path))
                    f = os.path.join(e.path, rnd.choice(names))
                    size = os.path.getsize(f)
                    if fault == "flip" and size:
                        off = rnd.randrange(size)
                        with open(f, "r+b") as fh:
                            fh.seek(off)
                            b = fh.read(1)
                            fh.seek(off)
                            fh.write(bytes([b[0] ^ (1 << rnd.randrange(8))]))
                    else:
                        with open(f, "r+b") as fh:
                            fh.truncate(rnd.randrange(size) if size else 0)
                    damaged.add(e.path)
            if fault == "fill":
                st = os.statvfs(root)
                free = st.f_bavail * st.f_frsize
                with open(filler, "wb") as fh:
                    fh.write(b"\0" * max(0, free - rnd.randrange(0, 160_000)))
            if fault == "nan":
                poisoned_gens.add(gen)
            if not nw.proc or nw.proc.poll() is not None:
                nw = NodeWriter(sock).start()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                try:
                    child(root, gen, fault == "nan")
                finally:
                    os._exit(1)
            if fault in ("kill_rank", "kill_writer", "kill_launcher"):
                time.sleep(rnd.uniform(0.0, dur))
                if fault == "kill_rank":
                    os.kill(pid, signal.SIGKILL)
                elif fault == "kill_writer":
                    for w in writers_of(nw):
                        _kill(w)
                else:
                    victims = writers_of(nw)
                    nw.proc.kill()
                    for w in victims:
                        _kill(w)
                    nw.proc.wait()
            end = time.monotonic() + 30
            while True:
                r, status = os.waitpid(pid, os.WNOHANG)
                if r:
                    break
                if time.monotonic() > end:
                    os.kill(pid, signal.SIGKILL)
            if fault == "kill_launcher" or nw.proc.poll() is not None:
                nw = NodeWriter(sock).start()
            quiesce(nw)
            if fault not in ("kill_rank", "kill_writer", "kill_launcher"):
                dur = 0.8 * dur + 0.2 * (time.perf_counter() - t0)
            if os.path.exists(filler):
                os.unlink(filler)
            # ---- judge ------------------------------------------------------------------
            good = []
            for e in fmt.list_checkpoints(root):
                if e.committed and e.path not in damaged and e.generation not in poisoned_gens:
                    good.append(e)
            m, opt = build(seed=10_000 + trial)
            c = Checkpointer(m, opt, config=CheckpointConfig(root=root), job=JOB, rank=0,
                             world_size=1)
            problem = None
            try:
                c.restore()
            except Exception as exc:  # noqa: BLE001 - counted
                out["restore_failures"] += 1
                problem = f"restore raised {type(exc).__name__}: {exc}"
            finally:
                if c.resources.staging is not None:
                    c.resources.staging.close(unlink=False)
            if problem is None:
                src = c.restore_source
                out["restore_sources"][src] = out["restore_sources"].get(src, 0) + 1
                if c.restored_step is None:
                    if good:
                        out["restore_failures"] += 1
                        problem = f"nothing restored, {good[0].path} was good: " \
                                  f"{c.restore_reason}"
                else:
                    name = os.path.basename(c.restored_path)
                    _, g = fmt.parse_name(name)
                    if c.restored_path in damaged or g in poisoned_gens or \
                            state_hash(m, opt) != ref.at(c.restored_step):
                        out["corrupt_restores"] += 1
                        problem = f"corrupt restore of {name} (source {src})"
                    elif good and (good[0].step, good[0].generation) > (c.restored_step, g):
                        out["stale_restores"] += 1
                        problem = f"stale: restored {name}, newest good " \
                                  f"{os.path.basename(good[0].path)}: {c.restore_reason}"
            out["trials"] += 1
            out["by_fault"][fault] += 1
            if problem:
                out["problems"].append(f"trial {trial} ({fault}): {problem}")
            if verbose:
                print(f"trial {trial:4d} {fault:13s} restored={c.restored_step} "
                      f"src={c.restore_source} {problem or ''}", flush=True)
    finally:
        nw.stop()
        os.environ.pop("TG_CKPT_WRITER", None)
        if is_tmpfs:
            subprocess.run(["umount", "-l", root], check=False)
        shutil.rmtree(root, ignore_errors=True)
        for p in (shm, shm + ".meta"):
            if os.path.exists(p):
                os.unlink(p)
    out["seconds"] = round(time.perf_counter() - t_start, 2)
    return out


def replica_rank(rank: int, world: int, port: int, root: str, plan: list, out: str) -> None:
    """One of the replica bench's ranks (a forked child): saves after every step, flips the
    bits ``plan`` gives it, and (rank 0) writes every save's certificate to ``out``."""
    import torch.distributed as dist

    from trainguard.checkpoint.verify import validate_checkpoint

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    m, opt = build(seed=0)
    c = Checkpointer(m, opt, config=CheckpointConfig(root=root, keep=2, fsync=False,
                                                     writer_nice=0, restore_from_shm=False),
                     job=f"{JOB}-replicas", rank=rank, world_size=world, group=group)
    rows = []
    for step, flip in enumerate(plan):
        train_step(m, opt, step)
        p = None
        if flip and flip[0] == rank:
            p = list(m.parameters())[flip[1] % 4].detach().view(-1)
            i = flip[2] % p.numel()
            p.view(torch.int32)[i] ^= 1 << flip[3]
        c.save(step)
        cert = c.certificate
        if rank == 0:
            c.wait(10)
            path = os.path.join(root, fmt.checkpoint_name(step, 0))
            valid = validate_checkpoint(path, quick=True).ok if flip else None
            rows.append({"step": step, "flip": flip, "ok": cert.ok,
                         "suspects": list(cert.suspects), "valid": valid})
        if p is not None:  # the replica heals: the next save compares identical state again
            p.view(torch.int32)[i] ^= 1 << flip[3]
    c.finalize()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()
    os._exit(0)


def run_replicas(flips: int, clean: int, seed: int, world: int = 3) -> dict:
    """The replica bench (module docstring); returns its figures."""
    from trainguard.stack.process import free_port

    torch.set_num_threads(1)
    rnd = random.Random(seed)
    plan: list = [None] * (flips + clean)
    for i in rnd.sample(range(flips + clean), flips):
        plan[i] = (rnd.randrange(world), rnd.randrange(4), rnd.randrange(1 << 20),
                   rnd.randrange(32))
    root = tempfile.mkdtemp(prefix="tg-replicas-")
    out = os.path.join(root, "rows.json")
    port, t0, pids = free_port(), time.perf_counter(), []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                replica_rank(r, world, port, root, plan, out)
            except BaseException:  # noqa: BLE001 - say why, then leave the fork
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    rows = json.load(open(out)) if os.path.exists(out) else []
    shutil.rmtree(root, ignore_errors=True)
    flipped = [r for r in rows if r["flip"]]
    res = {"flip_trials": len(flipped), "clean_saves": len(rows) - len(flipped),
           "detected": sum(1 for r in flipped if not r["ok"]),
           "suspect_named": sum(1 for r in flipped if r["suspects"] == [r["flip"][0]]),
           "rejected_by_verify": sum(1 for r in flipped if r["valid"] is False),
           "false_alarms": sum(1 for r in rows if not r["flip"] and not r["ok"]),
           "rank_exit_codes": codes, "seconds": round(time.perf_counter() - t0, 2)}
    res["missed"] = [r for r in flipped if r["ok"]][:10]
    return res


def main() -> None:
    import logging
    import warnings

    logging.getLogger("trainguard.checkpoint").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--flip-trials", type=int, default=100,
                   help="saves with one bit flipped in one of 3 replicas")
    p.add_argument("--clean-saves", type=int, default=1000,
                   help="saves of identical replicas (false alarms counted)")
    a = p.parse_args()
    load0 = provenance.loadavg()
    rep = run_replicas(a.flip_trials, a.clean_saves, a.seed) \
        if a.flip_trials or a.clean_saves else None
    if rep is not None:
        print(f"replica bit flips: detected {rep['detected']}/{rep['flip_trials']} at the next "
              f"save, suspect named {rep['suspect_named']}, rejected by verify "
              f"{rep['rejected_by_verify']}; false alarms {rep['false_alarms']} in "
              f"{rep['clean_saves']} clean saves ({rep['seconds']} s)")
    res = run(a.trials, a.seed, a.verbose) if a.trials else {
        "trials": 0, "corrupt_restores": 0, "stale_restores": 0, "restore_failures": 0,
        "by_fault": {}, "restore_sources": {}, "problems": [], "seconds": 0, "tmpfs": None}
    res["replicas"] = rep
    print(f"trials {res['trials']}  corrupt_restores {res['corrupt_restores']}  "
          f"stale_restores {res['stale_restores']}  restore_failures "
          f"{res['restore_failures']}  ({res['seconds']} s; tmpfs={res['tmpfs']})")
    print("faults:", res["by_fault"], " restored from:", res["restore_sources"])
    for line in res["problems"][:20]:
        print("  ", line)
    if a.json:
        res["provenance"] = provenance.record(load0)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()

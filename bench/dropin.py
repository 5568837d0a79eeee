"""Drop-in benchmark: unmodified training code under ``trainguard launch`` beside ``torchrun``
(and NVRx ``ft_launcher`` where it installs), side by side in one run.

    python bench/dropin.py --json PATH [--quick] [--jobs plain,lightning,hf] [--rounds N]
                           [--nvrx-python PATH] [--markdown PATH] [--keep DIR]

Three jobs, each 2 ranks on this machine, gloo, the same script and the same arguments under
every launcher (``bench/dropin_jobs/``): ``plain`` (a torchrun DDP script: env init,
``DistributedSampler``, its own snapshot), ``lightning`` (``lightning.pytorch.Trainer``,
strategy ddp, cpu, 2 devices, ``ModelCheckpoint``) and ``hf`` (``transformers.Trainer`` on a tiny
model built in code). Every rank appends a line per completed optimizer step (``records.py``);
every figure is computed from those lines, the same way for every launcher.

Each run of (job, launcher) is one launch, in phases:

1. **Fault-free step rate.** Once rank 0 has completed ``WARMUP_STEPS`` steps and every process
   the launcher started besides the ranks is idle (trainguard's spares, forked from its warm
   template, or cold ones importing torch beside the first steps; the rate is that of the job
   as it then trains), rank 0's step rate over a ``--window`` of seconds. Rounds alternate the order of the launchers for each job
   (trainguard first, then torchrun first, …), so a drift of the shared machine's load cancels
   out; the ratio is the median of trainguard's rates over the median of torchrun's.
2. **SIGKILL of rank 1.** Seconds from the signal to every rank's first completed step in a new
   process (each rank's first record after the fault with another pid); both launchers restart
   the whole group, which resumes from the job's own checkpoint. trainguard runs ``--mode action``;
   torchrun (and ``ft_launcher``) ``--max-restarts 3`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
   (without it torch 2.13's gloo restarts hang: findings).
3. **A Python exception in rank 1** (``--no-exception`` skips it), once the restarted ranks
   have trained a few steps and the launcher's other processes are idle: ``records.py`` raises
   ``RuntimeError`` at rank 1's next step (the bench's trigger file); seconds to every rank's
   first step in a new process (all three launchers restart the group for these scripts).
4. **Hang (SIGSTOP of rank 1)**, once the restarted ranks have trained a few steps and the
   launcher's other processes are idle again (trainguard's replacement spares have warmed), up
   to ``--hang-wait`` seconds: trainguard: seconds to its decision naming the stopped rank (and
   to every rank training again); torchrun, whose only
   hang guard is the collective's own timeout (gloo's default: 30 min): never, in the time we
   waited.

A launcher that is not here (``ft_launcher`` without ``nvidia-resiliency-ext``) gets rows that
say ``not run`` and why. All launchers run beside the same trainguard services (one stack,
started once), so the background load is the same for each.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOBS_DIR = os.path.join(HERE, "dropin_jobs")
sys.path.insert(0, ROOT)

SYSTEMS = ("trainguard", "torchrun", "nvrx")
#: job → (script, its arguments — relative paths: every run starts in its own directory, so the
#: argument list is the same word for word under every launcher; trainguard's spares pre-import)
JOBS: dict[str, tuple[str, list[str], str]] = {
    "plain": ("plain.py", ["--records", "records.txt", "--snapshot", "snapshot.pt"], ""),
    "lightning": ("lightning_job.py", ["--records", "records.txt", "--ckpt-dir", "ckpt"],
                  "lightning.pytorch"),
    "hf": ("hf_job.py", ["--records", "records.txt", "--out", "hf_out"], "transformers.trainer"),
}
#: torchrun's command line, the same for every launcher.
TORCHRUN_ARGS = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
WARMUP_STEPS = 20
NPROC = 2


@dataclass
class Settings:
    """``window_s``: seconds of fault-free steps per rate sample; ``rounds``: launches per
    (job, launcher); ``hang_wait_s``: how long a hang is given to be detected;
    ``settle_timeout_s``: the longest wait for the launcher's other processes to go idle;
    ``start_timeout_s``: for the first steps; ``recover_timeout_s``: for training again."""

    window_s: float = 12.0
    rounds: int = 3
    hang_wait_s: float = 30.0
    settle_timeout_s: float = 120.0
    start_timeout_s: float = 300.0
    recover_timeout_s: float = 120.0
    hang: bool = True
    exception: bool = True


QUICK = dict(window_s=5.0, rounds=1, hang_wait_s=12.0)


# ---- records ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rec:
    rank: int
    step: int
    t: int
    pid: int
    restarts: int


def read_records(path: str) -> list[Rec]:
    """The records of one run, in time order (a torn last line is skipped)."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 5:
                    try:
                        out.append(Rec(*map(int, parts)))
                    except ValueError:
                        pass
    except FileNotFoundError:
        pass
    return sorted(out, key=lambda r: r.t)


def step_rate(recs: list[Rec], t_a: int, t_b: int, rank: int = 0) -> float | None:
    """Steps per second of ``rank`` between ``t_a`` and ``t_b`` (its first and last records in
    the window); None with fewer than 3 records."""
    rs = [r for r in recs if r.rank == rank and t_a <= r.t <= t_b]
    if len(rs) < 3 or rs[-1].t <= rs[0].t:
        return None
    return (len(rs) - 1) / ((rs[-1].t - rs[0].t) / 1e9)


def startup(recs: list[Rec], t_launch: int, world: int = NPROC) -> float | None:
    """Seconds from the launcher's start (Unix ns ``t_launch``) until every rank completed
    its first step; None while some rank has not."""
    first: dict[int, int] = {}
    for r in recs:
        first.setdefault(r.rank, r.t)
    if len(first) < world:
        return None
    return round((max(first.values()) - t_launch) / 1e9, 3)


def latest(recs: list[Rec]) -> dict[int, Rec]:
    out: dict[int, Rec] = {}
    for r in recs:
        out[r.rank] = r
    return out


def back_after(recs: list[Rec], t_f: int, before: dict[int, Rec], world: int = NPROC
               ) -> dict[str, Any] | None:
    """Fault at ``t_f``, ``before`` each rank's last record then → the first step every rank
    completed afterwards in a new process: ``{"recovery_s", "resumed_step", "last_step",
    "rolled_back"}``, or None while some rank has not."""
    first: dict[int, Rec] = {}
    for r in recs:
        if r.t > t_f and r.rank not in first and r.rank in before and r.pid != before[r.rank].pid:
            first[r.rank] = r
    if len(first) < world:
        return None
    last = max(b.step for b in before.values())
    resumed = min(f.step for f in first.values())
    return {"recovery_s": round((max(f.t for f in first.values()) - t_f) / 1e9, 3),
            "resumed_step": resumed, "last_step": last,
            "rolled_back": max(0, last - resumed + 1)}


# ---- processes -------------------------------------------------------------------------------
def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    import psutil

    procs = _tree(pid)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def settle(root_pid: int, rank_pids: set[int], timeout_s: float, idle_pct: float = 5.0
           ) -> float:
    """Wait until every process under ``root_pid`` other than the root and the ranks uses
    less than ``idle_pct`` % of a core over a second (trainguard's spares have warmed up);
    returns the seconds waited."""
    import psutil

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        others = [p for p in _tree(root_pid)[1:] if p.pid not in rank_pids]
        try:
            for p in others:
                p.cpu_percent(None)
            time.sleep(1.0)
            busy = [p for p in others if p.is_running() and p.cpu_percent(None) >= idle_pct]
        except psutil.NoSuchProcess:
            continue
        if not busy:
            break
    return round(time.monotonic() - t0, 1)


@dataclass
class Stack:
    nats_url: str = ""
    redis_url: str = ""
    rdzv_endpoint: str = ""


def step_records(recs: list[Rec], t_f: int, before: dict[int, Rec], gen: int = 1
                 ) -> list[dict[str, Any]]:
    """The step records of ``trainguard.core.timeline`` (``{"t_ns", "rank", "gen", "step"}``)
    around the fault at ``t_f``: generation ``gen`` for a rank's steps in a process other than
    its process at the fault (``before``), ``gen - 1`` for the others."""
    return [{"t_ns": r.t, "rank": r.rank, "step": r.step,
             "gen": gen - 1 + int(r.t > t_f and r.rank in before and r.pid != before[r.rank].pid)}
            for r in recs]


def job_events(stack: Stack, job: str) -> list[Any]:
    """Every event JetStream kept on ``tg.job.<job>.>``, as schema objects (for a timeline)."""
    from trainguard import schemas

    out = []
    for e in bus_events(stack, job, ">"):
        try:
            out.append(schemas.from_dict(e))
        except Exception:  # noqa: BLE001 - a message of another shape: not a phase
            pass
    return out


def recovery_timeline(recs: list[Rec], t_f: int, before: dict[int, Rec],
                      events: list[Any] = ()) -> dict[str, Any]:
    """The phases of one recovery (``trainguard.core.timeline``): from the bus ``events`` where
    the launcher publishes them (trainguard), and from the ranks' records for every launcher
    (last progress, first step of every rank in its new process)."""
    from trainguard.core import timeline

    gen = max(1, timeline.build(t_f, events).generation or 1)  # the generation recovery made
    return timeline.build(t_f, events, steps=step_records(recs, t_f, before, gen)).to_dict()


def bus_events(stack: Stack, job: str, kind: str) -> list[dict[str, Any]]:
    """What JetStream kept on ``tg.job.<job>.<kind>``, oldest first."""
    from trainguard.tools.replay import history

    buf = io.StringIO()
    try:
        asyncio.run(history(stack.nats_url, buf, subject=f"tg.job.{job}.{kind}"))
    except Exception:  # noqa: BLE001 - no answer now: nothing seen yet
        return []
    return [json.loads(x)["event"] for x in buf.getvalue().splitlines() if x.strip()]


# ---- one launch --------------------------------------------------------------------------------
@dataclass
class RunResult:
    system: str
    job: str
    round: int
    rate: float | None = None
    startup_s: float | None = None
    settle_s: float | None = None
    kill: dict[str, Any] | None = None
    exception: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def command(system: str, job: str, tg_job: str, stack: Stack, nvrx_python: str
            ) -> tuple[list[str], dict[str, str]]:
    script, args, warm = JOBS[job]
    script = os.path.join(JOBS_DIR, script)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT", "TG_MODE", "TG_JOB"):
        env.pop(k, None)
    bindir = os.path.dirname(sys.executable)
    if system == "trainguard":
        own = ["--mode", "action", "--job", tg_job, "--node", "node0", "--hang-timeout", "2",
               "--nats-url", stack.nats_url, "--redis-url", stack.redis_url,
               "--rdzv-endpoint", stack.rdzv_endpoint]
        if warm:
            own += ["--warm-import", warm]
        return [os.path.join(bindir, "trainguard"), "launch", *TORCHRUN_ARGS, *own, script,
                *args], env
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # findings: else gloo restarts hang
    if system == "torchrun":
        return [os.path.join(bindir, "torchrun"), *TORCHRUN_ARGS, script, *args], env
    return [os.path.join(os.path.dirname(nvrx_python), "ft_launcher"), *TORCHRUN_ARGS, script,
            *args], env


def run_one(system: str, job: str, rnd: int, s: Settings, stack: Stack, root: str,
            nvrx_python: str, rate_only: bool = False) -> RunResult:
    res = RunResult(system, job, rnd)
    d = os.path.join(root, f"{job}-{system}-{rnd}")
    os.makedirs(d, exist_ok=True)
    tg_job = f"dropin-{job}-{uuid.uuid4().hex[:6]}"
    cmd, env = command(system, job, tg_job, stack, nvrx_python)
    recs_path = os.path.join(d, "records.txt")
    t0 = time.monotonic()
    t_launch = time.time_ns()
    with open(os.path.join(d, "launcher.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    stopped: int | None = None

    def wait_for(cond, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = cond(read_records(recs_path))
            if v:
                return v
            if proc.poll() is not None:
                return None
            time.sleep(0.02)
        return None

    try:
        ok = wait_for(lambda rs: len(latest(rs)) == NPROC and
                      sum(1 for r in rs if r.rank == 0) >= WARMUP_STEPS, s.start_timeout_s)
        if not ok:
            res.notes.append(f"never trained (launcher exit {proc.poll()}; see {d})")
            return res
        res.startup_s = startup(read_records(recs_path), t_launch)
        # --- 1. fault-free step rate
        res.settle_s = settle(proc.pid, {r.pid for r in latest(read_records(recs_path))
                                         .values()}, s.settle_timeout_s)
        t_a = time.time_ns()
        time.sleep(s.window_s)
        t_b = time.time_ns()
        res.rate = step_rate(read_records(recs_path), t_a, t_b)
        if rate_only:
            return res
        # --- 2. SIGKILL of rank 1
        before = latest(read_records(recs_path))
        t_f = time.time_ns()
        os.kill(before[1].pid, signal.SIGKILL)
        res.kill = wait_for(lambda rs: back_after(rs, t_f, before), s.recover_timeout_s)
        if res.kill is None:
            res.notes.append(f"SIGKILL: not training again within {s.recover_timeout_s:g} s "
                             f"(launcher exit {proc.poll()})")
            return res
        evs = job_events(stack, tg_job) if system == "trainguard" else []
        res.kill["timeline"] = recovery_timeline(read_records(recs_path), t_f, before, evs)
        if system == "trainguard":
            ds = [e for e in bus_events(stack, tg_job, "decision")
                  if e.get("execute") and e["ts"] > t_f]
            if ds:
                res.kill["decision"] = {"action": ds[0]["action"], "ranks": ds[0]["ranks"],
                                        "after_s": round((ds[0]["ts"] - t_f) / 1e9, 3)}
        def steady() -> float:
            """Every rank a few steps into its new process, and the launcher's other
            processes idle again: trainguard starts replacement spares 2 s after a respawn
            (refill_delay_s) and they take seconds to warm; a fault while they warm would be
            recovered from cold processes (a second fault that soon after the first one is a
            separate case, not this one). Returns the seconds the settling took."""
            now = latest(read_records(recs_path))
            wait_for(lambda rs: all(sum(1 for r in rs if r.rank == k and r.pid == now[k].pid)
                                    >= 5 for k in now), 30)
            time.sleep(3.0)
            return settle(proc.pid, {r.pid for r in latest(read_records(recs_path)).values()},
                          s.settle_timeout_s)

        # --- 2b. a Python exception in rank 1 (``records.py`` raises at its next step)
        if s.exception:
            steady()
            before = latest(read_records(recs_path))
            t_e = time.time_ns()
            open(os.path.join(d, f"{os.path.basename(recs_path)}.raise1"), "w").close()
            res.exception = wait_for(lambda rs: back_after(rs, t_e, before), s.recover_timeout_s)
            if res.exception is None:
                res.notes.append(f"exception: not training again within "
                                 f"{s.recover_timeout_s:g} s (launcher exit {proc.poll()})")
                return res
            res.exception["timeline"] = recovery_timeline(
                read_records(recs_path), t_e, before,
                job_events(stack, tg_job) if system == "trainguard" else [])
        if not s.hang:
            return res
        # --- 3. hang of rank 1
        settled = steady()
        before = latest(read_records(recs_path))
        stopped = before[1].pid
        t_h = time.time_ns()
        os.kill(stopped, signal.SIGSTOP)
        deadline = time.monotonic() + s.hang_wait_s
        hang: dict[str, Any] = {"waited_s": s.hang_wait_s, "detected": False, "by": None,
                                "settled_s": settled}
        while time.monotonic() < deadline and proc.poll() is None:
            if system == "trainguard" and not hang["detected"]:
                for e in bus_events(stack, tg_job, "decision"):
                    if e["ts"] > t_h and e.get("execute") and e["action"] != "none":
                        hang.update(detected=True, by=f"trainguard decision {e['action']} "
                                    f"ranks {e['ranks']}", ranks=e["ranks"],
                                    detected_s=round((e["ts"] - t_h) / 1e9, 3))
                        break
            back = back_after(read_records(recs_path), t_h, before)
            if back is not None:
                hang["training_again_s"] = back["recovery_s"]
                hang["timeline"] = recovery_timeline(
                    read_records(recs_path), t_h, before,
                    job_events(stack, tg_job) if system == "trainguard" else [])
                if not hang["detected"]:
                    hang.update(detected=True, by=f"{system} restarted the group",
                                detected_s=back["recovery_s"])
                break
            time.sleep(0.2)
        if not hang["detected"]:
            hang["by"] = f"nobody in {s.hang_wait_s:g} s"
        res.hang = hang
        return res
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # a clean stop: spares, writers, stores
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        res.wall_s = round(time.monotonic() - t0, 1)


# ---- the table ---------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def summarize(results: list[RunResult], jobs: list[str], missing: dict[str, str]
              ) -> list[dict[str, Any]]:
    """One row per job: rates and their ratio, SIGKILL recovery per launcher (median, samples,
    ``kill_<launcher>_tails``: p95, max and slow runs with their phase) and the ratio
    torchrun/trainguard, hang detection per launcher."""
    from trainguard.core import timeline

    rows = []
    for job in jobs:
        of = {sy: [r for r in results if r.job == job and r.system == sy] for sy in SYSTEMS}
        rate = {sy: _median([r.rate for r in of[sy]]) for sy in ("trainguard", "torchrun")}
        row: dict[str, Any] = {
            "job": job,
            "rate_trainguard": rate["trainguard"], "rate_torchrun": rate["torchrun"],
            "rate_ratio": round(rate["trainguard"] / rate["torchrun"], 3)
            if rate["trainguard"] and rate["torchrun"] else None,
            "rate_samples": {sy: [r.rate and round(r.rate, 3) for r in of[sy]]
                             for sy in ("trainguard", "torchrun")},
            # launch → every rank's first step (trainguard here on a stack already up)
            "startup_s": {sy: _median([r.startup_s for r in of[sy]]) for sy in SYSTEMS
                          if sy not in missing},
        }
        for sy in SYSTEMS:
            if sy in missing:
                row[f"kill_{sy}_s"] = None
                row[f"hang_{sy}"] = {"detected": None, "by": f"not run: {missing[sy]}"}
                continue
            es = [r.exception["recovery_s"] for r in of[sy] if r.exception]
            row[f"exception_{sy}_s"] = _median(es)
            row[f"exception_{sy}_samples"] = es
            ks = [r.kill["recovery_s"] for r in of[sy] if r.kill]
            row[f"kill_{sy}_s"] = _median(ks)
            row[f"kill_{sy}_samples"] = ks
            if of[sy]:  # p95, max and each slow run's phase (a launch that never came back: None)
                row[f"kill_{sy}_tails"] = timeline.tails(
                    [r.kill["recovery_s"] if r.kill else None for r in of[sy]],
                    [r.kill.get("timeline") if r.kill else None for r in of[sy]])
            hs = [r.hang for r in of[sy] if r.hang]
            if hs:
                det = [h for h in hs if h["detected"]]
                row[f"hang_{sy}"] = {
                    "detected": f"{len(det)}/{len(hs)}",
                    "by": det[0]["by"] if det else hs[0]["by"],
                    "detected_s": _median([h.get("detected_s") for h in det]),
                    "training_again_s": _median([h.get("training_again_s") for h in det]),
                    "waited_s": hs[0]["waited_s"]}
            else:
                row[f"hang_{sy}"] = {"detected": None, "by": "not run"}
            notes = sorted({n for r in of[sy] for n in r.notes})
            if notes:
                row[f"notes_{sy}"] = notes
        tg, tr = row.get("kill_trainguard_s"), row.get("kill_torchrun_s")
        row["kill_ratio_torchrun_over_trainguard"] = round(tr / tg, 2) if tg and tr else None
        rows.append(row)
    return rows


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


def _hang(h: dict[str, Any] | None) -> str:
    if not h or h.get("detected") is None:
        return (h or {}).get("by", "not run")
    if h["detected"].startswith("0/"):
        return f"never ({h['detected']} in {h['waited_s']:g} s)"
    again = (f"; training again {_f(h['training_again_s'])} s"
             if h.get("training_again_s") is not None and not h["by"].endswith("the group")
             else "")
    return f"{h['detected']} in {_f(h['detected_s'])} s ({h['by']}{again})"


COLUMNS = ("job", "steps/s tg", "steps/s torchrun", "rate tg/torchrun", "SIGKILL→training tg",
           "torchrun", "ft_launcher", "torchrun/tg", "exception→training tg", "torchrun",
           "hang: trainguard", "hang: torchrun", "hang: ft_launcher")


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[r["job"], _f(r["rate_trainguard"]), _f(r["rate_torchrun"]),
             _f(r["rate_ratio"], "{:.3f}"), _f(r["kill_trainguard_s"], "{:.2f} s"),
             _f(r["kill_torchrun_s"], "{:.2f} s"),
             _f(r["kill_nvrx_s"], "{:.2f} s") if r["hang_nvrx"].get("detected") is not None
             or r["kill_nvrx_s"] is not None else "not run",
             _f(r["kill_ratio_torchrun_over_trainguard"], "{:.1f}×"),
             _f(r.get("exception_trainguard_s"), "{:.2f} s"),
             _f(r.get("exception_torchrun_s"), "{:.2f} s"),
             _hang(r["hang_trainguard"]), _hang(r["hang_torchrun"]), _hang(r["hang_nvrx"])]
            for r in rows]


def print_table(rows: list[dict[str, Any]], file=sys.stdout) -> None:
    body = table_rows(rows)
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths)), file=file)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in table_rows(rows)])


# ---- CLI ---------------------------------------------------------------------------------------
def _csv(choices):
    def parse(v: str) -> list[str]:
        items = [x.strip() for x in v.split(",") if x.strip()]
        if not items or any(x not in choices for x in items):
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {v!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/dropin.py",
        description="Unmodified training jobs (plain DDP, Lightning, Hugging Face) under "
                    "trainguard launch beside torchrun (and NVRx ft_launcher where it "
                    "installs): fault-free step rate, SIGKILL → every rank training again, "
                    "hang detection.")
    p.add_argument("--json", default="", metavar="PATH", help="also write the rows here")
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    p.add_argument("--jobs", type=_csv(tuple(JOBS)), default=list(JOBS),
                   help=f"comma-separated subset of {','.join(JOBS)} (default: all)")
    p.add_argument("--systems", type=_csv(SYSTEMS), default=list(SYSTEMS),
                   help="comma-separated subset of trainguard,torchrun,nvrx (default: all)")
    p.add_argument("--rounds", "--runs", dest="rounds", type=int, default=None,
                   help="launches per (job, launcher), orders alternating (default 3; "
                        "--quick 1); ft_launcher runs in the first round only")
    p.add_argument("--window", type=float, default=None,
                   help="seconds of fault-free steps per rate sample (default 12; --quick 5)")
    p.add_argument("--hang-wait", type=float, default=None,
                   help="seconds a hang is given to be detected (default 30; --quick 12)")
    p.add_argument("--no-hang", action="store_true", help="skip the hang phase")
    p.add_argument("--no-exception", action="store_true", help="skip the exception phase")
    p.add_argument("--nvrx-python", default=sys.executable, metavar="PATH",
                   help="the Python whose environment has nvidia-resiliency-ext (its "
                        "ft_launcher beside it); default: this one")
    p.add_argument("--markdown", default="", metavar="PATH", help="also write the table here")
    p.add_argument("--keep", default="", metavar="DIR", help="keep every run's directory here")
    a = p.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        p.error("--rounds must be ≥ 1")
    for need in ("trainguard", "torchrun"):
        if need not in a.systems:
            p.error("--systems must include trainguard and torchrun (the ratios need both)")
    return a


def settings_from(a: argparse.Namespace) -> Settings:
    s = Settings(**(QUICK if a.quick else {}))
    if a.rounds is not None:
        s.rounds = a.rounds
    if a.window is not None:
        s.window_s = a.window
    if a.hang_wait is not None:
        s.hang_wait_s = a.hang_wait
    s.hang = not a.no_hang
    s.exception = not a.no_exception
    return s


def available(system: str, nvrx_python: str, job: str = "plain") -> str | None:
    """None when ``system`` can run ``job`` here, else why not."""
    if system == "nvrx":
        launcher = os.path.join(os.path.dirname(nvrx_python), "ft_launcher")
        r = subprocess.run([nvrx_python, "-c", "import nvidia_resiliency_ext.fault_tolerance"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
            return f"nvidia-resiliency-ext does not import in {nvrx_python} ({last[:160]})"
        if not os.path.exists(launcher):
            return f"no ft_launcher beside {nvrx_python}"
    return None


def plan(s: Settings, jobs: list[str], systems: list[str]) -> list[tuple[str, str, int]]:
    """(job, system, round) in the order they run: per round and job, trainguard and torchrun
    in alternating order (round 0 trainguard first), ft_launcher after them in round 0."""
    out = []
    for rnd in range(s.rounds):
        for j, job in enumerate(jobs):
            pair = ["trainguard", "torchrun"] if (rnd + j) % 2 == 0 else ["torchrun",
                                                                          "trainguard"]
            out += [(job, sy, rnd) for sy in pair]
            if rnd == 0 and "nvrx" in systems:
                out.append((job, "nvrx", rnd))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load0 = provenance.loadavg()
    s = settings_from(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    missing = {}
    for sy in SYSTEMS:
        if sy not in a.systems:
            missing[sy] = "not asked for (--systems)"
            continue
        why = available(sy, a.nvrx_python)
        if why:
            missing[sy] = why
            print(f"  {sy}: not run — {why}", flush=True)
    systems = [sy for sy in a.systems if sy not in missing]
    root = a.keep or tempfile.mkdtemp(prefix="tg-bench-dropin-")
    os.makedirs(root, exist_ok=True)
    from trainguard.stack.local import Stack as TgStack

    print(f"drop-in benchmark: jobs {','.join(a.jobs)}; launchers {','.join(systems)}; "
          f"{asdict(s)}; starting the trainguard services (shared by every run)…", flush=True)
    tg = TgStack(services=("agent", "detector", "attributor", "remediator"),
                 agent_nodes=("node0",), rendezvous=True, log_dir=os.path.join(root, "stack"))
    tg.start(timeout=180)
    stack = Stack(tg.nats_url, tg.redis_url, tg.rdzv_endpoint)
    results: list[RunResult] = []
    t_start = time.monotonic()
    try:
        for job, sy, rnd in plan(s, a.jobs, systems):
            r = run_one(sy, job, rnd, s, stack, root, a.nvrx_python)
            results.append(r)
            print(f"  {job:<9} {sy:<10} round {rnd + 1}: {_f(r.rate)} steps/s (settled "
                  f"{_f(r.settle_s, '{:g}')} s), SIGKILL→training "
                  f"{_f(r.kill and r.kill['recovery_s'])} s, hang "
                  f"{(r.hang or {}).get('by')} ({r.wall_s:.0f} s)"
                  + (f" — {'; '.join(r.notes)}" if r.notes else ""), flush=True)
    except (KeyboardInterrupt, SystemExit):
        print("  interrupted: tabling the runs done so far", flush=True)
    finally:
        tg.stop()
    rows = summarize(results, a.jobs, missing)
    print(f"\ndrop-in benchmark — 2 ranks, gloo, this machine ({os.cpu_count()} cores); "
          f"{s.rounds} round(s); {time.monotonic() - t_start:.0f} s\n")
    print_table(rows)
    for sy, why in missing.items():
        print(f"\n{sy}: not run — {why}")
    out = {"settings": asdict(s), "torchrun_args": TORCHRUN_ARGS, "rows": rows,
           "runs": [asdict(r) for r in results], "provenance": provenance.record(load0)}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    with open(os.path.join(root, "detail.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"\n{'written to ' + a.json + '; ' if a.json else ''}runs in {root}")
    if a.markdown:
        with open(a.markdown, "w") as fh:
            cmd = "python bench/dropin.py " + " ".join(argv if argv is not None else sys.argv[1:])
            fh.write(f"Command: `{cmd}`\n\n{markdown_table(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

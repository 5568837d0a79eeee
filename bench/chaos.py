"""Chaos benchmark: a live 4-rank job in action mode while the control plane itself is killed.

    python bench/chaos.py [--trials 100] [--seed 0] [--json PATH] [--quick] [--keep DIR]

One trainguard job (the demo: digits MLP, 2 simulated nodes × 2 ranks, DDP over gloo, action
mode, ``trainguard.demo.harness``) runs on a stack with persistent state (``Stack(data_dir=…)``:
Valkey with its append-only file, the JetStream store on disk, as ``trainguard up`` runs).
Each **trial** is one fault in the job (SIGKILL of a rank, or a Python exception raised in
one) together with one control-plane **outage**: NATS, Valkey, or one service process
(detector, attributor, remediator, checkpoint validator, an agent) SIGKILLed and started again
``down_s`` seconds later, at a seeded random moment. Half the outages start while the job
trains steadily, a few dozen steps before its fault (``steady``: what an outage costs training);
half start 0–1.5 s after the fault (``during``: the fault's detection, decision and recovery
run into the outage). ``make_schedule`` draws it all from ``--seed``.

Every rank appends a record per completed step to a progress file (``bench/peers/tg_hook``, the
same measurement as ``bench/recovery.py``); the figures come from that file, the job's audit
trail in Valkey and the events on the bus:

* ``trials``, ``faults`` (injected), ``full_restarts`` (a trial nothing recovered within
  ``--recovery-timeout``: the job is restarted whole, as a scheduler would, for the next one),
  ``recovered`` (every rank of the new world completed a new
  step, from the progress file), ``recovery_s`` (median, p95 nearest rank, max);
  ``recovery_tails``: the same by fault kind and outage moment, with every trial over twice its
  group's median named with its slow phase (each trial's ``timeline`` is in ``per_trial``);
* ``decisions_lost`` — faults followed by no decision that acts (``none`` does not) within
  ``--recovery-timeout``: none on the bus, none in the audit trail, and the job never
  recovered;
* ``duplicate_actions`` — an idempotency key carried out twice: two successful action results
  of one executor for one key, two decision records with one key in the audit trail, or one
  rank resuming twice for one decision;
* ``training_blocked_s`` — the sum of stalls of rank 0's progress longer than 1 s, split into
  ``in_fault_windows`` (fault → recovered: the price of the fault) and ``outside`` (an outage
  alone stopped training; should be 0);
* ``throughput_ratio`` — rank 0's steps/s during steady outages over its steps/s in the
  remaining fault-free time (target ≥ 0.95).

``--quick``: 4 trials.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Iterable
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: What an outage kills. Servers and services; agents are per simulated node.
TARGETS = ("nats", "valkey", "detector", "attributor", "remediator", "checkpoint_validator",
           "agent-node0", "agent-node1")
FAULT_KINDS = ("sigkill", "exception")


def _recovery_module():
    """``bench/recovery.py``: its progress-file parser and recovery metric."""
    spec = importlib.util.spec_from_file_location("bench_recovery_for_chaos",
                                                  os.path.join(HERE, "recovery.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---- the schedule (pure) -------------------------------------------------------------------------
def make_schedule(trials: int, seed: int = 0, world: int = 4, first_step: int = 60,
                  gap_steps: int = 90) -> list[dict[str, Any]]:
    """``trials`` trials, deterministic in ``seed``. Each: ``id``, the fault (``kind``,
    ``rank``, ``step``: the step it lands on, ``gap_steps`` after the previous one) and the
    outage (``target`` of ``TARGETS``, ``when`` ``steady`` | ``during``; ``lead_steps``: a
    steady outage starts when rank 0 reaches ``step - lead_steps``; ``offset_s``: a during
    outage starts that long after the fault; ``down_s``: seconds until it is started again).
    Every target comes up about equally often (cycled in a shuffled order)."""
    if trials < 1 or world < 2:
        raise ValueError("trials must be ≥ 1 and world ≥ 2")
    rnd = random.Random(seed)
    order: list[str] = []
    out = []
    for i in range(trials):
        if not order:
            order = list(TARGETS)
            rnd.shuffle(order)
        when = "steady" if i % 2 == 0 else "during"
        out.append({
            "id": i + 1, "kind": FAULT_KINDS[rnd.randrange(len(FAULT_KINDS))],
            "rank": rnd.randrange(1, world), "step": first_step + i * gap_steps,
            "target": order.pop(), "when": when,
            "lead_steps": rnd.randint(20, 45) if when == "steady" else 0,
            "offset_s": round(rnd.uniform(0.0, 1.5), 3) if when == "during" else 0.0,
            "down_s": round(rnd.uniform(0.3, 2.5), 3),
            # independent faults fail with different errors: the same error on ranks of two
            # nodes is, rightly, a bug of the program (the attributor's systematic fact) and
            # stops the job; numbers are masked in signatures, so the trial is spelled out
            "message": f"chaos trial {_spelled(i + 1)}",
        })
    return out


def _spelled(n: int) -> str:
    """``n`` ≥ 1 in letters (1 → "a", 27 → "aa"): a trial name that survives the digit mask of
    fault signatures."""
    out = ""
    while n:
        n, r = divmod(n - 1, 26)
        out = chr(ord("a") + r) + out
    return out


def total_steps(schedule: list[dict[str, Any]], tail: int = 60) -> int:
    """Steps the job must run so that every fault lands and the last one has room to recover."""
    return max(t["step"] for t in schedule) + tail


# ---- the accounting (pure) -------------------------------------------------------------------
def duplicate_actions(action_results: Iterable[dict[str, Any]],
                      audit: Iterable[dict[str, Any]],
                      resumed: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Idempotency keys carried out more than once.

    ``action_results``: ``{"idempotency_key", "executor", "ok", "skipped"}`` per action result;
    ``audit``: the job's audit records (``type == "decision"`` rows carry
    ``idempotency_key`` and ``execute``); ``resumed``: ``{"rank", "decision_id"}`` per
    ``recovery.resumed`` event. Returns the count and the keys of each kind."""
    seen: dict[tuple[str, str], int] = {}
    for a in action_results:
        if a.get("ok") and not a.get("skipped"):
            k = (a["idempotency_key"], a["executor"])
            seen[k] = seen.get(k, 0) + 1
    by_result = sorted(f"{k}@{e}" for (k, e), n in seen.items() if n > 1)
    keys: dict[str, int] = {}
    for r in audit:
        if r.get("type") == "decision" and r.get("execute") and r.get("idempotency_key"):
            keys[r["idempotency_key"]] = keys.get(r["idempotency_key"], 0) + 1
    by_audit = sorted(k for k, n in keys.items() if n > 1)
    res: dict[tuple[int, str], int] = {}
    for r in resumed:
        if r.get("decision_id"):
            k = (r["rank"], r["decision_id"])
            res[k] = res.get(k, 0) + 1
    by_rank = sorted(f"rank {r}: {d}" for (r, d), n in res.items() if n > 1)
    return {"count": len(by_result) + len(by_audit) + len(by_rank),
            "action_results": by_result, "audit_decisions": by_audit, "rank_resumes": by_rank}


def stalls(times_ns: list[int], threshold_s: float = 1.0) -> list[tuple[int, int]]:
    """Gaps between consecutive progress records (Unix ns, sorted) longer than
    ``threshold_s``, as ``(start, end)``."""
    return [(a, b) for a, b in zip(times_ns, times_ns[1:]) if (b - a) / 1e9 > threshold_s]


def overlap_s(a: tuple[int, int], windows: Iterable[tuple[int, int]]) -> float:
    """Seconds of interval ``a`` (Unix ns) covered by the (disjoint) ``windows``."""
    return sum(max(0, min(a[1], w[1]) - max(a[0], w[0])) for w in windows) / 1e9


def _subtract(a: tuple[int, int], windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of ``a`` outside the sorted, disjoint ``windows``."""
    out, start = [], a[0]
    for w0, w1 in windows:
        if w1 <= start or w0 >= a[1]:
            continue
        if w0 > start:
            out.append((start, w0))
        start = max(start, w1)
    if start < a[1]:
        out.append((start, a[1]))
    return out


def account(trials: list[dict[str, Any]], outages: list[dict[str, Any]], rank0_ns: list[int],
            stall_s: float = 1.0) -> dict[str, Any]:
    """The run's figures from its records.

    ``trials``: per fault ``injected_ns``, ``recovered_ns`` (None: never), ``decided``
    (a decision seen anywhere); ``outages``: ``{"target", "when", "down_ns", "up_ns"}``;
    ``rank0_ns``: Unix ns of every step rank 0 completed. Returns ``faults``, ``recovered``,
    ``decisions_lost``, ``recovery_s`` (median, p95, max), ``training_blocked_s`` (total, in fault
    windows, outside), ``steps_per_s`` (steady outages, fault-free time without outages) and
    ``throughput_ratio``."""
    from trainguard.core import timeline

    rank0_ns = sorted(rank0_ns)
    # in the order they were injected (a lagging harness injects out of the schedule's order)
    inj = sorted((t for t in trials if t.get("injected_ns")), key=lambda t: t["injected_ns"])
    windows = []
    for i, t in enumerate(inj):
        nxt = inj[i + 1]["injected_ns"] if i + 1 < len(inj) else (rank0_ns[-1] if rank0_ns
                                                                  else t["injected_ns"])
        end = t.get("recovered_ns") or nxt
        windows.append((t["injected_ns"], max(t["injected_ns"], end)))
    windows.sort()
    rec = [(t["recovered_ns"] - t["injected_ns"]) / 1e9 for t in inj if t.get("recovered_ns")]
    gaps = stalls(rank0_ns, stall_s)
    blocked = sum((b - a) / 1e9 for a, b in gaps)
    in_faults = sum(overlap_s(g, windows) for g in gaps)
    # throughput: rank 0's steps per second in steady time, inside and outside outages
    span = (rank0_ns[0], rank0_ns[-1]) if rank0_ns else (0, 0)
    steady = _subtract(span, windows)
    outs = sorted((o["down_ns"], o["up_ns"]) for o in outages if o.get("up_ns"))
    in_out: list[tuple[int, int]] = []
    for s in steady:
        for o in outs:
            lo, hi = max(s[0], o[0]), min(s[1], o[1])
            if hi > lo:
                in_out.append((lo, hi))
    free: list[tuple[int, int]] = []
    for s in steady:
        free += _subtract(s, outs)

    def rate(ivs: list[tuple[int, int]]) -> float | None:
        dur = sum(b - a for a, b in ivs) / 1e9
        if dur <= 0:
            return None
        n = sum(1 for t in rank0_ns for a, b in ivs if a < t <= b)
        return n / dur

    r_out, r_free = rate(in_out), rate(free)
    return {
        "faults": len(inj), "recovered": len(rec),
        "decisions_lost": sum(1 for t in inj if not t.get("decided") and
                              not t.get("recovered_ns")),
        "recovery_s": {"median": round(statistics.median(rec), 3) if rec else None,
                       "p95": round(timeline.p95(rec), 3) if rec else None,
                       "max": round(max(rec), 3) if rec else None},
        "training_blocked_s": {"total": round(blocked, 2), "in_fault_windows": round(in_faults, 2),
                               "outside": round(blocked - in_faults, 2)},
        "steps_per_s": {"during_outages": round(r_out, 2) if r_out else r_out,
                        "without": round(r_free, 2) if r_free else r_free,
                        "outage_seconds": round(sum(b - a for a, b in in_out) / 1e9, 1)},
        "throughput_ratio": round(r_out / r_free, 3) if r_out and r_free else None,
    }


# ---- the live run --------------------------------------------------------------------------------
class Chaos:
    """Kills and restarts one control-plane part of ``stack`` at a time, on one worker thread
    that lives as long as the run; records each outage.

    One long-lived thread, not one per outage: the stack's children get ``PR_SET_PDEATHSIG``,
    which fires when the *thread* that started them exits, so a server or service restarted
    from a short-lived thread would be killed again as soon as that thread ended."""

    def __init__(self, stack: Any) -> None:
        import queue

        self.stack = stack
        self.outages: list[dict[str, Any]] = []
        self._q: "queue.Queue[tuple | None]" = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="tg-chaos", daemon=True)
        self._worker.start()

    def _server(self, kind: str) -> Any:
        return next(s for s in self.stack._servers.servers if s.kind == kind)

    def outage(self, target: str, down_s: float, when: str, trial: int) -> None:
        """Queue an outage of ``target`` (it starts once the previous one ended)."""
        self._q.put((target, down_s, when, trial))

    def wait(self) -> None:
        """Until every queued outage has ended."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                self._run(*item)
            finally:
                self._q.task_done()

    def _run(self, target: str, down_s: float, when: str, trial: int) -> None:
        o: dict[str, Any] = {"trial": trial, "target": target, "when": when, "down_s": down_s,
                             "down_ns": time.time_ns(), "up_ns": None, "error": None}
        self.outages.append(o)
        try:
            if target in ("nats", "valkey"):
                s = self._server(target)
                port = s.port
                s.proc.send_signal(signal.SIGKILL)
                s.proc.wait()
                time.sleep(down_s)
                s.start()
                if s.port != port:
                    o["error"] = f"{target} came back on port {s.port}, not {port}"
            else:
                self.stack.kill_service(target, signal.SIGKILL)
                time.sleep(down_s)
                self.stack._spawn(target, *self.stack._service_cmd(target))
                self.stack.wait_healthy([target], 60)
        except Exception as exc:  # noqa: BLE001 - reported with the outage
            o["error"] = f"{type(exc).__name__}: {exc}"
        o["up_ns"] = time.time_ns()


def _demo_class():
    from trainguard.demo.harness import Demo

    class ChaosDemo(Demo):
        """The demo harness, with an outage started around each fault it injects."""

        chaos: Chaos

        def inject(self, f: dict[str, Any]) -> int | None:
            if f["when"] == "steady":
                hb = self.wait_step(0, max(0, f["step"] - f["lead_steps"]), 120)
                if hb is not None:
                    self.chaos.outage(f["target"], f["down_s"], "steady", f["id"])
            ts = super().inject(f)
            if ts is not None and f["when"] == "during":
                delay = max(0.0, f["offset_s"] - (time.time_ns() - ts) / 1e9)
                threading.Timer(delay, self.chaos.outage,
                                (f["target"], f["down_s"], "during", f["id"])).start()
            return ts

        def timeline(self, f: dict[str, Any], injected: int | None,
                     wait: bool = True) -> dict[str, Any]:
            """As the demo's; a fault nothing recovered (or one that could not be injected:
            ``wait=False``, the job stalled) leaves the job stuck, so the trial is counted as
            such and the job is restarted whole (as a scheduler would) for the next trials."""
            out = super().timeline(f, injected, wait=wait)
            if not out.get("recovered") and not out.get("stopped"):
                self.say(f"trial {f['id']}: not recovered; restarting the whole job")
                self.chaos.wait()
                self.full_restart()
                out["full_restart"] = True
            return out

    return ChaosDemo


def _audit(redis_url: str, job: str) -> list[dict[str, Any]]:
    from trainguard.clients.store import StateStore

    async def go() -> list[dict[str, Any]]:
        st = StateStore(redis_url)
        try:
            return await st.audit_trail(job, count=100000)
        finally:
            await st.close()
    return asyncio.run(go())


def run(a: argparse.Namespace) -> dict[str, Any]:
    from trainguard import schemas
    from trainguard.demo.config import DemoConfig
    from trainguard.stack.local import Stack

    rmod = _recovery_module()
    root = a.keep or tempfile.mkdtemp(prefix="tg-chaos-")
    os.makedirs(root, exist_ok=True)
    progress = os.path.join(root, "progress.txt")
    open(progress, "w").close()
    # the ranks (children of the launchers) write the progress file through the bench hook
    os.environ["BENCH_PROGRESS"] = progress
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "peers", "tg_hook"), ROOT] +
        ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    schedule = make_schedule(a.trials, a.seed)
    faults = [dict(t) for t in schedule]
    stack = Stack(agent_nodes=("node0", "node1"), rendezvous=True,
                  log_dir=os.path.join(root, "logs"), kernel_log_dir=root,
                  data_dir=os.path.join(root, "state"))
    stack.start(timeout=120)
    chaos = Chaos(stack)
    Demo = _demo_class()
    cfg = DemoConfig(job="chaos", steps=total_steps(schedule), seed=a.seed, faults=faults,
                     recovery_timeout_s=a.recovery_timeout, quiet=not a.verbose,
                     # every trial is a recovery of the one job: the budget must outlast them
                     # (the default 10 stopped the job at the 10th trial)
                     retry_budget=2 * len(faults) + 10,
                     run_dir=os.path.join(root, "run"))
    demo = Demo(cfg, stack=stack)
    demo.chaos = chaos
    t0 = time.monotonic()
    try:
        rep = demo.run()
        chaos.wait()
        events = demo.rec.events if demo.rec else []
        audit = _audit(stack.redis_url, cfg.job)
        dead = stack.dead()
    finally:
        chaos.close()
        stack.stop()
    recs, _ = rmod.load_progress(open(progress))
    decided_ids = {r.get("decision_id") for r in audit if r.get("type") == "decision"}
    decisions = [e for e in events if isinstance(e, schemas.Decision)]
    trials = []
    injected = sorted(f["injected_ns"] for f in rep["faults"] if f.get("injected_ns"))
    for t, r in zip(schedule, rep["faults"]):
        inj = r.get("injected_ns")
        # the next fault injected after this one: not the next in the schedule, which fires
        # first when the harness lags (an exception raises itself at its step while the harness
        # still waits on the previous trial's outage; a 100-trial run had steps 4650, 4740 and
        # 4830 injected at +0.19, +0.48 and +0 s, and the zero-width window of the middle one
        # counted its decision lost)
        nxt = next((x for x in injected if inj and x > inj), None)
        rv = rmod.recovery(recs, inj) if inj else None
        rec_ns = rv["resumed_ns"] if rv and (nxt is None or rv["resumed_ns"] < nxt) else None
        if r.get("full_restart"):
            rec_ns = None  # the bench restarted the job whole: trainguard did not recover it
        # a decision for this fault: from just before it until the next fault or the timeout
        # (a later one belongs to the whole-job restart, not to this fault)
        until = min(nxt or 2**63, (inj or 0) + int(a.recovery_timeout * 1e9))
        audit_dec = [x for x in audit if x.get("type") == "decision" and inj and
                     x.get("action") != "none" and inj - 5e8 <= int(x.get("ts") or 0) < until]
        bus_dec = [d for d in decisions if inj and d.action != "none" and
                   inj - 5e8 <= d.ts < until]
        trials.append({**t, "injected_ns": inj, "recovered_ns": rec_ns,
                       "recovery_s": round((rec_ns - inj) / 1e9, 3) if rec_ns else None,
                       "decided": bool(audit_dec or bus_dec),
                       "decision": (r.get("decision") or {}).get("action"),
                       "harness_recovered": r.get("recovered"),
                       "full_restart": bool(r.get("full_restart")),
                       "timeline": r.get("timeline")})
    rank0 = [x.t for x in recs if x.rank == 0]
    acc = account(trials, chaos.outages, rank0)
    acc["recovery_tails"] = recovery_tails(trials)
    dup = duplicate_actions(
        [{"idempotency_key": e.idempotency_key, "executor": e.executor, "ok": e.ok,
          "skipped": e.skipped} for e in events if isinstance(e, schemas.ActionResult)],
        audit,
        [{"rank": e.rank, "decision_id": e.decision_id} for e in events
         if isinstance(e, schemas.TrainingResumed)])
    out = {"trials": len(schedule), "seed": a.seed, **acc, "duplicate_actions": dup["count"],
           "full_restarts": sum(t["full_restart"] for t in trials),
           "duplicates": dup, "decisions_in_audit": len(decided_ids),
           "outage_errors": [o for o in chaos.outages if o["error"]],
           "outages_by_target": _by_target(trials), "service_deaths_at_end": dead,
           "accuracy": rep.get("accuracy"), "baseline_accuracy": rep.get("baseline_accuracy"),
           "wall_s": round(time.monotonic() - t0, 1), "run_dir": root,
           "per_trial": trials, "outages": chaos.outages}
    if not a.keep:
        shutil.rmtree(os.path.join(root, "state"), ignore_errors=True)
    return out


def recovery_tails(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Distributions of the trials' recovery seconds (``trainguard.core.timeline.tails``: median,
    p95, max, each trial over 2 x its group's median or never recovered with the phase that
    took the extra time) — all trials (``"all"``), and by the fault's kind and the outage's
    moment (``"sigkill/steady"``, ``"exception/during"``, …): a fault whose recovery ran into
    an outage is compared with its own kind."""
    from trainguard.core import timeline

    groups: dict[str, list[dict[str, Any]]] = {"all": list(trials)}
    for t in trials:
        groups.setdefault(f"{t.get('kind')}/{t.get('when')}", []).append(t)
    out = {}
    for name, ts in groups.items():
        d = timeline.tails([t.get("recovery_s") for t in ts], [t.get("timeline") for t in ts])
        for sr in d["slow_runs"]:  # the trial's own id and outage beside its index in the group
            t = ts[sr["run"]]
            sr.update(trial=t.get("id"), target=t.get("target"), when=t.get("when"))
        out[name] = d
    return out


def _by_target(trials: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in trials:
        d = out.setdefault(t["target"], {"trials": 0, "recovered": 0, "decided": 0})
        d["trials"] += 1
        d["recovered"] += bool(t["recovered_ns"])
        d["decided"] += bool(t["decided"])
    return out


def print_report(r: dict[str, Any]) -> None:
    print(f"\n{r['trials']} trials ({r['faults']} faults injected), {r['wall_s']} s")
    print(f"{'target':22} {'trials':>6} {'decided':>7} {'recovered':>9}")
    for k, v in sorted(r["outages_by_target"].items()):
        print(f"{k:22} {v['trials']:6} {v['decided']:7} {v['recovered']:9}")
    print(f"\nrecovered {r['recovered']}/{r['faults']}; recovery s median "
          f"{r['recovery_s']['median']} p95 {r['recovery_s'].get('p95')} "
          f"max {r['recovery_s']['max']}")
    for name, d in sorted((r.get("recovery_tails") or {}).items()):
        print(f"  {name:20} n={d['n']:3} median {d['median_s']} p95 {d['p95_s']} max {d['max_s']}")
        for sr in d["slow_runs"] if name == "all" else []:
            print(f"    slow: trial {sr['trial']} ({sr['target']}, {sr['when']}): {sr['seconds']} s,"
                  f" slow phase {sr['slow_phase']} (+{sr['extra_s']} s over its median)")
    print(f"decisions_lost {r['decisions_lost']}; duplicate_actions {r['duplicate_actions']}; "
          f"whole-job restarts after a stuck trial {r['full_restarts']}")
    b = r["training_blocked_s"]
    print(f"training_blocked_s {b['total']} (in fault windows {b['in_fault_windows']}, "
          f"outside {b['outside']})")
    sp = r["steps_per_s"]
    print(f"steps/s during steady outages {sp['during_outages']} ({sp['outage_seconds']} s) vs "
          f"without {sp['without']}: ratio {r['throughput_ratio']} (target ≥ 0.95)")
    if r["outage_errors"]:
        print(f"outage errors: {[(o['target'], o['error']) for o in r['outage_errors']]}")
    if r["service_deaths_at_end"]:
        print(f"processes dead at the end: {r['service_deaths_at_end']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=None, help="trials (100; 4 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", metavar="PATH", help="write the figures there")
    p.add_argument("--quick", action="store_true", help="4 trials")
    p.add_argument("--recovery-timeout", type=float, default=40.0,
                   help="seconds a fault may take to recover before the job is restarted whole "
                        "for the next trial (40)")
    p.add_argument("--keep", default="", metavar="DIR", help="keep logs and state in DIR")
    p.add_argument("--verbose", action="store_true", help="the harness's progress lines")
    a = p.parse_args(argv)
    if a.trials is None:
        a.trials = 4 if a.quick else 100
    if a.trials < 1:
        p.error("--trials must be ≥ 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load0 = provenance.loadavg()
    r = run(a)
    r["provenance"] = provenance.record(load0)
    print_report(r)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=2, default=str)
        print(f"figures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Node faults on a real cluster on one machine (``trainguard.cluster``): seconds from the fault
to every rank training again, for trainguard and for Slurm alone with ``--requeue``.

    python bench/cluster.py --json cluster.json [--faults power_off,partition,slow_link,
                            slurmd_death,partition_requeue] [--systems trainguard,slurm]
                            [--runs N] [--timeout S] [--nproc-per-node N]

The job: ``trainguard/cluster/train.py`` (a small MLP, DDP over gloo, a checkpoint every 5
steps), 2 nodes × 2 ranks, and a third node: trainguard's spare node (``--spare-node``), or the
third node of Slurm's partition. Each node is a network and UTS namespace on a private bridge;
the control plane (NATS, Valkey, rendezvous store, services) and slurmctld listen on the host
side. The fault hits node1 when its rank 3 completes step 15:

* ``power_off`` — node1's link down and every process in it SIGKILLed;
* ``partition`` — node1's veth down (healed after 20 s);
* ``slow_link`` — node1's link limited to 100 kbit/s both ways (tc tbf) for 30 s;
* ``slurmd_death`` — node1's slurmd SIGKILLed (in the node's namespace): the node, its network
  and its training processes are healthy, only Slurm's daemon is gone. Both systems run under
  Slurm here (trainguard: ``sbatch`` in action mode, 2 nodes and a spare node in the
  allocation, ``--no-kill``). The figure is ``acted_s``: fault → the system acted on node1
  (Slurm: node1 DOWN, after ``SlurmdTimeout``; trainguard: its first decision naming node1;
  null: it did nothing within ``SLURMD_WINDOW_S``); ``moved_work``: training stopped or moved
  (a new generation after the fault, or a rank silent for more than 5 s); ``culprit_correct``:
  the system did not move work off the healthy node (Slurm alone: false when it requeued the
  job, whose ranks on node1 it can no longer kill); ``seconds`` is ``again_s`` when work moved
  (training again), else ``acted_s``;
* ``partition_requeue`` — trainguard only: the partition of node1 under ``sbatch`` with no
  spare node and ``--min-world-size 4``: the requeue path (the Slurm controller drains node1,
  sets it DOWN, requeues the job without it and releases Slurm's hold; the requeued job resumes
  from the newest valid checkpoint); ``decision_to_again_s`` beside ``again_s``. Slurm alone's
  figure for the same fault is its ``partition`` row (it has no other path).

Figures per (system, fault), read from the ranks' per-step records (``steps.jsonl``), the same
way for both systems: ``again_s`` — fault → the last rank of the newest generation that started
after the fault completed its first step (``trainguard.cluster.training_again``); null when that
did not happen within ``--timeout``; ``steps_rolled_back`` — the newest step every old rank had
completed minus the step training started again after (``rolled_back``); ``culprit_correct`` —
trainguard: its first decision naming a node names node1 alone (the slow link: a verdict named
node1 or its ranks); Slurm alone: node1 alone is DOWN (the slow link: node1 set DOWN). For
``slow_link`` the figure is ``named_s``: fault → the first verdict naming node1 (or one of its
ranks) on the bus; ``steps_per_s_before`` / ``_during`` show what the slow link did to training.
Slurm alone (``trainguard launch --mode observe`` under ``sbatch --requeue``: decisions
published, none executed) recovers only by Slurm requeueing the job once slurmd has not
answered for ``SlurmdTimeout`` (10 s here) and starting it again; Slurm 22.05 makes a requeued
batch job eligible again only about 2 minutes later (``EligibleTime``, recorded per run), so its
figure is bounded by ``--slurm-timeout`` (330 s), not ``--timeout``.

Every run records its ``timeline`` (``trainguard.core.timeline``: when the fault was injected,
the last progress, detection, verdict, decision, each node's executor, the rendezvous and every
rank's first step, from the bus, the audit trail and the step records; Slurm alone: the step
records only).

``--json PATH`` writes a list of rows, one per (system, fault) (``row``): ``system``,
``fault``, ``seconds`` (the median of the runs' figures: ``again_s``, ``named_s`` or
``acted_s``, named in ``metric``), ``p95_s`` and ``max_s`` beside it, ``culprit_correct``
(true when every run's was), ``steps_rolled_back`` (median), ``median_phases`` (each phase's
median seconds), ``slow_runs`` (every run over 2 × the median, or without a figure, with the
phase that took the extra time: ``trainguard.core.timeline.tails``), ``runs_correct``,
``fault_spec``, ``conditions`` and ``runs`` (every run's record; a partition's carries
``waited_for_heal``: training again only after the link came back, and
``decided_before_fault``: decisions that moved the job before the fault fired).
``--keep-logs-over S DIR`` copies the logs of each run whose figure exceeds S seconds (or is missing) to DIR.

SIGTERM or SIGINT at any moment stops the cluster of the run under way (namespaces, veths,
daemons, processes) before the bench exits (``trainguard.cluster.stop_on_signals``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard import schemas  # noqa: E402

from trainguard.core import timeline
from trainguard.cluster import Cluster, ClusterConfig, FaultRunner, training_again  # noqa: E402
from trainguard.cluster.harness import stop_on_signals  # noqa: E402
from trainguard.core.fault_schedule import parse  # noqa: E402
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

FAULTS = {
    "power_off": {"kind": "power_off", "node": "node1", "step": 15, "rank": 3},
    "partition": {"kind": "partition", "node": "node1", "step": 15, "rank": 3,
                  "heal_after_s": 20},
    "slow_link": {"kind": "slow_link", "node": "node1", "step": 15, "rank": 3,
                  "rate": "100kbit", "duration_s": 30},
    # not a fault schedule's kind: carried out here (SlurmCluster.kill_slurmd)
    "slurmd_death": {"kind": "slurmd_death", "node": "node1", "step": 15, "rank": 3},
    "partition_requeue": {"kind": "partition", "node": "node1", "step": 15, "rank": 3,
                          "heal_after_s": 20},
}
STEPS = 200
#: seconds watched after a slurmd death: SlurmdTimeout (10 s) and Slurm's requeue of the job
SLURMD_WINDOW_S = 40.0


def job_args(fault: str) -> list[str]:
    """The training job's arguments: ``STEPS`` steps (a slurmd death is watched for
    ``SLURMD_WINDOW_S``: the job must not end on its own meanwhile)."""
    steps = 100000 if fault == "slurmd_death" else STEPS
    return ["--steps", str(steps), "--ckpt-every", "5", "--step-sleep", "0.05"]


def _rate(recs: list[dict], t0: float, t1: float) -> float | None:
    n = len([r for r in recs if r["rank"] == 0 and t0 <= r["t"] < t1])
    return round(n / (t1 - t0), 2) if t1 > t0 else None


def rolled_back(recs: list[dict], again: dict | None) -> int | None:
    """Steps trained again after the recovery: the newest step every rank of the older
    generations had completed, minus the step the new generation started after (0: nothing
    lost); None without a recovery."""
    if not again:
        return None
    old = [r for r in recs if r["gen"] < again["gen"]]
    if not old:
        return None
    common = min(max(r["step"] for r in old if r["rank"] == k) for k in {r["rank"] for r in old})
    return common - (again["first_step"] - 1)


def audit_trail(c: Cluster, job: str) -> list[dict]:
    """The job's audit trail from the cluster's state store (role ``reader``); [] when it
    cannot be read."""
    from trainguard.clients.store import StateStore

    async def read() -> list[dict]:
        st = StateStore(c.stack.urls("reader")[1])
        try:
            return await st.audit_trail(job, count=10000)
        finally:
            await st.close()

    try:
        return asyncio.run(read())
    except Exception:  # noqa: BLE001 - the timeline goes without it
        return []


def run_timeline(c: Cluster, job: str, t_f: float, rec=None) -> dict:
    """The run's recovery timeline (``trainguard.core.timeline``), ``to_dict()`` form."""
    return timeline.build(int(t_f * 1e9), rec.of(schemas.Event, int(t_f * 1e9)) if rec else (),
                          audit_trail(c, job) if rec else (), c.steps(job)).to_dict()


KEEP: dict = {}  # --keep-logs-over: {"over": seconds, "dir": path}


def keep_logs(c: Cluster, fault: str, value: float | None) -> None:
    """Copy the cluster's logs of a run whose figure exceeds ``--keep-logs-over``."""
    if not KEEP or (value is not None and value <= KEEP["over"]):
        return
    dest = os.path.join(KEEP["dir"], f"{fault}-{int(time.time())}")
    shutil.copytree(os.path.join(c.run_dir, "logs"), dest, dirs_exist_ok=True)
    print(f"  logs of this run kept in {dest}", flush=True)


def _fire(c: Cluster, job: str, spec: dict, timeout: float) -> tuple[FaultRunner, float | None]:
    """Start a ``FaultRunner`` of ``spec`` on ``job``; returns it (to cancel) and the Unix s the
    fault fired at (None: the job did not reach its step within 200 s)."""
    runner = FaultRunner(c, job, parse([spec]), timeout_s=timeout + 200)
    runner.start()
    deadline = time.monotonic() + 200
    while not runner.fired and time.monotonic() < deadline:
        time.sleep(0.05)
    return runner, (runner.fired[0]["ts"] if runner.fired else None)


def _trigger(c: Cluster, job: str, spec: dict, timeout: float = 200.0) -> float | None:
    """Unix s of the first record of ``spec``'s rank at its step (None: not reached)."""
    r = c.wait_step(job, spec["step"], rank=spec["rank"], timeout=timeout)
    return r["t"] if r else None


def _gaps(recs: list[dict], t0: float, t1: float) -> float:
    """The longest time, seconds, in [t0, t1] during which some rank recorded no step."""
    worst = 0.0
    for k in {r["rank"] for r in recs}:
        ts = sorted([t0, *[r["t"] for r in recs if r["rank"] == k and t0 <= r["t"] <= t1], t1])
        worst = max(worst, max(b - a for a, b in zip(ts, ts[1:])))
    return round(worst, 2)


def _watch_slurmd_death(c: Cluster, job: str, t_f: float, rec=None) -> dict:
    """What follows node1's slurmd death within ``SLURMD_WINDOW_S``: when Slurm set it DOWN,
    the first decision naming it (``rec``: trainguard's Recorder), whether work moved."""
    out: dict = {"fault_unix_s": t_f, "slurm_down_s": None, "acted_s": None}
    deadline = t_f + SLURMD_WINDOW_S
    while time.time() < deadline:
        if out["slurm_down_s"] is None and c.slurm.node_states().get(
                "node1", "").startswith("down"):
            out["slurm_down_s"] = round(time.time() - t_f, 2)
        time.sleep(0.2)
    recs = c.steps(job)
    again = training_again(recs, t_f)
    out["gap_s"] = _gaps([r for r in recs if r["gen"] == max(
        (x["gen"] for x in recs if x["t"] <= t_f), default=0)], t_f, deadline) if not again \
        else None
    out["moved_work"] = bool(again) or (out["gap_s"] or 0) > 5.0
    if again:
        out.update(again_s=round(again["t"] - t_f, 3), hosts=again["hosts"],
                   steps_rolled_back=rolled_back(recs, again))
    if rec is not None:
        decs = rec.of(schemas.Decision, int(t_f * 1e9))
        out["decisions"] = [d.action for d in decs]
        named = [d for d in decs if "node1" in d.nodes]
        out["acted_s"] = round(named[0].ts / 1e9 - t_f, 3) if named else None
    else:
        out["acted_s"] = out["slurm_down_s"]
    out["culprit_correct"] = not out["moved_work"]
    out.setdefault("steps_rolled_back", 0 if not out["moved_work"] else None)
    return out


def run_trainguard_slurm(fault: str, timeout: float, nproc: int = 2) -> dict:
    """trainguard in action mode under a real Slurm (``Cluster.sbatch``): ``slurmd_death``
    (2 nodes and a spare node in the allocation) or ``partition_requeue`` (no spare,
    ``--min-world-size`` 2 × ``nproc``: the requeue path). ``nproc`` ranks per node; the fault
    fires at node1's last rank's step."""
    from trainguard.demo.recorder import Recorder

    job, spec = f"b-{fault}", {**FAULTS[fault], "rank": 2 * nproc - 1}
    with Cluster(ClusterConfig(nodes=3, slurm=True, slurmd_timeout_s=10)) as c:
        rec = Recorder(c.stack.nats_url, job)
        try:
            spares = 1 if fault == "slurmd_death" else 0
            jid = c.sbatch(job, 2, spares, nproc, extra=["--min-world-size", str(2 * nproc)],
                           ckpt_dir=os.path.join(c.run_dir, f"ckpt-{job}"),
                           script_args=["--records", c.records_dir(job), *job_args(fault)])
            if fault == "slurmd_death":
                if _trigger(c, job, spec) is None:
                    return {"error": "the job did not reach the fault's step", "slurm_job": jid}
                out = _watch_slurmd_death(c, job, c.slurm.kill_slurmd(spec["node"]), rec)
                out["slurm_job"] = jid
                return out
            runner, t_f = _fire(c, job, spec, timeout)
            if t_f is None:
                return {"error": "the job did not reach the fault's step", "slurm_job": jid}
            out = {"fault_unix_s": t_f, "slurm_job": jid, "again_s": None}
            deadline = time.monotonic() + timeout
            again = None
            while time.monotonic() < deadline and not again:
                again = training_again(c.steps(job), t_f)
                time.sleep(0.1)
            decs = rec.of(schemas.Decision, int(t_f * 1e9))
            named = [d for d in decs if d.nodes]
            out["decisions"] = [d.action for d in decs]
            out["culprit_correct"] = bool(named) and named[0].nodes == ["node1"]
            if again:
                out.update(again_s=round(again["t"] - t_f, 3), world=again["world"],
                           hosts=again["hosts"],
                           steps_rolled_back=rolled_back(c.steps(job), again))
                if named:
                    out["decision_to_again_s"] = round(again["t"] - named[0].ts / 1e9, 3)
            st = c.slurm.job_state(jid)
            out.update(slurm_state=st.get("JobState"), restarts=st.get("Restarts"))
            out["timeline"] = run_timeline(c, job, t_f, rec)
            keep_logs(c, fault, out["again_s"])
            runner.cancel()
            return out
        finally:
            rec.close()


def run_trainguard(fault: str, timeout: float, nproc: int = 2) -> dict:
    from trainguard.demo.recorder import Recorder

    if fault in ("slurmd_death", "partition_requeue"):
        return run_trainguard_slurm(fault, timeout, nproc)
    job = f"b-{fault}"
    with Cluster(ClusterConfig(nodes=3)) as c:
        rec = Recorder(c.stack.nats_url, job)
        try:
            c.launch(job, ["node0", "node1"], ["node2"], 2, script_args=[
                "--records", c.records_dir(job), *job_args(fault)])
            runner, t_f = _fire(c, job, FAULTS[fault], timeout)
            early = [f"{d.action} g{d.generation} nodes {d.nodes}: {d.fault_class}"
                     for d in rec.of(schemas.Decision) if d.execute and d.action != "none"
                     and (t_f is None or d.ts < t_f * 1e9)]
            if t_f is None:
                return {"error": "the job did not reach the fault's step on node1",
                        "decided_before_fault": early}
            out: dict = {"fault_unix_s": t_f}
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if fault == "slow_link":
                    named = [v for v in rec.of(schemas.Verdict, int(t_f * 1e9))
                             if "node1" in v.culprit.nodes or {2, 3} & set(v.culprit.ranks)]
                    if named:
                        out["named_s"] = round(named[0].ts / 1e9 - t_f, 3)
                        out["verdict"] = named[0].fault_class
                        break
                else:
                    again = training_again(c.steps(job), t_f)
                    if again:
                        out.update(again_s=round(again["t"] - t_f, 3), world=again["world"],
                                   hosts=again["hosts"])
                        break
                time.sleep(0.1)
            if fault == "slow_link":
                out.setdefault("named_s", None)
                recs = c.steps(job)
                out["steps_per_s_before"] = _rate(recs, t_f - 10, t_f)
                out["steps_per_s_during"] = _rate(recs, t_f, min(time.time(), t_f + 10))
            else:
                out.setdefault("again_s", None)
                again = training_again(c.steps(job), t_f)
                out["steps_rolled_back"] = rolled_back(c.steps(job), again)
            decs = rec.of(schemas.Decision, int(t_f * 1e9))
            out["decisions"] = [d.action for d in decs]
            # the culprit named: the node of the first decision that names one (a node fault),
            # the node or its ranks in the first verdict that names them (the slow link)
            named = [d.nodes for d in decs if d.nodes]
            out["culprit_correct"] = (out["named_s"] is not None if fault == "slow_link"
                                      else bool(named) and named[0] == ["node1"])
            out["timeline"] = run_timeline(c, job, t_f, rec)
            if FAULTS[fault].get("heal_after_s") and out.get("again_s") is not None:
                # training again only once the node was back: recovery waited for the heal
                out["waited_for_heal"] = out["again_s"] >= FAULTS[fault]["heal_after_s"]
            if early:  # the job moved before the fault (e.g. a straggler at start-up)
                out["decided_before_fault"] = early
            keep_logs(c, fault, seconds_of(fault, out)[1])
            runner.cancel()
            return out
        finally:
            rec.close()


def run_slurm(fault: str, timeout: float) -> dict:
    if fault == "partition_requeue":
        return {"error": "Slurm alone has one path for a partition: see its partition row"}
    job = f"s-{fault}"
    tmp = tempfile.mkdtemp(prefix="tg-bench-slurm-")
    with Cluster(ClusterConfig(nodes=3, slurm=True, slurmd_timeout_s=10)) as c:
        argv = c.launch_argv(job, 2, None, "$(hostname)", 2, mode="observe", script_args=[
            "--records", c.records_dir(job), *job_args(fault)])
        cmd = " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)
        script = os.path.join(tmp, "job.sbatch")
        with open(script, "w") as fh:
            fh.write(f"#!/bin/bash\nsrun --ntasks-per-node=1 bash -c {shlex.quote('exec ' + cmd)}\n")
        env = {**c.worker_env(), "GLOO_SOCKET_IFNAME": "eth0"}
        os.environ.update(env)
        try:
            jid = c.slurm.sbatch(script, "-N", "2", "--requeue", "-o",
                                 os.path.join(tmp, "slurm-%j.out"))
        finally:
            for k in env:
                os.environ.pop(k, None)
        if fault == "slurmd_death":
            if _trigger(c, job, FAULTS[fault]) is None:
                return {"error": "the job did not reach the fault's step", "slurm_job": jid}
            out = _watch_slurmd_death(c, job, c.slurm.kill_slurmd("node1"))
            if out["moved_work"] and "again_s" not in out:  # requeued: wait for its restart
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    again = training_again(c.steps(job), out["fault_unix_s"])
                    if again:
                        out.update(again_s=round(again["t"] - out["fault_unix_s"], 3),
                                   hosts=again["hosts"],
                                   steps_rolled_back=rolled_back(c.steps(job), again))
                        break
                    time.sleep(0.2)
            st = c.slurm.job_state(jid)
            out.update(slurm_job=jid, slurm_state=st.get("JobState"),
                       restarts=st.get("Restarts"), eligible=st.get("EligibleTime"))
            return out
        runner, t_f = _fire(c, job, FAULTS[fault], timeout)
        if t_f is None:
            return {"error": "the job did not reach the fault's step", "slurm_job": jid}
        out: dict = {"fault_unix_s": t_f, "slurm_job": jid}
        deadline = time.monotonic() + timeout
        key = "named_s" if fault == "slow_link" else "again_s"
        out[key] = None
        down: set[str] = set()  # the nodes Slurm set DOWN meanwhile: its culprit
        while time.monotonic() < deadline:
            down |= {n for n, s in c.slurm.node_states().items() if s.startswith("down")}
            if fault == "slow_link":
                if "DOWN" in c.slurm.run("scontrol", "show", "node", "-o", "node1", check=False):
                    out[key] = round(time.time() - t_f, 3)
                    break
            else:
                again = training_again(c.steps(job), t_f)
                if again:
                    out.update(again_s=round(again["t"] - t_f, 3), world=again["world"],
                               hosts=again["hosts"])
                    break
            time.sleep(0.2)
        if key == "again_s":
            out["steps_rolled_back"] = rolled_back(
                c.steps(job), training_again(c.steps(job), t_f) if out[key] else None)
        out["slurm_down"] = sorted(down)
        out["culprit_correct"] = (out[key] is not None if fault == "slow_link"
                                  else out["slurm_down"] == ["node1"])
        st = c.slurm.job_state(jid)
        out.update(slurm_state=st.get("JobState"), restarts=st.get("Restarts"),
                   eligible=st.get("EligibleTime"), started=st.get("StartTime"))
        out["timeline"] = run_timeline(c, job, t_f)
        runner.cancel()
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--systems", default="trainguard,slurm")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a trainguard recovery may take before it counts as none")
    p.add_argument("--nproc-per-node", type=int, default=2,
                   help="ranks per node of the jobs under sbatch (slurmd_death, "
                        "partition_requeue): 1 gives each node's ranks a core of their own "
                        "on a 2-core machine, as nodes have")
    p.add_argument("--slurm-timeout", type=float, default=330.0,
                   help="the same for Slurm alone (it holds a requeued job ≈ 2 min)")
    p.add_argument("--keep-logs-over", nargs=2, metavar=("SECONDS", "DIR"), default=None,
                   help="copy the logs of every run slower than SECONDS (or with no figure) "
                        "to DIR")
    p.add_argument("--conditions", default="",
                   help="what else ran on the machine meanwhile (recorded in the JSON)")
    a = p.parse_args(argv)
    load0 = provenance.loadavg()
    if a.keep_logs_over:
        KEEP.update(over=float(a.keep_logs_over[0]), dir=a.keep_logs_over[1])
    stop_on_signals()
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {', '.join(bad)}: choose from {', '.join(FAULTS)}")
    systems = [s for s in a.systems.split(",") if s]
    if set(systems) - {"trainguard", "slurm"}:
        p.error("--systems: trainguard and/or slurm")
    rows: list[dict] = []
    for system in systems:
        for fault in faults:
            runs = []
            for i in range(a.runs):
                try:
                    r = (run_trainguard(fault, a.timeout, a.nproc_per_node)
                         if system == "trainguard" else run_slurm(fault, a.slurm_timeout))
                except Exception as exc:  # noqa: BLE001 - one failed trial is reported, not fatal
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                runs.append(r)
                metric, val = seconds_of(fault, r)
                extra = {k: r[k] for k in ("culprit_correct", "steps_rolled_back", "moved_work",
                                           "slurm_down_s", "decision_to_again_s",
                                           "steps_per_s_before", "steps_per_s_during",
                                           "decisions", "eligible", "error",
                                           "decided_before_fault", "waited_for_heal") if k in r}
                tl = r.get("timeline") or {}
                phases = " ".join(f"{k}={v}" for k, v in (tl.get("seconds") or {}).items()
                                  if k != "fault" and v is not None)
                print(f"{system:<10} {fault:<17} run {i + 1}: {metric} = {val} {extra}"
                      + (f"\n    timeline (s from fault): {phases}" if phases else ""),
                      flush=True)
            rows.append(row(system, fault, runs))
            rows[-1]["provenance"] = provenance.record(load0)
            rows[-1]["conditions"] = conditions(a.conditions)
            if a.json:  # after every (system, fault): an interrupted run keeps what it measured
                with open(a.json, "w") as fh:
                    json.dump(rows, fh, indent=2)
    print(f"\n{'system':<10} {'fault':<17} {'metric':<8} {'median':>8} {'p95':>8} {'max':>8} "
          f"recovered culprit_correct steps_rolled_back")
    for r in rows:
        print(f"{r['system']:<10} {r['fault']:<17} {r['metric']:<8} {str(r['seconds']):>8} "
              f"{str(r['p95_s']):>8} {str(r['max_s']):>8} {r['recovered']:>9} "
              f"{str(r['culprit_correct']):>15} {str(r['steps_rolled_back']):>17}")
        for s in r["slow_runs"]:
            print(f"    slow run {s['run'] + 1}: {s['seconds']} s, slow phase {s['slow_phase']} "
                  f"(+{s['extra_s']} s over its median)")
    return 0


def conditions(note: str = "") -> dict:
    """What the figures were taken under: cores, load average at the end, the note given."""
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "note": note}


def seconds_of(fault: str, r: dict) -> tuple[str, float | None]:
    """The figure of one run: ``(metric, seconds)`` (see the module docstring)."""
    if fault == "slow_link":
        return "named_s", r.get("named_s")
    if fault == "slurmd_death":
        if r.get("moved_work"):
            return "again_s", r.get("again_s")
        return "acted_s", r.get("acted_s")
    return "again_s", r.get("again_s")


def row(system: str, fault: str, runs: list[dict]) -> dict:
    """One row of the JSON list: ``system``, ``fault``, ``seconds`` (the median of the runs'
    figures; null when none had one), ``p95_s``, ``max_s``, ``recovered`` (runs with a figure /
    runs), ``median_phases``, ``slow_runs`` (``trainguard.core.timeline.tails``),
    ``culprit_correct`` (every run's), ``steps_rolled_back`` (median), and ``metric``,
    ``runs_correct``, ``runs`` (each run's record), ``fault_spec``."""
    figs = [seconds_of(fault, r) for r in runs]
    vals = [v for _, v in figs if v is not None]
    lost = [r["steps_rolled_back"] for r in runs if r.get("steps_rolled_back") is not None]
    metrics = sorted({m for m, _ in figs})
    dist = timeline.tails([v for _, v in figs], [r.get("timeline") for r in runs])
    return {"system": system, "fault": fault,
            "seconds": round(statistics.median(vals), 3) if vals else None,
            "p95_s": dist["p95_s"], "recovered": f"{dist['recovered']}/{dist['n']}",
            "median_phases": dist["median_phases"], "slow_runs": dist["slow_runs"],
            "culprit_correct": bool(runs) and all(r.get("culprit_correct") for r in runs),
            "steps_rolled_back": statistics.median(lost) if lost else None,
            "metric": "/".join(metrics), "max_s": max(vals) if vals else None,
            "runs_correct": f"{sum(bool(r.get('culprit_correct')) for r in runs)}/{len(runs)}",
            "fault_spec": FAULTS[fault], "runs": runs}


if __name__ == "__main__":
    sys.exit(main())

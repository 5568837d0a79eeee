"""Node faults on a real cluster on one machine (``trainguard.cluster``): seconds from the fault
to every rank training again, for trainguard and for Slurm alone with ``--requeue``.

    python bench/cluster.py --json cluster.json [--faults power_off,partition,slow_link]
                            [--systems trainguard,slurm] [--runs N] [--timeout S]

The job: ``trainguard/cluster/train.py`` (a small MLP, DDP over gloo, a checkpoint every 5
steps), 2 nodes × 2 ranks, and a third node: trainguard's spare node (``--spare-node``), or the
third node of Slurm's partition. Each node is a network and UTS namespace on a private bridge;
the control plane (NATS, Valkey, rendezvous store, services) and slurmctld listen on the host
side. The fault hits node1 when its rank 3 completes step 15:

* ``power_off`` — node1's link down and every process in it SIGKILLed;
* ``partition`` — node1's veth down (healed after 20 s);
* ``slow_link`` — node1's link limited to 100 kbit/s both ways (tc tbf) for 30 s.

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
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainguard import schemas  # noqa: E402
from trainguard.cluster import Cluster, ClusterConfig, FaultRunner, training_again  # noqa: E402
from trainguard.fault_schedule import parse  # noqa: E402

FAULTS = {
    "power_off": {"kind": "power_off", "node": "node1", "step": 15, "rank": 3},
    "partition": {"kind": "partition", "node": "node1", "step": 15, "rank": 3,
                  "heal_after_s": 20},
    "slow_link": {"kind": "slow_link", "node": "node1", "step": 15, "rank": 3,
                  "rate": "100kbit", "duration_s": 30},
}
STEPS = 200


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


def run_trainguard(fault: str, timeout: float) -> dict:
    from trainguard.demo.harness import Recorder

    job = f"b-{fault}"
    with Cluster(ClusterConfig(nodes=3)) as c:
        rec = Recorder(c.stack.nats_url, job)
        try:
            c.launch(job, ["node0", "node1"], ["node2"], 2, script_args=[
                "--records", c.records_dir(job), "--steps", str(STEPS), "--ckpt-every", "5",
                "--step-sleep", "0.05"])
            runner = FaultRunner(c, job, parse([FAULTS[fault]]), timeout_s=timeout + 200)
            runner.start()
            deadline = time.monotonic() + 200
            while not runner.fired and time.monotonic() < deadline:
                time.sleep(0.05)
            if not runner.fired:
                return {"error": "the job did not reach the fault's step"}
            t_f = runner.fired[0]["ts"]
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
            runner.cancel()
            return out
        finally:
            rec.close()


def run_slurm(fault: str, timeout: float) -> dict:
    job = f"s-{fault}"
    tmp = tempfile.mkdtemp(prefix="tg-bench-slurm-")
    with Cluster(ClusterConfig(nodes=3, slurm=True, slurmd_timeout_s=10)) as c:
        argv = c.launch_argv(job, 2, None, "$(hostname)", 2, mode="observe", script_args=[
            "--records", c.records_dir(job), "--steps", str(STEPS), "--ckpt-every", "5",
            "--step-sleep", "0.05"])
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
        runner = FaultRunner(c, job, parse([FAULTS[fault]]), timeout_s=timeout + 200)
        runner.start()
        deadline = time.monotonic() + 200
        while not runner.fired and time.monotonic() < deadline:
            time.sleep(0.05)
        if not runner.fired:
            return {"error": "the job did not reach the fault's step", "slurm_job": jid}
        t_f = runner.fired[0]["ts"]
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
    p.add_argument("--slurm-timeout", type=float, default=330.0,
                   help="the same for Slurm alone (it holds a requeued job ≈ 2 min)")
    a = p.parse_args(argv)
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        p.error(f"unknown fault(s) {', '.join(bad)}: choose from {', '.join(FAULTS)}")
    systems = [s for s in a.systems.split(",") if s]
    if set(systems) - {"trainguard", "slurm"}:
        p.error("--systems: trainguard and/or slurm")
    results: dict = {}
    t0 = time.monotonic()
    for system in systems:
        for fault in faults:
            runs = []
            for i in range(a.runs):
                fn = run_trainguard if system == "trainguard" else run_slurm
                try:
                    r = fn(fault, a.timeout if system == "trainguard" else a.slurm_timeout)
                except Exception as exc:  # noqa: BLE001 - one failed trial is reported, not fatal
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                runs.append(r)
                key = "named_s" if fault == "slow_link" else "again_s"
                extra = {k: r[k] for k in ("culprit_correct", "steps_rolled_back",
                                           "steps_per_s_before", "steps_per_s_during",
                                           "decisions", "eligible", "error") if k in r}
                print(f"{system:<10} {fault:<10} run {i + 1}: {key} = {r.get(key)} {extra}",
                      flush=True)
            key = "named_s" if fault == "slow_link" else "again_s"
            vals = [r[key] for r in runs if r.get(key) is not None]
            lost = [r["steps_rolled_back"] for r in runs
                    if r.get("steps_rolled_back") is not None]
            results[f"{system}/{fault}"] = {
                "metric": key, "median_s": statistics.median(vals) if vals else None,
                "max_s": max(vals) if vals else None, "recovered": f"{len(vals)}/{len(runs)}",
                "culprit_correct": f"{sum(bool(r.get('culprit_correct')) for r in runs)}"
                                   f"/{len(runs)}",
                "steps_rolled_back": statistics.median(lost) if lost else None,
                "runs": runs}
            if a.json:  # after every (system, fault): an interrupted run keeps what it measured
                with open(a.json, "w") as fh:
                    json.dump({"partial": True, "results": results}, fh, indent=2)
    report = {"wall_s": round(time.monotonic() - t0, 1), "results": results,
              "faults": {f: FAULTS[f] for f in faults}}
    print(f"\n{'system/fault':<22} {'metric':<8} {'median s':>9} {'max s':>8} recovered "
          f"culprit_correct steps_rolled_back")
    for k, v in results.items():
        print(f"{k:<22} {v['metric']:<8} {str(v['median_s']):>9} {str(v['max_s']):>8} "
              f"{v['recovered']:>9} {v['culprit_correct']:>15} {str(v['steps_rolled_back']):>17}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

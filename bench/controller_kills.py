"""SIGKILL the process that carries out Slurm actions, again and again, against a real
slurmctld, and count what Slurm was actually told to do.

    python bench/controller_kills.py [--kills 20] [--seed 1] [--json out.json]

The world: 3 nodes (``trainguard.cluster.net``), a real Slurm over them
(``trainguard.cluster.slurm.SlurmCluster``: slurmctld and one slurmd per node), a Valkey
(``trainguard.stack.embedded``). The actor — a process that carries out decisions with
``trainguard.scheduler.slurm.controller.SlurmController`` (``requeue=always``), as the remediator does
with ``TG_NODE_CONTROLLER=slurm`` — takes decisions from a queue in Valkey in order and marks
each done once the controller returned ``ok``; killed before that, its restart carries the
decision out again (at-least-once), so only the controller's own checks (it re-reads Slurm's
state and the generation's claims first) stand between a kill and a duplicate action.

One decision at a time, alternating at random: ``exclude`` (a Slurm job ``sbatch --requeue -w
NODE --wrap 'sleep 600'`` is running; expected: drain NODE, requeue the job, set its
``ExcNodeList``) and ``stop`` (expected: the reason on the job, ``scancel``). Between decisions
the bench itself resumes the node and cancels the job with the real commands.

The killer SIGKILLs the actor ``--kills`` times: half at a uniformly random moment of its life
(starting, idle between decisions, or acting), half aimed inside an action (once the actor says
it is acting, after a random 0–``--aim`` s); it restarts the actor at once. Every ``scontrol``
mutation (update, requeue, create, delete) and every ``scancel`` goes through a recording shim
(``SlurmConfig`` paths) that appends the command and its exit status to a log once the real
command returned — a shim outlives a killed actor, so a mutation performed is always logged.

Figures: ``kills`` (by the phase the actor was in), ``decisions``, ``reexecuted`` (decisions
started more than once), ``mutations`` (performed: exit status 0), ``expected``,
``duplicates`` (a performed mutation of a decision beyond its first), ``missing`` (an expected
one never performed), ``optional`` (performed ones a decision may make but need not: the release
of a requeued job's hold), ``unexpected``, ``refused`` (mutations Slurm refused), ``seconds``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

QUEUE, DONE, STARTS = "bench:decisions", "bench:done", "bench:starts"

SHIM = """#!/bin/bash
# recording shim of {name} (bench/controller_kills.py): reads pass through, mutations are logged
case "{name}:$1" in scontrol:show|scontrol:-o|scontrol:ping) exec {real} "$@";; esac
{real} "$@"
rc=$?
printf '%s\\t%s\\t%s\\n' "$rc" "$(date +%s%N)" "{name} $*" >> {log}
exit $rc
"""


def make_shims(where: str, log: str) -> dict[str, str]:
    """``scontrol``/``scancel`` shims in ``where`` logging to ``log``; name → path."""
    out = {}
    for name in ("scontrol", "scancel"):
        real = shutil.which(name)
        if real is None:
            raise SystemExit(f"{name} not found: apt-get install -y slurm-wlm")
        path = os.path.join(where, name)
        with open(path, "w") as fh:
            fh.write(SHIM.format(name=name, real=real, log=log))
        os.chmod(path, 0o755)
        out[name] = path
    return out


def classify(argv: str) -> tuple[str, str]:
    """A logged mutation → ``(verb, target)``: drain/resume of a node, requeue, excnodelist,
    comment, scancel of a job; anything else ``("other", argv)``."""
    w = argv.split()
    if w[0] == "scancel":
        return "scancel", w[-1]
    if len(w) > 1 and w[1] == "requeue":
        return "requeue", w[2]
    kv = dict(x.split("=", 1) for x in w[2:] if "=" in x)
    if "nodename" in kv:
        return ("drain" if kv.get("state") == "drain" else f"node_{kv.get('state')}",
                kv["nodename"])
    if "jobid" in kv:
        if "excnodelist" in kv:
            return "excnodelist", kv["jobid"]
        if kv.get("starttime") == "now":
            return "release", kv["jobid"]
        if "admincomment" in kv or "comment" in kv:
            return "comment", kv["jobid"]
    return "other", argv


def expected(d: dict[str, Any]) -> set[tuple[str, str]]:
    if d["kind"] == "exclude":
        return {("drain", d["node"]), ("requeue", d["jid"]), ("excnodelist", d["jid"])}
    return {("comment", d["jid"]), ("scancel", d["jid"])}


def optional(d: dict[str, Any]) -> set[tuple[str, str]]:
    """Mutations a decision may make, once, but need not: the release of Slurm's hold on a
    requeued job (``starttime=now``), made only once the job is PENDING within
    ``SlurmConfig.release_wait_s`` (a kill before that leaves the hold to Slurm)."""
    return {("release", d["jid"])} if d["kind"] == "exclude" else set()


def count(decisions: list[dict[str, Any]], log_lines: list[str]) -> dict[str, Any]:
    """The figures from the decisions (with ``posted_ns``) and the shim's log lines."""
    performed: Counter = Counter()
    refused = 0
    starts = sorted(d["posted_ns"] for d in decisions)
    by_start = {d["posted_ns"]: d for d in decisions}
    for line in log_lines:
        rc, ts, argv = line.rstrip("\n").split("\t", 2)
        if rc != "0":
            refused += 1
            continue
        owner = max((s for s in starts if s <= int(ts)), default=None)
        if owner is None:
            continue
        performed[(by_start[owner]["id"], *classify(argv))] += 1
    want = {(d["id"], *k) for d in decisions for k in expected(d)}
    maybe = {(d["id"], *k) for d in decisions for k in optional(d)}
    dups = {k: n - 1 for k, n in performed.items() if n > 1}
    return {"mutations": sum(performed.values()), "expected": len(want),
            "duplicates": sum(dups.values()),
            "duplicate_list": [list(k) + [n] for k, n in sorted(dups.items())],
            "missing": sorted(list(k) for k in want - set(performed)),
            "optional": sum(1 for k in performed if k in maybe),
            "unexpected": sorted(list(k) for k in set(performed) - want - maybe),
            "refused": refused}


# ---- the actor: carries out the queue's decisions with the Slurm controller ---------------------
async def actor(redis_url: str, shims: dict[str, str], phase: str) -> None:
    from trainguard.scheduler.slurm.config import SlurmConfig
    from trainguard.scheduler.slurm.controller import SlurmController
    from trainguard.clients.store import StateStore

    st = StateStore(redis_url)
    ctl = SlurmController(st, SlurmConfig(scontrol=shims["scontrol"], scancel=shims["scancel"],
                                          requeue="always"))

    def say(what: str) -> None:
        with open(phase + ".tmp", "w") as fh:
            fh.write(what)
        os.replace(phase + ".tmp", phase)

    say("idle")
    while True:
        done = await st.r.smembers(DONE)
        todo = [json.loads(x) for x in await st.r.lrange(QUEUE, 0, -1)]
        todo = [d for d in todo if d["id"] not in done]
        if not todo:
            say("idle")
            await asyncio.sleep(0.05)
            continue
        d = todo[0]
        say(f"acting {d['id']}")
        await st.r.hincrby(STARTS, d["id"], 1)
        if d["kind"] == "exclude":
            res = await ctl.exclude(d["node"], d["job"], d["reason"])
        else:
            res = await ctl.stop(d["job"], d["reason"], 0)
        if res.ok:
            await st.r.sadd(DONE, d["id"])
            await st.r.rpush("bench:results", json.dumps({"id": d["id"], "detail": res.detail,
                                                         "commands": res.commands}))
        else:
            print(f"actor: {d['id']} not ok: {res.detail}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.2)


# ---- the driver ---------------------------------------------------------------------------
class Killer(threading.Thread):
    """Keeps one actor process alive and SIGKILLs it ``kills`` times (see the module
    docstring); ``record`` lists ``(phase, monotonic s)`` of each kill."""

    def __init__(self, argv: list[str], env: dict[str, str], phase: str, kills: int,
                 rng: random.Random, life: tuple[float, float], aim: float):
        super().__init__(daemon=True)
        self.argv, self.env, self.phase, self.kills = argv, env, phase, kills
        self.rng, self.life, self.aim = rng, life, aim
        self.record: list[tuple[str, float]] = []
        self.proc: subprocess.Popen | None = None
        self.halt = threading.Event()
        self.err = open(os.path.join(os.path.dirname(phase), "actor.err"), "ab")

    def spawn(self) -> None:
        if os.path.exists(self.phase):
            os.unlink(self.phase)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self.err, stderr=self.err)

    def read_phase(self) -> str:
        try:
            with open(self.phase) as fh:
                return fh.read().split()[0]
        except (OSError, IndexError):
            return "starting"

    def run(self) -> None:
        self.spawn()
        while not self.halt.is_set() and len(self.record) < self.kills:
            aimed = len(self.record) % 2 == 1
            if aimed:
                deadline = time.monotonic() + 10
                while self.read_phase() != "acting" and time.monotonic() < deadline:
                    if self.halt.wait(0.002):
                        return
                time.sleep(self.rng.uniform(0, self.aim))
            elif self.halt.wait(self.rng.uniform(*self.life)):
                return
            assert self.proc is not None
            if self.proc.poll() is None:
                ph = self.read_phase()
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
                self.record.append((ph, time.monotonic()))
            self.spawn()

    def stop(self) -> None:
        self.halt.set()
        self.join(15)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench(a: argparse.Namespace) -> dict[str, Any]:
    import redis

    from trainguard.cluster.net import ClusterNet
    from trainguard.cluster.slurm import SlurmCluster
    from trainguard.stack.embedded import EmbeddedServers
    from trainguard.schemas import JobSettings  # noqa: F401 - fields of the job record

    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="tg-kills-")
    log = os.path.join(work, "mutations.log")
    open(log, "w").close()
    shims = make_shims(work, log)
    net = ClusterNet(3).start()
    slurm = servers = killer = None
    t0 = time.monotonic()
    decisions: list[dict[str, Any]] = []
    try:
        slurm = SlurmCluster(net, os.path.join(work, "slurm")).start()
        servers = EmbeddedServers().start()
        r = redis.Redis.from_url(servers.redis_url, decode_responses=True)
        env = {**slurm.env, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, os.path.abspath(__file__), "--actor", "--redis",
                servers.redis_url, "--shims", work]
        killer = Killer(argv, env, os.path.join(work, "phase"), a.kills, rng,
                        (a.life_min, a.life_max), a.aim)
        killer.start()
        i = 0
        while killer.is_alive() or i < a.min_decisions:
            if time.monotonic() - t0 > a.timeout:
                raise RuntimeError(f"not done in {a.timeout:.0f} s: {len(killer.record)} kills, "
                                   f"{i} decisions; logs in {work}")
            node = f"node{rng.randrange(3)}"
            kind = rng.choice(("exclude", "stop"))
            jid = slurm.sbatch(None, "--requeue", "-w", node, "-o", "/dev/null", "--wrap",
                               "sleep 600")
            for _ in range(100):
                if slurm.job_state(jid).get("JobState") == "RUNNING":
                    break
                time.sleep(0.1)
            job = f"kj{i}"
            r.sadd("tg:jobs", job)
            r.hset(f"tg:job:{job}", mapping={"mode": "action", "generation": "0",
                                              "world_size": "2", "slurm_job_id": jid,
                                              "status": "running"})
            d = {"id": f"d{i}", "kind": kind, "job": job, "node": node, "jid": jid,
                 "reason": f"bench decision {i}: {kind} on {node}", "posted_ns": time.time_ns()}
            decisions.append(d)
            r.rpush(QUEUE, json.dumps(d))
            deadline = time.monotonic() + 60
            while not r.sismember(DONE, d["id"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"decision {d['id']} not done in 60 s; logs in {work}")
                time.sleep(0.02)
            time.sleep(0.2)  # a shim orphaned by a kill finishes within its command's time
            slurm.run("scancel", jid, check=False)
            slurm.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            i += 1
        killer.stop()
        time.sleep(0.3)
        with open(log) as fh:
            lines = fh.readlines()
        starts = {k: int(v) for k, v in r.hgetall(STARTS).items()}
        r.close()
    finally:
        if killer is not None:
            killer.stop()
        if servers is not None:
            servers.stop()
        if slurm is not None:
            slurm.stop()
        net.stop()
    out = {"kills": len(killer.record), "kills_by_phase": dict(Counter(p for p, _ in
                                                                         killer.record)),
           "decisions": len(decisions),
           "by_kind": dict(Counter(d["kind"] for d in decisions)),
           "reexecuted": sum(1 for n in starts.values() if n > 1),
           **count(decisions, lines), "seconds": round(time.monotonic() - t0, 1),
           "seed": a.seed}
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        out["work_dir"] = work
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--min-decisions", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--life-min", type=float, default=0.2,
                   help="a random kill lands this many seconds or more after a start")
    p.add_argument("--life-max", type=float, default=1.5)
    p.add_argument("--aim", type=float, default=0.06,
                   help="an aimed kill lands up to this many seconds into an action")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default="", help="write the figures here ('-': stdout only)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--actor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--redis", default="", help=argparse.SUPPRESS)
    p.add_argument("--shims", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.actor:
        shims = {n: os.path.join(a.shims, n) for n in ("scontrol", "scancel")}
        asyncio.run(actor(a.redis, shims, os.path.join(a.shims, "phase")))
        return 0
    if a.kills < 1:
        p.error("--kills must be >= 1")
    load0 = provenance.loadavg()
    out = bench(a)
    out["provenance"] = provenance.record(load0)
    print(f"controller kills: {out['kills']} SIGKILLs {out['kills_by_phase']}, "
          f"{out['decisions']} decisions {out['by_kind']} ({out['reexecuted']} carried out "
          f"again after a kill), {out['mutations']} Slurm mutations performed for "
          f"{out['expected']} expected: {out['duplicates']} duplicate(s), "
          f"{len(out['missing'])} missing, {len(out['unexpected'])} unexpected, "
          f"{out['refused']} refused; {out['seconds']} s")
    if a.json == "-":
        print(json.dumps(out))
    elif a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if out["duplicates"] == 0 and not out["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""What losing a control-plane server costs a training job: the replicated stack
(``trainguard up --ha``: 3 NATS servers, a Valkey primary with a replica under 3 sentinels)
against the single-server stack, in one invocation, on one machine.

    python bench/ha.py [--json PATH] [--stacks ha,single] [--targets nats,valkey,rendezvous]
                       [--rank-fault-after 1.5] [--recovery-timeout 45]

For each stack and each **target** (``nats``: the NATS server the remediator is connected to;
``valkey``: the Valkey primary; ``rendezvous``: the rendezvous store, the replicated stack's
primary beside its standby), a fresh stack (detector, attributor, remediator, checkpoint
validator, rendezvous store) runs a 2-rank gloo job under ``trainguard launch --mode action``
(a small DDP model; each rank writes its step to a file after every step). Once both ranks
train, the target is SIGKILLed; ``--rank-fault-after`` seconds later, still inside the outage
(a Valkey failover takes seconds), rank 1 is SIGKILLed. A row says:

* ``step_rate_before`` / ``step_rate_during`` (rank 0's steps/s in the 4 s before the kill and
  between the kill and the rank fault) and their ``ratio``;
* ``failover_s`` — kill → the control plane answers again: a JetStream-acknowledged publish to
  the events stream and every stream's info answered by its leader (NATS), a write through
  the state store's URL (Valkey), or a store write through a new relay to the stack's
  rendezvous endpoint (rendezvous), from a fresh client every 0.2 s; null when it did not
  answer within ``--recovery-timeout``;
* the rank fault: ``detected`` (an anomaly of the job stored), ``decisions`` (decisions that
  act on it, for generation 1: stored, else as the launcher printed them; every stored
  decision is listed in ``decisions_seen``), ``carried_out`` (decisions the launcher
  executed), ``recovered`` (both ranks stepping at generation ≥ 1) and ``recovery_s``,
  ``decisions_lost`` (0 decisions) and ``decisions_duplicated`` (more than 1).

Not here yet (issue 37): the network-namespace cluster with separate hosts, partitions instead of
kills, and a service replica's host as a target.
"""
from __future__ import annotations

import argparse
import importlib
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCRIPT = '''
import os, time, torch, trainguard

def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = ctx.checkpointer(model, opt)
    start = ckpt.restore()
    net = ctx.ddp(model)
    for step in range(start, 100000):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = net(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.progress(step, loss=float(loss))
        with open(f"{progress}/.rank-{{ctx.rank}}", "w") as fh:
            fh.write(f"{{step}} {{ctx.generation}}")
        os.replace(f"{progress}/.rank-{{ctx.rank}}", f"{progress}/rank-{{ctx.rank}}")
        if step % 20 == 0:
            ckpt.save(step)
        time.sleep(0.03)

trainguard.run(train)
'''

SERVICES = ("detector", "attributor", "remediator", "checkpoint_validator")


def _steps(progress: Path) -> dict[int, tuple[int, int]]:
    out = {}
    for r in (0, 1):
        try:
            step, gen = (progress / f"rank-{r}").read_text().split()
            out[r] = (int(step), int(gen))
        except (OSError, ValueError):
            pass
    return out


class Sampler(threading.Thread):
    """Rank 0's step every 50 ms: ``(monotonic s, step, generation)``."""

    def __init__(self, progress: Path):
        super().__init__(daemon=True)
        self.progress, self.samples, self.stop = progress, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            s = _steps(self.progress).get(0)
            if s is not None:
                self.samples.append((time.monotonic(), *s))

    def rate(self, t0: float, t1: float) -> float | None:
        """Steps/s of rank 0 between ``t0`` and ``t1`` (generation 0 only)."""
        pts = [(t, s) for t, s, g in self.samples if t0 <= t <= t1 and g == 0]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def _nats_server_of(pid: int, stack) -> Any:
    """The embedded NATS server process ``pid`` is connected to."""
    import psutil

    servers = [s for s in stack._servers.servers if s.kind == "nats"]
    ports = {s.port: s for s in servers}
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED:
            return ports[c.raddr.port]
    return servers[0]


class _Child:
    """A stack child process as a target (``proc``): the rendezvous store."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc


def _target(stack, kind: str, target: str):
    if target == "rendezvous":  # the primary store (the single stack's only one)
        return _Child(stack.procs["rendezvous"])
    if target == "nats":
        return _nats_server_of(stack.procs["remediator"].pid, stack)
    if kind == "ha":
        return stack._servers.primary()
    return next(s for s in stack._servers.servers if s.kind == "valkey")


async def _answers(stack, target: str) -> bool:
    """One probe with a fresh client: True when the control plane took a write."""
    from trainguard import schemas
    from trainguard.clients.bus import Bus
    from trainguard.schemas import subjects
    from trainguard.clients.store import StateStore

    if target == "rendezvous":  # a store op through a relay, as a launcher's ranks make it
        import datetime

        import torch.distributed as dist

        from trainguard.rendezvous.endpoint import parse_endpoint
        from trainguard.rendezvous.gate import Relay

        relay = Relay(stack.rdzv_endpoint, "").start()
        try:
            host, port = parse_endpoint(relay.endpoint)
            store = await asyncio.to_thread(
                dist.TCPStore, host, port, is_master=False,
                timeout=datetime.timedelta(seconds=1.5))
            await asyncio.to_thread(store.set, "ha-probe", "1")
            return True
        except Exception:  # noqa: BLE001 - not answering
            return False
        finally:
            relay.stop()
    if target == "nats":
        from trainguard.clients.streams import STREAMS

        bus = Bus(stack.nats_url, "ha-probe")
        try:
            await bus.connect(timeout=1.0, retry=False)
            await bus.publish_stored(subjects.job("ha-probe", "log"),
                                     schemas.LogLine(job="ha-probe", line="probe"), timeout=1.0)
            js = bus.nc.jetstream(timeout=1.0)
            for name, _subs, _age in STREAMS:  # every stream has a leader again
                await js.stream_info(name)
            return True
        except Exception:  # noqa: BLE001 - not answering yet
            return False
        finally:
            await bus.close()
    st = StateStore(stack.redis_url)
    try:
        await asyncio.wait_for(st.r.set("tg:ha-probe", "1"), 1.5)
        return True
    except Exception:  # noqa: BLE001 - not answering yet
        return False
    finally:
        await st.close()


def _failover(stack, target: str, t_kill: float, timeout: float, out: dict) -> None:
    async def loop() -> None:
        while time.monotonic() - t_kill < timeout:
            if await _answers(stack, target):
                out["failover_s"] = round(time.monotonic() - t_kill, 2)
                return
            await asyncio.sleep(0.2)
    asyncio.run(loop())


async def _stored(stack, job: str, kind: str) -> list | None:
    from trainguard import schemas
    from trainguard.clients.bus import Bus
    from trainguard.services.durable import replay
    from trainguard.schemas import subjects

    bus = Bus(stack.nats_url, "ha-count")
    try:
        await bus.connect(timeout=3.0, retry=False)
        msgs = await replay(bus.nc, subjects.job(job, kind), time.time_ns() - 900 * 10**9)
        return [schemas.decode(m.data) for m, _ in msgs]
    except Exception:  # noqa: BLE001 - the bus is gone (the single stack's NATS)
        return None
    finally:
        await bus.close()


def account(decisions: list | None, anomalies: list | None, launcher_text: str) -> dict:
    """The rank fault's fate from the job's stored decisions and anomalies (None: the bus could
    not be read) and the launcher's output: ``decisions`` (those that act on the fault, for
    generation 1; flags such as a failed checkpoint save's ``none`` are listed in
    ``decisions_seen``, not counted; without the bus, the launcher's lines),
    ``carried_out`` (decisions the launcher executed), ``detected``, ``decisions_lost`` (1 when
    none) and ``decisions_duplicated`` (past the first, decided or carried out)."""
    row: dict[str, Any] = {"carried_out": len(re.findall(
        r"decision \S+ \(executing\) generation 1 ", launcher_text))}
    if decisions is None:
        row["decisions"] = len(re.findall(r"decision \S+ \([^)]*\) generation 1 ",
                                          launcher_text))
        row["detected"] = None
    else:
        row["decisions"] = len([x for x in decisions if x.generation == 1 and x.execute])
        row["decisions_seen"] = [
            {"id": x.event_id, "action": x.action, "generation": x.generation,
             "execute": x.execute, "ranks": x.ranks, "key": x.idempotency_key,
             "verdict": x.verdict_id, "reason": x.reason[:100]} for x in decisions]
        row["detected"] = bool(anomalies)
    row["decisions_lost"] = int(row["decisions"] == 0)
    row["decisions_duplicated"] = max(0, row["decisions"] - 1, row["carried_out"] - 1)
    return row


def run_row(kind: str, target: str, a: argparse.Namespace, work: Path,
            trial: int = 0) -> dict[str, Any]:
    from trainguard.stack.local import Stack

    row: dict[str, Any] = {"stack": kind, "target": target, "fault_kind": "sigkill",
                           "trial": trial}
    d = work / f"{kind}-{target}-{trial}"
    progress, ckpt = d / "progress", d / "ckpt"
    progress.mkdir(parents=True)
    ckpt.mkdir()
    script = d / "train.py"
    script.write_text(SCRIPT.format(progress=progress))
    job = f"ha-{kind}-{target}-{trial}"
    stack = Stack(services=SERVICES, rendezvous=True, log_dir=str(d / "logs"),
                  ha=(kind == "ha"))
    t = time.monotonic()
    stack.start(timeout=180)
    row["stack_start_s"] = round(time.monotonic() - t, 1)
    out = d / "launch.out"
    cmd = [sys.executable, "-m", "trainguard.cli", "launch", "--nproc-per-node", "2",
           "--job", job, "--mode", "action", "--nats-url", stack.urls("worker")[0],
           "--redis-url", stack.urls("worker")[1], "--rdzv-endpoint", stack.rdzv_endpoint,
           "--ckpt-dir", str(ckpt), str(script)]
    sampler = Sampler(progress)
    launcher = None
    try:
        with open(out, "w") as fh:
            launcher = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=d)
        deadline = time.monotonic() + 180
        while not (len(_steps(progress)) == 2 and min(s for s, _ in _steps(progress).values())
                   >= 30):
            if time.monotonic() > deadline or launcher.poll() is not None:
                raise RuntimeError(f"job did not train: {out.read_text()[-2000:]}")
            time.sleep(0.1)
        sampler.start()
        if target == "rendezvous":
            # imported here, not inside the measured failover (the probe's first use)
            importlib.import_module("torch.distributed")
        time.sleep(4.0)
        victim = _target(stack, kind, target)
        t_kill = time.monotonic()
        victim.proc.kill()
        fo: dict[str, Any] = {}
        prober = threading.Thread(target=_failover, args=(stack, target, t_kill,
                                                          a.recovery_timeout, fo), daemon=True)
        prober.start()
        time.sleep(a.rank_fault_after)
        pid = int(re.findall(r"rank 1 \(local 1\) started as pid (\d+)", out.read_text())[-1])
        t_fault = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        row["step_rate_before"] = sampler.rate(t_kill - 4.0, t_kill)
        row["step_rate_during"] = sampler.rate(t_kill, t_fault)
        if row["step_rate_before"] and row["step_rate_during"] is not None:
            row["ratio"] = round(row["step_rate_during"] / row["step_rate_before"], 3)
        recovered_at = None
        while time.monotonic() - t_fault < a.recovery_timeout:
            s = _steps(progress)
            if len(s) == 2 and all(g >= 1 for _, g in s.values()):
                base = {r: st for r, (st, _) in s.items()}
                time.sleep(0.5)
                if all(_steps(progress)[r][0] > base[r] for r in (0, 1)):
                    recovered_at = time.monotonic()
                    break
            time.sleep(0.1)
        prober.join(max(0.0, a.recovery_timeout - (time.monotonic() - t_kill)) + 2)
        row["failover_s"] = fo.get("failover_s")
        row["recovered"] = recovered_at is not None
        row["recovery_s"] = round(recovered_at - t_fault, 2) if recovered_at else None
        time.sleep(2.0)  # late duplicates
        decisions = asyncio.run(_stored(stack, job, "decision"))
        anomalies = asyncio.run(_stored(stack, job, "anomaly"))
        row.update(account(decisions, anomalies, out.read_text()))
    finally:
        sampler.stop.set()
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(20)
            except subprocess.TimeoutExpired:
                launcher.kill()
        stack.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--stacks", default="ha,single")
    p.add_argument("--targets", default="nats,valkey,rendezvous")
    p.add_argument("--rank-fault-after", type=float, default=1.5,
                   help="seconds from the server kill to the rank fault")
    p.add_argument("--recovery-timeout", type=float, default=45.0)
    p.add_argument("--keep", default=None, help="keep logs and outputs in this directory")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every row (interleaved)")
    a = p.parse_args(argv)
    load0 = provenance.loadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-bench-ha-") as tmp:
        if a.keep:
            tmp = a.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        for trial in range(a.repeat):
          for target in a.targets.split(","):  # noqa: E111
            for kind in a.stacks.split(","):  # interleaved: ha and single back to back
                t = time.monotonic()
                try:
                    row = run_row(kind, target, a, Path(tmp), trial)
                except Exception as exc:  # noqa: BLE001 - a row that failed says why
                    row = {"stack": kind, "target": target, "error": f"{type(exc).__name__}: "
                                                                     f"{exc}"[:2000]}
                row["row_s"] = round(time.monotonic() - t, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"bench": "ha", "rows": rows, "conditions": {
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "load_avg_at_end": os.getloadavg(), "note": "one machine, every server on loopback; "
        "the machine was shared with other work (figures noisy)",
        "rank_fault_after_s": a.rank_fault_after, "recovery_timeout_s": a.recovery_timeout},
        "provenance": provenance.record(load0)}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'stack':7} {'target':7} {'rate before':>11} {'during':>7} {'ratio':>6} "
          f"{'failover s':>10} {'detected':>8} {'decisions':>9} {'carried':>7} {'recovered':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['stack']:7} {r['target']:7} error: {r['error'][:100]}")
            continue
        f = lambda v, n=2: "-" if v is None else (f"{v:.{n}f}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"{r['stack']:7} {r['target']:7} {f(r['step_rate_before'], 1):>11} "
              f"{f(r['step_rate_during'], 1):>7} {f(r.get('ratio')):>6} "
              f"{f(r['failover_s']):>10} {f(r['detected']):>8} {r['decisions']:>9} "
              f"{r['carried_out']:>7} {f(r['recovered']):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``trainguard node``: node reputation and readmission, run where the scheduler's commands work
(Slurm: a login or controller node with ``scontrol`` and ``srun`` and the right to use them —
an operator or the ``SlurmUser``; Kubernetes: the remediator's service account).

* ``trainguard node readmit NODE…`` — ``NodeController.readmit``: return each node only when
  the policy (``trainguard.core.reputation``) allows it and its canary passes; exit status 0 when
  every node is in service at the end, 1 when one was kept out (the line says why).
* ``trainguard node probation [--every S] [--once]`` — the same for every node whose
  reputation says ``drained`` or ``held`` (a held node's score may have decayed below the
  threshold), every ``S`` seconds (default 600).
* ``trainguard node show [NODE…] [--json]`` — reputations (score now, status, evidence) and
  the cross-job fault history the attributor counts (``attributor.decide``, rule 5): the
  node's faults of the last ``history_window_s`` (24 h), the jobs whose faults were the node's
  (hardware, system software, infrastructure) and whether that makes it a repeat offender
  (``node_repeat_jobs`` jobs or more: a later crash there is attributed to the node). Every
  node with either, when no node is named.
* ``trainguard node forgive NODE`` — an operator repaired it: its reputation is removed (it is
  not returned: ``readmit`` does that, after its canary).

Options: ``--controller`` (env ``TG_NODE_CONTROLLER``, default ``slurm``), ``--canary-timeout S``
(Slurm: the ``srun`` of the canary). The state store is ``REDIS_URL`` (required: the reputation
lives there). Half-life, threshold and probation: env ``TG_REP_HALF_LIFE_S``,
``TG_REP_THRESHOLD``, ``TG_REP_PROBATION_S`` (``trainguard.core.reputation``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from trainguard.scheduler.local import make_controller
from trainguard.core.reputation import ReputationConfig, score_now
from trainguard.clients.store import StateStore

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard node")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("readmit", "probation", "show", "forgive"):
        s = sub.add_parser(name)
        if name in ("readmit", "forgive"):
            s.add_argument("nodes", nargs="+")
        elif name == "show":
            s.add_argument("nodes", nargs="*")
        s.add_argument("--controller", default=os.environ.get("TG_NODE_CONTROLLER", "slurm"))
        s.add_argument("--canary-timeout", type=float, default=None)
        s.add_argument("--json", action="store_true")
        if name == "probation":
            s.add_argument("--every", type=float, default=600.0)
            s.add_argument("--once", action="store_true")
    return p


def _controller(name: str, state: StateStore, canary_timeout: float | None) -> Any:
    ctl = make_controller(name, state)
    if canary_timeout is not None and hasattr(ctl, "config"):
        ctl.config.canary_timeout_s = canary_timeout
    return ctl


async def _readmit_all(ctl: Any, nodes: list[str], as_json: bool) -> int:
    worst = 0
    for node in nodes:
        res = await ctl.readmit(node)
        worst = max(worst, 0 if res.ok else 1)
        if as_json:
            print(json.dumps({"node": node, "ok": res.ok, "detail": res.detail,
                              "commands": res.commands}, default=str), flush=True)
        else:
            print(f"{node}: {'in service' if res.ok else 'kept out'}: {res.detail}", flush=True)
    return worst


async def fault_history(state: StateStore, node: str, now_ns: int) -> dict[str, Any]:
    """``node``'s cross-job fault history as the attributor weighs it: ``records`` (the last
    ``history_window_s``, oldest first: ``job``, ``layer``, ``signature``, ``ts`` Unix ns…),
    ``fault_jobs`` (the jobs whose fault there was the node's), ``repeat_offender``
    (``node_repeat_jobs`` of them or more) and ``window_s``."""
    from trainguard.attributor.decide import AttributorConfig, history_from_records

    cfg = AttributorConfig()
    since = now_ns - int(cfg.history_window_s * 1e9)
    records = await state.node_history(node, since)
    jobs = sorted(history_from_records("", {node: records}, [], since_ns=since)
                  .node_jobs.get(node, set()))
    return {"records": records, "fault_jobs": jobs, "window_s": cfg.history_window_s,
            "repeat_offender": len(jobs) >= cfg.node_repeat_jobs}


def _history_lines(node: str, h: dict[str, Any], shown: int = 5) -> list[str]:
    recs = h["records"]
    if not recs:
        return []
    hours = h["window_s"] / 3600
    verdict = ("a repeat offender: a later crash there is the node's" if h["repeat_offender"]
               else "not a repeat offender")
    out = [f"{node}: {len(recs)} fault(s) in the last {hours:g} h; the node's own in "
           f"{len(h['fault_jobs'])} job(s) ({', '.join(h['fault_jobs']) or 'none'}): {verdict}"]
    for r in recs[-shown:]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(r.get("ts", 0)) / 1e9))
        out.append(f"  {when}  job {r.get('job')}: {r.get('layer', '?')} "
                   f"({r.get('signature') or r.get('fault_class') or '?'})")
    if len(recs) > shown:
        out.append(f"  … {len(recs) - shown} earlier (--json shows every one)")
    return out


async def _show(state: StateStore, nodes: list[str], as_json: bool) -> int:
    """``trainguard node show``: one block (text) or one JSON object per node: its reputation
    (null when it has none) and ``fault_history``."""
    cfg, now = ReputationConfig.from_env(), time.time_ns()
    reps = {r.node: r for r in ([await state.reputation(n) for n in nodes] if nodes
                                else await state.reputations())}
    names = list(nodes) if nodes else sorted(set(reps) | set(await state.history_nodes()))
    for n in names:
        r, h = reps.get(n), await fault_history(state, n, now)
        if as_json:
            row = ({**r.to_dict(), "score_now": round(score_now(r, now, cfg), 3)} if r
                   else {"node": n, "reputation": None})
            print(json.dumps({**row, "fault_history": h}, default=str), flush=True)
            continue
        if r is not None:
            print(f"{r.node}: {r.status}, score {score_now(r, now, cfg):.2f} "
                  f"(threshold {cfg.threshold:g}), {r.offences} offence(s); {r.detail}")
        for line in _history_lines(n, h):
            print(line)
        if r is not None and not h["records"] and nodes:
            print(f"{n}: no fault in the last {h['window_s'] / 3600:g} h")
    return 0


async def _run(a: argparse.Namespace) -> int:
    url = os.environ.get("REDIS_URL", "")
    if not url:
        print("trainguard node: REDIS_URL is not set: the reputation lives in the state store",
              file=sys.stderr)
        return 2
    state = StateStore(url)
    ctl = None
    try:
        await state.ping()
        if a.cmd == "show":
            return await _show(state, a.nodes, a.json)
        if a.cmd == "forgive":
            for n in a.nodes:
                await state.forget_reputation(n)
                print(f"{n}: reputation removed (readmit returns it after its canary)")
            return 0
        ctl = _controller(a.controller, state, a.canary_timeout)
        if a.cmd == "readmit":
            return await _readmit_all(ctl, a.nodes, a.json)
        while True:  # probation
            nodes = [r.node for r in await state.reputations() if r.status in ("drained", "held")]
            rc = await _readmit_all(ctl, nodes, a.json) if nodes else 0
            if a.once:
                return rc
            await asyncio.sleep(a.every)
    finally:
        kube = getattr(ctl, "kube", None)
        if kube is not None:
            await kube.close()
        await state.close()


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd == "probation" and a.every <= 0:
        print("trainguard node probation: --every must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(a))
    except (ValueError, ImportError, ConnectionError) as exc:
        print(f"trainguard node: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

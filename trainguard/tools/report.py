"""``trainguard report JOB [--out DIR]``: a continuity report of one job from what trainguard
kept of it — the stored history (JetStream, ``trainguard.tools.replay.history``) and the remediator's
audit trail (Valkey) — one section per recovery, and a timeline picture.

Writes ``DIR/<job>-report.md``, ``DIR/<job>-report.json`` and ``DIR/<job>-timeline.png``
(matplotlib, the ``report`` extra; without it the picture is skipped and the report says so).

Per recovery (a decision other than ``none``, with the verdict it answered): times (fault,
detected, decided, every rank training again; Unix ns and seconds from the fault), the restored
step and the steps replayed (``recovery.resumed``), the loss before (the last reported by a
heartbeat before the fault) and after (the first after the resume; ``recovery.verified`` when
present, with its verdict ``ok``), all of one rank (the lowest reporting a loss: each rank's
loss is its own shard's), the verdict (fault class, layer, culprit, confidence) and
the decision (action, generation, executed, reason), the recovery path (``peer`` or
``checkpoint``, and why: ``recovery.resumed``), and the recovery's timeline
(``trainguard.core.timeline``: last progress, detected, verdict, decision, each node's executor,
rendezvous, every rank's first step; seconds from the fault and each phase's own), so a slow
recovery shows where it spent its time. The job's goodput ledger
(``trainguard.core.goodput``) heads the report.

Needs ``NATS_URL`` (history: the ``reader`` role suffices) and, for the audit trail,
``REDIS_URL``; without it the audit part is left out and the report says so.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from typing import Any

from trainguard import schemas

from trainguard.core import timeline
from trainguard.core.goodput import Ledger, ledger

__all__ = ["job_events", "build_report", "to_markdown", "plot_timeline", "main"]


async def job_events(nats_url: str, job: str) -> list[schemas.Event]:
    """The job's events JetStream kept (``tg.job.<job>.>``), oldest first; undecodable
    messages are skipped. Raises ConnectionError when NATS cannot be reached."""
    from trainguard.tools.recording import read_recording
    from trainguard.tools.replay import history

    buf = io.StringIO()
    await history(nats_url, buf, f"tg.job.{schemas.subjects.token(job)}.>")
    out = []
    for rec in read_recording(io.StringIO(buf.getvalue())):
        try:
            out.append(schemas.decode(rec.data))
        except schemas.DecodeError:
            continue
    return out


def _s(a: int | None, b: int | None) -> float | None:
    return None if not a or not b else round((b - a) / 1e9, 3)


def _loss_before(hbs: list[schemas.RankHeartbeat], t_ns: int) -> float | None:
    prior = [h for h in hbs if h.ts <= t_ns and h.loss is not None]
    return prior[-1].loss if prior else None


def _loss_after(hbs: list[schemas.RankHeartbeat], t_ns: int | None) -> float | None:
    if t_ns is None:
        return None
    later = [h for h in hbs if h.ts >= t_ns and h.loss is not None]
    return later[0].loss if later else None


def build_report(job: str, events: list[schemas.Event],
                 audit: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report as a dict (JSON-ready); see the module docstring. ``audit``: the audit trail
    (None: not read)."""
    evs = sorted((e for e in events if e.job == job), key=lambda e: e.ts)
    led: Ledger = ledger(evs, job)
    hbs = [e for e in evs if isinstance(e, schemas.RankHeartbeat)]
    # losses differ by rank (each trains on its own shard): compare one rank's, the lowest
    loss_rank = min((h.rank for h in hbs if h.loss is not None and h.rank is not None),
                    default=None)
    hbs_loss = [h for h in hbs if h.rank == loss_rank]
    verdicts = {e.event_id: e for e in evs if isinstance(e, schemas.Verdict)}
    decisions = {e.event_id: e for e in evs if isinstance(e, schemas.Decision)}
    verified = [e for e in evs if isinstance(e, schemas.RecoveryVerified)
                and (loss_rank is None or e.rank in (None, loss_rank))]
    resumes = [e for e in evs if isinstance(e, schemas.TrainingResumed)]
    recoveries = []
    steps = timeline.steps_from_heartbeats(hbs)
    faults = [inc.fault_ns for inc in led.incidents]
    for k, inc in enumerate(led.incidents):
        tl = timeline.build(inc.fault_ns, evs, audit or (), steps, decision_id=inc.decision_id,
                            until_ns=faults[k + 1] - 1 if k + 1 < len(faults) else None)
        back = [r for r in resumes if inc.resumed_ns is not None
                and inc.decided_ns <= r.ts <= inc.resumed_ns and r.generation >= inc.generation]
        dec = decisions.get(inc.decision_id)
        v = verdicts.get(dec.verdict_id) if dec is not None else None
        ver = next((x for x in verified if inc.resumed_ns is not None
                    and x.ts >= inc.decided_ns and x.generation >= inc.generation), None)
        loss_after = ver.loss_after if ver and ver.loss_after is not None else _loss_after(
            hbs_loss, inc.resumed_ns)
        restored = (inc.restored_step if inc.restored_step is not None and inc.restored_step >= 0
                    else None)
        recoveries.append({
            "fault_class": inc.fault_class, "action": inc.action, "generation": inc.generation,
            "times_ns": {"fault": inc.fault_ns, "detected": inc.detected_ns,
                         "decided": inc.decided_ns, "resumed": inc.resumed_ns},
            "seconds_from_fault": {"detected": _s(inc.fault_ns, inc.detected_ns),
                                   "decided": _s(inc.fault_ns, inc.decided_ns),
                                   "resumed": _s(inc.fault_ns, inc.resumed_ns)},
            "decision_id": inc.decision_id,
            # a script that restores itself (an unmodified torchrun script) reports no step:
            # its ranks say -1, which is "unknown", not a step
            "restored_step": restored,
            "steps_replayed": inc.steps_rolled_back if restored is not None else None,
            "path": back[-1].path if back else None,
            "path_reason": back[-1].reason if back else None,
            "loss_rank": loss_rank, "loss_before": _loss_before(hbs_loss, inc.fault_ns),
            "loss_after": loss_after,
            "loss_at_save": ver.loss_at_save if ver else None,
            "continuity_ok": ver.ok if ver else None,
            "verdict": None if v is None else {
                "fault_class": v.fault_class, "layer": v.layer, "ranks": v.culprit.ranks,
                "nodes": v.culprit.nodes, "confidence": v.confidence},
            "decision": None if dec is None else {
                "action": dec.action, "generation": dec.generation, "executed": dec.execute,
                "mode": dec.mode, "ranks": dec.ranks, "nodes": dec.nodes, "reason": dec.reason},
            "gpu_seconds_lost": inc.gpu_seconds, "timeline": tl.to_dict()})
    summary = {k: v for k, v in led.to_dict().items() if k != "incidents"}
    return {"job": job, "events": len(evs), "goodput": summary, "recoveries": recoveries,
            "audit": None if audit is None else {
                "records": len(audit),
                "by_type": {t: sum(1 for a in audit if a.get("type") == t)
                            for t in sorted({str(a.get("type")) for a in audit})}}}


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "–" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))


def to_markdown(rep: dict[str, Any], picture: str | None = None) -> str:
    """The report as markdown; ``picture``: file name of the timeline image, when drawn."""
    g = rep["goodput"]
    lines = [f"# trainguard report: job `{rep['job']}`", "",
             f"{rep['events']} events kept; start-up {_f(g.get('startup_s'), '{:.1f}')} s, "
             f"then {_f(g['wall_s'], '{:.1f}')} s training on "
             f"{g['world_size']} ranks; steps {g['first_step']} → {g['last_step']}; "
             f"fault-free step {_f(g['ref_step_s'], '{:.4f}')} s; training goodput "
             f"**{_f(g['training_goodput'], '{:.1%}')}**.", "",
             "| GPU-seconds | total | useful | detection | decision | restart | rollback | other |",
             "|---|---|---|---|---|---|---|---|",
             "| | " + " | ".join(_f(x, "{:.1f}") for x in (
                 g["gpu_s_total"], g["gpu_s_useful"], *(g["gpu_s_lost"][p] for p in (
                     "detection", "decision", "restart", "rollback")), g["gpu_s_other"]))
             + " |", ""]
    if picture:
        lines += [f"![timeline]({picture})", ""]
    if rep["audit"] is None:
        lines += ["Audit trail: not read (no REDIS_URL).", ""]
    else:
        lines += [f"Audit trail: {rep['audit']['records']} records "
                  f"({json.dumps(rep['audit']['by_type'])}).", ""]
    for i, r in enumerate(rep["recoveries"], 1):
        sec, v, d = r["seconds_from_fault"], r["verdict"], r["decision"]
        lines += [f"## Recovery {i}: {r['fault_class']} → {r['action']} "
                  f"(generation {r['generation']})", "",
                  f"* times from the fault: detected {_f(sec['detected'])} s, decided "
                  f"{_f(sec['decided'])} s, training again {_f(sec['resumed'])} s",
                  (f"* restored step {_f(r['restored_step'])}, steps replayed "
                   f"{_f(r['steps_replayed'])}, from {_f(r.get('path'))}"
                   if r["restored_step"] is not None else
                   "* restored step unknown: the script restores itself and reports no step"),
                  (f"* loss (rank {r['loss_rank']}) before {_f(r['loss_before'], '{:.4f}')}, "
                   f"after {_f(r['loss_after'], '{:.4f}')}, at save "
                   f"{_f(r['loss_at_save'], '{:.4f}')}" if r["loss_rank"] is not None else
                   "* loss: not reported by the script")
                  + f"; continuity verdict: "
                  f"{ {True: 'ok', False: 'NOT ok', None: 'not checked'}[r['continuity_ok']] }"]
        if v:
            lines.append(f"* verdict: {v['fault_class']}/{v['layer']}, ranks {v['ranks']}, "
                         f"nodes {v['nodes']}, {v['confidence']} confidence")
        if d:
            lines.append(f"* decision: {d['action']} ({d['mode']}, executed {d['executed']}): "
                         f"{d['reason']}")
        if r.get("timeline"):
            lines += ["", "Timeline (first steps from the ranks' heartbeats):", "",
                      *timeline.format_timeline(r["timeline"])]
        lines.append("")
    if not rep["recoveries"]:
        lines += ["No recovery: no decision other than a flag.", ""]
    return "\n".join(lines)


def plot_timeline(rep: dict[str, Any], events: list[schemas.Event], path: str) -> bool:
    """Draw steps over time per rank, with each incident's phases shaded; False when
    matplotlib is not installed (``pip install 'trainguard[report]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    job = rep["job"]
    hbs = sorted((e for e in events if isinstance(e, schemas.RankHeartbeat) and e.job == job),
                 key=lambda e: e.ts)
    t0 = hbs[0].ts if hbs else min((e.ts for e in events), default=0)
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, rank in enumerate(sorted({h.rank for h in hbs if h.rank is not None})):
        pts = [((h.ts - t0) / 1e9, h.step) for h in hbs if h.rank == rank]
        # one line per process: a restarted rank starts over below its last step, and a line
        # from the old process's last heartbeat to the new one's first is no training
        segs: list[list[tuple[float, int]]] = []
        for p in pts:
            if not segs or p[1] < segs[-1][-1][1]:
                segs.append([])
            segs[-1].append(p)
        for j, seg in enumerate(segs):
            ax.plot([p[0] for p in seg], [p[1] for p in seg], lw=1, color=f"C{i}",
                    label=f"rank {rank}" if j == 0 else None)
    colors = {"detection": "#f4a261", "decision": "#e76f51", "restart": "#9d4edd"}
    for r in rep["recoveries"]:
        t = r["times_ns"]
        marks = [("detection", t["fault"], t["detected"]), ("decision", t["detected"],
                                                              t["decided"]),
                 ("restart", t["decided"], t["resumed"])]
        for name, a, b in marks:
            if a and b and b >= a:
                ax.axvspan((a - t0) / 1e9, (b - t0) / 1e9, color=colors[name], alpha=0.35,
                           label=name if r is rep["recoveries"][0] else None)
        ax.axvline((t["fault"] - t0) / 1e9, color="red", lw=0.8)
        ax.annotate(r["action"], ((t["fault"] - t0) / 1e9, ax.get_ylim()[1] * 0.95),
                    fontsize=7, rotation=90, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("step")
    ax.set_title(f"{job}: steps per rank, recoveries shaded")
    if ax.get_legend_handles_labels()[0]:  # no rank stepped: nothing to name
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


async def _audit(redis_url: str, job: str) -> list[dict[str, Any]] | None:
    if not redis_url:
        return None
    from trainguard.clients.store import StateStore

    st = StateStore(redis_url)
    try:
        return await st.audit_trail(job, count=100000)
    finally:
        await st.close()


def write(job: str, events: list[schemas.Event], audit: list[dict[str, Any]] | None,
          out_dir: str) -> dict[str, str]:
    """Write the three files to ``out_dir``; returns kind → path (no ``png`` without
    matplotlib)."""
    os.makedirs(out_dir, exist_ok=True)
    rep = build_report(job, events, audit)
    paths = {"json": os.path.join(out_dir, f"{job}-report.json"),
             "md": os.path.join(out_dir, f"{job}-report.md")}
    png = os.path.join(out_dir, f"{job}-timeline.png")
    drawn = plot_timeline(rep, events, png)
    if drawn:
        paths["png"] = png
    with open(paths["json"], "w") as fh:
        json.dump(rep, fh, indent=1, default=str)
    with open(paths["md"], "w") as fh:
        fh.write(to_markdown(rep, os.path.basename(png) if drawn else None))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainguard report",
                                description="Continuity report of a job from its stored history "
                                            "and audit trail.")
    p.add_argument("job")
    p.add_argument("--out", default=".", help="output directory (default: .)")
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""))
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    args = p.parse_args(argv)
    if not args.nats_url:
        print("trainguard report: no NATS URL: pass --nats-url or set NATS_URL (the reader "
              "role's env file has it)", file=sys.stderr)
        return 2
    try:
        schemas.subjects.token(args.job)

        async def load() -> tuple[list[schemas.Event], list[dict[str, Any]] | None]:
            return (await job_events(args.nats_url, args.job),
                    await _audit(args.redis_url, args.job))

        events, audit = asyncio.run(load())
        if not events:
            print(f"trainguard report: no stored events of job {args.job!r} (history keeps "
                  f"events 7 days, heartbeats 1 hour)", file=sys.stderr)
            return 1
        paths = write(args.job, events, audit, args.out)
    except (ConnectionError, OSError, ValueError) as exc:
        print(f"trainguard report: {exc}", file=sys.stderr)
        return 1
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0

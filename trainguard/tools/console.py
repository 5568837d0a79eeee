"""A small console over the state store (read-only but for the breaker's reset): a JSON API and one web page.

``python -m trainguard.tools.console --redis-url URL [--nats-url URL] [--host 127.0.0.1] [--port 8080]``

* ``GET /healthz`` — ``{"ok": true}`` when Redis/Valkey answers, else HTTP 503 with the error;
* ``GET /jobs`` — ``[{"job", "mode", "generation", "world_size", "status", "retries_used",
  "retry_budget"}]``;
* ``GET /jobs/{job}`` — ``{"job", "state": <the job record, every field>, "audit": [records,
  oldest first], "checkpoints": [{"path", "step", "status", "reasons"}, newest first]}``; 404
  for an unknown job;
* ``GET /api/jobs/{job}/goodput`` — the job's goodput ledger (``trainguard.core.goodput.Ledger``
  as JSON) from its stored history (JetStream; needs ``--nats-url``, else HTTP 503; 404 when
  nothing of the job is stored);
* ``GET /metrics`` — Prometheus: ``tg_job_training_goodput{job}`` and
  ``tg_job_gpu_seconds_lost{job, phase}`` of the jobs in the state store, from ledgers
  refreshed every ``refresh_s`` (15 s) in the background (with ``--nats-url``);
* ``GET /api/nodes`` — the node table: every node of a job record (members, spares) or with
  a ``tg:node`` record: ``[{"node", "state" (excluded | lost | suspect | healthy), "status"
  (the store's; None when it has none), "reason", "updated_ns", "ranks" {job: [ranks]},
  "spare_for" [jobs], "faults" (node-layer faults in the cross-job history within the
  attributor's ``history_window_s``), "fault_jobs", "repeat_offender"}]``; ``suspect``: such
  faults in at least one job, ``repeat_offender``: in ``node_repeat_jobs`` jobs or more (the
  attributor's rule, ``trainguard.attributor.decide``);
* ``GET /api/jobs/{job}/incidents`` — ``{"source", "goodput", "incidents", "flags"}``: with
  ``--nats-url`` the report's recoveries (``trainguard.tools.report.build_report``: times, verdict,
  decision, restored step, steps rolled back, recovery path, loss check) from the stored
  history, else the audit trail's decisions (times, fault class, culprit, action, reason);
  ``flags``: the decisions of action ``none``;
* ``GET /api/breaker`` — the fleet breaker (``trainguard breaker status --json``);
  ``POST /api/breaker/reset`` with ``{"by", "reason"}`` closes it (both required: HTTP 400
  without; 503 when the console's store user may not write it), who, when and why into its
  trail (``docs/fleet-guard.md``);
* ``GET /`` — the page of jobs and nodes (and the breaker's line); ``GET /job/{job}`` — one
  job's page: record, goodput, timeline (``trainguard.tools.console_timeline``: an SVG of steps per
  rank with each fault's silence, detection, decision and recovery, from the stored history),
  incidents, nodes, checkpoints, audit trail (``trainguard.tools.console_page``: HTML rendered here,
  no script; both reload every 5 s).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response

from trainguard import schemas

from trainguard.tools import breaker as breaker_cli

from trainguard.tools.console_page import index_page, job_page
from trainguard.tools.console_timeline import timeline
from trainguard.core.goodput import Ledger, ledger
from trainguard.clients.store import StateStore

log = logging.getLogger("trainguard.tools.console")

SUMMARY_FIELDS = ("mode", "generation", "world_size", "status", "retries_used", "retry_budget")


def create_app(redis_url: str, nats_url: str = "", refresh_s: float = 15.0) -> FastAPI:
    """The console app reading the state store at ``redis_url`` and, with ``nats_url``, the
    stored history (goodput); ``refresh_s``: period of the ledgers behind ``/metrics``."""
    from trainguard.services.metrics import Metrics, job_collector

    store: dict[str, StateStore] = {}
    ledgers: dict[str, Ledger] = {}
    metrics = Metrics()
    job_collector(metrics, lambda: list(ledgers.values()))

    async def goodput_of(job: str) -> Ledger | None:
        from trainguard.tools.report import job_events

        events = await job_events(nats_url, job)
        if not events:
            return None
        led = ledgers[job] = ledger(events, job)
        return led

    async def refresh() -> None:
        while True:
            try:
                for job in await store["s"].jobs():
                    await goodput_of(job)
            except Exception as exc:  # noqa: BLE001 - a failed refresh is tried again later
                log.warning("goodput refresh failed: %s", exc)
            await asyncio.sleep(refresh_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store["s"] = StateStore(redis_url)
        task = asyncio.create_task(refresh()) if nats_url else None
        yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await store["s"].close()

    app = FastAPI(title="trainguard console", lifespan=lifespan)

    @app.get("/api/jobs/{job}/goodput")
    async def goodput(job: str) -> Any:
        if not nats_url:
            return JSONResponse({"error": "the console has no NATS URL (--nats-url): the "
                                          "goodput comes from the stored history"},
                                status_code=503)
        try:
            led = await goodput_of(job)
        except (ConnectionError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        if led is None:
            raise HTTPException(404, f"nothing stored of job {job!r}")
        return led.to_dict()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> Any:
        try:
            await store["s"].ping()
        except ConnectionError as exc:
            return JSONResponse({"ok": False, "error": str(exc)}, status_code=503)
        return {"ok": True}

    @app.get("/jobs")
    async def jobs() -> list[dict[str, Any]]:
        out = []
        for job in await store["s"].jobs():
            st = await store["s"].job(job)
            out.append({"job": job, **{k: getattr(st, k) for k in SUMMARY_FIELDS}})
        return out

    @app.get("/jobs/{job}")
    async def job(job: str, audit_count: int = 1000) -> dict[str, Any]:
        if job not in await store["s"].jobs():
            raise HTTPException(404, f"no job {job!r}: GET /jobs lists the known ones")
        st = await store["s"].job(job)
        return {"job": job, "state": st.to_dict(),
                "audit": await store["s"].audit_trail(job, count=audit_count),
                "checkpoints": await store["s"].checkpoints(job)}

    async def nodes_view(only: set[str] | None = None) -> list[dict[str, Any]]:
        from trainguard.attributor.decide import NODE_LAYERS
        from trainguard.tools.node import fault_history

        st = store["s"]
        records = await st.nodes()
        ranks: dict[str, dict[str, list[int]]] = {}
        spare: dict[str, list[str]] = {}
        for name in sorted(await st.jobs()):
            rec = await st.job(name)
            for m in rec.members or []:
                ranks.setdefault(str(m.get("node")), {}).setdefault(name, []).append(
                    int(m.get("rank", -1)))
            for n in rec.spare_nodes or []:
                spare.setdefault(n, []).append(name)
        names = sorted(set(records) | set(ranks) | set(spare))
        if only is not None:
            names = [n for n in names if n in only]
        now = time.time_ns()
        out = []
        for n in names:
            r = records.get(n) or {}
            h = await fault_history(st, n, now)  # as the attributor weighs it
            jobs_hit = h["fault_jobs"]
            status = r.get("status")
            state = status if status in ("excluded", "lost") else (
                "suspect" if jobs_hit else "healthy")
            out.append({"node": n, "state": state, "status": status,
                        "reason": r.get("reason") or "",
                        "updated_ns": int(r["updated_ns"]) if r.get("updated_ns") else None,
                        "ranks": {j: sorted(v) for j, v in ranks.get(n, {}).items()},
                        "spare_for": spare.get(n, []),
                        "faults": sum(1 for x in h["records"] if x.get("layer") in NODE_LAYERS),
                        "fault_jobs": jobs_hit,
                        "repeat_offender": h["repeat_offender"]})
        return out

    async def incidents_view(name: str, audit: list[dict[str, Any]] | None = None,
                             with_timeline: bool = False) -> dict[str, Any]:
        st = store["s"]
        if audit is None:
            audit = await st.audit_trail(name, count=100000)
        if nats_url:
            from trainguard.tools.report import build_report, job_events

            events = await job_events(nats_url, name)
            if events:
                rep = build_report(name, events, audit)
                ledgers[name] = ledger(events, name)
                flags = [e.to_dict() for e in events
                         if isinstance(e, schemas.Decision) and e.action == "none"]
                out = {"source": "the stored history", "goodput": rep["goodput"],
                       "incidents": rep["recoveries"], "flags": flags}
                if with_timeline:
                    out["timeline"] = timeline(events, rep["recoveries"], rep["goodput"])
                return out
        decs = [a.get("decision") or a for a in audit if a.get("type") == "decision"]
        incs = []
        for d in decs:
            if d.get("action") == "none":
                continue
            f, det, ts = d.get("fault_ts") or 0, d.get("detected_ts") or 0, d.get("ts") or 0
            incs.append({
                "fault_class": d.get("fault_class"), "action": d.get("action"),
                "generation": d.get("generation"),
                "times_ns": {"fault": f, "detected": det, "decided": ts, "resumed": None},
                "seconds_from_fault": {
                    "detected": round((det - f) / 1e9, 3) if f and det else None,
                    "decided": round((ts - f) / 1e9, 3) if f and ts else None,
                    "resumed": None},
                "decision_id": d.get("event_id") or d.get("decision_id"), "verdict": None,
                "decision": {"action": d.get("action"), "generation": d.get("generation"),
                             "executed": d.get("execute"), "mode": d.get("mode"),
                             "ranks": d.get("ranks") or [], "nodes": d.get("nodes") or [],
                             "reason": d.get("reason")},
                "restored_step": None, "steps_replayed": None, "path": None,
                "continuity_ok": None})
        led = ledgers.get(name)
        return {"source": "the audit trail (no --nats-url: no verdicts nor resumes)",
                "goodput": None if led is None else {
                    k: v for k, v in led.to_dict().items() if k != "incidents"},
                "incidents": incs, "flags": [d for d in decs if d.get("action") == "none"]}

    @app.get("/api/nodes")
    async def api_nodes() -> list[dict[str, Any]]:
        return await nodes_view()

    @app.get("/api/jobs/{name}/incidents")
    async def api_incidents(name: str) -> dict[str, Any]:
        if name not in await store["s"].jobs():
            raise HTTPException(404, f"no job {name!r}: GET /jobs lists the known ones")
        try:
            return await incidents_view(name)
        except (ConnectionError, ValueError) as exc:
            raise HTTPException(503, str(exc)) from None

    @app.get("/api/breaker")
    async def api_breaker() -> dict[str, Any]:
        try:
            return await breaker_cli.status(store["s"])
        except (ConnectionError, ValueError) as exc:
            raise HTTPException(503, str(exc)) from None

    @app.post("/api/breaker/reset")
    async def api_breaker_reset(body: dict[str, Any]) -> dict[str, Any]:
        by, reason = str(body.get("by") or ""), str(body.get("reason") or "")
        try:
            await breaker_cli.reset(store["s"], by, reason)
            return await breaker_cli.status(store["s"])
        except breaker_cli.br.BreakerError as exc:
            raise HTTPException(400, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a read-only role, the store away
            raise HTTPException(503, f"reset not written: {exc}") from None

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        try:
            b = await breaker_cli.status(store["s"], trail=0)
        except (ConnectionError, ValueError):
            b = None
        return index_page(await jobs(), await nodes_view(), breaker=b)

    @app.get("/job/{name}", response_class=HTMLResponse)
    async def job_html(name: str) -> str:
        st = store["s"]
        if name not in await st.jobs():
            raise HTTPException(404, f"no job {name!r}: GET /jobs lists the known ones")
        rec = await st.job(name)
        audit = await st.audit_trail(name, count=100000)  # read once: incidents and the trail
        try:
            incs = await incidents_view(name, audit, with_timeline=True)
        except (ConnectionError, ValueError) as exc:
            incs = {"source": f"nothing ({exc})", "goodput": None, "incidents": [], "flags": []}
        mine = {str(m.get("node")) for m in rec.members or []} | set(rec.spare_nodes or [])
        for r in incs["incidents"]:
            mine |= set((r.get("decision") or {}).get("nodes") or [])
        return job_page(name, rec.to_dict(), incs, await nodes_view(mine),
                        await st.checkpoints(name), audit, timeline=incs.pop("timeline", None))

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.tools.console",
                                description="Read-only web console over the trainguard state.")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""),
                   help="NATS (reader role) for the goodput of the stored history")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("TG_CONSOLE_PORT", "8080")))
    p.add_argument("--refresh-s", type=float, default=15.0,
                   help="seconds between refreshes of the goodput behind /metrics (15)")
    args = p.parse_args(argv)
    if not args.redis_url:
        print("trainguard console: pass --redis-url or set REDIS_URL (`trainguard up` prints it)",
              file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(create_app(args.redis_url, args.nats_url, args.refresh_s), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())

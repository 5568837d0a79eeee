"""A small read-only console over the state store: a JSON API and one web page.

``python -m trainguard.console --redis-url URL [--nats-url URL] [--host 127.0.0.1] [--port 8080]``

* ``GET /healthz`` — ``{"ok": true}`` when Redis/Valkey answers, else HTTP 503 with the error;
* ``GET /jobs`` — ``[{"job", "mode", "generation", "world_size", "status", "retries_used",
  "retry_budget"}]``;
* ``GET /jobs/{job}`` — ``{"job", "state": <the job record, every field>, "audit": [records,
  oldest first], "checkpoints": [{"path", "step", "status", "reasons"}, newest first]}``; 404
  for an unknown job;
* ``GET /api/jobs/{job}/goodput`` — the job's goodput ledger (``trainguard.goodput.Ledger``
  as JSON) from its stored history (JetStream; needs ``--nats-url``, else HTTP 503; 404 when
  nothing of the job is stored);
* ``GET /metrics`` — Prometheus: ``tg_job_training_goodput{job}`` and
  ``tg_job_gpu_seconds_lost{job, phase}`` of the jobs in the state store, from ledgers
  refreshed every ``refresh_s`` (15 s) in the background (with ``--nats-url``);
* ``GET /`` — a page listing the jobs and, for a chosen job, its decisions.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .goodput import Ledger, ledger
from .state import StateStore

log = logging.getLogger("trainguard.console")

SUMMARY_FIELDS = ("mode", "generation", "world_size", "status", "retries_used", "retry_budget")


def create_app(redis_url: str, nats_url: str = "", refresh_s: float = 15.0) -> FastAPI:
    """The console app reading the state store at ``redis_url`` and, with ``nats_url``, the
    stored history (goodput); ``refresh_s``: period of the ledgers behind ``/metrics``."""
    from .metrics import Metrics, job_collector

    store: dict[str, StateStore] = {}
    ledgers: dict[str, Ledger] = {}
    metrics = Metrics()
    job_collector(metrics, lambda: list(ledgers.values()))

    async def goodput_of(job: str) -> Ledger | None:
        from .report import job_events

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

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return _PAGE

    return app


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>trainguard</title>
<style>body{font:14px system-ui,sans-serif;margin:2em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}a{cursor:pointer;color:#06c}</style>
</head><body><h1>trainguard</h1><table id="jobs"></table><h2 id="title"></h2><p id="goodput"></p>
<table id="audit"></table><script>
const esc = s => String(s ?? "").replace(/[&<>]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;"}[c]));
function row(cells, tag) { return "<tr>" + cells.map(c => `<${tag}>${c}</${tag}>`).join("") + "</tr>"; }
async function jobs() {
  const js = await (await fetch("jobs")).json();
  document.getElementById("jobs").innerHTML =
    row(["job","mode","generation","world size","status","retries"], "th") +
    js.map(j => row([`<a onclick="show('${esc(j.job)}')">${esc(j.job)}</a>`, esc(j.mode),
      esc(j.generation), esc(j.world_size), esc(j.status),
      `${esc(j.retries_used ?? 0)} / ${esc(j.retry_budget)}`], "td")).join("");
}
async function show(job) {
  const j = await (await fetch("jobs/" + encodeURIComponent(job))).json();
  document.getElementById("title").textContent = job + " — audit trail";
  const g = await fetch("api/jobs/" + encodeURIComponent(job) + "/goodput");
  document.getElementById("goodput").textContent = g.ok ? (gp => `training goodput ${
    gp.training_goodput === null ? "–" : (100 * gp.training_goodput).toFixed(1) + " %"}; GPU-s lost: ${
    Object.entries(gp.gpu_s_lost).map(([k, v]) => k + " " + v.toFixed(1)).join(", ")}`)(await g.json()) : "";
  document.getElementById("audit").innerHTML =
    row(["type","action","generation","execute","reason"], "th") +
    j.audit.map(a => row([esc(a.type), esc(a.action), esc(a.generation), esc(a.execute),
      esc(a.reason)], "td")).join("");
}
jobs(); setInterval(jobs, 2000);
</script></body></html>"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.console",
                                description="Read-only web console over the trainguard state.")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""),
                   help="NATS (reader role) for the goodput of the stored history")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("TG_CONSOLE_PORT", "8080")))
    args = p.parse_args(argv)
    if not args.redis_url:
        print("trainguard console: pass --redis-url or set REDIS_URL (`trainguard up` prints it)",
              file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(create_app(args.redis_url, args.nats_url), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())

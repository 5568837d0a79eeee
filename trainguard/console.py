"""A small read-only console over the state store: a JSON API and one web page.

``python -m trainguard.console --redis-url URL [--host 127.0.0.1] [--port 8080]``

* ``GET /healthz`` — ``{"ok": true}`` when Redis/Valkey answers, else HTTP 503 with the error;
* ``GET /jobs`` — ``[{"job", "mode", "generation", "world_size", "status", "retries_used",
  "retry_budget"}]``;
* ``GET /jobs/{job}`` — ``{"job", "state": <the job record, every field>, "audit": [records,
  oldest first], "checkpoints": [{"path", "step", "status", "reasons"}, newest first]}``; 404
  for an unknown job;
* ``GET /`` — a page listing the jobs and, for a chosen job, its decisions.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse

from .state import StateStore

SUMMARY_FIELDS = ("mode", "generation", "world_size", "status", "retries_used", "retry_budget")


def create_app(redis_url: str) -> FastAPI:
    """The console app reading the state store at ``redis_url``."""
    store: dict[str, StateStore] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store["s"] = StateStore(redis_url)
        yield
        await store["s"].close()

    app = FastAPI(title="trainguard console", lifespan=lifespan)

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
</head><body><h1>trainguard</h1><table id="jobs"></table><h2 id="title"></h2>
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
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("TG_CONSOLE_PORT", "8080")))
    args = p.parse_args(argv)
    if not args.redis_url:
        print("trainguard console: pass --redis-url or set REDIS_URL (`trainguard up` prints it)",
              file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(create_app(args.redis_url), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The console's web pages, rendered on the server from what the console read (plain HTML and
CSS, no script): pure functions of plain data, so a test renders them without servers.

* ``index_page(jobs, nodes)`` — the job list and the node table;
* ``job_page(job, record, incidents, nodes, checkpoints, audit, refresh_s, timeline)`` — one job:
  its record, its goodput, its timeline (``trainguard.tools.console_timeline``: steps per rank, each
  fault's silence, detection, decision and recovery), its incidents (fault, detected and decided times, the verdict: fault class,
  layer, culprit; the decision: action, reason; the recovery: training again, restored step,
  steps rolled back, path), its nodes, checkpoints and audit trail.

Inputs are the console's JSON (``GET /jobs``, ``/api/nodes``, ``/api/jobs/<job>/incidents``);
times are Unix ns and are shown as UTC with milliseconds, and in seconds from the fault.
Every value is HTML-escaped.
"""
from __future__ import annotations

import datetime as _dt
import html
from typing import Any, Iterable

__all__ = ["index_page", "job_page", "utc"]

_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em 2em;color:#222}
h1{font-size:1.4em;margin:0 0 .6em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;margin:.2em 0}td,th{border:1px solid #ccc;padding:.25em .55em;
text-align:left;vertical-align:top}th{background:#f3f3f3}a{color:#06c}
.num{white-space:nowrap;font-variant-numeric:tabular-nums}.muted{color:#777}
.st-healthy,.st-finished,.st-running{color:#18794e}.st-excluded,.st-lost,.st-failed,
.st-stopped,.st-invalid{color:#c62828;font-weight:600}.st-suspect,.st-pending{color:#b26a00;
font-weight:600}.reason{max-width:36em}"""


def utc(ns: int | None) -> str:
    """Unix ns → ``HH:MM:SS.mmm`` UTC (with the date when it is not today's); ``–`` for none."""
    if not ns:
        return "–"
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    today = _dt.datetime.now(_dt.timezone.utc).date()
    fmt = "%H:%M:%S.%f" if t.date() == today else "%Y-%m-%d %H:%M:%S.%f"
    return t.strftime(fmt)[:-3]


def _e(v: Any) -> str:
    return "–" if v is None or v == "" else html.escape(str(v))


def _secs(v: float | None) -> str:
    return "–" if v is None else f'<span class="num">+{v:.3f} s</span>'


def _table(tid: str, head: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A table; cells are HTML already (escape values with ``_e``)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    heads = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f'<table id="{tid}"><thead><tr>{heads}</tr></thead><tbody>{body}</tbody></table>'


def _page(title: str, body: str, refresh_s: int) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"{body}</body></html>")


def _status(s: str | None) -> str:
    return f'<span class="st-{html.escape(s or "")}">{_e(s)}</span>'


def _node_rows(nodes: list[dict[str, Any]]) -> list[list[str]]:
    return [[_e(n["node"]), _status(n["state"]), _e(n.get("status")),
             _e("; ".join(f"{j}: {', '.join(map(str, r))}" for j, r in n.get("ranks", {}).items())),
             _e(", ".join(n.get("spare_for", []))),
             f'<span class="num">{n.get("faults", 0)}</span>',
             _e(", ".join(n.get("fault_jobs", []))), _e(utc(n.get("updated_ns"))),
             f'<span class="reason">{_e(n.get("reason"))}</span>'] for n in nodes]


NODE_HEAD = ("node", "state", "status in store", "ranks (job: ranks)", "spare for",
             "node faults (24 h)", "in jobs", "updated (UTC)", "reason")


def breaker_line(b: dict[str, Any] | None) -> str:
    """The fleet breaker in one paragraph (``GET /api/breaker``); empty when unknown."""
    if not b:
        return ""
    text = (f'fleet breaker: {_status("stopped" if b.get("status") == "tripped" else "running")}'
            f' {_e(b.get("status"))} — {_e(b.get("taken"))} of at most {_e(b.get("limit"))} '
            f'node(s) taken out within {_e(b.get("window_s"))} s')
    if b.get("status") == "tripped":
        text += (f'; {_e(b.get("held"))} decision(s) held: {_e(b.get("trip_reason"))}; '
                 f'reset with <code>trainguard breaker reset --reason …</code>')
    return f'<p id="breaker">{text}</p>'


def index_page(jobs: list[dict[str, Any]], nodes: list[dict[str, Any]],
               refresh_s: int = 5, breaker: dict[str, Any] | None = None) -> str:
    """The front page: ``jobs`` as ``GET /jobs`` returns them, ``nodes`` as ``/api/nodes``,
    ``breaker`` as ``/api/breaker``."""
    rows = [[f'<a href="job/{html.escape(j["job"], quote=True)}">{_e(j["job"])}</a>',
             _e(j.get("mode")), _status(j.get("status")), f'<span class="num">'
             f'{_e(j.get("generation"))}</span>', f'<span class="num">'
             f'{_e(j.get("world_size"))}</span>',
             f'{_e(j.get("retries_used") or 0)} / {_e(j.get("retry_budget"))}'] for j in jobs]
    body = ("<h1>trainguard</h1>" + breaker_line(breaker) + "<h2>Jobs</h2>"
            + (_table("jobs", ("job", "mode", "status", "generation", "world size",
                               "retries used / budget"), rows) if rows else
               '<p id="jobs" class="muted">no job in the state store</p>')
            + "<h2>Nodes</h2>" + (_table("nodes", NODE_HEAD, _node_rows(nodes)) if nodes else
                                  '<p id="nodes" class="muted">no node known</p>'))
    return _page("trainguard", body, refresh_s)


def _culprit(v: dict[str, Any] | None) -> str:
    if not v:
        return "–"
    parts = []
    if v.get("ranks"):
        parts.append("ranks " + ", ".join(map(str, v["ranks"])))
    if v.get("nodes"):
        parts.append("nodes " + ", ".join(v["nodes"]))
    return _e("; ".join(parts) or None)


def job_page(job: str, record: dict[str, Any], incidents: dict[str, Any],
             nodes: list[dict[str, Any]], checkpoints: list[dict[str, Any]],
             audit: list[dict[str, Any]], refresh_s: int = 5,
             timeline: dict[str, Any] | None = None) -> str:
    """One job's page. ``incidents``: ``/api/jobs/<job>/incidents`` (``{"source", "goodput",
    "incidents": [...], "flags": [...]}``); ``record``: the job record as a dict; ``timeline``:
    ``trainguard.tools.console_timeline.timeline`` of the job's stored history, drawn under the
    record (None: the page says the picture needs the stored history)."""
    from trainguard.tools.console_timeline import svg
    g = incidents.get("goodput")
    gp = "–" if not g or g.get("training_goodput") is None else \
        f"{100 * g['training_goodput']:.1f} %"
    lost = "" if not g else ", ".join(f"{k} {v:.1f}" for k, v in g["gpu_s_lost"].items())
    summary = _table("record", ("mode", "status", "generation", "world size", "retries",
                                "training goodput", "GPU-s lost"), [[
        _e(record.get("mode")), _status(record.get("status")), _e(record.get("generation")),
        _e(record.get("world_size")),
        f'{_e(record.get("retries_used") or 0)} / {_e(record.get("retry_budget"))}',
        f'<span id="goodput">{gp}</span>', _e(lost or None)]])
    inc_rows = []
    for i, r in enumerate(incidents.get("incidents", []), 1):
        v, d, sec = r.get("verdict"), r.get("decision") or {}, r["seconds_from_fault"]
        t = r["times_ns"]
        inc_rows.append([
            str(i), _e(utc(t.get("fault"))), _secs(sec.get("detected")),
            _secs(sec.get("decided")), _secs(sec.get("resumed")),
            _e(r.get("fault_class")), _e(v.get("layer") if v else None), _culprit(v or d),
            _e(v.get("confidence") if v else None),
            f'<b>{_e(r.get("action"))}</b>' + ("" if d.get("executed", True) else
                                               ' <span class="muted">(not executed)</span>'),
            f'<span class="reason">{_e(d.get("reason"))}</span>',
            _e(r.get("restored_step")), _e(r.get("steps_replayed")), _e(r.get("path")),
            {True: "ok", False: '<span class="st-failed">NOT ok</span>', None: "–"}[
                r.get("continuity_ok")]])
    src = incidents.get("source", "")
    incident_html = (_table("incidents", (
        "#", "fault (UTC)", "detected", "decided", "training again", "fault class", "layer",
        "culprit", "confidence", "decision", "reason", "restored step", "steps rolled back",
        "recovery path", "loss check"), inc_rows) if inc_rows else
        '<p id="incidents" class="muted">no incident</p>')
    flags = incidents.get("flags", [])
    flag_html = "" if not flags else "<h2>Flags (decision none)</h2>" + _table(
        "flags", ("decided (UTC)", "fault class", "culprit", "reason"),
        [[_e(utc(f.get("ts"))), _e(f.get("fault_class")), _culprit(f),
          f'<span class="reason">{_e(f.get("reason"))}</span>'] for f in flags])
    ck_rows = [[_e(c["step"]), _status(c["status"]), _e(c["path"]),
                _e("; ".join(c.get("reasons") or []) or None)] for c in checkpoints[:20]]
    audit_rows = [[_e(utc(a.get("ts"))), _e(a.get("type")), _e(a.get("action")),
                   _e(a.get("generation")), _e(a.get("execute")),
                   f'<span class="reason">{_e(a.get("reason"))}</span>'] for a in audit[-50:]]
    picture = ('<p id="no-timeline" class="muted">no timeline: it is drawn from the stored '
               "history (the console needs --nats-url) and its heartbeats</p>"
               if not timeline or not timeline.get("ranks") else svg(timeline))
    body = (f'<p><a href="../">← all jobs</a></p><h1>Job <span id="job">{_e(job)}</span></h1>'
            + summary + "<h2>Timeline</h2>" + picture
            + f'<h2>Incidents</h2><p class="muted">times from {html.escape(src)}; seconds '
              f"from the fault (a hang's fault: the rank's last progress, so detection "
              f"includes the silence)</p>" + incident_html + flag_html
            + "<h2>Nodes</h2>" + (_table("nodes", NODE_HEAD, _node_rows(nodes)) if nodes
                                  else '<p id="nodes" class="muted">no node known</p>')
            + "<h2>Checkpoints (newest first)</h2>" + (_table(
                "checkpoints", ("step", "status", "path", "reasons"), ck_rows) if ck_rows
                else '<p class="muted">none indexed</p>')
            + "<h2>Audit trail (last 50)</h2>" + (_table(
                "audit", ("time (UTC)", "type", "action", "generation", "executed",
                          "reason"), audit_rows) if audit_rows else
                '<p class="muted">empty</p>'))
    return _page(f"trainguard: {job}", body, refresh_s)

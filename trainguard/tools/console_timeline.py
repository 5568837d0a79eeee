"""A job's timeline as a picture the console renders on the server (inline SVG, no script): the
steps of every rank over time, each incident's phases — the silence (fault → detected: for a
hang, from the rank's last progress), the decision (detected → decided) and the restart (decided
→ every rank training again) — shaded and marked, and the training goodput. Pure: plain data in,
markup out, so a test renders it without servers.

* ``timeline(events, recoveries, goodput)`` — the data: ``{"t0_ns", "t1_ns", "max_step",
  "ranks": {rank: [[(seconds from t0, step), …] per process]}, "incidents": [{"fault_class",
  "action", "culprit", "times_s": {"fault", "detected", "decided", "resumed"}, "detected_s"}],
  "goodput"}``;
  ``recoveries`` as ``trainguard.tools.report.build_report`` gives them (times in Unix ns), ``goodput``
  its ledger summary. A rank's line is cut where its step goes back (a restarted process) and
  thinned to ``max_points`` per rank.
* ``svg(tl, width, height)`` — the picture; every value is escaped. Element ids and classes
  a reader (or a test) can find: ``svg#timeline``, ``g.incident`` (``data-fault-class``,
  ``data-action``, ``data-ranks``: the culprit ranks, ``data-detected-s``: seconds from the
  fault to detection), ``rect.silence``,
  ``rect.decision``, ``rect.restart``, ``line.fault`` / ``.detected`` / ``.decided`` /
  ``.resumed``, ``polyline.rank``.
"""
from __future__ import annotations

import html
from typing import Any, Iterable

from trainguard import schemas

__all__ = ["timeline", "svg", "PHASE_COLORS"]

#: Fill of each shaded phase (the report's picture uses the same hues).
PHASE_COLORS = {"silence": "#f4a261", "decision": "#e76f51", "restart": "#9d4edd"}
_RANK_COLORS = ("#1f77b4", "#2ca02c", "#d62728", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f",
                "#e377c2")


def _thin(seg: list[tuple[float, int]], keep: int) -> list[tuple[float, int]]:
    if len(seg) <= keep:
        return seg
    stride = len(seg) / keep
    out = [seg[int(i * stride)] for i in range(keep)]
    return out if out[-1] == seg[-1] else out + [seg[-1]]


def timeline(events: Iterable[schemas.Event], recoveries: list[dict[str, Any]],
             goodput: dict[str, Any] | None = None, max_points: int = 400) -> dict[str, Any]:
    """The timeline data of one job (see the module docstring). ``events``: the job's stored
    events (heartbeats are read, the rest ignored)."""
    hbs = sorted((e for e in events if isinstance(e, schemas.RankHeartbeat)
                  and e.rank is not None), key=lambda e: e.ts)
    times = [h.ts for h in hbs] + [t for r in recoveries for t in r["times_ns"].values() if t]
    t0 = min(times, default=0)
    t1 = max(times, default=0)
    ranks: dict[int, list[list[tuple[float, int]]]] = {}
    per = max(1, max_points)
    for h in hbs:
        segs = ranks.setdefault(h.rank, [])
        p = (round((h.ts - t0) / 1e9, 3), h.step)
        if not segs or h.step < segs[-1][-1][1]:
            segs.append([])
        segs[-1].append(p)
    for r, segs in ranks.items():
        n = sum(len(s) for s in segs)
        ranks[r] = [_thin(s, max(2, per * len(s) // max(1, n))) for s in segs]
    incs = []
    for r in recoveries:
        t = r["times_ns"]
        d = r.get("decision") or {}
        v = r.get("verdict") or d
        incs.append({
            "fault_class": r.get("fault_class"), "action": r.get("action"),
            "culprit": {"ranks": list(v.get("ranks") or []), "nodes": list(v.get("nodes") or [])},
            "times_s": {k: (round((t[k] - t0) / 1e9, 3) if t.get(k) else None)
                        for k in ("fault", "detected", "decided", "resumed")},
            # from the Unix ns, as the report's table rounds them (not from the rounded marks)
            "detected_s": (round((t["detected"] - t["fault"]) / 1e9, 3)
                           if t.get("fault") and t.get("detected") else None)})
    return {"t0_ns": t0, "t1_ns": t1, "max_step": max((h.step for h in hbs), default=0),
            "ranks": {r: ranks[r] for r in sorted(ranks)}, "incidents": incs,
            "goodput": None if not goodput else goodput.get("training_goodput")}


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def svg(tl: dict[str, Any], width: int = 960, height: int = 300) -> str:
    """The timeline picture as an inline ``<svg id="timeline">`` (see the module docstring)."""
    left, right, top, bottom = 52, 12, 28, 34
    span = max(1e-3, (tl["t1_ns"] - tl["t0_ns"]) / 1e9)
    top_step = max(1, tl["max_step"])
    pw, ph = width - left - right, height - top - bottom

    def x(s: float) -> float:
        return round(left + pw * min(max(s / span, 0.0), 1.0), 1)

    def y(step: float) -> float:
        return round(top + ph * (1 - min(max(step / top_step, 0.0), 1.0)), 1)

    gp = tl.get("goodput")
    title = ("steps per rank; each fault: silence (fault → detected; a hang's fault is the "
             "rank's last progress), decision, restart"
             + (f"; training goodput {100 * gp:.1f} %" if gp is not None else ""))
    parts = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{_e(title)}" style="font:11px system-ui,sans-serif">',
             f"<title>{_e(title)}</title>",
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" '
             f'stroke="#ccc"/>']
    for i, inc in enumerate(tl["incidents"]):
        ts = inc["times_s"]
        who = (", ".join(f"rank {r}" for r in inc["culprit"]["ranks"])
               or ", ".join(inc["culprit"]["nodes"]))
        det = inc.get("detected_s")
        ranks = ",".join(map(str, inc["culprit"]["ranks"]))
        parts.append(f'<g class="incident" data-fault-class="{_e(inc["fault_class"])}" '
                     f'data-action="{_e(inc["action"])}" data-ranks="{_e(ranks)}"'
                     + (f' data-detected-s="{det:.3f}"' if det is not None else "") + ">")
        for name, a, b in (("silence", "fault", "detected"), ("decision", "detected", "decided"),
                           ("restart", "decided", "resumed")):
            if ts[a] is None or ts[b] is None or ts[b] < ts[a]:
                continue
            w = max(1.0, x(ts[b]) - x(ts[a]))
            parts.append(f'<rect class="{name}" x="{x(ts[a])}" y="{top}" width="{w:.1f}" '
                         f'height="{ph}" fill="{PHASE_COLORS[name]}" fill-opacity="0.35">'
                         f"<title>{_e(f'{name}: {ts[b] - ts[a]:.3f} s')}</title></rect>")
        for mark, color in (("fault", "#c62828"), ("detected", "#b26a00"),
                            ("decided", "#6a1b9a"), ("resumed", "#18794e")):
            if ts[mark] is None:
                continue
            since = "" if ts["fault"] is None else f" +{ts[mark] - ts['fault']:.3f} s"
            parts.append(f'<line class="{mark}" x1="{x(ts[mark])}" x2="{x(ts[mark])}" '
                         f'y1="{top}" y2="{top + ph}" stroke="{color}" stroke-width="1">'
                         f"<title>{_e(f'{mark}{since}')}</title></line>")
        if ts["fault"] is not None:
            label = f"{i + 1}. {inc['fault_class']} {who}".strip()
            if det is not None:
                label += f": detected +{det:.3f} s"
            parts.append(f'<text x="{x(ts["fault"]) + 2}" y="{top - 6 - 10 * (i % 2)}" '
                         f'fill="#333">{_e(label)}</text>')
        parts.append("</g>")
    for i, (rank, segs) in enumerate(tl["ranks"].items()):
        color = _RANK_COLORS[i % len(_RANK_COLORS)]
        for seg in segs:
            pts = " ".join(f"{x(s)},{y(st)}" for s, st in seg)
            parts.append(f'<polyline class="rank" data-rank="{_e(rank)}" points="{pts}" '
                         f'fill="none" stroke="{color}" stroke-width="1.2">'
                         f"<title>rank {_e(rank)}</title></polyline>")
    parts += [f'<text x="{left}" y="{top + ph + 12}" fill="#555">0 s</text>',
              f'<text x="{left + pw}" y="{top + ph + 12}" text-anchor="end" fill="#555">'
              f"{span:.1f} s</text>",
              f'<text x="{left - 6}" y="{top + 10}" text-anchor="end" fill="#555">'
              f"{_e(top_step)}</text>",
              f'<text x="{left - 6}" y="{top + ph}" text-anchor="end" fill="#555">0</text>',
              f'<text x="8" y="{top + ph / 2}" fill="#555" transform="rotate(-90 8 '
              f'{top + ph / 2})" text-anchor="middle">step</text>']
    lx = left + 8
    for name, color in PHASE_COLORS.items():
        parts.append(f'<rect x="{lx}" y="{height - 12}" width="10" height="10" fill="{color}" '
                     f'fill-opacity="0.6"/><text x="{lx + 14}" y="{height - 3}" '
                     f'fill="#333">{name}</text>')
        lx += 80
    if gp is not None:
        parts.append(f'<text class="goodput" x="{left + pw / 2}" y="{height - 3}" '
                     f'text-anchor="middle" fill="#333">training goodput {100 * gp:.1f} %</text>')
    parts.append("</svg>")
    return "".join(parts)

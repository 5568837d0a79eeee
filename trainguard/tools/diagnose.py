"""``trainguard diagnose FILE [FILE…] [--json]``: attribute saved logs offline.

Runs the detector's rules (``detector.rules`` + the ``detector.patterns`` table + the XID
parser) over saved job logs, dmesg output or journal exports, then the attributor's
``attributor.decide.decide`` over what they found, then the remediator's policy table for the
action it would choose (``remediator.plan.table_action`` for a job with no registered state:
no spare node) — the same code the live services run.

Offline specifics:

* lines are in file order (the order of the evidence); a file's lines get increasing
  pseudo-timestamps so "first fault" means "first line";
* the rank a line belongs to comes from its prefix (``[rank3]:``, ``[3]<stderr>:``,
  ``[1,3]<stderr>:``) or from the torchrun failure summary block (``rank : 3 (local_rank: 3)``,
  ``host : node-7``), which applies to the lines that follow it;
* the node comes from a journal/syslog prefix (``Aug 26 15:28:16 node-001 kernel: …``) or a
  NCCL prefix (``node-001:3468:3905 [4] NCCL …``) when there is one;
* progress lines with step times (``1.21 sec/step``) are grouped per rank or device and scored
  with the live straggler rule; cross-process history of application XIDs is taken from the
  file itself (distinct pids per GPU).

Exit status: 0 when a verdict was printed, 1 when nothing abnormal was found, 2 on bad usage or
an unreadable file (the message says which).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Iterable

from trainguard import schemas
from trainguard.attributor.decide import APP_XIDS, History, VerdictSpec, decide
from trainguard.detector import rules
from trainguard.detector import patterns as pat
from trainguard.remediator import plan
from trainguard.core.xid import parse_gpu_uuid_line, parse_xid_line

_JOURNAL_NODE = re.compile(
    r"^(?:[A-Z][a-z]{2}\s+\d+\s+[\d:]+|\d{4}-\d\d-\d\dT[\d:.+-]+)\s+(?P<node>[\w.-]+)\s+\S+?:")
_NCCL_NODE = re.compile(r"^(?P<node>[A-Za-z][\w.-]*):\d+:\d+ \[\d+\]")
_HOST_LINE = re.compile(r"^\s*host\s*:\s*(?P<node>\S+)\s*$")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)")
#: how many lines a torchrun summary's rank/host applies to
_CONTEXT_LINES = 8
#: The tag ``trainguard launch`` puts before every line of a rank or spare (``[node rank 3] ``).
_LAUNCH_TAG = re.compile(r"^\[(?P<node>[\w:-]+) (?:rank (?P<rank>\d+)|spare)\] ")


def findings_from_lines(lines: Iterable[str], source: str = "", ts0: int = 0
                        ) -> tuple[list[rules.Finding], dict[str, set[int]]]:
    """Findings of every line (time = ``ts0`` + line index) and the pids that hit an
    application XID per GPU (``{pci: {pid}}``)."""
    out: list[rules.Finding] = []
    app_xid_pids: dict[str, set[int]] = {}
    series: dict[str, list[float]] = {}
    ctx_rank: int | None = None
    ctx_node: str | None = None
    ctx_left = 0
    cfg = rules.DetectorConfig()
    for i, raw in enumerate(lines):
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        ts = ts0 + i
        tag = _LAUNCH_TAG.match(line)
        if tag:  # a `trainguard launch` log: the tag names the node and rank of the line
            line = line[tag.end():]
            ctx_node, ctx_left = tag.group("node"), 1
            ctx_rank = int(tag.group("rank")) if tag.group("rank") is not None else None
        sm = _SUMMARY_RANK.match(line)
        if sm:
            ctx_rank, ctx_left = int(sm.group("rank")), _CONTEXT_LINES
        hm = _HOST_LINE.match(line)
        if hm:
            ctx_node, ctx_left = hm.group("node"), _CONTEXT_LINES
        node = None
        jm = _JOURNAL_NODE.match(line) or _NCCL_NODE.match(line)
        if jm:
            node = jm.group("node")
        elif ctx_left > 0:
            node = ctx_node
        if parse_gpu_uuid_line(line):
            continue
        x = parse_xid_line(line)
        if x is not None:
            f = rules.xid_finding_from_match(x, node, ts)
            if f is not None:
                if x.xid in APP_XIDS and x.pid is not None:
                    app_xid_pids.setdefault(x.pci, set()).add(x.pid)
                out.append(f)
            continue
        rank = pat.line_rank(line)
        if rank is None and ctx_left > 0:
            rank = ctx_rank
        f = rules.log_rule(line, "stderr", rank, node, None, ts)
        if f is not None:
            lr = pat.line_local_rank(line)
            if lr is not None:
                f.detail["local_rank"] = lr
            dev = pat.line_device(line)
            if dev is not None and f.fault_class in ("ecc", "oom_gpu", "nan_loss", "gpu_xid"):
                f.gpus = f.gpus or [f"{node}:{dev}" if node else f"gpu{dev}"]
            f.detail["source"] = f"{source}:{i + 1}" if source else f"line {i + 1}"
            out.append(f)
        st = pat.step_time_of(line)
        if st is not None:
            key = rank if rank is not None else pat.line_device(line)
            series.setdefault(str(key), []).insert(0, st)
        ctx_left -= 1
    for key, x, med, z in rules.straggler_scores(series, cfg):
        zs = "n/a" if z != z else f"{z:.1f}"
        out.append(rules.Finding(
            "straggler", "straggler", ranks=[int(key)] if key.isdigit() else [],
            severity="warning",
            evidence=[f"{'rank/device ' + key}: median step time {x:.3f} s vs {med:.3f} s "
                      f"across {len(series)} ranks/devices ({x / med:.1f}x, robust z {zs})"],
            detail={"rule": "straggler", "layer": "unknown", "weight": 0.6, "key": key},
            ts=ts0 + 10 ** 9))
    return out, app_xid_pids


def to_anomaly(f: rules.Finding, job: str = "offline") -> schemas.Anomaly:
    """A finding as the ``schemas.Anomaly`` the live detector would publish."""
    return schemas.Anomaly(job=job, kind=f.kind, fault_class=f.fault_class,
                           culprit=schemas.Culprit(ranks=f.ranks, nodes=f.nodes, gpus=f.gpus),
                           symptom=f.symptom, severity=f.severity, first_ts=f.ts, ts=f.ts or 1,
                           evidence=f.evidence, detail=f.detail, generation=f.generation)


def diagnose_lines(lines: Iterable[str], source: str = "") -> VerdictSpec | None:
    """Verdict of one log (an iterable of lines); None when nothing abnormal was found.
    Warnings (a corrected ECC error, an informational XID) alone are not a verdict."""
    findings, pids = findings_from_lines(lines, source)
    return verdict_of(findings, pids)


def verdict_of(findings: list[rules.Finding], app_xid_pids: dict[str, set[int]]
               ) -> VerdictSpec | None:
    if not findings:
        return None
    faults = [f for f in findings if f.severity == "error"] or findings
    anomalies = [to_anomaly(f) for f in faults]
    hist = History(gpu_app_xid_pids={k: v for k, v in app_xid_pids.items()})
    return decide(anomalies, hist)


def policy_action(v: VerdictSpec) -> str:
    """The action the remediator's policy gives the verdict ``v`` for a job with no registered
    state (observe mode, no spare node), before loop and budget checks."""
    verdict = schemas.Verdict(job="offline", fault_class=v.fault_class, layer=v.layer,
                              confidence=v.confidence, culprit=schemas.Culprit(
                                  ranks=v.ranks, nodes=v.nodes, gpus=v.gpus),
                              evidence=v.evidence, detail=v.detail)
    action, _ = plan.table_action(verdict, plan.with_defaults(schemas.JobRecord()))
    return str(action)


def render(v: VerdictSpec | None) -> str:
    """Human-readable verdict."""
    if v is None:
        return "no fault found: no line matched a known fault pattern or XID"
    c = []
    if v.ranks:
        c.append(f"ranks {v.ranks}")
    if v.nodes:
        c.append(f"nodes {v.nodes}")
    if v.gpus:
        c.append(f"GPUs {v.gpus}")
    out = [f"fault:      {v.fault_class}",
           f"layer:      {v.layer}",
           f"culprit:    {', '.join(c) or 'not named by the log'}",
           f"action:     {policy_action(v)} (the remediator's policy, no spare node)",
           f"confidence: {v.confidence} ({v.score:.2f})"]
    for n in v.detail.get("notes", []):
        out.append(f"note:       {n}")
    out.append("evidence (in order):")
    out += [f"  {e}" for e in v.evidence]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainguard diagnose",
                                description="Attribute saved job logs, dmesg or journal files.")
    p.add_argument("files", nargs="+", metavar="FILE", help="log files ('-' reads stdin)")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    args = p.parse_args(argv)
    findings: list[rules.Finding] = []
    pids: dict[str, set[int]] = {}
    for n, path in enumerate(args.files):
        try:
            if path == "-":
                lines = sys.stdin.read().splitlines()
            else:
                with open(path, errors="replace") as fh:
                    lines = fh.read().splitlines()
        except OSError as exc:
            print(f"trainguard diagnose: cannot read {path}: {exc.strerror}; check the path",
                  file=sys.stderr)
            return 2
        f, p_ = findings_from_lines(lines, path, ts0=n * 10 ** 10)
        findings += f
        for k, v in p_.items():
            pids.setdefault(k, set()).update(v)
    v = verdict_of(findings, pids)
    if args.json:
        obj = {**v.to_dict(), "action": policy_action(v)} if v else {"fault_class": None, "layer": "unknown",
                                     "culprit": {"ranks": [], "nodes": [], "gpus": []},
                                     "action": "none", "confidence": "low", "evidence": []}
        print(json.dumps(obj))
    else:
        print(render(v))
    return 0 if v else 1


if __name__ == "__main__":
    sys.exit(main())

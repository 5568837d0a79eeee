"""NATS subjects, hierarchical by job and node so tools can subscribe with wildcards.

``tg.node.<node>.{telemetry,xid,kernel,heartbeat,anomaly}`` (``kernel``: host kernel-log lines such as OOM kills, as ``log.line``) and
``tg.job.<job>.{rank.<rank>.hb,log,worker,anomaly,verdict,decision,ckpt,action,recovery}``.
Names must be NATS tokens: no ``.``, ``*``, ``>`` or whitespace.
"""
from __future__ import annotations

import os
import re
import socket

PREFIX = "tg"
DEAD_LETTER = "tg.dlq"
_TOKEN = re.compile(r"^[A-Za-z0-9_\-:]+$")
#: Longest job or node name (characters). A subject is sent in one protocol line, which
#: nats-server caps at 4,096 bytes (``max_control_line``) and answers past it by closing the
#: connection: a 200 KB job name taken from an event made every service that published about
#: it lose its connection (bench/fuzz.py).
MAX_TOKEN_CHARS = 128


def token(name: str | int) -> str:
    """Check that ``name`` can be one subject token; raises ValueError saying why not."""
    s = str(name)
    if len(s) > MAX_TOKEN_CHARS:
        raise ValueError(f"{s[:40]!r}… ({len(s)} characters) cannot be a NATS subject token: "
                         f"at most {MAX_TOKEN_CHARS}")
    if not _TOKEN.match(s):
        raise ValueError(
            f"{s!r} cannot be a NATS subject token: use letters, digits, '_', '-' or ':' only"
        )
    return s


def default_node() -> str:
    """This host's node name, the same for the agent, the launcher, the ranks and the services:
    env ``TG_NODE``, else the short host name (a subject token has no dots)."""
    return os.environ.get("TG_NODE") or socket.gethostname().split(".")[0]


def node(node_name: str, kind: str) -> str:
    """``tg.node.<node>.<kind>`` (kind: telemetry, xid, heartbeat, anomaly)."""
    return f"{PREFIX}.node.{token(node_name)}.{kind}"


def job(job_name: str, kind: str) -> str:
    """``tg.job.<job>.<kind>`` (kind: log, worker, anomaly, verdict, decision, ckpt, action,
    recovery)."""
    return f"{PREFIX}.job.{token(job_name)}.{kind}"


def rank_hb(job_name: str, rank: int) -> str:
    """``tg.job.<job>.rank.<rank>.hb``."""
    return f"{PREFIX}.job.{token(job_name)}.rank.{int(rank)}.hb"


def dead_letter(service: str) -> str:
    """``tg.dlq.<service>``: where a service republishes messages it could not decode."""
    return f"{DEAD_LETTER}.{token(service)}"


ALL_JOBS = f"{PREFIX}.job.>"
ALL_NODES = f"{PREFIX}.node.>"


def parse(subject: str) -> dict[str, str]:
    """Split a trainguard subject into its parts: ``{"scope": "job"|"node", "name": …,
    "kind": …, "rank": …}``. Raises ValueError for a subject outside ``tg.``."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != PREFIX or parts[1] not in ("job", "node"):
        raise ValueError(f"not a trainguard subject: {subject!r}")
    out = {"scope": parts[1], "name": parts[2], "kind": parts[3]}
    if parts[3] == "rank" and len(parts) >= 6:
        out["rank"] = parts[4]
        out["kind"] = parts[5]
    return out

"""NATS subjects, hierarchical by job and node so tools can subscribe with wildcards.

``tg.node.<node>.{telemetry,xid,kernel,heartbeat,anomaly,slurm}`` (``kernel``: host kernel-log lines such as OOM kills, as ``log.line``;
``slurm``: the Slurm watcher's ``slurm.node``; ``heartbeat``: the node agent's beat),
``tg.node.<node>.launcher.<job>`` (a job's launcher's beat on that node: ``launcher``) and
``tg.job.<job>.{rank.<rank>.hb,log,worker,anomaly,verdict,decision,control,ckpt,action,recovery,slurm}``
(``control``: requests to the ranks that are no decision, e.g. ``ckpt.request``; ``slurm``: the
Slurm watcher's ``slurm.job``).

Names become one subject token each (``token``). A name of letters, digits, ``_``, ``-`` and
``:`` is its own token, as it always was. A dot, which NATS reads as a token separator but which
Kubernetes node names carry (``ip-10-0-1-2.ec2.internal``: a DNS subdomain, RFC 1123), is written
``%2E``; ``parse`` turns it back, so a dotted name round-trips and every older subject reads as
before (``%`` was never allowed in a name, so no older token contains it). ``*``, ``>``, ``%``,
whitespace and other characters stay refused.
"""
from __future__ import annotations

import os
import re
import socket

PREFIX = "tg"
DEAD_LETTER = "tg.dlq"
_NAME = re.compile(r"^[A-Za-z0-9_\-:.]+$")
#: How a dot is written inside a token (percent-encoding of ``.``, RFC 3986).
DOT = "%2E"
#: Longest job or node name (characters). A subject is sent in one protocol line, which
#: nats-server caps at 4,096 bytes (``max_control_line``) and answers past it by closing the
#: connection: a 200 KB job name taken from an event made every service that published about
#: it lose its connection (bench/fuzz.py).
MAX_TOKEN_CHARS = 128


def token(name: str | int) -> str:
    """The subject token of ``name``: the name itself, with each ``.`` written ``%2E``.
    Raises ValueError saying why for an empty name, a leading, trailing or doubled dot, or a
    character outside letters, digits, ``_``, ``-``, ``:`` and ``.``."""
    s = str(name)
    if len(s) > MAX_TOKEN_CHARS:
        raise ValueError(f"{s[:40]!r}… ({len(s)} characters) cannot be a NATS subject token: "
                         f"at most {MAX_TOKEN_CHARS}")
    if not _NAME.match(s) or s.startswith(".") or s.endswith(".") or ".." in s:
        raise ValueError(
            f"{s!r} cannot be a NATS subject token: use letters, digits, '_', '-', ':' or "
            f"single dots between them only"
        )
    return s.replace(".", DOT)


def job_name(name: str) -> str:
    """``name`` when it can name a job: a subject token (``token``) without ``:``, which
    separates the parts of a job's state-store keys (``tg:job:<job>``, ``tg:job:<job>:launchers``,
    ``tg:ckpt:<job>:<path>``): a job ``a:launchers`` would read and write job ``a``'s lease set,
    and a per-job user's key rules for ``a`` would cover job ``a:b``. Raises ValueError saying
    why."""
    token(name)
    if ":" in name:
        raise ValueError(f"{name!r} cannot name a job: ':' separates the parts of its state-store "
                         f"keys (tg:job:<job>:<part>); use '-' or '_' instead")
    return name


def untoken(tok: str) -> str:
    """The name a token stands for (``token``'s inverse): ``%2E`` back to ``.``."""
    return tok.replace(DOT, ".")


def default_node() -> str:
    """This host's node name, the same for the agent, the launcher, the ranks and the services:
    env ``TG_NODE`` as given (on Kubernetes the pod's ``spec.nodeName`` through the downward API,
    dots included), else the short host name (the part before the first dot, as before)."""
    return os.environ.get("TG_NODE") or socket.gethostname().split(".")[0]


def node(node_name: str, kind: str) -> str:
    """``tg.node.<node>.<kind>`` (kind: telemetry, xid, heartbeat, anomaly, slurm)."""
    return f"{PREFIX}.node.{token(node_name)}.{kind}"


#: Subject kind of a launcher's node heartbeat: ``tg.node.<node>.launcher.<job>``.
LAUNCHER = "launcher"
#: Every job's launcher beats on every node (what the detector and the stream read).
ALL_LAUNCHERS = f"{PREFIX}.node.*.{LAUNCHER}.*"


def launcher(node_name: str, job_name: str) -> str:
    """``tg.node.<node>.launcher.<job>``: where the launcher of ``job`` on ``node`` beats
    (``NodeHeartbeat``, role ``launcher``). Under the node, so it is in the node's partition
    key (``node:<node>``: the detector replica that judges the node hears its agent and its
    launchers alike); named by its job, so a job's own NATS user may publish its launchers'
    beats and no other job's, nor the node agent's ``tg.node.<node>.heartbeat``
    (``trainguard.security.roles.job_role``)."""
    return f"{PREFIX}.node.{token(node_name)}.{LAUNCHER}.{token(job_name)}"


def job(job_name: str, kind: str) -> str:
    """``tg.job.<job>.<kind>`` (kind: log, worker, anomaly, verdict, decision, control, ckpt,
    action, recovery, slurm)."""
    return f"{PREFIX}.job.{token(job_name)}.{kind}"


def rank_hb(job_name: str, rank: int) -> str:
    """``tg.job.<job>.rank.<rank>.hb``."""
    return f"{PREFIX}.job.{token(job_name)}.rank.{int(rank)}.hb"


def dead_letter(service: str) -> str:
    """``tg.dlq.<service>``: where a service republishes messages it could not decode."""
    return f"{DEAD_LETTER}.{token(service)}"


def job_dead_letter(job: str, client: str) -> str:
    """``tg.dlq.job.<job>.<client>``: where a job's rank (``client`` ``rank-<rank>``) or
    launcher (``launcher-<node>``) republishes messages it could not decode: under its job, so
    a job's user may dead-letter there and nowhere else (``trainguard.security.roles.job_role``). Raises
    ValueError as ``token``."""
    return f"{DEAD_LETTER}.job.{token(job)}.{token(client)}"


#: the fleet breaker's transitions (``schemas.breaker.BreakerChanged``): one subject for the
#: whole control plane, since the breaker spans every job
FLEET_BREAKER = f"{PREFIX}.fleet.breaker"


def parse(subject: str) -> dict[str, str]:
    """Split a trainguard subject into its parts: ``{"scope": "job"|"node", "name": …,
    "kind": …, "rank": …, "job": …}`` (``rank`` for a rank heartbeat, ``job`` for a launcher's
    node heartbeat ``tg.node.<node>.launcher.<job>``); ``name`` and ``job`` are decoded
    (``untoken``: a dotted name comes back with its dots). Raises ValueError for a subject
    outside ``tg.``."""
    parts = subject.split(".")
    if len(parts) < 4 or parts[0] != PREFIX or parts[1] not in ("job", "node"):
        raise ValueError(f"not a trainguard subject: {subject!r}")
    out = {"scope": parts[1], "name": untoken(parts[2]), "kind": parts[3]}
    if parts[3] == "rank" and len(parts) >= 6:
        out["rank"] = parts[4]
        out["kind"] = parts[5]
    elif parts[1] == "node" and parts[3] == LAUNCHER and len(parts) == 5:
        out["job"] = untoken(parts[4])
    return out


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match of ``subject`` against ``pattern``: ``*`` one token, ``>`` the rest
    (one token or more)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)

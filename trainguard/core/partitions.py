"""Job partitions of the JetStream streams: which partition a job is in, and the subjects the
streams store a job's messages under.

A stream that keeps job subjects (``streams.PARTITIONED_STREAMS``) has the subject transform
``tg.job.*.>`` → ``tg.p.{{partition(N,1)}}.job.{{wildcard(1)}}.>`` (``transform``): the server
stores ``tg.job.<job>.<rest>`` as ``tg.p.<partition>.job.<job>.<rest>``. Only the stored subject
changes: core NATS subscribers (launchers and ranks on ``tg.job.<job>.decision``) and
publishers see the subjects as published, and every reader of a stream here maps stored
subjects back (``original``). A replica then consumes only the partitions it owns by filtering
its consumers on ``tg.p.<p>.job.…`` (``stored_filters``), instead of receiving every message.

* ``partition(job, n)`` — the server's ``partition(N,1)`` over the job token: FNV-1a 32-bit of
  the token's bytes, modulo ``n`` (nats-server ``subject_transform.go``, ``getHashPartition``;
  ``tests/test_partitions.py`` checks it against a real server).
* ``stored(subject, p)`` / ``original(stored)`` — a concrete job subject as stored / back.
* ``stored_filters(pattern, parts)`` — the stream filters that select ``pattern`` (a subject or
  NATS wildcards, as published) in the given partitions, or in every partition and in an
  unpartitioned stream at once (``parts=None``: what a reader who does not know ``N`` uses).
* ``partitions_of(dest)`` — ``N`` of a stream's transform destination (0: not partitioned).

Node subjects (``tg.node.…``) are stored as published: every detector replica steps them.
"""
from __future__ import annotations

import os
import re
from typing import Iterable

#: Partitions of the job streams when the streams are created (env ``TG_PARTITIONS``): 32, so
#: that 3 replicas own 10–11 partitions each and a 10,000-rank cluster (1,250 jobs of 8 ranks)
#: puts ~40 jobs in each; 0 stores job subjects as published (no transform: every replica
#: reads every message, as before partitions).
DEFAULT_PARTITIONS = 32
#: The subject family of stored job subjects: ``tg.p.<partition>.job.<job>.<rest>`` (reserved:
#: nothing is published on ``tg.p.…``).
PREFIX = "tg.p"
#: A partition token no stored subject has (partitions are numbers): the filter of a consumer
#: whose replica owns no partition (more replicas than partitions).
NONE = "none"
_SRC = "tg.job.*.>"
_DEST = re.compile(r"^tg\.p\.\{\{\s*partition\(\s*(\d+)\s*,\s*1\s*\)\s*\}\}\.job\.")
_FNV_OFFSET, _FNV_PRIME = 0x811C9DC5, 0x01000193


def configured(env: str | None = None) -> int:
    """The partition count to create the streams with: ``env`` (default env ``TG_PARTITIONS``),
    else ``DEFAULT_PARTITIONS``. Raises ValueError for a value that is not an integer ≥ 0."""
    raw = os.environ.get("TG_PARTITIONS", "") if env is None else env
    n = int(raw) if raw.strip() else DEFAULT_PARTITIONS
    if n < 0:
        raise ValueError(f"TG_PARTITIONS={raw!r}: a partition count is 0 (none) or more")
    return n


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits (Go's ``hash/fnv.New32a``), of ``data``."""
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def partition(job: str, n: int) -> int:
    """The partition (0 … ``n``-1) the server stores ``job``'s subjects in: FNV-1a 32 of the
    job's subject token (a name's dots written ``%2E``, as ``subjects.token`` does; a token is
    its own token) modulo ``n``. Raises ValueError for ``n`` < 1."""
    if n < 1:
        raise ValueError(f"{n} partitions: at least 1")
    return fnv1a_32(job.replace(".", "%2E").encode()) % n


def transform(n: int) -> tuple[str, str]:
    """``(source, destination)`` of the stream subject transform into ``n`` partitions."""
    return _SRC, f"{PREFIX}.{{{{partition({int(n)},1)}}}}.job.{{{{wildcard(1)}}}}.>"


def partitions_of(dest: str | None) -> int:
    """``N`` of a stream subject transform destination made by ``transform`` (0 for none or
    any other transform)."""
    m = _DEST.match(dest or "")
    return int(m.group(1)) if m else 0


def stored(subject: str, p: int | str) -> str:
    """``tg.job.<job>.<rest>`` as a partitioned stream stores it in partition ``p`` (a number,
    or ``*`` for any)."""
    return f"{PREFIX}.{p}.{subject[3:]}"


def original(subject: str) -> str:
    """The subject as published of a stored ``subject`` (``tg.p.<p>.job.…`` → ``tg.job.…``);
    any other subject is returned as it is."""
    if subject.startswith("tg.p."):
        parts = subject.split(".", 3)
        if len(parts) == 4 and parts[3].startswith("job."):
            return "tg." + parts[3]
    return subject


def is_job_pattern(pattern: str) -> bool:
    """Whether ``pattern`` (a subject as published, wildcards allowed) names job subjects only:
    ``tg.job.…`` (what a partitioned stream transforms)."""
    return pattern.startswith("tg.job.")


def stored_filters(pattern: str, parts: Iterable[int] | None = None, n: int = 0) -> list[str]:
    """The stream filter subjects that select the messages published on ``pattern``.

    ``parts`` — the partitions to select (an empty collection: none, one filter no stored
    subject matches; all ``n`` of them: one filter with ``*`` for the partition, as cheap for
    the server as an unpartitioned filter); None — every partition, and the unpartitioned form
    as well (a stream made without the transform, or a reader that does not know ``N``). A pattern that is not a job
    pattern is stored as published: ``[pattern]`` (``tg.>`` and ``>`` match stored subjects
    too). The filters never overlap (JetStream refuses overlapping ``filter_subjects``)."""
    if not is_job_pattern(pattern):
        return [pattern]
    if parts is None:
        return [pattern, stored(pattern, "*")]
    ps = sorted(set(parts))
    if n and len(ps) >= n:
        return [stored(pattern, "*")]
    return [stored(pattern, p) for p in ps] if ps else [stored(pattern, NONE)]

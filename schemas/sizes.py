"""Bounds on the size of one message, by subject family, checked before it is decoded.

A message far larger than any valid event of its subject is refused by its length alone
(``DecodeError`` kind ``too_large``, dead-lettered like any bad message): it is never unpacked
into Python objects, so a flood of them costs a service the bytes the client read and nothing
more. ``decode(data, subject)`` applies ``max_bytes(subject)``; the per-value bounds of
``schemas.LIMITS`` still apply to what passes.

Each row's limit is at least the largest valid event of the family, worked out from the
schema's own bounds (a job or node name at most ``subjects.MAX_TOKEN_CHARS`` characters, a
phase ``worker.MAX_PHASE_CHARS``, a string ``schemas.LIMITS``' ``max_str_len`` bytes) and
from what the producers send, with room for fields added within the major version. Families whose events
legitimately carry long lists (a checkpoint verdict's reasons, an anomaly's or verdict's
evidence, a decision's members) have no row: the server's payload limit
(``trainguard.security.server_config.MAX_PAYLOAD``) and the streams' ``max_msg_size``
(``trainguard.clients.streams.STREAM_LIMITS``) bound them.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainguard.schemas.subjects import matches

KiB = 1024


@dataclass(frozen=True)
class SizeLimit:
    """A subject family (NATS wildcards), the largest message (bytes of MessagePack) accepted on
    it, and why."""

    pattern: str
    max_bytes: int
    reason: str


#: "The envelope" in the reasons below: ``schema``, ``v``, ``event_id``, ``ts``, ``rank``, a job
#: and a node name of ``MAX_TOKEN_CHARS`` (128) characters of up to 4 bytes each, a ``trace``
#: with a ``traceparent`` and a ``tracestate`` (W3C: at most 512 characters): under 2 KiB.
#: First matching row wins; a subject that matches none is bounded by the server and its
#: stream only.
SIZE_LIMITS: tuple[SizeLimit, ...] = (
    SizeLimit("tg.job.*.rank.*.hb", 4 * KiB,
              "the envelope, a phase of at most MAX_PHASE_CHARS (64) characters and a dozen "
              "numbers: under 1 KiB as the shim sends it (worker.RankHeartbeat)"),
    SizeLimit("tg.node.*.heartbeat", 4 * KiB,
              "the envelope, a role name and a few numbers (node.NodeHeartbeat)"),
    SizeLimit("tg.job.*.worker", 4 * KiB,
              "the envelope and a few numbers and flags (worker.WorkerStarted, WorkerExited)"),
    SizeLimit("tg.job.*.recovery", 16 * KiB,
              "the envelope, a few numbers and a path and reason the shim writes in a sentence "
              "(worker.TrainingResumed, RecoveryVerified)"),
    SizeLimit("tg.node.*.xid", 264 * KiB,
              "the kernel line twice (raw, message), each a string of at most max_str_len "
              "(131,072 bytes of UTF-8; a kernel record is under 1 KiB), and the envelope "
              "(node.XidEvent)"),
    SizeLimit("tg.node.*.kernel", 136 * KiB,
              "one kernel line, a string of at most max_str_len (131,072 bytes), and the "
              "envelope (worker.LogLine)"),
    SizeLimit("tg.job.*.log", 136 * KiB,
              "one line, a string of at most max_str_len (131,072 bytes): a line a script "
              "logs is not cut before it is sent (worker.LogLine; the shim sends a "
              "traceback's last 4,000 characters), and the envelope"),
    SizeLimit("tg.node.*.telemetry", 256 * KiB,
              "the TG_TELEMETRY stream's max_msg_size (trainguard.clients.streams.STREAM_LIMITS): GPU "
              "samples and a latency per peer (node.NodeTelemetry)"),
)


def _shape(pattern_or_subject: str) -> tuple[int, str, str]:
    """(tokens, second token, last token): what tells the families of ``SIZE_LIMITS`` apart
    (``tg.<job|node>.….<kind>``), so a lookup is one dict get and one match, not a wildcard
    match per row: every heartbeat pays it."""
    t = pattern_or_subject.split(".")
    return len(t), t[1] if len(t) > 1 else "", t[-1]


def _index(table: tuple[SizeLimit, ...]) -> dict[tuple[int, str, str], SizeLimit]:
    """``table`` keyed by ``_shape``; first row wins. Raises ValueError for a row whose second
    or last token is a wildcard (its shape would not key it)."""
    out: dict[tuple[int, str, str], SizeLimit] = {}
    for row in table:
        shape = _shape(row.pattern)
        if shape[0] < 2 or {shape[1], shape[2]} & {"*", ">"}:
            raise ValueError(f"size limit pattern {row.pattern!r}: its second and last tokens "
                             f"must be literal")
        if shape in out:
            raise ValueError(f"size limit patterns {out[shape].pattern!r} and {row.pattern!r} "
                             f"have the same shape: one lookup could not tell them apart")
        out[shape] = row
    return out


_INDEX = _index(SIZE_LIMITS)


#: Subjects whose ``SIZE_LIMITS`` bound was looked up already (subject → bytes): a rank's
#: heartbeat subject comes back every interval, and the lookup (two splits and a match, ≈ 3 µs)
#: was a twentieth of a detector's CPU at 10,000 ranks (``bench/scale.py``, sampled). Only
#: bounded subjects are kept, at most ``_KNOWN_MAX`` (then it starts again): a flood of made-up
#: subjects costs at most that many entries.
_KNOWN: dict[str, int] = {}
_KNOWN_MAX = 16_384


def max_bytes(subject: str | None) -> int | None:
    """The largest message (bytes) accepted on ``subject`` (``SIZE_LIMITS``); None when no row
    matches or no subject is given (no bound but the server's)."""
    if not subject:
        return None
    known = _KNOWN.get(subject)
    if known is not None:
        return known
    row = _INDEX.get(_shape(subject))
    limit = row.max_bytes if row is not None and matches(row.pattern, subject) else None
    if limit is not None:
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.clear()
        _KNOWN[subject] = limit
    return limit

"""trainguard v1 event schemas: typed events, MessagePack codec, subjects, JSON Schema export.

Use ``encode(event) -> bytes`` and ``decode(data) -> Event``. ``decode`` validates types and
raises ``DecodeError`` (with ``kind`` = ``malformed`` | ``unknown_schema`` | ``bad_version`` |
``invalid``, ``too_large``) on anything it cannot turn into a known event of this major
version, or that is larger than its subject family allows (``schemas.sizes``).
"""
from __future__ import annotations

import json
from typing import Any

import msgpack
from pydantic import ValidationError

from trainguard.schemas import sizes, subjects, vocabulary
from trainguard.schemas.base import SCHEMA_VERSION, Event, new_event_id, new_traceparent
from trainguard.schemas.checkpoint import (
    CheckpointInvalid,
    CheckpointRequest,
    CheckpointRequestDone,
    CheckpointSaved,
    CheckpointSaveFailed,
    CheckpointValidated,
)
from trainguard.schemas.decision import (
    ActionResult,
    Anomaly,
    Culprit,
    Decision,
    Member,
    Verdict,
)
from trainguard.schemas.breaker import BreakerChanged, BreakerState
from trainguard.schemas.job import JobRecord, JobRecordError, JobSettings
from trainguard.schemas.vocabulary import (
    ACTIONS,
    FAULT_CLASSES,
    LAYERS,
    VOCABULARY,
    Action,
    FaultClass,
    FaultSpec,
    Layer,
    signature,
    stronger,
)
from trainguard.schemas.node import GpuSample, NodeHeartbeat, NodeTelemetry, XidEvent
from trainguard.schemas.slurm import SlurmJobEvent, SlurmNodeEvent
from trainguard.schemas.worker import (
    PHASES,
    LogLine,
    RankHeartbeat,
    RecoveryVerified,
    TrainingResumed,
    WorkerExited,
    WorkerStarted,
)

EVENT_TYPES: dict[str, type[Event]] = {
    cls.SCHEMA: cls
    for cls in (
        NodeTelemetry, NodeHeartbeat, XidEvent,
        RankHeartbeat, WorkerStarted, WorkerExited, LogLine, TrainingResumed, RecoveryVerified,
        Anomaly, Verdict, Decision, ActionResult,
        CheckpointSaved, CheckpointValidated, CheckpointInvalid, CheckpointSaveFailed,
        CheckpointRequest, CheckpointRequestDone,
        SlurmNodeEvent, SlurmJobEvent, BreakerChanged,
    )
}


class DecodeError(ValueError):
    """A message that is not a valid trainguard event. ``kind`` names the failure class:
    ``malformed`` (not MessagePack / not a map), ``unknown_schema``, ``bad_version``,
    ``invalid`` (fields of the wrong type or missing), ``too_large`` (past ``LIMITS``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def encode(event: Event) -> bytes:
    """MessagePack bytes of ``event`` (its ``to_dict()``)."""
    return msgpack.packb(event.to_dict(), use_bin_type=True)


#: Bounds of one decoded message, enforced while MessagePack is read (``decode``) and, for
#: depth, before validation (``from_dict``). Past any of them the message is refused as
#: ``too_large`` (dead-lettered with the reason), so no service keeps a hostile 50,000-item list
#: or a 200 KB string in its windows. (name, limit, reason)
LIMITS: tuple[tuple[str, int, str], ...] = (
    ("max_str_len", 131072, "characters of one string: a log or kernel line is cut at 64 KiB "
                            "where it is read (agents.kernel_log.MAX_LINE); a hang's evidence "
                            "lists every rank of a 16,384-rank world in ≈ 100 KB"),
    ("max_bin_len", 65536, "bytes of one binary value: no event carries raw bytes"),
    ("max_array_len", 32768, "items of one list: a decision's members of the largest world one "
                             "1 MiB message can carry (≈ 25,000 ranks)"),
    ("max_map_len", 16384, "entries of one map: a node's latency to each of its peers"),
    ("max_depth", 16, "levels of nesting: the deepest event (a decision's members, a verdict's "
                      "detail) nests 4"),
)
_UNPACK_LIMITS = {name: n for name, n, _ in LIMITS if name != "max_depth"}
MAX_DEPTH = next(n for name, n, _ in LIMITS if name == "max_depth")


def _too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``obj`` nests dicts and lists deeper than ``limit`` levels (``obj`` is level 1).
    A flat map, as every telemetry event is, costs one pass over its values."""
    stack: list[tuple[Any, int]] | None = None
    for v in (obj.values() if isinstance(obj, dict) else obj):
        if isinstance(v, (dict, list)):
            if stack is None:
                stack = []
            stack.append((v, 2))
    if stack is None:
        return limit < 1
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        for v in (o.values() if isinstance(o, dict) else o):
            if isinstance(v, (dict, list)):
                stack.append((v, d + 1))
    return False


#: The bytes that can open a MessagePack map or array: fixmap 0x80–0x8f, fixarray 0x90–0x9f,
#: array 16/32 0xdc/0xdd, map 16/32 0xde/0xdf (the MessagePack specification, "formats").
_CONTAINER_BYTES = bytes(range(0x80, 0xA0)) + b"\xdc\xdd\xde\xdf"
_OTHER_BYTES = bytes(b for b in range(256) if b not in _CONTAINER_BYTES)


def _cannot_be_too_deep(data: bytes) -> bool:
    """Whether MessagePack ``data`` holds at most ``MAX_DEPTH`` bytes that could open a map or
    an array: every level of nesting opens with one of its own, so such data cannot nest deeper
    than ``MAX_DEPTH`` whatever its bytes mean, and ``decode`` skips the walk of
    ``_too_deep``. Bytes inside strings and numbers count too, so this errs towards the walk.
    One pass in C over the bytes (a flat event as a rank heartbeat holds a handful), where the
    walk is a Python loop over every value."""
    return len(data.translate(None, _OTHER_BYTES)) <= MAX_DEPTH


def from_dict(obj: Any) -> Event:
    """Validate a decoded dict into its event class; raises ``DecodeError`` (``too_large`` past
    ``LIMITS``' depth)."""
    return _validate(obj, check_depth=True)


def _validate(obj: Any, check_depth: bool) -> Event:
    """``from_dict``; ``check_depth`` False where the depth is known to be within bounds."""
    if not isinstance(obj, dict):
        raise DecodeError("malformed", f"event must be a map, got {type(obj).__name__}")
    if check_depth and _too_deep(obj):
        raise DecodeError("too_large", f"nested deeper than {MAX_DEPTH} levels")
    name = obj.get("schema")
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise DecodeError("unknown_schema", f"unknown event schema {name!r}; known: "
                          f"{', '.join(sorted(EVENT_TYPES))}")
    v = obj.get("v")
    if v != SCHEMA_VERSION:
        raise DecodeError("bad_version", f"{name} has schema version {v!r}; this trainguard "
                          f"reads version {SCHEMA_VERSION}: upgrade the older side")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise DecodeError("invalid", f"{name}: field {where!r}: {first.get('msg')}") from None


def decode(data: bytes, subject: str | None = None) -> Event:
    """Event from MessagePack bytes received on ``subject``; raises ``DecodeError`` (never
    another exception). A message longer than ``sizes.max_bytes(subject)`` is refused as
    ``too_large`` by its length, before anything is unpacked."""
    limit = sizes.max_bytes(subject)
    if limit is not None and len(data) > limit:
        raise DecodeError("too_large", f"{len(data)} bytes on {subject[:200]}: at most {limit} "
                                       f"for its family (schemas.sizes.SIZE_LIMITS)")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, **_UNPACK_LIMITS)
    except ValueError as exc:
        if "exceeds max" in str(exc):  # a container or string past LIMITS
            raise DecodeError("too_large", f"over the bounds of one event: {exc}") from None
        raise DecodeError("malformed", f"not MessagePack: {exc}") from None
    except Exception as exc:  # msgpack raises several types for garbage
        raise DecodeError("malformed", f"not MessagePack: {exc}") from None
    return _validate(obj, check_depth=not _cannot_be_too_deep(data))


def json_schemas() -> dict[str, Any]:
    """JSON Schema of every event type, keyed by schema name (for other tools)."""
    return {name: cls.model_json_schema(by_alias=True) for name, cls in EVENT_TYPES.items()}


def export_json_schemas(directory: str) -> list[str]:
    """Write one ``<schema>.json`` per event type into ``directory``; returns the paths."""
    import os

    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, schema in json_schemas().items():
        p = os.path.join(directory, f"{name}.json")
        with open(p, "w") as fh:
            json.dump(schema, fh, indent=2, sort_keys=True)
        paths.append(p)
    return paths


__all__ = [
    "SCHEMA_VERSION", "Event", "EVENT_TYPES", "DecodeError", "encode", "decode", "from_dict",
    "json_schemas", "export_json_schemas", "sizes", "subjects", "new_event_id", "new_traceparent",
    "NodeTelemetry", "NodeHeartbeat", "XidEvent", "GpuSample",
    "RankHeartbeat", "WorkerStarted", "WorkerExited", "LogLine", "TrainingResumed",
    "RecoveryVerified", "PHASES",
    "Anomaly", "Verdict", "Decision", "ActionResult", "BreakerChanged", "BreakerState", "Culprit", "Member",
    "FAULT_CLASSES", "LAYERS", "ACTIONS", "FaultClass", "Layer", "Action", "FaultSpec",
    "VOCABULARY", "signature", "stronger", "vocabulary",
    "CheckpointSaved", "CheckpointValidated", "CheckpointInvalid", "CheckpointSaveFailed",
    "CheckpointRequest", "CheckpointRequestDone",
    "JobRecord", "JobSettings", "JobRecordError",
    "SlurmNodeEvent", "SlurmJobEvent",
]

"""trainguard v1 event schemas: typed events, MessagePack codec, subjects, JSON Schema export.

Use ``encode(event) -> bytes`` and ``decode(data) -> Event``. ``decode`` validates types and
raises ``DecodeError`` (with ``kind`` = ``malformed`` | ``unknown_schema`` | ``bad_version`` |
``invalid``) on anything it cannot turn into a known event of this major version.
"""
from __future__ import annotations

import json
from typing import Any

import msgpack
from pydantic import ValidationError

from . import subjects, vocabulary
from .base import SCHEMA_VERSION, Event, new_event_id, new_traceparent
from .checkpoint import (
    CheckpointInvalid,
    CheckpointRequest,
    CheckpointRequestDone,
    CheckpointSaved,
    CheckpointSaveFailed,
    CheckpointValidated,
)
from .decision import (
    ActionResult,
    Anomaly,
    Culprit,
    Decision,
    Member,
    Verdict,
)
from .job import JobRecord, JobRecordError, JobSettings
from .vocabulary import (
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
from .node import GpuSample, NodeHeartbeat, NodeTelemetry, XidEvent
from .worker import (
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
    )
}


class DecodeError(ValueError):
    """A message that is not a valid trainguard event. ``kind`` names the failure class:
    ``malformed`` (not MessagePack / not a map), ``unknown_schema``, ``bad_version``,
    ``invalid`` (fields of the wrong type or missing)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def encode(event: Event) -> bytes:
    """MessagePack bytes of ``event`` (its ``to_dict()``)."""
    return msgpack.packb(event.to_dict(), use_bin_type=True)


def from_dict(obj: Any) -> Event:
    """Validate a decoded dict into its event class; raises ``DecodeError``."""
    if not isinstance(obj, dict):
        raise DecodeError("malformed", f"event must be a map, got {type(obj).__name__}")
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


def decode(data: bytes) -> Event:
    """Event from MessagePack bytes; raises ``DecodeError`` (never another exception)."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for garbage
        raise DecodeError("malformed", f"not MessagePack: {exc}") from None
    return from_dict(obj)


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
    "json_schemas", "export_json_schemas", "subjects", "new_event_id", "new_traceparent",
    "NodeTelemetry", "NodeHeartbeat", "XidEvent", "GpuSample",
    "RankHeartbeat", "WorkerStarted", "WorkerExited", "LogLine", "TrainingResumed",
    "RecoveryVerified", "PHASES",
    "Anomaly", "Verdict", "Decision", "ActionResult", "Culprit", "Member",
    "FAULT_CLASSES", "LAYERS", "ACTIONS", "FaultClass", "Layer", "Action", "FaultSpec",
    "VOCABULARY", "signature", "stronger", "vocabulary",
    "CheckpointSaved", "CheckpointValidated", "CheckpointInvalid", "CheckpointSaveFailed",
    "CheckpointRequest", "CheckpointRequestDone",
    "JobRecord", "JobSettings", "JobRecordError",
]

"""Common envelope of every trainguard event, and the typed registry used at decode.

Every event carries:

* ``schema`` — the event type name, e.g. ``"rank.heartbeat"`` (fixed per class);
* ``v`` — the schema major version (``SCHEMA_VERSION``); a decoder rejects other majors;
* ``event_id`` — 32 hex characters (uuid4, or a digest for an id derived from what the event
  concerns), unique per event; at most ``MAX_EVENT_ID_CHARS``;
* ``ts`` — producer time, Unix nanoseconds (``time.time_ns()``);
* ``job`` / ``node`` / ``rank`` — what the event concerns, ``None`` where it does not apply
  (``job`` a subject token, ``node`` at most ``subjects.MAX_TOKEN_CHARS`` characters);
* ``trace`` — W3C trace context (``{"traceparent": "00-<trace>-<span>-01"}``) so one trace spans
  fault → anomaly → verdict → decision → action; only ``TRACE_KEYS`` are kept.

Wire format: MessagePack of the model's field dict (``encode``/``decode`` in ``schemas``).
Fields added within a major version are ignored by older decoders (forward compatible).
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator
from pydantic.types import FailFast
from pydantic_core import PydanticCustomError

from trainguard.schemas.subjects import MAX_TOKEN_CHARS, job_name

SCHEMA_VERSION = 1

#: Characters of an event id: 32 hex (uuid4, or 16 bytes of blake2b for the ids the detector,
#: the attributor and the Slurm watcher derive); twice that leaves room. Services key their
#: dedup memory, incidents and the streams' ``Nats-Msg-Id`` by it, so a longer one (a hostile
#: 100 KB id kept by each incident it joined, bench/fuzz.py) is refused at decode.
MAX_EVENT_ID_CHARS = 64
#: The trace context an event keeps: the two headers of W3C Trace Context, with their limits
#: (``traceparent`` 55 characters, ``tracestate`` at most 512). Other keys, and longer values,
#: are dropped at decode: nothing reads them, and every service passes the context on.
TRACE_KEYS = ("traceparent", "tracestate")
MAX_TRACE_VALUE_CHARS = 512


T = TypeVar("T")


def _one_error(v: Any, handler: Any) -> Any:
    """Validate a map with ``handler``; its entries' errors, when there are several, as one
    (``map_entries``, with their count). See ``Entries``."""
    try:
        return handler(v)
    except ValidationError as exc:
        n = exc.error_count()
        if n == 1:
            raise
        raise PydanticCustomError("map_entries", "{count} entries of the map are invalid",
                                  {"count": n}) from None


#: A list field of an event: validation stops at its first invalid item (pydantic's
#: ``FailFast``), so a hostile list costs one error, not one per item. Without it a 90 KB
#: anomaly whose ``evidence`` held 30,000 integers made 30,000 errors, and reading the first
#: built all of them: 23 MiB and 48 ms of one service's time per message (``bench/fuzz.py``'s
#: flood replayed into the decoder and the attributor's reducer grew 1.0 MiB without its
#: ``big_list`` messages, 3.7 MiB with them).
Items = Annotated[list[T], FailFast()]
#: A map field of an event (``dict[str, T]``): the errors of its entries (a hostile map of
#: 16,384 integer keys, ``schemas.LIMITS``) are reported as one, with their count: 14 MiB
#: of errors for a 64 KB anomaly otherwise. Pydantic has no ``FailFast`` for maps.
Entries = Annotated[dict[str, T], WrapValidator(_one_error)]


def new_event_id() -> str:
    """A new event id: 32 lowercase hex characters (uuid4)."""
    return uuid.uuid4().hex


def new_traceparent(trace_id: str | None = None) -> str:
    """A W3C ``traceparent`` header value; keeps ``trace_id`` (32 hex) when given, new span id."""
    tid = trace_id or os.urandom(16).hex()
    return f"00-{tid}-{os.urandom(8).hex()}-01"


class Event(BaseModel):
    """Base class of all events. Subclasses set ``SCHEMA`` and add typed fields."""

    model_config = ConfigDict(extra="ignore", validate_assignment=False)

    SCHEMA: ClassVar[str] = "event"

    schema_: str = Field(default="", alias="schema")
    v: int = SCHEMA_VERSION
    event_id: str = Field(default_factory=new_event_id)
    ts: int = Field(default_factory=time.time_ns)
    job: str | None = None
    node: str | None = None
    rank: int | None = None
    trace: Entries[str] = Field(default_factory=dict)

    @field_validator("event_id")
    @classmethod
    def _event_id_length(cls, v: str) -> str:
        """An event id is at most ``MAX_EVENT_ID_CHARS`` characters."""
        if len(v) > MAX_EVENT_ID_CHARS:
            raise ValueError(f"event id of {len(v)} characters: at most {MAX_EVENT_ID_CHARS}")
        return v

    @field_validator("trace")
    @classmethod
    def _trace_headers(cls, v: dict[str, str]) -> dict[str, str]:
        """Only the ``TRACE_KEYS`` of at most ``MAX_TRACE_VALUE_CHARS`` characters are kept (a
        missing ``traceparent`` is made anew, ``model_post_init``)."""
        if len(v) <= len(TRACE_KEYS) and all(
                k in TRACE_KEYS and len(x) <= MAX_TRACE_VALUE_CHARS for k, x in v.items()):
            return v
        return {k: x for k, x in v.items()
                if k in TRACE_KEYS and len(x) <= MAX_TRACE_VALUE_CHARS}

    @field_validator("job")
    @classmethod
    def _job_token(cls, v: str | None) -> str | None:
        """A job name can be a subject token without ``:`` (``subjects.job_name``: letters,
        digits, ``_-`` and single dots, at most ``MAX_TOKEN_CHARS``); one that cannot (a space,
        ``*``, a ``:``, 200 KB) is refused at decode, before a service keys state by it or
        publishes on a subject made of it. The name itself is kept (its dots are encoded only in
        subjects)."""
        if v:
            job_name(v)
        return v

    @field_validator("node")
    @classmethod
    def _node_length(cls, v: str | None) -> str | None:
        """A node name is at most ``MAX_TOKEN_CHARS`` long (it may hold dots: a peer host name
        a log line names); services make subjects only of node names that are tokens."""
        if v is not None and len(v) > MAX_TOKEN_CHARS:
            raise ValueError(f"node name of {len(v)} characters: at most {MAX_TOKEN_CHARS}")
        return v

    def model_post_init(self, __context: Any) -> None:  # noqa: D401 - pydantic hook
        if not self.schema_:
            self.schema_ = self.SCHEMA
        if "traceparent" not in self.trace:
            self.trace["traceparent"] = new_traceparent()

    # ---- tracing helpers -------------------------------------------------
    @property
    def trace_id(self) -> str:
        """The 32-hex W3C trace id of this event."""
        parts = self.trace.get("traceparent", "").split("-")
        return parts[1] if len(parts) == 4 else ""

    def child_trace(self) -> dict[str, str]:
        """Trace context for an event caused by this one (same trace id, new span)."""
        return {"traceparent": new_traceparent(self.trace_id or None)}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict as it goes on the wire (``schema`` key, not ``schema_``)."""
        return self.model_dump(by_alias=True, mode="python")

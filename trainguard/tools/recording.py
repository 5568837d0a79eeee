"""The recording file format of ``trainguard replay record`` (JSON lines, one message a line:
``recv_ns``, ``subject``, ``data`` base64, ``headers``, and ``event`` decoded for people to
read). Pure: read and written by ``trainguard.tools.replay`` (which talks to the bus) and read by
``trainguard.tools.replay_decide`` and ``trainguard.tools.report`` (which do not)."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import IO, Any, Iterator

import msgpack

__all__ = ["Record", "read_recording"]


@dataclass
class Record:
    """One recorded message. ``recv_ns`` — Unix ns when the recorder received it."""

    recv_ns: int
    subject: str
    data: bytes
    headers: dict[str, str] | None = None

    def to_json(self) -> str:
        try:
            event = msgpack.unpackb(self.data, raw=False, strict_map_key=False)
            event = json.loads(json.dumps(event, default=_jsonable))
        except Exception:  # noqa: BLE001 - malformed on the wire: keep the bytes only
            event = None
        return json.dumps({"recv_ns": self.recv_ns, "subject": self.subject,
                           "data": base64.b64encode(self.data).decode(),
                           "headers": self.headers, "event": event}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Record":
        """Parse one recorded line; raises ValueError saying which field is wrong."""
        try:
            obj = json.loads(line)
            return cls(int(obj["recv_ns"]), str(obj["subject"]),
                       base64.b64decode(obj["data"]), obj.get("headers") or None)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a trainguard recording line ({exc}): {line[:120]!r}") from None


def _jsonable(o: Any) -> Any:
    if isinstance(o, bytes):
        return base64.b64encode(o).decode()
    return str(o)


def read_recording(fh: IO[str]) -> Iterator[Record]:
    """Records of a recording file, in file order; blank lines are skipped."""
    for n, line in enumerate(fh, 1):
        if line.strip():
            try:
                yield Record.from_json(line)
            except ValueError as exc:
                raise ValueError(f"line {n}: {exc}") from None

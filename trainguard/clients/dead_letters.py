"""Dead letters: what the bus client republishes in place of a message that does not decode.

A dead letter goes to ``tg.dlq.<service>`` (``subjects.dead_letter``) or a job's
``tg.dlq.job.<job>.<client>`` (``subjects.job_dead_letter``), kept by the ``TG_DLQ`` stream
(``trainguard.clients.streams``). It carries the reason in headers and only a prefix of the
payload, never a whole copy: a flood of large bad messages must not double on disk.

Headers: ``Tg-Error-Kind`` (``DecodeError.kind``), ``Tg-Error`` (the error, at most 500
characters), ``Tg-Subject`` (where it was sent, at most 256), ``Tg-Size`` (its size, bytes),
``Tg-Truncated`` (``True`` when the payload kept is a prefix).
"""
from __future__ import annotations

from trainguard.schemas import DecodeError

#: How much of an undecodable message its dead letter keeps (bytes); headers carry its size.
DLQ_PREFIX_BYTES = 1024


def dead_letter(subject: str, data: bytes, exc: DecodeError) -> tuple[bytes, dict[str, str]]:
    """The payload and headers of the dead letter of ``data``, received on ``subject``, which
    did not decode (``exc``)."""
    return data[:DLQ_PREFIX_BYTES], {
        "Tg-Error-Kind": exc.kind, "Tg-Error": str(exc)[:500], "Tg-Subject": subject[:256],
        "Tg-Size": str(len(data)), "Tg-Truncated": str(len(data) > DLQ_PREFIX_BYTES)}

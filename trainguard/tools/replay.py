"""Record events from the bus to a file, and play a recording back into a bus.

``trainguard replay record --out FILE [--subject 'tg.>'] [--duration S] [--count N]``
    writes one JSON object per line for every message on ``--subject``:
    ``{"recv_ns": <Unix ns received>, "subject": …, "data": <base64 of the raw MessagePack>,
    "headers": {…} | null, "event": <decoded event dict> | null}``. ``data`` is the exact wire
    bytes (so malformed messages replay as they were); ``event`` is there for reading with jq.
    Health requests (``tg.svc.*``) are not recorded. Stops at Ctrl-C/SIGTERM, after
    ``--duration`` seconds or ``--count`` messages.

``trainguard replay record --history --out FILE [--subject 'tg.>'] [--count N]``
    writes what the JetStream streams kept on ``--subject`` instead (events 7 days, telemetry
    and heartbeats 1 hour: ``trainguard.clients.streams.STREAMS``), oldest first across the streams, with
    ``recv_ns`` the time the server stored each message; it ends when the history is written.

``trainguard replay decide FILE [--policy PATH] [--set ROW=ACTION] [--json]``
    re-decides the recording offline through the current detector, attributor and remediator
    (``trainguard.tools.replay_decide``) and marks the decisions that differ from the recorded ones.

``trainguard replay play FILE [--speed X] [--subject-prefix P]``
    republishes every line with the original spacing divided by ``--speed`` (2 = twice as fast,
    0 = as fast as possible), so a service under a debugger sees what it saw live.

Both take ``--nats-url`` (default env ``NATS_URL``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import IO, Any, Iterator

from trainguard import schemas

from trainguard.security.credentials import redact
from trainguard.clients.bus import Bus
from trainguard.tools.recording import Record, read_recording


async def record(nats_url: str, out: IO[str], subject: str = "tg.>",
                 duration_s: float | None = None, count: int | None = None,
                 stop: asyncio.Event | None = None) -> int:
    """Write every message on ``subject`` to ``out`` until ``stop`` is set, ``duration_s``
    passed or ``count`` messages were written; returns the number written. Raises
    ConnectionError when NATS cannot be reached."""
    bus = await Bus(nats_url, "trainguard-replay").connect()
    stop = stop or asyncio.Event()
    written = 0

    async def on_msg(msg: Any) -> None:
        nonlocal written
        if msg.subject.startswith("tg.svc.") or stop.is_set():
            return
        rec = Record(time.time_ns(), msg.subject, msg.data, dict(msg.headers or {}) or None)
        out.write(rec.to_json() + "\n")
        out.flush()
        written += 1
        if count is not None and written >= count:
            stop.set()

    assert bus.nc is not None
    sub = await bus.nc.subscribe(subject, cb=on_msg)
    await bus.flush()
    try:
        await asyncio.wait_for(stop.wait(), duration_s)
    except asyncio.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
        await bus.close()
    return written


async def play(nats_url: str, records: Iterator[Record] | list[Record], speed: float = 1.0,
               subject_prefix: str = "") -> int:
    """Publish ``records`` keeping their original spacing divided by ``speed`` (0 = no
    waiting); ``subject_prefix`` (subject tokens, e.g. ``"test"`` or ``"a.b"``) is put in front
    of each subject, joined with a dot (e.g. to replay into a separate namespace: ``test.tg.…``).
    Returns the number published. Raises ValueError for a negative speed or a prefix that is
    not subject tokens."""
    if speed < 0:
        raise ValueError("speed must be >= 0 (0 = as fast as possible)")
    prefix = subject_prefix.strip(".")
    if prefix:
        for tok in prefix.split("."):
            try:
                schemas.subjects.token(tok)
            except ValueError as exc:
                raise ValueError(f"--subject-prefix {subject_prefix!r}: {exc}") from None
        prefix += "."
    bus = await Bus(nats_url, "trainguard-replay").connect()
    assert bus.nc is not None
    n, t0_rec, t0 = 0, None, time.monotonic()
    try:
        for rec in records:
            if t0_rec is None:
                t0_rec = rec.recv_ns
            if speed > 0:
                due = t0 + (rec.recv_ns - t0_rec) / 1e9 / speed
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            await bus.nc.publish(prefix + rec.subject, rec.data, headers=rec.headers)
            n += 1
        await bus.flush()
    finally:
        await bus.close()
    return n


async def history(nats_url: str, out: IO[str], subject: str = "tg.>",
                  count: int | None = None, batch: int = 512) -> int:
    """Write what the JetStream streams of ``trainguard.clients.streams.STREAMS`` keep on ``subject``
    (wildcards allowed) to ``out``, oldest first: the streams are read side by side in batches
    of ``batch`` and merged by the time the server stored each message (``recv_ns``), so a
    recording of events and heartbeats interleaves as it happened; each with its subject as
    published (a partitioned stream stores job subjects by partition, ``trainguard.core.partitions``).
    Stops after ``count`` messages when given. Returns the number written. Raises
    ConnectionError when NATS cannot be reached, PermissionError when the server refuses this
    user the stored history (a worker's credentials: the reader role's may read it); a stream
    that does not exist or holds nothing of ``subject`` is skipped."""
    import heapq
    from collections import deque

    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from trainguard.clients.streams import STREAMS
    from trainguard.core.partitions import original, stored_filters

    bus = await Bus(nats_url, "trainguard-replay").connect()
    assert bus.nc is not None
    js = bus.nc.jetstream()
    readers = []
    try:
        filters = stored_filters(subject)  # job subjects: stored by partition, or as published
        for name, _subjects, _age in STREAMS:
            try:
                psub = await js.pull_subscribe(filters[0], stream=name, config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                    inactive_threshold=30.0,
                    filter_subjects=filters if len(filters) > 1 else None))
                left = (await psub.consumer_info()).num_pending
            except Exception:  # noqa: BLE001 - no such stream, or nothing of subject in it
                if bus.permission_errors:  # refused: this user may not read the history
                    raise PermissionError(
                        f"the NATS user of {redact(nats_url)} may not read the stored events "
                        f"({bus.permission_errors[0]}): use the reader role's URLs (source "
                        f"env/reader.env of the stack's data directory, or pass --nats-url)"
                    ) from None
                continue
            if left:
                readers.append([psub, left])

        heap: list[tuple[int, int, int, Any]] = []
        buffers: list[deque] = [deque() for _ in readers]

        async def push_next(i: int) -> None:
            """Put stream ``i``'s next message on the merge heap (fetching a batch if needed)."""
            psub, left = readers[i]
            if not buffers[i] and left > 0:
                msgs = await psub.fetch(min(batch, left), timeout=5.0)
                readers[i][1] = left - len(msgs)
                buffers[i].extend(msgs)
            if buffers[i]:
                m = buffers[i].popleft()
                heapq.heappush(heap, (_stored_ns(m), i, m.metadata.sequence.stream, m))

        for i in range(len(readers)):
            await push_next(i)
        written = 0
        while heap and (count is None or written < count):
            ts, i, _seq, m = heapq.heappop(heap)
            if not m.subject.startswith("tg.svc."):
                out.write(Record(ts, original(m.subject), m.data, dict(m.headers or {}) or None)
                          .to_json() + "\n")
                written += 1
            await push_next(i)
        out.flush()
        return written
    finally:
        for psub, _left in readers:
            try:
                await psub.unsubscribe()
            except Exception:  # noqa: BLE001 - the ephemeral consumer expires on its own
                pass
        await bus.close()


def _stored_ns(msg: Any) -> int:
    """Unix ns at which the JetStream server stored ``msg`` (microsecond resolution)."""
    ts = msg.metadata.timestamp
    return int(ts.timestamp() * 1_000_000) * 1000


def summarize(records: list[Record]) -> dict[str, int]:
    """Count of records per event schema (``<malformed>`` for undecodable ones)."""
    out: dict[str, int] = {}
    for r in records:
        try:
            name = schemas.decode(r.data).SCHEMA
        except schemas.DecodeError:
            name = "<malformed>"
        out[name] = out.get(name, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["decide"]:  # offline: no bus (trainguard.tools.replay_decide)
        from trainguard.tools.replay_decide import main as decide_main

        return decide_main(argv[1:])
    p = argparse.ArgumentParser(prog="trainguard replay",
                                description="Record bus events to a file or play them back.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="write events from the bus to FILE (JSON lines)")
    r.add_argument("--out", required=True, help="output file ('-' for stdout)")
    r.add_argument("--subject", default="tg.>", help="NATS subject (wildcards allowed)")
    r.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    r.add_argument("--count", type=int, default=None, help="stop after N messages")
    r.add_argument("--history", action="store_true",
                   help="write what JetStream kept on --subject (oldest first), then exit")
    r.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""))
    pl = sub.add_parser("play", help="publish a recording with its original spacing")
    pl.add_argument("file")
    pl.add_argument("--speed", type=float, default=1.0,
                    help="time scale: 2 = twice as fast, 0 = as fast as possible")
    pl.add_argument("--subject-prefix", default="",
                    help="subject tokens put before every subject: 'test' → test.tg.…")
    pl.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""))
    sub.add_parser("decide", help="re-decide a recording offline with the current services "
                                  "(`trainguard replay decide --help`)", add_help=False)
    args = p.parse_args(argv)
    if not args.nats_url:
        print("trainguard replay: no NATS URL: pass --nats-url or set NATS_URL (`trainguard up` "
              "prints it)", file=sys.stderr)
        return 2
    try:
        if args.cmd == "record":
            return _record_cli(args)
        with open(args.file) as fh:
            recs = list(read_recording(fh))
        n = asyncio.run(play(args.nats_url, recs, args.speed, args.subject_prefix))
        print(f"replayed {n} message(s): {json.dumps(summarize(recs))}", file=sys.stderr)
        return 0
    except (ConnectionError, OSError, ValueError) as exc:
        print(f"trainguard replay: {exc}", file=sys.stderr)
        return 1


def _record_cli(args: argparse.Namespace) -> int:
    async def run(out: IO[str]) -> int:
        if args.history:
            return await history(args.nats_url, out, args.subject, args.count)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        return await record(args.nats_url, out, args.subject, args.duration, args.count, stop)

    if args.out == "-":
        n = asyncio.run(run(sys.stdout))
    else:
        with open(args.out, "w") as fh:
            n = asyncio.run(run(fh))
    print(f"recorded {n} message(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one bus client of trainguard: nats-py with event decode, dead-lettering and counters.

* ``Bus`` — asyncio client used by the services. ``subscribe`` decodes every message; a message
  that does not decode is counted (``stats.bad[kind]``), logged once per kind, republished to
  ``tg.dlq.<service>`` with the error in headers, and the service goes on. A handler that raises
  is counted and logged once per exception type; the subscription goes on.
* ``ThreadedBus`` — the same client on a background thread, for synchronous code (the worker
  shim, the launcher). ``publish`` never blocks the caller: it hands the encoded bytes to the loop
  thread; when the bus is slow or gone, at most ``max_pending`` messages wait and newer ones are
  dropped and counted (``stats.dropped``).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import nats
from nats.js.api import (DiscardPolicy, RetentionPolicy, StorageType, StreamConfig,
                         SubjectTransform)

from trainguard import schemas
from trainguard.schemas import DecodeError, Event, subjects

from trainguard.core import partitions as parts
from trainguard.security.credentials import redact
from trainguard.security.roles import inbox_of
from trainguard.clients.errors import ServerUnreachable
from trainguard.security.tls import CA_ENV, ca_file, client_context

log = logging.getLogger("trainguard.clients.bus")


class _QuietTLSClose(logging.Filter):
    """Drops asyncio's ``returning true from eof_received() has no effect when using ssl``:
    nats-py's protocol asks to keep a half-closed connection open, which asyncio cannot do over
    TLS and says on every TLS connection that closes (a client revoked and reconnecting said it
    10 times a second); nothing is wrong and nothing else is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_QuietTLSClose())

Handler = Callable[..., Awaitable[None] | None]  # (subject, event, *extra)


def tls_context(url: str, ca: str | None = None) -> ssl.SSLContext | None:
    """The client TLS context for NATS ``url`` (a comma-separated list): one verifying against
    ``ca_file(ca)`` when a server is ``tls://`` or a CA file is given (``ca`` or env
    ``TG_TLS_CA``: a ``nats://`` server that requires TLS then works too), else None (nats-py
    upgrades to TLS with the system's trust store if the server requires it)."""
    if ca_file(ca) or any(u.strip().startswith("tls://") for u in url.split(",")):
        return client_context(ca)
    return None


def server_options(url: str) -> dict[str, Any]:
    """nats-py's ``connect`` options for NATS ``url``, one URL or a comma-separated list of the
    servers of one cluster (``nats://u:p@h1:4222,nats://u:p@h2:4222``): ``servers`` (a list when
    there are several: the client connects to one and, when it goes, to another, as it does to
    the servers the cluster announces), and ``user``/``password`` of the first URL that has them,
    so that an announced server (named without credentials) is logged into as the same user.
    Raises ValueError for an empty ``url``."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError("empty NATS URL")
    opts: dict[str, Any] = {"servers": urls if len(urls) > 1 else urls[0]}
    if len(urls) > 1:
        for u in urls:
            try:
                parts_ = urlsplit(u)
            except ValueError:
                continue
            if parts_.username and parts_.password:
                opts["user"], opts["password"] = parts_.username, parts_.password
                break
    return opts


class NotStored(ConnectionError):
    """A JetStream publish that no stream acknowledged (``Bus.publish_stored``)."""

#: JetStream streams that keep event history for audit and replay.
#: (name, subjects, max_age seconds). Telemetry and heartbeats are kept briefly: the node
#: agents' (``tg.node.<node>.heartbeat``) and the launchers' (``tg.node.<node>.launcher.<job>``)
#: alike. A stream made by an earlier release gets the subjects it lacks at the next
#: ``ensure_streams`` (an update of its configuration).
STREAMS: tuple[tuple[str, list[str], float], ...] = (
    ("TG_EVENTS", ["tg.job.*.log", "tg.job.*.worker", "tg.job.*.anomaly", "tg.job.*.verdict",
                   "tg.job.*.decision", "tg.job.*.ckpt", "tg.job.*.action", "tg.job.*.recovery",
                   "tg.node.*.xid", "tg.node.*.kernel", "tg.node.*.anomaly", "tg.node.*.slurm",
                   "tg.job.*.slurm"], 7 * 86400.0),
    ("TG_TELEMETRY", ["tg.node.*.telemetry", "tg.node.*.heartbeat", "tg.node.*.launcher.*",
                      "tg.job.*.rank.*.hb"], 3600.0),
    ("TG_DLQ", ["tg.dlq.>"], 7 * 86400.0),
)
#: The streams that keep job subjects, stored by partition (``trainguard.core.partitions``): a
#: replica of a partitioned service consumes only its partitions of them.
PARTITIONED_STREAMS = ("TG_EVENTS", "TG_TELEMETRY")

MiB = 1024 * 1024


@dataclass(frozen=True)
class StreamLimits:
    """Size bounds of one stream (bytes); the oldest messages go first when ``max_bytes`` is
    reached (discard old), so a flood costs history, never the disk."""

    max_bytes: int
    max_msg_size: int
    reason: str


#: Bounds of each stream of ``STREAMS`` (its age limit is there). A stream over its bound drops
#: its oldest messages; the JetStream store of the embedded NATS is capped at their sum plus a
#: margin (``streams_max_bytes``).
STREAM_LIMITS: dict[str, StreamLimits] = {
    "TG_EVENTS": StreamLimits(1024 * MiB, 1 * MiB,
                              "a week of faults, decisions and logs of a busy cluster is tens of "
                              "MiB; a message is at most the server's payload limit"),
    "TG_TELEMETRY": StreamLimits(256 * MiB, 256 * 1024,
                                 "an hour of heartbeats and telemetry of ~1,000 ranks and ~100 "
                                 "nodes; a telemetry sample is a few KiB"),
    "TG_DLQ": StreamLimits(64 * MiB, 16 * 1024,
                           "dead letters keep the reason headers and a 1 KiB prefix "
                           "(``DLQ_PREFIX_BYTES``): enough to see what was sent, never a copy"),
}

#: Copies of each stream of ``STREAMS`` in a NATS cluster (capped at its size,
#: ``stream_replicas``): a stream acknowledges a message once a majority of its copies stored
#: it, so with 3 copies the loss of any one server loses no acknowledged decision, verdict,
#: action or dead letter (the design card: "JetStream R3 for decisions, outbox, audit and
#: verdicts"; the outbox and the audit trail themselves live in Valkey). Telemetry gets 3 too,
#: though it is re-sent every few seconds: the detector reads heartbeats through the stream
#: (``trainguard.services.durable``), so a one-copy telemetry stream on the server that died is silence
#: from every rank and node at once — ``bench/ha.py`` saw that become a node declared lost and
#: the job stopped.
STREAM_REPLICAS: dict[str, int] = {"TG_EVENTS": 3, "TG_TELEMETRY": 3, "TG_DLQ": 3}


def stream_replicas(name: str, cluster_size: int) -> int:
    """Copies stream ``name`` gets on a cluster of ``cluster_size`` servers (1 for a single
    server): ``STREAM_REPLICAS`` capped at the cluster size (JetStream refuses more copies than
    servers)."""
    return max(1, min(STREAM_REPLICAS.get(name, 1), cluster_size))


#: How much of an undecodable message its dead letter keeps (bytes); headers carry its size.
DLQ_PREFIX_BYTES = 1024


def streams_max_bytes(limits: dict[str, StreamLimits] | None = None) -> int:
    """Sum of the streams' ``max_bytes`` (bytes): what the JetStream store may hold."""
    return sum(lim.max_bytes for lim in (limits or STREAM_LIMITS).values())


@dataclass
class BusStats:
    """Counters of one client. ``bad`` is keyed by DecodeError kind."""

    received: int = 0
    published: int = 0
    dropped: int = 0
    handler_errors: int = 0
    bad: collections.Counter = field(default_factory=collections.Counter)


def user_inbox(url: str) -> str:
    """The inbox prefix of the user in NATS URL ``url`` (``auth.inbox_of``: ``_INBOX.<user>``),
    or ``_INBOX`` for a URL without a user. ``trainguard.security.auth`` lets each role and per-job user
    subscribe to its own prefix only, so no client reads the replies to another's requests (a
    JetStream answer carries stored events)."""
    try:
        user = urlsplit(url.split(",", 1)[0]).username
    except ValueError:
        user = None
    return inbox_of(user) if user else "_INBOX"


class Bus:
    """Asyncio NATS client for trainguard events.

    ``url`` is a NATS URL (``nats://host:port``, ``tls://host:port``); ``name`` identifies the
    client and names the dead-letter subject. ``connect`` raises ``ServerUnreachable`` (a
    ``ConnectionError``) with what to do when the server cannot be reached within ``timeout``
    seconds. TLS (a ``tls://`` URL, or a server that requires it): the server's certificate is
    verified against ``tls_ca``, else the CA file in env ``TG_TLS_CA``, else the system's trust
    store (``trainguard.security.tls.client_context``).
    """

    def __init__(self, url: str, name: str, inbox: str | None = None, tls_ca: str | None = None,
                 dead_letters: str | None = None):
        self.url = url
        self.tls_ca = tls_ca
        self.name = name
        #: where ``dead_letter`` republishes: ``subjects.dead_letter(name)`` for a service,
        #: ``subjects.job_dead_letter`` for a job's ranks and launchers (what their role allows)
        self.dead_letters = dead_letters or subjects.dead_letter(name)
        # replies to this client's requests come under ``<inbox>.>``: by default the user's own
        # prefix (``user_inbox``), the one its role may subscribe to
        self.inbox = inbox or user_inbox(url)
        self.nc: nats.NATS | None = None
        self.stats = BusStats()
        self._logged: set[str] = set()
        self._streams: dict[str, tuple[str | None, float]] = {}
        #: the server's "Permissions Violation" errors this client got, oldest first (at most
        #: 20): the subjects its user may not publish or subscribe to (tools say so)
        self.permission_errors: list[str] = []
        self._background: set[asyncio.Task] = set()
        #: (subject, callback) of the ``last_stored`` subscriptions: read again at a reconnect
        #: the ``last_stored`` subscriptions: (subject, callback, nats-py subscription)
        self._last_stored_subs: list[tuple[str, Callable[[Any], Awaitable[None]], Any]] = []

    async def connect(self, timeout: float = 5.0, retry: bool = True) -> "Bus":
        last: list[str] = []  # the client's own last error: why the attempts timed out
        refusal: list[str] = []  # the server refused the credentials (then a reset follows)

        async def _err(e: Exception) -> None:
            last[:] = [str(e) or type(e).__name__]
            if "permissions violation" in last[0].lower() and len(self.permission_errors) < 20:
                self.permission_errors.append(last[0])
            if ServerUnreachable.is_refusal(last[0]):
                refusal[:] = last
                refused.set()
            self._log_once(f"conn:{type(e).__name__}", "bus %s: %s", redact(self.url), e)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            tls = tls_context(self.url, self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ServerUnreachable("NATS", redact(self.url), f"the CA file "
                                    f"{ca_file(self.tls_ca)} ({CA_ENV}) is unusable: {exc}",
                                    "NATS_URL") from None
        refused = asyncio.Event()
        while True:
            # nats-py retries its first connection too (as later reconnects, without end): a
            # refusal of the credentials is not worth another try, so it ends the attempt
            attempt = asyncio.ensure_future(nats.connect(
                **server_options(self.url), name=self.name, connect_timeout=min(timeout, 2.0),
                max_reconnect_attempts=-1, reconnect_time_wait=0.2, allow_reconnect=True,
                error_cb=_err, reconnected_cb=self._reconnected,
                pending_size=8 * 1024 * 1024, inbox_prefix=self.inbox,
                **({"tls": tls} if tls is not None else {})))
            stop = asyncio.ensure_future(refused.wait())
            try:
                await asyncio.wait({attempt, stop}, timeout=max(0.1, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not attempt.done():
                    attempt.cancel()
                    await asyncio.gather(attempt, return_exceptions=True)
                    raise asyncio.TimeoutError()
                self.nc = attempt.result()
                break
            except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
                if not retry or refusal or loop.time() >= deadline:
                    why = (refusal or last or [str(exc) or type(exc).__name__])[0]
                    raise ServerUnreachable("NATS", redact(self.url), why, "NATS_URL") from None
                await asyncio.sleep(0.2)
            finally:
                stop.cancel()
        return self

    @property
    def connected(self) -> bool:
        return bool(self.nc and self.nc.is_connected)

    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)

    async def publish(self, subject: str, event: Event, dedup: bool = False) -> None:
        """Publish ``event`` on ``subject`` (core NATS; JetStream streams capture it).
        ``dedup``: the event id goes in the ``Nats-Msg-Id`` header, so a stream keeps one copy
        of an event published twice within its duplicate window (2 minutes) — a service that
        re-decides the same event after a restart or a takeover."""
        await self.publish_raw(subject, schemas.encode(event),
                               headers={"Nats-Msg-Id": event.event_id} if dedup else None)

    async def publish_stored(self, subject: str, event: Event, timeout: float = 2.0) -> int:
        """Publish ``event`` and wait until a JetStream stream has stored it (the ``Nats-Msg-Id``
        header is the event id: publishing it again stores nothing new). Returns the stream
        sequence. Where no stream keeps ``subject`` (a bus without JetStream streams) it is a
        plain publish and returns 0: there is nothing to wait for. Raises ``NotStored`` when
        the stream did not acknowledge it within ``timeout`` seconds (bus gone or slow)."""
        assert self.nc is not None, "call connect() first"
        try:
            stream = await self._stream_for(subject)
            if stream is None:
                await self.publish(subject, event, dedup=True)
                return 0
            ack = await self.nc.jetstream().publish(
                subject, schemas.encode(event), timeout=timeout, stream=stream,
                headers={"Nats-Msg-Id": event.event_id})
        except Exception as exc:  # noqa: BLE001 - every failure means the same: not stored
            raise NotStored(f"{subject}: {type(exc).__name__}: {exc}") from None
        self.stats.published += 1
        return int(ack.seq)

    async def publish_raw(self, subject: str, data: bytes, headers: dict | None = None) -> None:
        assert self.nc is not None, "call connect() first"
        try:
            await self.nc.publish(subject, data, headers=headers)
            self.stats.published += 1
        except Exception as exc:  # noqa: BLE001 - a slow or gone bus never kills a caller
            self.stats.dropped += 1
            self._log_once(f"pub:{type(exc).__name__}", "publish to %s dropped: %s", subject, exc)

    async def subscribe(self, subject: str, handler: Handler, queue: str = "",
                        last_stored: bool = False) -> Any:
        """Subscribe ``handler(subject, event)`` (sync or async) to ``subject``.

        Undecodable messages go to the dead-letter subject; handler errors are logged and
        counted. ``last_stored`` (an exact subject kept by a JetStream stream, e.g. a job's
        decisions): once subscribed, and again after every reconnect of this client, the newest
        stored message is handed to ``handler`` too, so that a process that subscribes late or
        was cut off the bus still learns what was decided meanwhile (the handler must ignore
        what it has already seen). Returns the nats-py subscription.
        """
        assert self.nc is not None, "call connect() first"

        async def _cb(msg: Any) -> None:
            await self.handle(msg.subject, msg.data, handler)

        sub = await self.nc.subscribe(subject, queue=queue, cb=_cb)
        if last_stored:
            self._last_stored_subs.append((subject, _cb, sub))
            raw = await self.last_stored(subject)
            if raw is not None:
                await _cb(raw)
        return sub

    async def _reconnected(self) -> None:
        """nats-py's reconnect callback: the ``last_stored`` subscriptions are read again (in a
        task of their own, not in the client's reconnect), as at their start. What was
        published while this client was away (a server restarted: a decision the remediator's
        outbox published before this client came back) was never delivered to it; the client
        subscribed again before this callback, so the newest stored message plus what arrives
        from now on miss nothing."""
        if self._last_stored_subs:
            task = asyncio.ensure_future(self._read_last_stored())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    #: Seconds between the reads of ``_read_last_stored`` while it finds nothing: a server
    #: just restarted may answer JetStream requests a moment after it accepts clients, and
    #: ``last_stored`` answers None for "nothing stored" and "no answer" alike.
    REREAD_AFTER_S = (0.0, 0.5, 1.0, 2.0)

    async def _read_last_stored(self) -> None:
        # a subscription unsubscribed since is forgotten, not read again (nats-py marks it
        # closed; its callback must not get a message it no longer wants)
        self._last_stored_subs = [e for e in self._last_stored_subs
                                  if not getattr(e[2], "_closed", False)]
        for subject, cb, _sub in list(self._last_stored_subs):
            for wait in self.REREAD_AFTER_S:
                await asyncio.sleep(wait)
                if self.nc is None:
                    return  # closed meanwhile
                try:
                    raw = await self.last_stored(subject)
                except Exception:  # noqa: BLE001 - the bus went again: the next reconnect
                    break
                if raw is not None:
                    await cb(raw)
                    break

    async def _stream_for(self, subject: str, ttl_s: float = 10.0) -> str | None:
        """The stream that keeps ``subject`` (None: none), remembered ``ttl_s`` seconds."""
        import time

        got = self._streams.get(subject)
        if got is not None and got[1] > time.monotonic():
            return got[0]
        assert self.nc is not None
        try:
            name: str | None = await self.nc.jetstream().find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            name = None
        if len(self._streams) > 10_000:
            self._streams.clear()
        self._streams[subject] = (name, time.monotonic() + ttl_s)
        return name

    async def handle(self, subject: str, data: bytes, handler: Handler,
                     *extra: Any) -> Event | None:
        """Decode ``data`` and call ``handler(subject, event, *extra)``: what every subscription
        does with a message. Undecodable: dead-lettered; a handler error: counted, logged once
        per type. Returns the event (None when it was dead-lettered); never raises."""
        self.stats.received += 1
        try:
            ev = schemas.decode(data, subject)
        except DecodeError as exc:
            await self.dead_letter(subject, data, exc)
            return None
        try:
            res = handler(subject, ev, *extra)
            if asyncio.iscoroutine(res):
                await res
        except Exception as exc:  # noqa: BLE001 - one bad message never kills a service
            self.stats.handler_errors += 1
            self._log_once(f"handler:{type(exc).__name__}",
                           "%s: handler error on %s (%s): %s", self.name, subject,
                           ev.SCHEMA, exc, )
            log.debug("handler error", exc_info=True)
        return ev

    async def last_stored(self, subject: str) -> Any | None:
        """The newest message a JetStream stream keeps on exact ``subject`` (``.subject`` as
        published, ``.data``), or None: none stored, no stream holds the subject, or no
        JetStream.

        A job subject of a partitioned stream is looked up in its stored form
        (``tg.p.<partition>.job.…``, the partition computed from the stream's transform,
        ``partitions.partition``), then as published (a stream made without partitions). A
        stream with ``allow_direct`` (``ensure_streams`` sets it) is read with a direct get whose
        API subject names the subject read (``$JS.API.DIRECT.GET.<stream>.<subject>``), so that
        ``trainguard.security.auth`` can let a job's workers read their own job's stored messages only;
        another stream with ``$JS.API.STREAM.MSG.GET.<stream>`` (the subject in the body)."""
        assert self.nc is not None, "call connect() first"
        js = self.nc.jetstream(timeout=2.0)  # a refused request is never answered: wait less
        try:
            stream = await js.find_stream_name_by_subject(subject)
        except Exception:  # noqa: BLE001 - no stream (or no JetStream): nothing to replay
            return None
        try:
            cfg = (await js.stream_info(stream)).config
        except Exception:  # noqa: BLE001 - a stack of an earlier release: no stream info for
            # this role, a plain get of any partition (``tg.p.*.job.…``) then as published
            direct, forms = False, parts.stored_filters(subject)[::-1]
        else:
            n = parts.partitions_of(cfg.subject_transform.dest if cfg.subject_transform else None)
            direct, forms = bool(cfg.allow_direct), [subject]
            if n and parts.is_job_pattern(subject):
                forms.insert(0, parts.stored(subject, parts.partition(subject.split(".")[2], n)))
        for form in forms:
            try:
                msg = await js.get_msg(stream, subject=form, direct=direct)
            except Exception:  # noqa: BLE001 - nothing stored in this form
                continue
            msg.subject = parts.original(msg.subject)
            return msg
        return None

    async def dead_letter(self, subject: str, data: bytes, exc: DecodeError) -> None:
        """Count, log once per kind, and republish a bad message to ``dead_letters``: the
        reason in headers and the first ``DLQ_PREFIX_BYTES`` of the payload, never a whole copy
        (a flood of large bad messages must not double on disk)."""
        self.stats.bad[exc.kind] += 1
        self._log_once(f"bad:{exc.kind}", "%s: bad message on %s (%s): %s — sent to %s",
                       self.name, subject, exc.kind, exc, self.dead_letters)
        await self.publish_raw(self.dead_letters, data[:DLQ_PREFIX_BYTES],
                               headers={"Tg-Error-Kind": exc.kind, "Tg-Error": str(exc)[:500],
                                        "Tg-Subject": subject[:256], "Tg-Size": str(len(data)),
                                        "Tg-Truncated": str(len(data) > DLQ_PREFIX_BYTES)})

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0) -> bytes:
        assert self.nc is not None
        msg = await self.nc.request(subject, payload, timeout=timeout)
        return msg.data

    def cluster_size(self) -> int:
        """Servers of the NATS cluster this client is connected to, as the server announces
        them (``connect_urls`` of its INFO); 1 for a server without a cluster."""
        assert self.nc is not None, "call connect() first"
        info = getattr(self.nc, "_server_info", None) or {}
        return max(1, len(info.get("connect_urls") or ()))

    async def ensure_streams(self, limits: dict[str, StreamLimits] | None = None,
                             partitions: int | None = None,
                             cluster_size: int | None = None) -> None:
        """Create (or update) the JetStream streams in ``STREAMS`` with their age limit and the
        size bounds of ``limits`` (default ``STREAM_LIMITS``); those of ``PARTITIONED_STREAMS``
        store job subjects in ``partitions`` partitions (default ``partitions.configured()``:
        env ``TG_PARTITIONS``, else 32; 0: as published). Idempotent. Needs the ``admin`` role
        (stream creation is nobody else's). Raises ValueError for a bad ``TG_PARTITIONS``.
        Changing the count of a running bus: restart the partitioned services after it (they
        read it at start). Each stream gets ``stream_replicas`` copies for ``cluster_size``
        servers (default: ``cluster_size()``, the cluster connected to); an existing stream is
        scaled to it."""
        assert self.nc is not None
        js = self.nc.jetstream()
        limits = limits or STREAM_LIMITS
        n = parts.configured() if partitions is None else partitions
        size = self.cluster_size() if cluster_size is None else cluster_size
        for name, subs, max_age in STREAMS:
            lim = limits[name]
            tr = None
            if n and name in PARTITIONED_STREAMS:
                src, dest = parts.transform(n)
                tr = SubjectTransform(src=src, dest=dest)
            cfg = StreamConfig(name=name, subjects=subs, max_age=max_age,
                               max_bytes=lim.max_bytes, max_msg_size=lim.max_msg_size,
                               discard=DiscardPolicy.OLD, subject_transform=tr,
                               allow_direct=True,  # Bus.last_stored: a get per subject
                               retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                               num_replicas=stream_replicas(name, size))
            try:
                await js.add_stream(cfg)
            except Exception:  # noqa: BLE001 - exists with other config: update it
                await js.update_stream(cfg)

    async def flush(self, timeout: float = 2.0) -> None:
        if self.nc and self.nc.is_connected:
            await self.nc.flush(timeout=timeout)

    async def close(self) -> None:
        for task in list(self._background):  # a re-read after a reconnect still running
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self._last_stored_subs.clear()
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001
                try:
                    await self.nc.close()
                except Exception:  # noqa: BLE001
                    pass
            self.nc = None


class ThreadedBus:
    """A ``Bus`` on its own event-loop thread, for synchronous callers.

    ``start()`` returns at once; the connection is made (and remade) in the background, so a
    missing bus never blocks training. ``publish`` is non-blocking. ``subscribe`` handlers run on
    the bus thread and must be quick. ``call(coro_fn, timeout)`` runs a coroutine on that loop
    and waits for its result (used for state-store calls from sync code).
    """

    def __init__(self, url: str, name: str, max_pending: int = 10000,
                 dead_letters: str | None = None):
        self.bus = Bus(url, name, dead_letters=dead_letters)
        self.max_pending = max_pending
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"tg-bus-{name}", daemon=True)
        self._pending = 0
        self._lock = threading.Lock()
        self._connected = threading.Event()
        #: why the last connection attempt failed (None: none failed)
        self.error: ServerUnreachable | None = None
        self._subs: list[tuple[str, Handler, str, bool]] = []

    @property
    def stats(self) -> BusStats:
        return self.bus.stats

    def start(self) -> "ThreadedBus":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), self.loop)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _connect(self) -> None:
        while True:
            try:
                await self.bus.connect(timeout=2.0)
                break
            except ConnectionError as exc:
                self.error = exc if isinstance(exc, ServerUnreachable) else None
                self.bus._log_once("threaded-connect", "%s", exc)
                await asyncio.sleep(0.5)
        for subject, handler, queue, last in self._subs:
            await self.bus.subscribe(subject, handler, queue, last_stored=last)
        self._connected.set()

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the connection; False at once when the server refused
        the credentials (``error.refused``: no retry will connect), or at the timeout."""
        deadline = time.monotonic() + timeout
        while not self._connected.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (self.error is not None and self.error.refused):
                return False
        return True

    def publish(self, subject: str, event: Event) -> None:
        """Queue ``event`` for publishing; never blocks. Dropped (and counted) when
        ``max_pending`` messages already wait."""
        data = schemas.encode(event)
        with self._lock:
            if self._pending >= self.max_pending or not self.loop.is_running():
                self.bus.stats.dropped += 1
                return
            self._pending += 1
        self.loop.call_soon_threadsafe(self._enqueue, subject, data)

    def _enqueue(self, subject: str, data: bytes) -> None:
        async def _send() -> None:
            try:
                if not self._connected.is_set():
                    await asyncio.wait_for(self._wait_conn(), 30.0)
                await self.bus.publish_raw(subject, data)
            except asyncio.TimeoutError:
                self.bus.stats.dropped += 1
            finally:
                with self._lock:
                    self._pending -= 1

        self.loop.create_task(_send())

    async def _wait_conn(self) -> None:
        while not self._connected.is_set():
            await asyncio.sleep(0.05)

    def subscribe(self, subject: str, handler: Handler, queue: str = "",
                  last_stored: bool = False) -> None:
        """Subscribe now if connected, else as soon as the connection is made.
        ``last_stored``: see ``Bus.subscribe``."""
        if self._connected.is_set():
            asyncio.run_coroutine_threadsafe(
                self.bus.subscribe(subject, handler, queue, last_stored=last_stored),
                self.loop).result(5.0)
        else:
            self._subs.append((subject, handler, queue, last_stored))

    def call(self, coro: Awaitable[Any], timeout: float = 5.0) -> Any:
        """Run ``coro`` on the bus loop; wait at most ``timeout`` seconds (TimeoutError)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def flush(self, timeout: float = 2.0) -> None:
        """Wait until queued messages are handed to the server (bounded by ``timeout``)."""
        import time

        if not self._connected.is_set():
            return  # nothing can be handed over now; queued messages are dropped at close
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._connected.is_set():
            try:
                self.call(self.bus.flush(timeout), timeout + 0.5)
            except Exception:  # noqa: BLE001
                pass

    def close(self, timeout: float = 2.0) -> None:
        self.flush(timeout)
        if self.loop.is_running():
            if self._connected.is_set():
                try:
                    self.call(self.bus.close(), timeout)
                except Exception:  # noqa: BLE001
                    pass
            self.loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(timeout)

    def _shutdown(self) -> None:
        async def _drain() -> None:
            # cancel until none is left: a publish queued just before close() schedules its
            # task after a first sweep (left pending, it was reported at interpreter exit)
            while True:
                tasks = [t for t in asyncio.all_tasks(self.loop)
                         if t is not asyncio.current_task()]
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        self.loop.create_task(_drain())

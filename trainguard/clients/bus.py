"""The one bus client of trainguard: nats-py with event decode, dead-lettering and counters.

``Bus`` is the asyncio client the services use. ``subscribe`` decodes every message; a message
that does not decode is counted (``stats.bad[kind]``), logged once per kind, and republished as a
dead letter (``trainguard.clients.dead_letters``) to ``tg.dlq.<service>``; the service goes on. A
handler that raises is counted and logged once per exception type; the subscription goes on.
Synchronous code uses it through ``trainguard.clients.threaded_bus.ThreadedBus``; what a NATS URL
means (servers, TLS, inbox) is ``trainguard.clients.nats_url``; the streams it creates are
``trainguard.clients.streams``.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import nats

from trainguard import schemas
from trainguard.clients import dead_letters, streams
from trainguard.clients.errors import ServerUnreachable
from trainguard.clients.nats_url import server_options, tls_context, user_inbox
from trainguard.core import partitions as parts
from trainguard.schemas import DecodeError, Event, subjects
from trainguard.security.credentials import redact
from trainguard.security.tls import CA_ENV, ca_file

log = logging.getLogger("trainguard.clients.bus")

Handler = Callable[..., Awaitable[None] | None]  # (subject, event, *extra)


class NotStored(ConnectionError):
    """A JetStream publish that no stream acknowledged (``Bus.publish_stored``)."""


@dataclass
class BusStats:
    """Counters of one client. ``bad`` is keyed by DecodeError kind."""

    received: int = 0
    published: int = 0
    dropped: int = 0
    handler_errors: int = 0
    bad: collections.Counter = field(default_factory=collections.Counter)


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
        #: the ``last_stored`` subscriptions, read again at a reconnect: (subject, callback,
        #: nats-py subscription)
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
        published, ``.data``), or None: none stored, no stream holds the subject, no JetStream,
        or the stream's configuration could not be read.

        A job subject of a partitioned stream is looked up in its stored form
        (``tg.p.<partition>.job.…``, the partition computed from the stream's transform,
        ``partitions.partition``), then as published (a stream made without partitions). A
        stream with ``allow_direct`` (``ensure_streams`` sets it) is read with a direct get whose
        API subject names the subject read (``$JS.API.DIRECT.GET.<stream>.<subject>``), so that
        ``trainguard.security.roles`` can let a job's workers read their own job's stored
        messages only; another stream with ``$JS.API.STREAM.MSG.GET.<stream>`` (the subject in
        the body)."""
        assert self.nc is not None, "call connect() first"
        js = self.nc.jetstream(timeout=2.0)  # a refused request is never answered: wait less
        try:
            stream = await js.find_stream_name_by_subject(subject)
        except Exception:  # noqa: BLE001 - no stream (or no JetStream): nothing to replay
            return None
        try:
            cfg = (await js.stream_info(stream)).config
        except Exception:  # noqa: BLE001 - no answer (or no right): nothing to replay
            return None
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
        reason in headers and a prefix of the payload (``dead_letters.dead_letter``)."""
        self.stats.bad[exc.kind] += 1
        self._log_once(f"bad:{exc.kind}", "%s: bad message on %s (%s): %s — sent to %s",
                       self.name, subject, exc.kind, exc, self.dead_letters)
        payload, headers = dead_letters.dead_letter(subject, data, exc)
        await self.publish_raw(self.dead_letters, payload, headers=headers)

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

    async def ensure_streams(self, limits: dict[str, streams.StreamLimits] | None = None,
                             partitions: int | None = None,
                             cluster_size: int | None = None) -> None:
        """Create (or update to) the JetStream streams of ``streams.stream_configs``: the
        size bounds of ``limits`` (default ``streams.STREAM_LIMITS``); job subjects in
        ``partitions`` partitions (default ``partitions.configured()``: env ``TG_PARTITIONS``,
        else 32; 0: as published); ``stream_replicas`` copies for ``cluster_size`` servers
        (default: ``cluster_size()``, the cluster connected to; an existing stream is scaled to
        it). Idempotent. Needs the ``admin`` role (stream creation is nobody else's). Raises
        ValueError for a bad ``TG_PARTITIONS``. Changing the count of a running bus: restart
        the partitioned services after it (they read it at start)."""
        assert self.nc is not None
        js = self.nc.jetstream()
        n = parts.configured() if partitions is None else partitions
        size = self.cluster_size() if cluster_size is None else cluster_size
        for cfg in streams.stream_configs(limits, n, size):
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

"""Base of the trainguard services (agent, detector, attributor, remediator,
checkpoint_validator): bus + state connection, subscriptions, a periodic tick, a health
responder, replicas that share the jobs, and a clean shutdown.

A service is thin: ``handle`` parses (the bus already decoded and validated the event), calls a
pure decide function, and publishes what it returns. Each service also answers NATS requests on
``tg.svc.<name>.health`` with a JSON object ``{"ok": true, "name": …, "stats": {…}}``, which is
what ``trainguard up`` waits for. With ``TG_METRICS_PORT`` (or ``--metrics-port``) set, it also
serves Prometheus ``/metrics`` (``trainguard.services.metrics``; the port is in the health reply).

Run one alone with ``python -m <service> --nats-url URL --redis-url URL``
(``trainguard.services.entry.main``).

A service takes its messages in through durable JetStream consumers where a stream keeps the
topic (``trainguard.services.intake``: acks, held messages, restarts).

Several replicas run side by side: each holds a lease in Valkey
(``trainguard.services.membership``) and handles the events of the jobs it owns by rendezvous
hashing over the live replicas. Where the streams store job subjects by partition
(``trainguard.core.partitions``; the count is read from the streams at start), a replica owns
whole partitions and its durable consumers filter only those: it is not sent the others'
messages at all; otherwise it receives every message and acks the others' events unhandled. When the members change, the consumers' filters follow the
partitions owned, and ``members_changed`` gets the keys this replica gained and lost and the
partitions it gained (``ReducerService`` rebuilds a gained job or partition from the stream and
forgets a lost one); live messages of what is being rebuilt wait for the rebuild.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from trainguard.clients.bus import Bus, Handler
from trainguard.clients.store import StateStore
from trainguard.clients.streams import PARTITIONED_STREAMS
from trainguard.core import partitions
from trainguard.schemas import subjects
from trainguard.security.credentials import redact
from trainguard.services import durable as consume, metrics, tracing
from trainguard.services.intake import DurableIntake
from trainguard.services.membership import (Membership, MembershipConfig, default_replica,
                                            partition_key)
from trainguard.services.memory import release_freed_memory

log = logging.getLogger("trainguard.services.base")


def health_subject(name: str, replica: str | None = None) -> str:
    """``tg.svc.<name>.health`` (any replica answers), or ``….health.<replica>`` (that one);
    ``name`` as a subject token (an agent on a dotted node: ``agent-ip-10-0-1-2%2Eec2…``)."""
    return f"tg.svc.{subjects.token(name)}.health" + (f".{replica}" if replica else "")


@dataclass
class ServiceConfig:
    """Connection settings shared by all services.

    ``nats_url``/``redis_url`` — required (env ``NATS_URL``/``REDIS_URL``); there is no default
    so a service never talks to a server by accident. ``node`` — this host's node name
    (env ``TG_NODE``, default the hostname). ``tick_s`` — period of ``tick()`` in seconds.
    ``replica`` — this replica's name among the service's replicas (env ``TG_REPLICA``; default
    ``<host>-<pid>``, unique to the process): a replica restarted under the same name resumes
    its durable consumers, one with a new name starts from what arrives. ``durable`` — consume
    through JetStream durable consumers where a stream keeps the topic (False: plain
    subscriptions, nothing handled after a restart; env ``TG_DURABLE=0``). ``membership`` —
    lease timing.
    """

    nats_url: str = field(default_factory=lambda: os.environ.get("NATS_URL", ""))
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", ""))
    node: str = field(default_factory=subjects.default_node)
    tick_s: float = 0.05
    replica: str = field(default_factory=lambda: os.environ.get("TG_REPLICA") or
                         default_replica())
    durable: bool = field(default_factory=lambda: os.environ.get("TG_DURABLE", "1") != "0")
    membership: MembershipConfig = field(default_factory=MembershipConfig)


class Service(DurableIntake):
    """Subclass and set ``name``; override ``subscriptions``, ``setup``, ``tick``, ``health``.
    How it consumes: ``DurableIntake``."""

    name = "service"
    uses_state = True
    #: jobs are partitioned among the service's replicas (see the module docstring)
    partitioned = False
    #: topics whose messages may be held unacked after handling, until ``unfinished`` no
    #: longer names their event (their consumers' ack wait: ``consume.HELD_ACK_WAIT_S``)
    holding_topics: Sequence[str] = ()
    #: seconds between two looks at the held messages (acks of the settled ones)
    ack_check_s = 0.2
    #: seconds between two returns of freed heap memory to the OS (``release_freed_memory``)
    memory_trim_s = 5.0

    def __init__(self, config: ServiceConfig | None = None):
        self.config = config or ServiceConfig()
        if not self.config.nats_url:
            raise SystemExit(f"{self.name}: no NATS URL: pass --nats-url or set NATS_URL "
                             f"(`trainguard up` starts a local stack)")
        if self.uses_state and not self.config.redis_url:
            raise SystemExit(f"{self.name}: no Redis URL: pass --redis-url or set REDIS_URL")
        self.bus = Bus(self.config.nats_url, self.name, inbox=f"_INBOX.{self.name}")
        self.state: StateStore | None = None
        self.metrics: Any = None  # trainguard.services.metrics.Metrics when TG_METRICS_PORT is set
        self._stop = asyncio.Event()
        self.membership = Membership(self.name, self.config.replica, self.config.membership)
        super().__init__()
        # partition keys seen on the bus: another replica's, and this one's that decoded
        self.known: set[str] = set()
        self.replayed: dict[tuple[str, str], int] = {}  # (stream, key) -> last seq replayed
        self._plain_streams = False  # the job streams store subjects as published
        self._refilter_due = False
        #: takeovers so far; when the last began (Unix ns) and how long it took (seconds)
        self.takeovers: dict[str, Any] = {"count": 0, "last_began_ns": None, "last_s": None}
        #: while a takeover rebuilds: (set when done, whether a partition key is being rebuilt)
        self._gate: tuple[asyncio.Event, Callable[[str | None], bool]] | None = None
        self._member_task: asyncio.Task | None = None
        self._started_ns = time.time_ns()

    # ---- to override ------------------------------------------------------------------------
    def subscriptions(self) -> list[tuple[str, Handler]]:
        return []

    async def setup(self) -> None:
        """Called once connected, before subscribing."""

    async def tick(self) -> None:
        """Called every ``config.tick_s`` seconds."""

    def health(self) -> dict[str, Any]:
        return {}

    def extra_stats(self) -> dict[str, Any]:
        """Counters of the service base class, added to the health reply's ``stats``."""
        return {}

    def unfinished(self) -> Collection[str]:
        """Event ids of handled inputs whose outcome is still being worked out: a message of
        ``holding_topics`` carrying one is acked once it leaves this set, not when handled.
        Default: none."""
        return ()

    def accepts(self, subject: str) -> bool:
        """Whether this replica handles a message on ``subject``: its partition key is one it
        owns (always, for a service that is not ``partitioned``). The key of another replica's
        message is recorded in ``known`` here (this replica does not decode it); that of its
        own once the message decoded (``_seen``)."""
        if not self.partitioned:
            return True
        key = partition_key(subject)
        owned = self.membership.owns(key)
        if key is not None and not owned:
            self.known.add(key)
        return owned

    def _seen(self, subject: str) -> None:
        """Record the partition key of ``subject``, whose message this replica decoded: a key
        named only by messages that do not decode (a hostile flood names a new one in each) has
        nothing to rebuild or forget, and is not kept."""
        if self.partitioned:
            key = partition_key(subject)
            if key is not None:
                self.known.add(key)

    async def members_changed(self, gained: set[str], lost: set[str],
                              partitions: frozenset[int] = frozenset()) -> None:
        """The members changed: this replica now owns ``gained`` and no longer ``lost``
        (partition keys it knew of), and owns the stream ``partitions`` it did not before
        (their jobs may include some it never heard of). Called with no input being handled
        of what it gained."""

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.connect(timeout=10.0)
        if self.uses_state:
            self.state = StateStore(self.config.redis_url)
            await self.state.ping()
        joined_others = False
        if self.partitioned and self.config.durable:
            self.membership.set_partitions(await self._stream_partitions())
        if self.partitioned and self.state is not None:
            await self.membership.renew(self.state)
            joined_others = len(self.membership.members) > 1
        if joined_others:  # live messages of what it takes over wait for the rebuild
            assert self.state is not None
            self.known.update(await self.state.jobs())
            self._gate = (asyncio.Event(), self._rebuilding(
                {k for k in self.known if self.membership.owns(k)},
                self.membership.owned_partitions()))
        await self.setup()
        tracing.configure_from_env(self.name)
        self.metrics = metrics.mount(self)  # /metrics when TG_METRICS_PORT is set
        for subject, handler in self.subscriptions():
            await self._consume(subject, tracing.traced(self.name, handler))
        self._start_intake()
        assert self.bus.nc is not None
        await self.bus.nc.subscribe(health_subject(self.name), cb=self._health)
        if self.partitioned:  # a replica among others answers on its own subject too
            await self.bus.nc.subscribe(health_subject(self.name, self.config.replica),
                                        cb=self._health)
        await self.bus.flush()
        if self.partitioned and self.state is not None:
            if joined_others:  # take over what the others served of ours: rebuild it
                mine = {k for k in self.known if self.membership.owns(k)}
                await self._take_over(mine, set(), self.membership.owned_partitions())
            self._member_task = asyncio.create_task(self._renew_loop())
        log.info("%s ready (replica %s, nats=%s)", self.name, self.config.replica,
                 redact(self.config.nats_url))

    async def _stream_partitions(self) -> int:
        """The partition count of the job streams (``streams.PARTITIONED_STREAMS``): 0 when they
        are not partitioned, cannot be read, or disagree (then jobs are owned one by one and
        every replica reads every message, as without partitions)."""
        assert self.bus.nc is not None
        js = self.bus.nc.jetstream()
        counts = {await consume.stream_partitions(js, s) for s in PARTITIONED_STREAMS}
        self._plain_streams = counts == {0}
        if len(counts) != 1:
            log.warning("%s: the job streams' partition counts differ (%s): every replica "
                        "reads every message", self.name, sorted(counts))
            return 0
        return counts.pop()

    def _filters(self, topic: str) -> list[str]:
        """The stream filters of ``topic``'s durable consumer: the partitions this replica
        owns when the streams are partitioned; the topic itself when they are not; every
        message in either form when their counts disagree."""
        n = self.membership.partitions
        if not partitions.is_job_pattern(topic) or (not n and self._plain_streams):
            return [topic]
        if not n:
            return partitions.stored_filters(topic)
        return partitions.stored_filters(topic, self.membership.owned_partitions(), n)

    def _rebuilding(self, keys: set[str], parts: frozenset[int]) -> Callable[[str | None], bool]:
        """Whether a partition key is among ``keys`` or in one of the stream partitions
        ``parts`` (what a takeover rebuilds)."""
        n = self.membership.partitions

        def test(key: str | None) -> bool:
            if key is None:
                return False
            if key in keys:
                return True
            return bool(n and parts) and not key.startswith("node:") and \
                partitions.partition(key, n) in parts
        return test

    async def _refilter(self) -> None:
        """Point each durable consumer at the partitions owned now; one the server did not
        update is tried again at the next renewal (``_refilter_due``)."""
        self._refilter_due = False
        for dc in self._durables:
            try:
                if await dc.refilter(self._filters(dc.topic)):
                    log.info("%s: consumer %s now filters %s", self.name, dc.name,
                             ",".join(dc.filters))
            except Exception as exc:  # noqa: BLE001 - tried again at the next renewal
                self._refilter_due = True
                log.warning("%s: consumer %s not refiltered: %s", self.name, dc.name, exc)

    async def _take_over(self, gained: set[str], lost: set[str],
                         parts: frozenset[int]) -> None:
        """Point the durable consumers at the partitions owned now, then ``members_changed``;
        live messages of what is gained wait meanwhile (``_gate``)."""
        if self._gate is None:
            self._gate = (asyncio.Event(), self._rebuilding(gained, parts))
        began, t0 = time.time_ns(), time.monotonic()
        try:
            await self._refilter()
            await self.members_changed(gained, lost, parts)
        finally:
            gate, self._gate = self._gate, None
            gate[0].set()
            self.takeovers = {"count": self.takeovers["count"] + 1, "last_began_ns": began,
                              "last_s": round(time.monotonic() - t0, 4)}

    async def _renew_loop(self) -> None:
        """Renew the lease every ``renew_s``; on a change of members, ``members_changed``."""
        assert self.state is not None
        while not self._stop.is_set():
            await asyncio.sleep(self.membership.config.renew_s)
            before = {k for k in self.known if self.membership.owns(k)}
            parts_before = self.membership.owned_partitions()
            try:
                changed = await self.membership.renew(self.state)
            except Exception as exc:  # noqa: BLE001 - Valkey away: keep the last list
                log.warning("%s: lease not renewed: %s", self.name, exc)
                continue
            if not changed and self._refilter_due:
                await self._refilter()
            if changed:
                try:
                    self.known.update(await self.state.jobs())
                except Exception:  # noqa: BLE001
                    pass
                after = {k for k in self.known if self.membership.owns(k)}
                try:
                    await self._take_over(after - before, before - after,
                                          self.membership.owned_partitions() - parts_before)
                except Exception:  # noqa: BLE001 - a failed takeover is logged, not fatal
                    log.exception("%s: taking over after a change of members failed",
                                  self.name)

    async def _health(self, msg: Any) -> None:
        s = self.bus.stats
        body = {"ok": True, "name": self.name, "pid": os.getpid(),
                "replica": self.config.replica, "members": list(self.membership.members),
                "partitions": {"count": self.membership.partitions,
                               "owned": sorted(self.membership.owned_partitions())},
                "stats": {"received": s.received, "published": s.published,
                          "dropped": s.dropped, "handler_errors": s.handler_errors,
                          "bad": dict(s.bad), "consumed": dict(self.consumed),
                          "holding": sum(1 for d in self._deliveries.values() if d.event_id),
                          "takeovers": dict(self.takeovers),
                          **self.extra_stats()},
                "metrics_port": self.metrics.port if self.metrics else None, **self.health()}
        await msg.respond(json.dumps(body).encode())

    async def run(self) -> None:
        """Start, tick until ``stop()``, then close connections."""
        await self.start()
        trimmed = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    await self.tick()
                except Exception:  # noqa: BLE001 - a tick error never kills the service
                    log.exception("%s tick failed", self.name)
                if time.monotonic() - trimmed >= self.memory_trim_s:
                    release_freed_memory()
                    trimmed = time.monotonic()
                try:
                    await asyncio.wait_for(self._stop.wait(), self.config.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.close()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self._member_task is not None:
            self._member_task.cancel()
        await self._close_intake()
        await self.bus.close()
        if self.state is not None:
            if self.partitioned:
                try:
                    await self.state.leave_member(self.name, self.config.replica)
                except Exception:  # noqa: BLE001 - its lease runs out by itself
                    pass
            await self.state.close()



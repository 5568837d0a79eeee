"""How a service takes in its messages: durable JetStream consumers with explicit acks where
a stream keeps the topic, plain NATS subscriptions where none does (``DurableIntake``, mixed into
``trainguard.services.base.Service``).

A ``partitioned`` service (detector, attributor, remediator, checkpoint validator) consumes every
topic a JetStream stream keeps through its own durable consumer with explicit acks
(``trainguard.services.durable``): a message is acked once handled (heartbeats and telemetry in
batches, ``consume.ACKS``), so a replica that restarts under the same ``--replica`` name
handles what arrived while it was down, within each subject family's relevance
(``consume.RELEVANCE``). A message of one of the service's ``holding_topics`` whose outcome is
still being worked out once handled (its event id in ``unfinished()``: a verdict whose
state-store call waits to be tried again) is held unacked, kept from redelivery with
in-progress acks, and acked once it leaves ``unfinished()``; a replica killed meanwhile gets it
again when it comes back (``consume.HELD_ACK_WAIT_S`` after the last in-progress ack at most). A
message of those topics delivered again while this process still handles or holds it is not
handled twice. A message of a partition key this replica does not own is acked unhandled
(``Service.accepts``); live messages of what a takeover is rebuilding wait for the rebuild,
then those it stepped already are skipped. Topics no stream keeps stay plain NATS
subscriptions, filtered by ownership.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from trainguard.clients.bus import Handler
from trainguard.core import partitions
from trainguard.services import durable as consume
from trainguard.services.membership import partition_key


@dataclass
class _Delivery:
    """A JetStream message this process handles or holds. ``msg`` — its latest delivery (the
    one acked); ``event_id`` — set when it is held after handling (``Service.unfinished``);
    ``touched`` — ``time.monotonic()`` of its delivery or last in-progress ack."""

    msg: Any
    event_id: str | None = None
    touched: float = 0.0


class DurableIntake:
    """The consuming half of ``Service``: ``_consume`` subscribes a handler to a topic,
    ``_start_intake`` and ``_close_intake`` start and end the upkeep of held messages and
    batched acks. It uses the service's ``bus``, ``config``, ``partitioned``,
    ``holding_topics``, ``ack_check_s``, ``accepts``, ``_seen``, ``unfinished``, ``_filters``,
    ``_gate``, ``replayed``, ``_started_ns`` and ``_stop``.

    ``consumed`` counts the messages of the durable consumers by outcome: ``durable``
    (handled), ``stale`` (a backlog older than its relevance), ``foreign`` (another replica's
    partition key), ``replayed_before`` (stepped by a takeover's replay already), ``held``
    (kept unacked after handling), ``again`` (delivered again while handled or held here)."""

    def __init__(self) -> None:
        self.consumed = {"durable": 0, "stale": 0, "foreign": 0, "replayed_before": 0,
                         "held": 0, "again": 0}
        self._deliveries: dict[tuple[str, int], _Delivery] = {}  # (stream, seq) -> delivery
        self._ack_task: asyncio.Task | None = None
        self._subs: list[Any] = []
        self._durables: list[consume.DurableConsumer] = []
        self._batches: list[consume.BatchedAcks] = []  # of the batched-ack consumers

    def _start_intake(self) -> None:
        """Once subscribed: keep the held messages (``_keep_deliveries``) when there can be
        any."""
        if self._subs and self.config.durable and self.partitioned and self.holding_topics:
            self._ack_task = asyncio.create_task(self._keep_deliveries())

    async def _close_intake(self) -> None:
        """Stop keeping held messages (they stay unacked: the next process gets them) and ack
        the last batch (what was handled is not handled again after a restart)."""
        if self._ack_task is not None:
            self._ack_task.cancel()
        for batch in self._batches:
            if self.bus.connected:
                await batch.flush()
            batch.cancel()

    async def _consume(self, topic: str, handler: Handler) -> None:
        """Subscribe ``handler`` to ``topic``: a durable consumer when a stream keeps it (and
        ``config.durable``), else a plain subscription; either way filtered by ``accepts``."""
        assert self.bus.nc is not None
        if self.config.durable and self.partitioned:
            max_age = consume.max_age_s(topic)
            holds = topic in self.holding_topics
            batch = consume.BatchedAcks() if consume.batched_acks(topic, holds) else None

            async def on_message(msg: Any) -> None:
                subject = partitions.original(msg.subject)
                st = consume.stored_of(msg)
                # only a topic whose messages may be held is tracked (the hot heartbeat path
                # acks in batches, ``consume.ACKS``)
                key = None if st is None or not holds else (st.stream, st.seq)
                if key is not None and key in self._deliveries:
                    # delivered again while handled or held here (its ack wait ran out while
                    # the bus was away): the newest delivery is the one acked; nothing twice
                    self.consumed["again"] += 1
                    d = self._deliveries[key]
                    d.msg = msg
                    await self._progress(d)
                    return
                if key is not None:
                    self._deliveries[key] = _Delivery(msg, touched=time.monotonic())
                held = False
                try:
                    if not self.accepts(subject):  # first: the cheapest test
                        self.consumed["foreign"] += 1
                        return
                    pkey = partition_key(subject)
                    gate = self._gate
                    if gate is not None and gate[1](pkey):
                        await gate[0].wait()  # a takeover is rebuilding it: after that
                    if st is not None and st.stored_ns < self._started_ns and \
                            st.age_s > max_age:
                        # a backlog of before this process ran (a restart): only what is still
                        # relevant; live traffic is handled however late this service runs
                        self.consumed["stale"] += 1
                    elif st is not None and st.seq <= self.replayed.get(
                            (st.stream, pkey or ""), 0):
                        self.consumed["replayed_before"] += 1  # stepped in a takeover replay
                    else:
                        self.consumed["durable"] += 1
                        ev = await self.bus.handle(subject, msg.data, handler)
                        if ev is not None:
                            self._seen(subject)
                        if holds and key is not None and ev is not None and \
                                ev.event_id in self.unfinished():
                            held = True  # acked by _keep_deliveries once settled
                            self.consumed["held"] += 1
                            self._deliveries[key].event_id = ev.event_id
                finally:
                    if batch is not None:  # acked with the next batch
                        await batch.handled(msg)
                    elif not held:
                        d = self._deliveries.pop(key, None) if key is not None else None
                        await self._ack(msg if d is None else d.msg)

            dc = await consume.durable_subscribe(
                self.bus.nc, self.name, self.config.replica, topic, on_message,
                ack_wait_s=consume.HELD_ACK_WAIT_S if holds else consume.ACK_WAIT_S,
                filters=self._filters(topic),
                max_ack_pending=consume.max_ack_pending_for(topic, holds),
                batched=batch is not None)
            if dc is not None:
                if batch is not None:
                    self._batches.append(batch)
                self._durables.append(dc)
                self._subs.append(dc.sub)
                return

        async def plain(subject: str, ev: Any) -> None:
            if self.accepts(subject):
                self._seen(subject)
                res = handler(subject, ev)
                if asyncio.iscoroutine(res):
                    await res
            else:
                self.consumed["foreign"] += 1

        self._subs.append(await self.bus.subscribe(topic, plain))

    @staticmethod
    async def _ack(msg: Any) -> None:
        try:
            await msg.ack()
        except Exception:  # noqa: BLE001 - connection gone: redelivered later
            pass

    @staticmethod
    async def _progress(d: _Delivery) -> None:
        """An in-progress ack: the server waits its ack wait again before redelivering."""
        d.touched = time.monotonic()
        try:
            await d.msg.in_progress()
        except Exception:  # noqa: BLE001 - connection gone: redelivered later, handled once
            pass

    async def _keep_deliveries(self) -> None:
        """Every ``ack_check_s``: ack the held messages ``unfinished`` no longer names; keep
        every message of ``holding_topics`` handled or held for a third of
        ``consume.HELD_ACK_WAIT_S`` or longer from redelivery with an in-progress ack."""
        while not self._stop.is_set():
            await asyncio.sleep(self.ack_check_s)
            if not self._deliveries:
                continue
            still = set(self.unfinished())
            now = time.monotonic()
            for key, d in list(self._deliveries.items()):
                if self._deliveries.get(key) is not d:
                    continue  # acked by its handler meanwhile
                if d.event_id is not None and d.event_id not in still:
                    del self._deliveries[key]
                    await self._ack(d.msg)
                elif now - d.touched >= consume.HELD_ACK_WAIT_S / 3:
                    await self._progress(d)

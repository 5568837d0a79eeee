"""Batched acks of the short-lived subject families (``consume.ACKS``): which topics, when a
batch is acked, and, against a real server, that one ack of the newest message acks every
earlier one."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from trainguard.services.durable import (ACK_BATCH_N, ACK_BATCH_S, ACKS, BatchedAcks, batched_acks,
                                consumer_name, durable_subscribe)


# ---- pure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("topic", ["tg.job.*.rank.*.hb", "tg.node.*.heartbeat",
                                   "tg.node.*.telemetry"])
def test_heartbeats_and_telemetry_are_acked_in_batches(topic):
    assert batched_acks(topic)
    assert not batched_acks(topic, holds=True)  # a held message is acked alone, once settled


@pytest.mark.parametrize("topic", ["tg.job.*.worker", "tg.job.*.log", "tg.job.*.anomaly",
                                   "tg.job.*.verdict", "tg.job.*.decision", "tg.job.*.ckpt",
                                   "tg.node.*.xid", "tg.node.*.kernel", "tg.job.*.recovery"])
def test_events_are_acked_one_by_one(topic):
    assert not batched_acks(topic)


def test_ack_table_rows_have_reasons_and_a_batch_is_short():
    assert all(r.reason for r in ACKS) and ACKS[-1].pattern == ">" and not ACKS[-1].batched
    assert ACK_BATCH_S < 5.0 / 10  # a tenth of a heartbeat's relevance at most
    assert ACK_BATCH_N <= 50_000 // 10  # a tenth of MAX_ACK_PENDING at most


class _Msg:
    def __init__(self, i: int, acks: list, fail: bool = False):
        self.i, self.acks, self.fail = i, acks, fail

    async def ack(self) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.acks.append(self.i)


async def test_batch_acks_the_newest_after_n_messages():
    acks: list[int] = []
    b = BatchedAcks(every_s=60.0, every_n=3)
    for i in range(7):
        await b.handled(_Msg(i, acks))
    assert acks == [2, 5]  # the newest of each full batch
    await b.flush()
    assert acks == [2, 5, 6] and b.acks == 3
    await b.flush()  # nothing left: no ack
    assert acks == [2, 5, 6]


async def test_batch_acks_the_newest_after_its_time():
    acks: list[int] = []
    b = BatchedAcks(every_s=0.02, every_n=1000)
    for i in range(5):
        await b.handled(_Msg(i, acks))
    assert acks == []
    await asyncio.sleep(0.1)
    assert acks == [4]
    await b.handled(_Msg(5, acks))  # a new batch, a new timer
    await asyncio.sleep(0.1)
    assert acks == [4, 5]


async def test_a_batch_due_while_the_last_ack_is_written_is_acked_after_it():
    acks: list[int] = []
    gate = asyncio.Event()

    class _Slow(_Msg):
        async def ack(self) -> None:
            await gate.wait()
            await super().ack()

    b = BatchedAcks(every_s=0.02, every_n=1000)
    await b.handled(_Slow(0, acks))
    await asyncio.sleep(0.05)          # its ack is being written (blocked)
    await b.handled(_Msg(1, acks))     # the next batch falls due meanwhile
    await asyncio.sleep(0.05)
    assert acks == []
    gate.set()
    await asyncio.sleep(0.1)           # no further message: the newest is acked anyway
    assert acks == [0, 1]


async def test_a_failed_ack_is_left_to_redelivery():
    b = BatchedAcks(every_s=60.0, every_n=1)
    await b.handled(_Msg(0, [], fail=True))  # does not raise
    assert b.acks == 0
    b.cancel()


# ---- against a real server ----------------------------------------------------------------------
async def _info(js, stream: str, name: str):
    return await js.consumer_info(stream, name)


@pytest.fixture()
def own_nats(tmp_path):
    """A NATS server of this test's own: its stream takes the heartbeat subjects, which the
    session's shared server's TG_TELEMETRY may hold already (the full suite creates it)."""
    from trainguard.stack.embedded import EmbeddedServers

    with EmbeddedServers(auth=False, data_dir=tmp_path / "own") as srv:
        yield srv


async def test_ack_all_of_the_newest_acks_every_earlier(own_nats):
    from nats.js.api import AckPolicy, StreamConfig

    from trainguard.clients.bus import Bus

    bus = await Bus(own_nats.nats_url, "test-acks").connect()
    js = bus.nc.jetstream()
    stream = f"TGTEST_ACKS_{uuid.uuid4().hex[:8]}"
    topic = "tg.job.*.rank.*.hb"
    await js.add_stream(StreamConfig(name=stream, subjects=["tg.job.*.rank.*.hb"]))
    replica = uuid.uuid4().hex[:8]
    name = consumer_name("detector", replica, topic)
    try:
        got: list = []
        batch = BatchedAcks(every_s=60.0, every_n=10_000)  # acked at flush() only

        async def on_message(msg) -> None:
            got.append(msg)
            await batch.handled(msg)

        dc = await durable_subscribe(bus.nc, "detector", replica, topic, on_message,
                                     batched=True)
        assert dc is not None
        assert (await _info(js, stream, name)).config.ack_policy == AckPolicy.ALL
        for i in range(20):
            await bus.nc.publish(f"tg.job.j.rank.{i}.hb", b"x")
        await bus.flush()
        for _ in range(100):
            if len(got) == 20:
                break
            await asyncio.sleep(0.05)
        assert len(got) == 20
        assert (await _info(js, stream, name)).num_ack_pending == 20
        await batch.flush()  # one ack, of the newest
        assert batch.acks == 1
        for _ in range(50):
            info = await _info(js, stream, name)
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_ack_pending == 0 and info.ack_floor.stream_seq == 20
        await dc.unsubscribe()
    finally:
        await js.delete_stream(stream)
        await bus.close()

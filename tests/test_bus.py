"""The bus client against a real nats-server: delivery, dead-lettering, a bad message never
stops the subscription, and the threaded publisher never blocks when the bus is gone."""
import asyncio
import time

import msgpack

from trainguard import schemas
from trainguard.clients.bus import Bus
from trainguard.clients.threaded_bus import ThreadedBus


async def test_delivery_and_dead_letter(servers):
    got, dlq = [], []
    bus = await Bus(servers.nats_url, "testsvc").connect()
    raw = await Bus(servers.nats_url, "raw").connect()
    await bus.subscribe("tg.job.t1.log", lambda s, e: got.append(e))

    async def _dl(m):
        dlq.append(m)
    await raw.nc.subscribe("tg.dlq.testsvc", cb=_dl)
    await bus.flush()  # both subscriptions are registered at the server before anything is sent
    await raw.flush()
    await raw.nc.publish("tg.job.t1.log", b"garbage\xc1")
    await raw.nc.publish("tg.job.t1.log", msgpack.packb({"schema": "log.line", "v": 9}))
    await raw.publish("tg.job.t1.log", schemas.LogLine(job="t1", line="hello"))
    await raw.flush()
    for _ in range(250):
        if got and len(dlq) >= 2:
            break
        await asyncio.sleep(0.02)
    assert [e.line for e in got] == ["hello"]
    assert bus.stats.bad == {"malformed": 1, "bad_version": 1}
    assert {m.headers["Tg-Error-Kind"] for m in dlq} == {"malformed", "bad_version"}
    assert dlq[0].headers["Tg-Subject"] == "tg.job.t1.log"
    await bus.close()
    await raw.close()


async def test_handler_error_does_not_stop_subscription(servers):
    seen = []

    def handler(subject, ev):
        seen.append(ev.line)
        if ev.line == "boom":
            raise RuntimeError("handler bug")

    bus = await Bus(servers.nats_url, "svc2").connect()
    await bus.subscribe("tg.job.t2.log", handler)
    await bus.flush()
    for line in ("a", "boom", "b"):
        await bus.publish("tg.job.t2.log", schemas.LogLine(line=line))
    await bus.flush()
    for _ in range(250):
        if len(seen) == 3:
            break
        await asyncio.sleep(0.02)
    assert seen == ["a", "boom", "b"] and bus.stats.handler_errors == 1
    await bus.close()


def test_threaded_publish_never_blocks_without_server():
    tb = ThreadedBus("nats://127.0.0.1:9", "nobus", max_pending=100).start()
    t0 = time.perf_counter()
    for i in range(1000):
        tb.publish("tg.job.x.log", schemas.LogLine(line=str(i)))
    elapsed = time.perf_counter() - t0
    assert tb.stats.dropped >= 900  # bounded queue: newer messages dropped and counted
    assert elapsed < 5.0
    tb.close(timeout=0.2)


def test_threaded_round_trip(servers):
    got = []
    tb = ThreadedBus(servers.nats_url, "tb").start()
    tb.subscribe("tg.job.t3.log", lambda s, e: got.append(e.line))
    assert tb.wait_connected(5)
    tb.publish("tg.job.t3.log", schemas.LogLine(line="x"))
    tb.flush()
    deadline = time.time() + 5
    while not got and time.time() < deadline:
        time.sleep(0.01)
    assert got == ["x"]
    tb.close()


def test_threaded_unsubscribe_from_the_handler_ends_the_deliveries(servers):
    """The launcher's use: a wildcard subscription dropped from its own handler (on the bus
    thread) once it learned enough; a later message on the subject reaches nobody."""
    got = []
    tb = ThreadedBus(servers.nats_url, "tb-unsub").start()

    def handler(subject, ev):
        got.append(ev.line)
        tb.unsubscribe("tg.job.t4.rank.*.hb")
    tb.subscribe("tg.job.t4.rank.*.hb", handler)
    assert tb.wait_connected(5)
    tb.publish("tg.job.t4.rank.0.hb", schemas.LogLine(line="first"))
    tb.flush()
    deadline = time.time() + 5
    while not got and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the unsubscription reaches the server
    tb.publish("tg.job.t4.rank.1.hb", schemas.LogLine(line="second"))
    tb.flush()
    time.sleep(0.5)
    assert got == ["first"]
    tb.close()


def test_unreachable_server_says_why_and_what_to_do():
    """A refused connection names the refusal (not a bare timeout) and the way out; a service
    started against it exits with that one line instead of a traceback."""
    import os
    import socket
    import subprocess
    import sys

    import pytest

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"nats://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError) as err:
        asyncio.run(Bus(url, "t").connect(timeout=1.0))
    msg = str(err.value)
    assert "Connect call failed" in msg and "trainguard up" in msg and "TimeoutError" not in msg
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "trainguard.detector", "--nats-url", url, "--redis-url",
                        "redis://127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                       cwd=root)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"detector: cannot reach NATS at {url}")


async def test_late_subscriber_gets_the_last_stored_decision(servers):
    """A rank that subscribes after a decision was published (a spare still warming) learns it
    from JetStream: ``last_stored`` hands the newest stored message on the subject over."""
    pub = await Bus(servers.nats_url, "decider").connect()
    await pub.ensure_streams()
    for gen in (1, 2):
        await pub.publish("tg.job.late.decision", schemas.Decision(
            job="late", action="restart_workers", mode="action", execute=True, generation=gen,
            idempotency_key=f"k{gen}"))
    await pub.flush()
    await asyncio.sleep(0.2)  # stored by the stream
    got, nothing = [], []
    late = await Bus(servers.nats_url, "late-rank").connect()
    await late.subscribe("tg.job.late.decision", lambda s, e: got.append(e), last_stored=True)
    await late.subscribe("tg.job.quiet.decision", lambda s, e: nothing.append(e),
                         last_stored=True)
    assert [(d.generation, d.idempotency_key) for d in got] == [(2, "k2")]
    assert nothing == []
    # live messages still arrive after the replayed one
    await pub.publish("tg.job.late.decision", schemas.Decision(
        job="late", action="restart_workers", mode="action", execute=True, generation=3,
        idempotency_key="k3"))
    await pub.flush()
    for _ in range(100):
        if len(got) == 2:
            break
        await asyncio.sleep(0.02)
    assert [d.generation for d in got] == [2, 3]
    # a reconnect reads the stored decision again for a subscription still there (the handler
    # drops what it has seen), and forgets one unsubscribed since
    await late._read_last_stored()
    assert [d.generation for d in got] == [2, 3, 3] and nothing == []
    await late._last_stored_subs[0][2].unsubscribe()
    await late._read_last_stored()
    assert [d.generation for d in got] == [2, 3, 3]
    assert [s for s, _cb, _sub in late._last_stored_subs] == ["tg.job.quiet.decision"]
    await late.close()
    await pub.close()


async def test_ensure_streams_gives_an_existing_stream_the_subjects_it_lacks(servers):
    """An existing TG_TELEMETRY made without ``tg.node.*.launcher.*`` gets it
    at the next ``ensure_streams`` (an update of the existing stream, its messages kept), and
    the launchers' beats are stored from then on."""
    from trainguard.schemas import subjects

    admin = await Bus(servers.nats_url, "streams-admin").connect()
    await admin.ensure_streams()
    js = admin.nc.jetstream()
    cfg = (await js.stream_info("TG_TELEMETRY")).config
    cfg.subjects = ["tg.node.*.telemetry", "tg.node.*.heartbeat", "tg.job.*.rank.*.hb"]
    await js.update_stream(cfg)  # as another configuration made it
    agent = schemas.NodeHeartbeat(node="up1", role="agent")
    await admin.publish(subjects.node("up1", "heartbeat"), agent)
    await admin.flush()
    await asyncio.sleep(0.1)
    assert await admin.last_stored(subjects.launcher("up1", "upj")) is None
    await admin.ensure_streams()
    assert subjects.ALL_LAUNCHERS in (await js.stream_info("TG_TELEMETRY")).config.subjects
    beat = schemas.NodeHeartbeat(node="up1", job="upj", role="launcher")
    await admin.publish(subjects.launcher("up1", "upj"), beat)
    await admin.flush()
    await asyncio.sleep(0.1)
    for subject, sent in ((subjects.launcher("up1", "upj"), beat),
                          (subjects.node("up1", "heartbeat"), agent)):
        msg = await admin.last_stored(subject)
        assert msg is not None and schemas.decode(msg.data).event_id == sent.event_id, subject
    await admin.close()


def test_a_flush_waits_for_a_client_still_connecting():
    """A rank that fails in its first moments publishes its exception while its client is still
    connecting: ``flush`` (called at exit) gives it its timeout to connect and hands the message
    over, instead of returning at once and dropping it."""
    import subprocess

    from trainguard.stack.nats_server import nats_server_binary
    from trainguard.stack.process import free_port

    port = free_port("127.0.0.1")
    tb = ThreadedBus(f"nats://127.0.0.1:{port}", "early-rank")
    tb.start()
    server = None
    try:
        tb.publish("tg.job.early.log", schemas.LogLine(job="early", line="boom"))
        time.sleep(0.3)
        assert not tb.wait_connected(0.1)  # nothing listens yet
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tb.flush(timeout=15.0)
        assert tb.wait_connected(0.1) and tb._pending == 0  # handed to the server
        assert tb.bus.stats.dropped == 0
    finally:
        tb.close(timeout=2.0)
        if server is not None:
            server.kill()
            server.wait()

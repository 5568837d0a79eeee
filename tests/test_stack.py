"""The local stack with real processes: services healthy, a restarted remediator does not repeat
a decision, and `trainguard up` leaves no process behind after SIGTERM."""
import asyncio
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainguard.schemas import Verdict, subjects
from trainguard.clients.bus import Bus
from trainguard.stack.children import StackError
from trainguard.stack.local import Stack
from trainguard.stack.services import DEFAULT_SERVICES, SERVICE_SPECS, service_available
from trainguard.clients.store import StateStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _valkey_serves_tls() -> bool:
    """Whether a stack asking for TLS gets it from Valkey here (a binary built with TLS is
    installed: ``valkey_server.valkey_server_binary``)."""
    from trainguard.stack.valkey_server import has_tls, valkey_server_binary

    return has_tls(valkey_server_binary(tls=True))


def gone(pids, timeout=15.0):
    """Pids still alive (zombies count as gone) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


async def _decisions_for(nats_url, redis_url, job, verdict, wait_s=1.5):
    bus = await Bus(nats_url, "test-stack").connect()
    got = []
    await bus.subscribe(subjects.job(job, "decision"), lambda s, e: got.append(e))
    await bus.flush()
    await bus.publish(subjects.job(job, "verdict"), verdict)
    await bus.flush()
    await asyncio.sleep(wait_s)
    await bus.close()
    return got


def test_stack_remediator_restart_does_not_repeat(servers, redis_db, tmp_path):
    async def register():
        st = StateStore(redis_db)
        await st.register_job("sj", mode="action", generation=0, world_size=2,
                              members=[{"rank": 0, "node": "a", "local_rank": 0},
                                       {"rank": 1, "node": "a", "local_rank": 1}])
        await st.close()
    asyncio.run(register())
    v = Verdict(job="sj", fault_class="crash", layer="unknown", action="restart_workers",
                culprit={"ranks": [1]}, generation=0)
    with Stack(servers.nats_url, redis_db, services=("remediator",), rendezvous=False,
               log_dir=tmp_path) as stack:
        first_pid = stack.procs["remediator"].pid
        assert stack.health("remediator")["ok"] is True
        got = asyncio.run(_decisions_for(stack.nats_url, stack.redis_url, "sj", v))
        assert [d.action for d in got] == ["restart_workers"]
        stack.restart_service("remediator")
        assert stack.procs["remediator"].pid != first_pid
        again = asyncio.run(_decisions_for(stack.nats_url, stack.redis_url, "sj", v))
        assert again == []
        assert stack.health("remediator")["counts"]["folded"] == 1
        pid = stack.procs["remediator"].pid
    assert gone([pid]) == []


def test_stack_start_failure_names_service_and_cleans_up(servers, tmp_path):
    # a Redis nobody listens on: the remediator exits at start; the error carries its log tail
    stack = Stack(servers.nats_url, "redis://127.0.0.1:9/0", services=("remediator",),
                  rendezvous=False, log_dir=tmp_path)
    with pytest.raises(StackError, match="remediator exited") as err:
        stack.start(timeout=30)
    assert "REDIS_URL" in str(err.value) or "Redis" in str(err.value)
    assert gone([p.pid for p in stack.procs.values()]) == []


def test_a_stack_removes_the_log_folder_it_made_unless_kept(servers):
    """No ``log_dir``: the stack's own temporary folder goes at ``stop``; ``keep_logs`` keeps it,
    and so does a failed start, whose error names a log in it."""
    with Stack(servers.nats_url, servers.redis_url, services=(), rendezvous=False) as stack:
        made = stack.log_dir
        assert made.is_dir()
    assert not made.exists()
    with Stack(servers.nats_url, servers.redis_url, services=(), rendezvous=False,
               keep_logs=True) as stack:
        kept = stack.log_dir
    assert kept.is_dir()
    kept.rmdir()
    stack = Stack(servers.nats_url, "redis://127.0.0.1:9/0", services=("remediator",),
                  rendezvous=False)
    with pytest.raises(StackError, match="remediator exited") as err:
        stack.start(timeout=30)
    log = stack.log_dir / "remediator.log"
    assert str(log) in str(err.value) and log.stat().st_size > 0
    shutil.rmtree(stack.log_dir)


def test_trainguard_up_sigterm_leaves_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    env["PYTHONPATH"] = ROOT
    up = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "up", "--services",
                           "remediator", "--log-dir", str(tmp_path), "--timeout", "90",
                           "--ephemeral"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                          cwd=ROOT)
    try:
        line = up.stdout.readline()  # blocks until healthy (or the stack failed)
        assert line.startswith("export NATS_URL=tls://"), (line, up.stderr.read()[-3000:]
                                                           if up.poll() is not None else "")
        exports = dict(kv.split("=", 1) for kv in line.split()[1:])
        # the worker role's URLs and the CA they are verified with: what a launcher needs
        assert exports["NATS_URL"].startswith("tls://worker:")
        assert os.path.exists(exports["TG_TLS_CA"])
        assert exports["REDIS_URL"].startswith(
            "rediss://worker:" if _valkey_serves_tls() else "redis://worker:")
        assert "@127.0.0.1:" in exports["REDIS_URL"]
        children = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "nats-server" in names and "remediator" in names
        assert "valkey" in names or "redis-server" in names
        if importlib.util.find_spec("trainguard.rendezvous.store") is not None:
            import socket

            from trainguard.rendezvous.endpoint import parse_endpoint

            # the gate serves TLS with the stack's certificate: its token never goes in clear
            assert exports["TG_RDZV_ENDPOINT"].startswith("tls://127.0.0.1:")
            socket.create_connection(parse_endpoint(exports["TG_RDZV_ENDPOINT"]),
                                     timeout=2).close()

        async def health():
            bus = await Bus(exports["NATS_URL"], "probe", tls_ca=exports["TG_TLS_CA"]).connect()
            body = await bus.request("tg.svc.remediator.health", timeout=2)
            await bus.close()
            return body
        assert b'"ok": true' in asyncio.run(health())

        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        assert gone([c.pid for c in children]) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


async def _crash_chain(nats_url, redis_url):
    """Heartbeats of 4 ranks, then rank 1 is SIGKILLed: the detector, attributor and remediator
    processes must turn that into one restart decision for rank 1."""
    from trainguard.schemas import RankHeartbeat, WorkerExited
    members = [{"rank": r, "node": f"node-{'ab'[r // 2]}", "local_rank": r % 2}
               for r in range(4)]
    st = StateStore(redis_url)
    await st.register_job("chain", mode="action", generation=0, world_size=4, min_world_size=2,
                          retry_budget=5, members=members, nnodes=2, nproc_per_node=2)
    bus = await Bus(nats_url, "test-chain").connect()
    got = []
    await bus.subscribe(subjects.job("chain", "decision"), lambda s, e: got.append(e))
    await bus.flush()
    for step in range(10):
        for m in members:
            await bus.publish(subjects.rank_hb("chain", m["rank"]), RankHeartbeat(
                job="chain", rank=m["rank"], node=m["node"], local_rank=m["local_rank"],
                world_size=4, step=step, step_time_s=0.1, progress_ts=time.time_ns()))
        await asyncio.sleep(0.1)
    await bus.publish(subjects.job("chain", "worker"), WorkerExited(
        job="chain", rank=1, node="node-a", local_rank=1, signal=9))
    await bus.flush()
    for _ in range(100):
        if got:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    trail = await st.audit_trail("chain")
    await bus.close()
    await st.close()
    return got, trail


@pytest.mark.skipif(not all(service_available(s) for s in DEFAULT_SERVICES),
                    reason="not every service package is installed yet")
def test_full_default_stack(tmp_path, monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    # a log directory reused from an earlier run: its store's address must not be taken
    (tmp_path / "rendezvous.log").write_text("ready 127.0.0.1:9\n")
    with Stack(nats_url="", redis_url="", agent_nodes=("node-a", "node-b"),
               log_dir=tmp_path) as stack:
        names = stack.service_names()
        assert names == ["agent-node-a", "agent-node-b", "detector", "attributor", "remediator",
                         "checkpoint_validator"]
        for name in names:
            assert stack.health(name)["ok"] is True, name
        pids = [p.pid for p in stack.procs.values()]
        pids += [s.proc.pid for s in stack._servers.servers]
        assert stack.rdzv_endpoint and stack.rdzv_endpoint != "127.0.0.1:9"
        from trainguard.rendezvous.store import connect_store

        connect_store(stack.rdzv_endpoint, timeout_s=5).set("probe", "1")
        decisions, trail = asyncio.run(_crash_chain(stack.nats_url, stack.redis_url))
        assert [(d.action, d.ranks, d.generation, d.execute) for d in decisions] == [
            ("restart_workers", [1], 1, True)], decisions
        assert trail[0]["type"] == "decision" and trail[0]["decision_id"] == decisions[0].event_id
    assert gone(pids) == []


CA_PATH = "/etc/trainguard/ca/ca.pem"  # where compose and Kubernetes mount the CA for clients


def test_compose_runs_every_service_against_its_servers():
    import yaml

    from trainguard.security.roles import ROLES
    with open(os.path.join(ROOT, "docker-compose.yml")) as fh:
        compose = yaml.safe_load(fh)
    svcs = compose["services"]
    # the servers run from the config the credentials service writes (users, JetStream, TLS)
    cred = svcs["credentials"]
    assert cred["command"][:4] == ["python", "-m", "trainguard.stack.deploy", "server-config"]
    assert "--no-tls" not in cred["command"]
    assert cred["command"][cred["command"].index("--ca-dir") + 1] == "/ca"
    assert set(cred["volumes"]) == {"tg-secrets:/secrets", "tg-ca:/ca"}
    for role in ROLES:  # server-config refuses to write anything without every role's password
        assert f"TG_{role.upper()}_PASSWORD" in cred["environment"], role
    assert svcs["nats"]["command"] == ["-c", "/secrets/nats.conf"]
    vk = svcs["valkey"]["command"]
    assert "valkey" in svcs["valkey"]["image"] and "--aclfile" in vk
    flags = dict(zip(vk[1::2], vk[2::2]))  # valkey-server --name value …
    assert flags["--port"] == "0" and flags["--tls-port"] == "6379"  # TLS only
    assert flags["--tls-cert-file"] == "/secrets/tls/server.pem"
    assert flags["--tls-key-file"] == "/secrets/tls/server.key"
    assert flags["--tls-ca-cert-file"] == "/secrets/tls/ca.pem"
    assert flags["--tls-auth-clients"] == "no"
    assert "--tls --cacert /secrets/tls/ca.pem" in svcs["valkey"]["healthcheck"]["test"][1]
    # the servers' secrets stay with the servers: a client mounts only the CA's volume
    for name, c in svcs.items():
        mounts = [v.split(":")[:2] for v in c.get("volumes", [])]
        if name in ("credentials", "rendezvous") or c.get("image", "").startswith(
                ("nats:", "valkey/")):  # the servers (the profile ha's replicated ones too)
            continue
        assert not any(src == "tg-secrets" for src, _ in mounts), name
    for name in [*DEFAULT_SERVICES, "streams"]:
        c = svcs[name]
        env = c["environment"]
        role = SERVICE_SPECS[name].role if name != "streams" else "admin"
        password = f"${{TG_{role.upper()}_PASSWORD:?"  # each service connects as its own role
        assert env["NATS_URL"].startswith(f"tls://{role}:{password}"), name
        assert env["NATS_URL"].endswith("@nats:4222")
        if name != "streams":
            assert c["command"][:3] == ["python", "-m", SERVICE_SPECS[name].module], name
            assert env["REDIS_URL"].startswith(f"rediss://{role}:{password}"), name
            assert env["REDIS_URL"].endswith("@valkey:6379/0")
            assert c["build"] == "." and set(c["depends_on"]) == {"nats", "valkey", "streams"}
        assert env["TG_TLS_CA"] == CA_PATH, name
        assert f"tg-ca:{os.path.dirname(CA_PATH)}:ro" in c["volumes"], name
    assert svcs["streams"]["command"][:3] == ["trainguard", "up", "--streams-only"]
    # the rendezvous store runs its token gate; the token is .env's, as the host launcher's
    rdzv = svcs["rendezvous"]
    assert rdzv["command"][:3] == ["python", "-m", "trainguard.rendezvous.store"]
    assert rdzv["environment"]["TG_RDZV_TOKEN"].startswith("${TG_RDZV_TOKEN:?")
    # it serves TLS with the servers' certificate, its key read as group 999 (the credentials
    # command's --key-group), read-only; it starts once the credentials are written
    flags = dict(zip(rdzv["command"][3::2], rdzv["command"][4::2]))
    assert flags["--tls-cert"] == "/secrets/tls/server.pem"
    assert flags["--tls-key"] == "/secrets/tls/server.key"
    assert "tg-secrets:/secrets:ro" in rdzv["volumes"]
    assert rdzv["group_add"] == [cred["command"][cred["command"].index("--key-group") + 1]]
    assert rdzv["depends_on"]["credentials"]["condition"] == "service_completed_successfully"
    assert not any("TG_RDZV_ENDPOINT" in (c.get("environment") or {}) for c in svcs.values())
    with open(os.path.join(ROOT, "docker-compose.yml")) as fh:
        head = fh.read().split("\nname:", 1)[0]
    for text in ("tls://worker:", "rediss://worker:", "TG_TLS_CA=", "TG_RDZV_ENDPOINT=tls://",
                 "docker compose cp nats:"
                 "/secrets/tls/ca.pem", "set -a; . ./.env"):  # the host's launcher: CA, token
        assert text in head, text
    assert os.path.exists(os.path.join(ROOT, "Dockerfile"))


def test_kubernetes_manifests_cover_every_service():
    import yaml
    docs = []

    def load(kdir: str) -> None:  # a resource is a file or a directory with its kustomization
        with open(os.path.join(kdir, "kustomization.yaml")) as fh:
            for f in yaml.safe_load(fh)["resources"]:
                path = os.path.join(kdir, f)
                if os.path.isdir(path):
                    load(path)
                    continue
                with open(path) as fh2:
                    docs.extend(d for d in yaml.safe_load_all(fh2) if d)
    load(os.path.join(ROOT, "deploy", "kubernetes"))
    workloads = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cfg = workloads[("ConfigMap", "trainguard-config")]["data"]
    assert "NATS_URL" not in cfg and "REDIS_URL" not in cfg  # no URL without a user
    assert cfg["TG_TLS_CA"] == CA_PATH  # every service has the config in its environment
    for name in DEFAULT_SERVICES:
        kind = "DaemonSet" if name == "agent" else "Deployment"
        d = workloads[(kind, name.replace("_", "-"))]
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["command"][:3] == ["python", "-m", SERVICE_SPECS[name].module]
        assert {"configMapRef": {"name": "trainguard-config"}} in c["envFrom"]
        role = SERVICE_SPECS[name].role  # each service connects as its own role
        env = {e["name"]: e for e in c["env"]}
        assert env["TG_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "trainguard-credentials", "key": f"TG_{role.upper()}_PASSWORD"}, name
        assert env["NATS_URL"]["value"].startswith(f"tls://{role}:$(TG_PASSWORD)@"), name
        assert env["REDIS_URL"]["value"].startswith(f"rediss://{role}:$(TG_PASSWORD)@"), name
    for server in ("nats", "valkey"):
        spec = workloads[("StatefulSet", server)]["spec"]["template"]["spec"]
        cmd = spec["initContainers"][0]["command"]
        assert cmd[:4] == ["python", "-m", "trainguard.stack.deploy", "server-config"]
        assert cmd[cmd.index("--tls-from") + 1] == "/tls"  # the one Secret: one CA for all


def test_slurm_example_is_valid_bash():
    path = os.path.join(ROOT, "deploy", "slurm", "train.sbatch")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    with open(path) as fh:
        assert "trainguard launch" in fh.read()


def test_embedded_servers_never_take_urls_from_the_environment(monkeypatch):
    """A NATS_URL/REDIS_URL left in the shell (`source tg.env`, a shared bus) must not receive
    the demo's injected faults or the tests' events: the embedded stack starts its own."""
    from trainguard.stack.embedded import EmbeddedServers

    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")
    with EmbeddedServers() as srv:
        nats, valkey = srv.servers
        assert srv.nats_url.endswith(f"@127.0.0.1:{nats.port}") and nats.port != 1
        assert valkey.port != 1 and f"@127.0.0.1:{valkey.port}/" in srv.redis_url

        async def _ping():
            bus = await Bus(srv.nats_url, "env-test").connect(timeout=5.0)
            await bus.close()
            st = StateStore(srv.redis_url)
            await st.ping()
            await st.close()

        asyncio.run(_ping())


def test_a_dead_embedded_server_is_reported():
    """`trainguard up` stops when the NATS it runs dies: ``Stack.dead_servers`` names it."""
    with Stack(services=(), rendezvous=False) as stack:
        assert stack.dead_servers() == []
        nats = next(s for s in stack._servers.servers if s.kind == "nats")
        nats.proc.kill()
        nats.proc.wait(10)
        (dead,) = stack.dead_servers()
        assert f"embedded nats server at {nats.address} exited" in dead
        assert "admin:" not in dead  # no credentials in messages


def test_slurm_example_makes_the_last_nodes_spares(tmp_path):
    """``TG_SPARE_NODES=1`` on 3 nodes: nodes 0 and 1 get node ranks of a 2-node job, node 2
    is a spare node (a stand-in ``srun`` runs the per-node command for each node id, a
    stand-in ``trainguard`` prints its arguments)."""
    path = os.path.join(ROOT, "deploy", "slurm", "train.sbatch")
    (tmp_path / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'for i in 0 1 2; do SLURM_NODEID=$i "$@"; done\n')
    (tmp_path / "trainguard").write_text('#!/bin/bash\necho "$@"\n')
    for f in ("srun", "trainguard"):
        (tmp_path / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NNODES": "3",
           "SLURM_JOB_ID": "7", "TG_SPARE_NODES": "1", "NPROC_PER_NODE": "2",
           "NATS_URL": "nats://x:1", "REDIS_URL": "redis://x:2", "TG_RDZV_ENDPOINT": "x:3"}
    out = subprocess.run(["bash", path, "train.py"], env=env, capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.splitlines()
    assert [ln.split(" --nnodes")[0] for ln in out] == [
        "launch --node-rank 0", "launch --node-rank 1", "launch --spare-node --spares 2"], out
    assert all("--nnodes 2 " in ln and ln.endswith(" train.py") for ln in out), out


def test_the_rendezvous_port_of_the_last_start_is_kept_while_free(tmp_path, capsys):
    """``rendezvous_store.store_port``: a port is chosen and kept in the data dir
    (``rdzv.port``); the next start takes it again while it is free, a new one (kept instead,
    and said) once another process holds it."""
    import socket

    from trainguard.stack.rendezvous_store import store_port

    first = store_port(tmp_path, "127.0.0.1", gated=False)
    assert (tmp_path / "rdzv.port").read_text().strip() == str(first)
    assert store_port(tmp_path, "127.0.0.1", gated=False) == first
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        second = store_port(tmp_path, "127.0.0.1", gated=False)
    assert second != first and (tmp_path / "rdzv.port").read_text().strip() == str(second)
    assert f"({first}) is taken" in capsys.readouterr().err


def test_a_restarted_stack_serves_the_rendezvous_store_at_the_same_endpoint(tmp_path):
    """A stack stopped and started on the same data dir prints the same ``TG_RDZV_ENDPOINT``
    (its TLS gate, token and port kept), so a launcher's line outlives the restart."""
    endpoints = []
    for _ in range(2):
        with Stack(services=(), data_dir=tmp_path / "state", log_dir=tmp_path / "logs",
                   tls=True, rdzv_token=True) as stack:
            endpoints.append((stack.rdzv_endpoint, stack.rdzv_token))
    assert endpoints[0] == endpoints[1] and endpoints[0][0].startswith("tls://127.0.0.1:")



@pytest.mark.timeout(300)
@pytest.mark.parametrize("exit_code", [0, 3], ids=["job-succeeds", "job-fails"])
def test_a_standalone_launch_leaves_no_temporary_folder(tmp_path, exit_code):
    """``trainguard launch --standalone`` runs on a stack of its own, whose logs and state go
    to temporary folders: when the job succeeds both are gone afterwards; when it fails the
    logs are kept (and said where), the state folder still goes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("NATS_URL", "REDIS_URL", "TG_RDZV_ENDPOINT")}
    env["TMPDIR"] = str(tmp)  # every temporary folder of the launch and its stack lands here
    p = subprocess.run([sys.executable, "-m", "trainguard.cli", "launch", "--standalone",
                        "--nproc-per-node", "1", "--no-python", "--job", f"tmp-{exit_code}",
                        "/bin/sh", "-c", f"echo rank $RANK; exit {exit_code}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert (p.returncode == 0) == (exit_code == 0), p.stderr[-3000:]
    (logs,) = re.findall(r"services' logs in (\S+?),", p.stderr)
    assert logs.startswith(str(tmp / "trainguard-up-")), p.stderr[-3000:]
    left = sorted(x.name for x in tmp.iterdir())
    # what stays by design: the host lock folder of standalone launches
    # (``launcher.standalone_lock``); the stack's state folder (its credentials) and its
    # servers' folders go; the ranks' own log folder (``trainguard-<job>-…``) goes when the
    # job succeeds and is kept, and named, when it fails
    ranks = [n for n in left if n.startswith(f"trainguard-tmp-{exit_code}-")]
    assert ranks == ([] if exit_code == 0 else ranks[:1]) and (exit_code == 0 or ranks), left
    if exit_code:
        assert f"the ranks' logs are kept in {tmp / ranks[0]}" in p.stderr, p.stderr[-3000:]
    assert not [n for n in left if (tmp / n / "credentials.json").exists()
                or n.startswith(("tg-nats-", "tg-valkey-"))], left
    assert [n for n in left if n.startswith("trainguard-up-")] == (
        [] if exit_code == 0 else [os.path.basename(logs)]), left
    if exit_code == 0:
        assert not os.path.exists(logs), left
    else:
        assert (Path(logs) / "detector.log").stat().st_size > 0, sorted(os.listdir(logs))
        assert f"logs are kept in {logs}" in p.stderr, p.stderr[-3000:]

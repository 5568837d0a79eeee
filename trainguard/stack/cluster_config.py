"""The replicated servers' files for docker compose (profile ``ha``) and the Kubernetes overlay
``deploy/kubernetes/ha``, written by ``python -m trainguard.stack.deploy server-config``:

* ``nats_cluster_config``: one nats-server's configuration in a 3-server JetStream cluster —
  the single server's (``trainguard.security.server_config.nats_config``: users, permissions,
  JetStream, client TLS) plus its own server name, the address it advertises to clients and a
  ``cluster`` block: routes to every peer (a route to itself is recognised and dropped by the
  server), a route user, and mutual TLS between the servers with the servers' certificate.
  Streams acknowledge a message once a majority of their copies stored it
  (``trainguard.clients.streams.STREAM_REPLICAS``): the cluster keeps every acknowledged
  message when one server is lost.
* ``valkey_node_config``: a Valkey node of a primary and its replicas (TLS only, the roles' ACL,
  a replica authenticates to the primary as ``admin`` over TLS, announces its host name);
  ``valkey_start_script``: the shell script a node starts with, which asks the sentinels for
  the current primary (after a failover it is no longer the first node) and replicates it.
* ``ha_sentinel_config``: a sentinel of those nodes over TLS, with the roles' users
  (``trainguard.stack.sentinel.sentinel_config``), host names resolved and announced (container
  and pod addresses change at every restart; their names do not); ``sentinel_start_script``:
  the shell script a sentinel starts with (a writable copy of that file, its own name announced).

Pure text builders: nothing here starts a server.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from trainguard.security.credentials import Credentials
from trainguard.stack.sentinel import sentinel_config

#: Port of the NATS routes between the servers of a cluster (nats-server's usual one).
ROUTE_PORT = 6222
#: Port of a sentinel (Valkey's usual one); it serves TLS only.
SENTINEL_PORT = 26379
#: Port of a Valkey node (TLS only).
VALKEY_PORT = 6379
#: The name the sentinels monitor the primary under: the ``<master name>`` of the clients'
#: ``rediss+sentinel://…/trainguard/0`` URL (``trainguard.clients.store_sentinel``).
MASTER_NAME = "trainguard"
#: The route user's name; its password is ``admin``'s (whoever has it may do anything anyway).
ROUTE_USER = "route"


@dataclass(frozen=True)
class Peer:
    """One server of a NATS cluster: the host name the others route to and clients are told
    of, its route port."""

    host: str
    route_port: int = ROUTE_PORT

    @property
    def route(self) -> str:
        return f"{self.host}:{self.route_port}"


def parse_peers(spec: str) -> list[Peer]:
    """``HOST[:ROUTE_PORT],HOST[:ROUTE_PORT],…`` (``server-config --cluster``) as peers.
    Raises ValueError for fewer than 2 servers, a host given twice, or a port that is not a
    number in 1–65535."""
    peers = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep:
            host, port = part, str(ROUTE_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster peer {part!r} is not HOST[:ROUTE_PORT]")
        peers.append(Peer(host, int(port)))
    hosts = [p.host for p in peers]
    if len(peers) < 2 or len(set(hosts)) != len(hosts):
        raise ValueError(f"a cluster needs 2 or more distinct hosts, not {spec!r}")
    return peers


def peer_named(peers: list[Peer], name: str) -> Peer:
    """The peer ``name`` stands for: its host, or the first label of its host (a pod's name,
    ``nats-1`` for ``nats-1.nats-cluster.trainguard.svc``). Raises ValueError when none is."""
    for p in peers:
        if p.host == name or p.host.split(".", 1)[0] == name:
            return p
    raise ValueError(f"{name!r} is none of the cluster's hosts {[p.host for p in peers]}")


def nats_cluster_config(base: str, me: Peer, peers: list[Peer], route_password: str | None,
                        client_port: int = 4222, tls: tuple[str, str, str] | None = None,
                        cluster_name: str = "trainguard") -> str:
    """``base`` (a ``nats_config`` text, JSON) for server ``me`` of ``peers``: server name
    ``me.host``, clients told of ``me.host:client_port``, a cluster ``cluster_name`` listening
    on ``me.route_port`` with routes to every peer, as ``ROUTE_USER`` with ``route_password``
    (None: routes without a user), and ``tls`` ``(cert, key, ca)``: routes over mutual TLS
    (nats-server verifies the peer's certificate both ways; its names must cover every host).
    Raises ValueError when ``me`` is not one of ``peers``."""
    if me not in peers:
        raise ValueError(f"{me.host} is not one of the cluster's peers")
    cfg = json.loads(base)
    cfg["server_name"] = me.host
    cfg["client_advertise"] = f"{me.host}:{client_port}"
    auth = f"{ROUTE_USER}:{route_password}@" if route_password else ""
    cluster: dict = {"name": cluster_name, "host": cfg.get("host", "0.0.0.0"),
                     "port": me.route_port,
                     "routes": [f"nats-route://{auth}{p.route}" for p in peers]}
    if route_password:
        cluster["authorization"] = {"user": ROUTE_USER, "password": route_password,
                                    "timeout": 2}
    if tls is not None:
        cluster["tls"] = {"cert_file": tls[0], "key_file": tls[1], "ca_file": tls[2],
                          "timeout": 5}
    cfg["cluster"] = cluster
    return json.dumps(cfg, indent=1) + "\n"


def valkey_node_config(creds: Credentials, acl_file: str, tls: tuple[str, str, str],
                       data_dir: str = "/data", port: int = VALKEY_PORT) -> str:
    """A Valkey node's configuration file: append-only file in ``data_dir``, the ACL file, TLS
    only on ``port`` with ``tls`` ``(cert, key, ca)`` (clients are not asked for
    certificates), replication over TLS as ``admin`` (what a replica, and a primary demoted by
    the sentinels, authenticates with) and host names allowed where addresses are."""
    cert, key, ca = tls
    return "\n".join([
        "appendonly yes", f"dir {data_dir}", f"aclfile {acl_file}",
        "port 0", f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
        f"tls-ca-cert-file {ca}", "tls-auth-clients no", "tls-replication yes",
        "masteruser admin", f"masterauth {creds.password('admin')}",
    ]) + "\n"


def ha_sentinel_config(creds: Credentials, primary: str, tls: tuple[str, str, str],
                       quorum: int = 2, down_after_ms: int = 5000,
                       failover_timeout_ms: int = 30000, data_dir: str = "/data",
                       port: int = SENTINEL_PORT, master_name: str = MASTER_NAME) -> str:
    """A sentinel's configuration: it monitors the Valkey node ``primary`` (a host name, port
    ``VALKEY_PORT``) under ``master_name`` with ``quorum`` (2 of 3 sentinels: a majority),
    thinks it down after ``down_after_ms`` without an answer, serves TLS only on ``port``, talks
    TLS to the nodes and the other sentinels, resolves and announces host names, and has the
    roles' users (every role may ask where the primary is: ``SENTINEL_READ_RULES``). A sentinel
    rewrites its file as it learns: start it from a writable copy."""
    cert, key, ca = tls
    base = sentinel_config("0.0.0.0", 0, data_dir, master_name, (primary, VALKEY_PORT), quorum,
                           down_after_ms, failover_timeout_ms, creds)
    # the monitor line names a host: it must be resolvable when the line is read
    head, monitor, rest = base.partition(f"sentinel monitor {master_name}")
    return "\n".join([
        head.rstrip("\n"), "sentinel resolve-hostnames yes", "sentinel announce-hostnames yes",
        f"tls-port {port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
        f"tls-ca-cert-file {ca}", "tls-auth-clients no", "tls-replication yes",
    ]) + "\n" + monitor + rest


def valkey_start_script(config: str, sentinels: list[str], default_primary: str,
                        ca: str, master_name: str = MASTER_NAME) -> str:
    """The shell script a Valkey node starts with (``sh SCRIPT``; env ``TG_VALKEY_SELF``: the
    host name this node is known by, else ``$(hostname).$TG_VALKEY_DOMAIN`` — a StatefulSet's pod
    under its headless Service —; ``TG_READER_PASSWORD``): it asks each of ``sentinels``
    (host names, port ``SENTINEL_PORT``, TLS with ``ca``) where the primary of ``master_name``
    is; the first answer that names another node is the primary it replicates; no answer (the
    first start: no sentinel runs yet) makes ``default_primary`` the primary and every other
    node its replica. Then it runs valkey-server with ``config`` through the image's entry
    point (which drops root for the ``valkey`` user), announcing ``TG_VALKEY_SELF``, with the
    script's own arguments after (more server options)."""
    q = shlex.quote
    hosts = " ".join(q(s) for s in sentinels)
    return f"""#!/bin/sh
# written by trainguard.stack.deploy server-config: start this Valkey node as the replica of the
# primary the sentinels name, or on a first start as the replica of {default_primary}
set -u
self="${{TG_VALKEY_SELF:-$(hostname)${{TG_VALKEY_DOMAIN:+.$TG_VALKEY_DOMAIN}}}}"
primary=""
for s in {hosts}; do
  primary=$(valkey-cli --tls --cacert {q(ca)} -h "$s" -p {SENTINEL_PORT} --user reader \\
            --pass "${{TG_READER_PASSWORD:-}}" --no-auth-warning \\
            sentinel get-master-addr-by-name {q(master_name)} 2>/dev/null | head -n 1)
  case "$primary" in *" "*|ERR*|NO*) primary="" ;; esac   # an error, not a host name
  [ -n "$primary" ] && break
done
[ -n "$primary" ] || primary={q(default_primary)}
replicaof=""
[ "$primary" = "$self" ] || replicaof="--replicaof $primary {VALKEY_PORT}"
# shellcheck disable=SC2086 # replicaof: two words, or none
exec docker-entrypoint.sh valkey-server {q(config)} --replica-announce-ip "$self" $replicaof "$@"
"""


def sentinel_start_script(config: str, data_dir: str = "/data") -> str:
    """The shell script a sentinel starts with (``sh SCRIPT``; env ``TG_SENTINEL_SELF``: the
    host name this sentinel is known by, else ``$(hostname).$TG_SENTINEL_DOMAIN``;
    ``TG_SENTINEL_DIR``: where its own file lives, default ``data_dir``): it copies ``config``
    there unless a copy is there already (a sentinel rewrites its file with what it learnt:
    the current primary, the other sentinels), sets ``sentinel announce-ip`` to its name (the
    other sentinels reach it by name, whatever address it has now), and runs the sentinel
    through the image's entry point, with the script's own arguments after."""
    q = shlex.quote
    return f"""#!/bin/sh
# written by trainguard.stack.deploy server-config: start this sentinel from its own copy of
# {config}, announcing its host name
set -eu
self="${{TG_SENTINEL_SELF:-$(hostname)${{TG_SENTINEL_DOMAIN:+.$TG_SENTINEL_DOMAIN}}}}"
conf="${{TG_SENTINEL_DIR:-{data_dir}}}/sentinel.conf"
[ -f "$conf" ] || cp {q(config)} "$conf"
grep -v '^sentinel announce-ip ' "$conf" > "$conf.new" || true
echo "sentinel announce-ip $self" >> "$conf.new"
mv "$conf.new" "$conf"
exec docker-entrypoint.sh valkey-server "$conf" --sentinel "$@"
"""

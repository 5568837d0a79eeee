"""The one state store of trainguard: job state, node state, checkpoint index, audit trail,
idempotency keys and cross-job fault history, in Redis/Valkey (redis-py asyncio).

``StateStore`` is the connection and the sum of one class per key family, each in its own
module of ``trainguard.clients`` with its keys' table; every key is under ``tg:``:

* ``store_jobs`` — ``tg:jobs``, ``tg:job:<job>``: the job record;
* ``store_runs`` — ``tg:job:<job>:launchers``: a run's launchers and the members they register;
* ``store_decisions`` — ``tg:idem:<key>``, ``tg:outbox:<job>``, ``tg:outboxes``,
  ``tg:audit:<job>``: idempotency claims, the decision outbox, the audit trail;
* ``store_nodes`` — ``tg:node:<node>``, ``tg:nodeattrs:<node>``, ``tg:hist:node:<node>``,
  ``tg:hist:sig:<signature>``: node status, attributes, cross-job fault history;
* ``store_reputation`` — ``tg:rep:<node>`` and its ``:evidence``, ``:keys``, ``:readmit``: a
  node's reputation across jobs;
* ``store_checkpoints`` — ``tg:ckpt:<job>``, ``tg:ckpt:<job>:<path>``: the checkpoint index;
* ``store_replicas`` — ``tg:members:<service>``: the services' replica leases;
* ``store_breaker`` — ``tg:breaker``, ``tg:breaker:observe``, ``tg:breaker:audit``: the fleet
  breaker.

Key names and the atomic Lua scripts are ``trainguard.clients.store_scripts``; a replicated
Valkey's client is ``trainguard.clients.store_sentinel``; what the services' reducers may call is
``trainguard.clients.store_protocol.ReducerStore``.
"""
from __future__ import annotations

import ssl
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trainguard.clients.errors import ServerUnreachable
from trainguard.clients.store_breaker import BreakerKeys
from trainguard.clients.store_checkpoints import CheckpointKeys
from trainguard.clients.store_decisions import DecisionKeys
from trainguard.clients.store_jobs import JobKeys
from trainguard.clients.store_nodes import NodeKeys
from trainguard.clients.store_replicas import ReplicaKeys
from trainguard.clients.store_reputation import ReputationKeys
from trainguard.clients.store_runs import RunKeys
from trainguard.clients.store_sentinel import close_client, is_sentinel_url, sentinel_client
from trainguard.schemas.job import JobRecord
from trainguard.security.credentials import redact
from trainguard.security.tls import ca_file


def tls_options(url: str, ca: str | None = None) -> dict[str, Any]:
    """redis-py options for ``url``: for ``rediss://``, verify the server's certificate and
    name against ``ca_file(ca)`` (``ca``, else env ``TG_TLS_CA``, else the system's trust
    store); nothing for ``redis://``."""
    if not url.startswith("rediss://"):
        return {}
    opts: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
                            "ssl_min_version": ssl.TLSVersion.TLSv1_2}
    if ca_file(ca):
        opts["ssl_ca_certs"] = ca_file(ca)
    return opts


class StateStore(JobKeys, RunKeys, DecisionKeys, NodeKeys, ReputationKeys, CheckpointKeys,
                 ReplicaKeys, BreakerKeys):
    """Async access to trainguard state in Redis/Valkey at ``url`` (``redis://host:port/db``, or
    ``redis://<role>:<password>@host:port/db`` for a role of ``trainguard.security.roles``;
    ``rediss://`` for TLS, verified as ``tls_options`` says; ``redis+sentinel://…/<master
    name>/<db>`` for a replicated Valkey, whose failovers its commands outlive:
    ``trainguard.clients.store_sentinel``)."""

    def __init__(self, url: str, tls_ca: str | None = None):
        self.url = url
        if is_sentinel_url(url):  # a replicated Valkey: the primary its sentinels name
            self.r = sentinel_client(url, tls_options(url.replace("+sentinel", "", 1), tls_ca),
                                     decode_responses=True, socket_connect_timeout=2.0,
                                     socket_timeout=5.0, health_check_interval=10)
        else:
            self.r = aioredis.Redis.from_url(url, decode_responses=True,
                                             socket_connect_timeout=2.0, socket_timeout=5.0,
                                             health_check_interval=10,
                                             **tls_options(url, tls_ca))
        self._records: dict[str, tuple[dict[str, str], JobRecord]] = {}

    async def ping(self) -> None:
        """Raises ``ServerUnreachable`` (a ConnectionError) with what to do when Redis/Valkey
        cannot be reached."""
        try:
            await self.r.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ServerUnreachable("Redis/Valkey", redact(self.url), str(exc),
                                    "REDIS_URL") from None

    async def close(self) -> None:
        await close_client(self.r)

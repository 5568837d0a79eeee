"""The state store's client for a replicated Valkey: a primary found through its sentinels, and
commands that outlive a failover.

URL form (what ``trainguard up --ha`` prints, and what ``StateStore`` and every service accept
as ``REDIS_URL``)::

    redis+sentinel://[<user>:<password>@]<host>:<port>[,<host>:<port>…]/<master name>[/<db>]
    rediss+sentinel://…     the same with TLS to the sentinels and the primary

The hosts are the sentinels'; ``<user>:<password>`` authenticates to the sentinels and to the
primary alike (``trainguard.stack.ha`` gives the sentinels the same users); ``<master name>``
is the name the sentinels monitor the primary under; ``<db>`` defaults to 0.

A command that fails because the primary went (the connection refused or reset, a timeout, the
old primary answering ``READONLY`` as a replica, no primary known to the sentinels) is sent once
more, after ``FailoverRetry`` saw a primary that answers as one (at most ``wait_s`` seconds): a
failover costs the callers time, not an error. A command the old primary ran but whose answer
was lost runs twice: the claims (``SET NX``), Lua compare-and-set scripts and ``HSET`` of whole
values make a second run change nothing. Replication is asynchronous: a write the primary
acknowledged in the last milliseconds before it died may be missing on the replica it promoted
(Valkey's ``WAIT`` would bound that; the store does not use it).
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("trainguard.clients.store")

SCHEMES = ("redis+sentinel", "rediss+sentinel")

#: How long a command waits for a new primary before its error is raised (seconds): a
#: sentinel failover is ``down-after-milliseconds`` + election + promotion (``embedded_ha``'s
#: defaults: about 2–3 s); 15 s leaves room for a slow one without a caller waiting forever.
FAILOVER_WAIT_S = 15.0

_URL = re.compile(r"^(?P<scheme>rediss?\+sentinel)://(?:(?P<user>[^:@/]*):(?P<pw>[^@/]*)@)?"
                  r"(?P<hosts>[^/@]+)/(?P<master>[^/]+)(?:/(?P<db>\d+))?/?$")


@dataclass(frozen=True)
class SentinelURL:
    """A parsed sentinel URL: ``sentinels`` as ``(host, port)``, the master's name, the
    database number, the user and password (None: none), TLS."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def is_sentinel_url(url: str) -> bool:
    """True when ``url`` names sentinels (``redis+sentinel://`` or ``rediss+sentinel://``)."""
    return url.split("://", 1)[0].lower() in SCHEMES


def parse(url: str) -> SentinelURL:
    """Parse a sentinel URL (module docstring). Raises ValueError saying what is wrong."""
    m = _URL.match(url.strip())
    if not m:
        raise ValueError("a sentinel URL is redis+sentinel://[user:password@]host:port[,host:"
                         "port…]/<master name>[/<db>]")
    hosts = []
    for part in m["hosts"].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"sentinel {part!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    return SentinelURL(tuple(hosts), unquote(m["master"]), int(m["db"] or 0),
                       unquote(m["user"]) if m["user"] else None,
                       unquote(m["pw"]) if m["pw"] is not None else None,
                       m["scheme"].startswith("rediss"))


class FollowingConnection(SentinelManagedConnection):
    """A connection to the primary that asks the sentinels where the primary is each time it
    connects. redis-py's own reconnects a dropped connection to the address it had (a command
    sent again after a failover went to the dead primary: ``Error 111 connecting``); only its
    first connect asked the sentinels."""

    async def connect_check_health(self, check_health: bool = True,
                                   retry_socket_connect: bool = True) -> None:
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health,
                                           retry_socket_connect=retry_socket_connect)


class FollowingSSLConnection(FollowingConnection, SSLConnection):
    """``FollowingConnection`` over TLS."""


class FailoverRetry(Retry):
    """redis-py's retry policy for a sentinel-managed client: on a connection error, a timeout,
    or ``READONLY``, wait until the sentinels name a primary that answers ``ROLE`` as one (a
    ``PING`` for a user that may not run ``ROLE``; at most ``wait_s`` seconds), then run the
    command once more; a second failure is raised.
    Shared by every connection of the client (a copy is this object)."""

    def __init__(self, sentinel: Sentinel, master: str, auth: dict[str, Any],
                 wait_s: float = FAILOVER_WAIT_S):
        super().__init__(NoBackoff(), 1, (RedisConnectionError, RedisTimeoutError,
                                          ReadOnlyError, OSError))
        self.sentinel, self.master, self.auth, self.wait_s = sentinel, master, auth, wait_s
        self._waiting: asyncio.Future | None = None
        #: failovers waited for (counted once per failed command)
        self.waits = 0

    def __deepcopy__(self, memo: dict) -> "FailoverRetry":
        return self  # redis-py copies the policy into each connection: one shared object

    async def primary_answers(self) -> tuple[str, int] | None:
        """The primary's address when the sentinels name one that answers as a primary."""
        try:
            host, port = await self.sentinel.discover_master(self.master)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return None
        r = aioredis.Redis(host=host, port=port, socket_connect_timeout=0.5, socket_timeout=0.5,
                           **self.auth)
        try:
            try:
                role = await r.execute_command("ROLE")
            except NoPermissionError:  # a role without ROLE (``trainguard.security.roles``): the
                await r.ping()  # sentinels' word that it is the primary, and it answers
                return host, port
            kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
            return (host, port) if kind == "master" else None
        except Exception:  # noqa: BLE001 - not up, not promoted yet
            return None
        finally:
            await r.aclose()

    async def wait_for_primary(self) -> bool:
        """Poll every ``POLL_S`` until a primary answers (True) or ``wait_s`` passed (False).
        The commands of one client that fail together share one wait (one poll at a time,
        not one per command)."""
        task = self._waiting
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            task = self._waiting = asyncio.ensure_future(self._poll())
        return await asyncio.shield(task)

    #: seconds between polls of the sentinels while waiting for a primary
    POLL_S = 0.2

    async def _poll(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while loop.time() < deadline:
            if await self.primary_answers() is not None:
                return True
            await asyncio.sleep(self.POLL_S)
        return False

    async def call_with_retry(self, do: Callable[[], Awaitable[Any]], fail: Callable[..., Any],
                              is_retryable: Callable[[Exception], bool] | None = None,
                              with_failure_count: bool = False) -> Any:
        for attempt in (1, 2):
            try:
                return await do()
            except self._supported_errors as error:
                res = fail(error, attempt) if with_failure_count else fail(error)
                if asyncio.iscoroutine(res):
                    await res
                if attempt == 2 or (is_retryable is not None and not is_retryable(error)):
                    raise
                self.waits += 1
                t0 = asyncio.get_running_loop().time()
                found = await self.wait_for_primary()
                log.warning("state store: %s: %s; %s after %.2f s", self.master,
                            f"{type(error).__name__}: {error}",
                            "a primary answers, sending again" if found else "no primary",
                            asyncio.get_running_loop().time() - t0)
                if not found:
                    raise
        raise AssertionError("unreachable")


def sentinel_client(url: str, tls_options: dict[str, Any] | None = None,
                    wait_s: float = FAILOVER_WAIT_S, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client of the primary the sentinels of ``url`` name (``master_for``), with
    ``FailoverRetry``; ``kwargs`` go to every connection (``decode_responses``, timeouts…),
    ``tls_options`` (``state.tls_options``) with ``ssl`` for a ``rediss+sentinel`` URL. Its
    sentinels' clients are closed by ``close_client``. Raises ValueError for a bad URL."""
    u = parse(url)
    auth = {k: v for k, v in (("username", u.username), ("password", u.password)) if v}
    tls = {"ssl": True, **(tls_options or {})} if u.tls else {}
    sentinel_kw = {"socket_connect_timeout": 0.5, "socket_timeout": 1.0, **auth, **tls}
    sentinel = Sentinel(list(u.sentinels), sentinel_kwargs=sentinel_kw)
    retry = FailoverRetry(sentinel, u.master, {**auth, **tls}, wait_s)
    conn_class = FollowingSSLConnection if u.tls else FollowingConnection
    client = sentinel.master_for(u.master, redis_class=aioredis.Redis, db=u.db, retry=retry,
                                 connection_class=conn_class, **auth,
                                 **(tls_options or {} if u.tls else {}), **kwargs)
    client.tg_sentinel = sentinel  # type: ignore[attr-defined]
    client.tg_retry = retry  # type: ignore[attr-defined]
    return client


async def close_client(client: aioredis.Redis) -> None:
    """Close ``client`` and, for a ``sentinel_client``, its sentinels' clients."""
    await client.aclose()
    sentinel = getattr(client, "tg_sentinel", None)
    if sentinel is not None:
        for s in sentinel.sentinels:
            await s.aclose()

"""A token in front of the rendezvous store.

torch's ``TCPStore`` has no authentication: anyone who reaches its port can read and write every
key of every job (and so join or break any job's rendezvous). trainguard puts a gate in front
of it and a relay beside each client, so that neither torch nor the training script changes:

* ``Gate`` (in ``python -m trainguard.rendezvous.store`` when ``TG_RDZV_TOKEN`` is set): the store
  listens on loopback only; the gate listens on the store's public address and, per connection,
  reads one preamble line ``TGRDZV1 <token>\\n`` (at most ``PREAMBLE_MAX`` bytes within
  ``PREAMBLE_TIMEOUT_S``), compares the token in constant time (``hmac.compare_digest``) and
  then relays bytes both ways to the store. A connection with no preamble, a wrong token or a
  slow one is closed and counted (``refused``) before it sends the store a byte.
* ``Relay`` (in ``trainguard launch``, and in ``rendezvous.connect_store`` of a rank started
  with the token itself): listens on ``127.0.0.1:<free port>``; every connection to it is
  opened to the gate with the preamble first. The launcher gives its ranks the relay as
  ``TG_RDZV_ENDPOINT`` / ``MASTER_ADDR:MASTER_PORT`` and not the token, so a rank's code (and
  torch's own ``env://`` store client) reaches the store without ever holding the secret.

Both run an asyncio loop in a daemon thread, with ``TCP_NODELAY`` on every socket (a store
request is a few small writes; Nagle would add tens of ms to each). The token is given by
``trainguard up`` (``TG_RDZV_TOKEN`` on its export line, kept in the data dir), or, for docker
compose and Kubernetes, by ``python -m trainguard.stack.deploy compose-env`` (``.env``, the Secret
``trainguard-credentials``); without one the store is open, as before (``python -m
trainguard.rendezvous.store`` by hand, a private stack).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import ssl
import threading
from typing import Callable

from trainguard.security.credentials import RDZV_TOKEN_ENV as TOKEN_ENV  # the variable carrying the store's token
from trainguard.security.credentials import rdzv_token as new_token  # a new token: 32 URL-safe characters (192 bits)

__all__ = ["TOKEN_ENV", "PREAMBLE", "PREAMBLE_MAX", "PREAMBLE_TIMEOUT_S", "CONNECT_TIMEOUT_S",
           "Gate", "Relay",
           "new_token", "preamble", "relay_for", "server_context"]

log = logging.getLogger("trainguard.rendezvous.gate")

#: The first bytes of every connection through the gate, then the token and a newline.
PREAMBLE = b"TGRDZV1 "
#: Longest preamble line the gate reads (bytes): a token is 32 URL-safe characters.
PREAMBLE_MAX = 256
#: Seconds a new connection has to send its preamble.
PREAMBLE_TIMEOUT_S = 5.0
_CHUNK = 65536


def preamble(token: str) -> bytes:
    """The line a client sends first: ``TGRDZV1 <token>\\n``. Raises ValueError for a token
    that is empty or holds whitespace."""
    if not token or any(c.isspace() for c in token):
        raise ValueError("a rendezvous token is a non-empty string without whitespace")
    return PREAMBLE + token.encode() + b"\n"


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - already closed
            pass


async def _splice(ar: asyncio.StreamReader, aw: asyncio.StreamWriter,
                  br: asyncio.StreamReader, bw: asyncio.StreamWriter) -> None:
    """Copy bytes both ways until either side closes, then close both."""
    one = asyncio.ensure_future(_pump(ar, bw))
    two = asyncio.ensure_future(_pump(br, aw))
    await asyncio.wait({one, two}, return_when=asyncio.FIRST_COMPLETED)
    for t in (one, two):
        t.cancel()
    for w in (aw, bw):
        try:
            w.close()
        except Exception:  # noqa: BLE001
            pass


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """The gate's TLS context (TLS 1.2 or later) from PEM ``cert`` and ``key`` files (the
    stack's server certificate, ``trainguard.security.tls``). Raises ``OSError`` / ``ssl.SSLError`` for
    files that are missing or not PEM."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


class _Server:
    """An asyncio TCP server in a daemon thread; ``start()`` returns once it listens
    (over TLS with ``ssl_ctx``)."""

    def __init__(self, host: str, port: int, ssl_ctx: ssl.SSLContext | None = None):
        self.host, self.port = host, port
        self.ssl_ctx = ssl_ctx
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def start(self, timeout_s: float = 10.0) -> "_Server":
        threading.Thread(target=self._run, name=type(self).__name__, daemon=True).start()
        if not self._ready.wait(timeout_s):
            raise OSError(f"{type(self).__name__} did not start listening in {timeout_s} s")
        if self._error is not None:
            raise OSError(f"{type(self).__name__} cannot listen on {self.host}:{self.port}: "
                          f"{self._error}")
        return self

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self._server = self.loop.run_until_complete(asyncio.start_server(
                self._handle, self.host, self.port, reuse_address=True, ssl=self.ssl_ctx,
                ssl_handshake_timeout=PREAMBLE_TIMEOUT_S if self.ssl_ctx else None))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        loop = self.loop
        if loop is None or not loop.is_running():
            return

        def _close() -> None:
            if self._server is not None:
                self._server.close()
            loop.stop()
        loop.call_soon_threadsafe(_close)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


class Gate(_Server):
    """Listens on ``host:port`` (0: a free port) and relays each connection that opens with
    ``preamble(token)`` to the store at ``127.0.0.1:store_port``. ``refused`` counts the
    connections closed for no or a wrong preamble; ``admitted`` the others. ``on_refused(peer,
    why)`` is called for each refusal (default: a warning per peer address, once). ``ssl_ctx``
    (``server_context``): TLS only — a client that does not complete a TLS handshake within
    ``PREAMBLE_TIMEOUT_S`` never reaches the preamble check."""

    def __init__(self, host: str, port: int, store_port: int, token: str,
                 on_refused: Callable[[str, str], None] | None = None,
                 ssl_ctx: ssl.SSLContext | None = None):
        super().__init__(host, port, ssl_ctx)
        self.store_port = store_port
        self._expected = preamble(token)
        self.refused = 0
        self.admitted = 0
        self._warned: set[str] = set()
        self.on_refused = on_refused or self._warn

    def _warn(self, peer: str, why: str) -> None:
        host = peer.rsplit(":", 1)[0]
        if host not in self._warned and len(self._warned) < 1000:
            self._warned.add(host)
            log.warning("rendezvous store: refused a connection from %s (%s); further "
                        "refusals from that address are counted, not logged", peer, why)

    async def _read_preamble(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes, str]:
        """``(line, rest, why)``: the first line (newline included), the bytes read after it,
        and why it is refused ("" when it is the expected one; "quiet" for a connection
        closed before it sent anything, a port probe)."""
        buf = b""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PREAMBLE_TIMEOUT_S
        while b"\n" not in buf:
            if len(buf) > PREAMBLE_MAX:
                return b"", b"", f"no preamble in its first {PREAMBLE_MAX} bytes"
            try:
                chunk = await asyncio.wait_for(reader.read(PREAMBLE_MAX + 1 - len(buf)),
                                               max(0.0, deadline - loop.time()))
            except (asyncio.TimeoutError, ConnectionError, OSError):
                return b"", b"", f"no preamble within {PREAMBLE_TIMEOUT_S:.0f} s"
            if not chunk:
                return b"", b"", "closed inside its preamble" if buf else "quiet"
            buf += chunk
            head = buf[:len(PREAMBLE)]
            if not PREAMBLE.startswith(head):  # a bare TCPStore client, or anything else
                return b"", b"", "no trainguard preamble"
        line, _, rest = buf.partition(b"\n")
        line += b"\n"
        if hmac.compare_digest(line, self._expected):
            return line, rest, ""
        return line, rest, "a wrong token" if line.startswith(PREAMBLE) else \
            "no trainguard preamble"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_s = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        _line, rest, why = await self._read_preamble(reader)
        if why:
            if why != "quiet":
                self.refused += 1
                self.on_refused(peer_s, why)
            writer.close()
            return
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.store_port)
        except OSError as exc:
            log.warning("rendezvous store: the gate cannot reach the store on port %d: %s",
                        self.store_port, exc)
            writer.close()
            return
        _nodelay(writer)
        _nodelay(sw)
        self.admitted += 1
        if rest:  # the client's first request, sent right behind its preamble
            sw.write(rest)
        await _splice(reader, writer, sr, sw)


#: Seconds a relay waits for one store to accept a connection before it tries the next (a
#: powered-off host answers no SYN: without a bound, a connect waits out the kernel's retries).
CONNECT_TIMEOUT_S = 2.0


class Relay(_Server):
    """Listens on ``127.0.0.1`` (a free port) and opens each connection to a store at
    ``remote``: ``host:port``, or ``tls://host:port`` (over TLS, the gate's certificate and name
    verified against ``ca``, else env ``TG_TLS_CA``), with ``preamble(token)`` first when
    ``token`` is set (a gate), nothing when it is "" (a store without one).

    ``remote`` may list standbys (``split_endpoints``: ``a:1,b:2``): each connection goes to the
    store in use (``current``), and when it does not accept within ``CONNECT_TIMEOUT_S``, to the
    next in order, which then stays in use (``failovers`` counts the moves; each is logged).
    Sticky, so a primary restarted empty is not taken back while the standby holds the job's
    keys. Raises ``ValueError`` for a malformed list, ``FileNotFoundError`` / ``ssl.SSLError``
    for a CA file that is missing or not PEM."""

    def __init__(self, remote: str, token: str, ca: str | None = None):
        super().__init__("127.0.0.1", 0)
        from trainguard.rendezvous.endpoint import is_tls, parse_endpoint, split_endpoints
        from trainguard.security.tls import client_context

        self.remotes = [parse_endpoint(e) for e in split_endpoints(remote)]
        self.current = 0
        self.failovers = 0
        self._preamble = preamble(token) if token else b""
        self._client_ssl = client_context(ca) if is_tls(remote) else None
        self._warned = False

    @property
    def remote(self) -> tuple[str, int]:
        """The store in use, ``(host, port)``."""
        return self.remotes[self.current]

    async def _connect(self, host: str, port: int):
        if self._client_ssl is not None:
            return await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=self._client_ssl, server_hostname=host), PREAMBLE_TIMEOUT_S)
        return await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)

    async def _open(self):
        """``(reader, writer)`` of a connection to the store in use, or else the next that
        accepts; raises the last store's error when none does."""
        n, start, last = len(self.remotes), self.current, None
        for i in range(n):
            idx = (start + i) % n
            try:
                conn = await self._connect(*self.remotes[idx])
            except (OSError, asyncio.TimeoutError) as exc:
                last = exc
                if isinstance(exc, ssl.SSLError) and not self._warned:
                    self._warned = True  # once: the client retries its connection
                    log.warning("rendezvous relay: TLS to %s:%d failed: %s (is TG_TLS_CA the "
                                "CA of the stack that printed the endpoint?)",
                                *self.remotes[idx], exc)
                continue
            if idx != self.current:
                log.warning("rendezvous relay: the store at %s:%d does not answer (%s); "
                            "using the standby at %s:%d from now on", *self.remotes[self.current],
                            last or "no answer", *self.remotes[idx])
                self.current = idx
                self.failovers += 1
            return conn
        raise last if last is not None else OSError("no rendezvous store")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            rr, rw = await self._open()
        except (OSError, asyncio.TimeoutError):
            writer.close()  # the client sees the store as unreachable, as without a relay
            return
        _nodelay(writer)
        _nodelay(rw)
        if self._preamble:
            rw.write(self._preamble)
        await _splice(reader, writer, rr, rw)


_relays: dict[tuple[str, str], Relay] = {}
_relays_lock = threading.Lock()


def relay_for(endpoint: str, token: str | None = None) -> str:
    """The endpoint a client of the store at ``endpoint`` connects to: ``endpoint`` itself
    for one store without a token (``token`` None: env ``TG_RDZV_TOKEN``), else that of this
    process's relay to it (started on first use, one per endpoint and token; to a ``tls://``
    endpoint over TLS; to the standbys of a list in turn, ``Relay``). Raises OSError when the
    relay cannot listen or its CA cannot be read, ValueError for a malformed endpoint or a
    ``tls://`` one without a token."""
    from trainguard.rendezvous.endpoint import is_tls, split_endpoints

    token = os.environ.get(TOKEN_ENV, "") if token is None else token
    several = len(split_endpoints(endpoint)) > 1
    if not token:
        if is_tls(endpoint):
            raise ValueError(f"the rendezvous store at {endpoint} serves TLS behind a token: "
                             f"set {TOKEN_ENV} (the line `trainguard up` printed carries it)")
        if not several:
            return endpoint
    with _relays_lock:
        relay = _relays.get((endpoint, token))
        if relay is None:
            relay = _relays[(endpoint, token)] = Relay(endpoint, token).start()
        return relay.endpoint

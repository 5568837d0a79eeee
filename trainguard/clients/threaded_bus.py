"""The bus client for synchronous code: a ``Bus`` on a background event-loop thread (the rank
runtime, the launcher).

``publish`` never blocks the caller: it hands the encoded bytes to the loop thread; when the bus
is slow or gone, at most ``max_pending`` messages wait and newer ones are dropped and counted
(``stats.dropped``). The connection is made, and remade, in the background, so a missing bus
never blocks training.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable

from trainguard import schemas
from trainguard.clients.bus import Bus, BusStats, Handler
from trainguard.clients.errors import ServerUnreachable
from trainguard.schemas import Event


class ThreadedBus:
    """A ``Bus`` on its own event-loop thread, for synchronous callers.

    ``start()`` returns at once; the connection is made (and remade) in the background, so a
    missing bus never blocks training. ``publish`` is non-blocking. ``subscribe`` handlers run on
    the bus thread and must be quick. ``call(coro_fn, timeout)`` runs a coroutine on that loop
    and waits for its result (used for state-store calls from sync code).
    """

    def __init__(self, url: str, name: str, max_pending: int = 10000,
                 dead_letters: str | None = None):
        self.bus = Bus(url, name, dead_letters=dead_letters)
        self.max_pending = max_pending
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"tg-bus-{name}", daemon=True)
        self._pending = 0
        self._lock = threading.Lock()
        self._connected = threading.Event()
        #: why the last connection attempt failed (None: none failed)
        self.error: ServerUnreachable | None = None
        self._subs: list[tuple[str, Handler, str, bool]] = []
        #: the nats-py subscriptions made, by subject (``unsubscribe``)
        self._live: dict[str, list[Any]] = {}

    @property
    def stats(self) -> BusStats:
        return self.bus.stats

    def start(self) -> "ThreadedBus":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._connect(), self.loop)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _connect(self) -> None:
        while True:
            try:
                await self.bus.connect(timeout=2.0)
                break
            except ConnectionError as exc:
                self.error = exc if isinstance(exc, ServerUnreachable) else None
                self.bus._log_once("threaded-connect", "%s", exc)
                await asyncio.sleep(0.5)
        for subject, handler, queue, last in self._subs:
            await self._subscribe(subject, handler, queue, last)
        self._connected.set()

    async def _subscribe(self, subject: str, handler: Handler, queue: str, last: bool) -> None:
        sub = await self.bus.subscribe(subject, handler, queue, last_stored=last)
        self._live.setdefault(subject, []).append(sub)

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the connection; False at once when the server refused
        the credentials (``error.refused``: no retry will connect), or at the timeout."""
        deadline = time.monotonic() + timeout
        while not self._connected.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or (self.error is not None and self.error.refused):
                return False
        return True

    def publish(self, subject: str, event: Event) -> None:
        """Queue ``event`` for publishing; never blocks. Dropped (and counted) when
        ``max_pending`` messages already wait."""
        data = schemas.encode(event)
        with self._lock:
            if self._pending >= self.max_pending or not self.loop.is_running():
                self.bus.stats.dropped += 1
                return
            self._pending += 1
        self.loop.call_soon_threadsafe(self._enqueue, subject, data)

    def _enqueue(self, subject: str, data: bytes) -> None:
        async def _send() -> None:
            try:
                if not self._connected.is_set():
                    await asyncio.wait_for(self._wait_conn(), 30.0)
                await self.bus.publish_raw(subject, data)
            except asyncio.TimeoutError:
                self.bus.stats.dropped += 1
            finally:
                with self._lock:
                    self._pending -= 1

        self.loop.create_task(_send())

    async def _wait_conn(self) -> None:
        while not self._connected.is_set():
            await asyncio.sleep(0.05)

    def subscribe(self, subject: str, handler: Handler, queue: str = "",
                  last_stored: bool = False) -> None:
        """Subscribe now if connected, else as soon as the connection is made.
        ``last_stored``: see ``Bus.subscribe``."""
        if self._connected.is_set():
            asyncio.run_coroutine_threadsafe(
                self._subscribe(subject, handler, queue, last_stored), self.loop).result(5.0)
        else:
            self._subs.append((subject, handler, queue, last_stored))

    def unsubscribe(self, subject: str) -> None:
        """Stop every subscription to ``subject`` (any thread, the bus thread included; never
        blocks): a handler may still see messages already on their way."""
        def _drop() -> None:
            self._subs = [e for e in self._subs if e[0] != subject]
            for sub in self._live.pop(subject, []):
                self.loop.create_task(sub.unsubscribe())
        self.loop.call_soon_threadsafe(_drop)

    def call(self, coro: Awaitable[Any], timeout: float = 5.0) -> Any:
        """Run ``coro`` on the bus loop; wait at most ``timeout`` seconds (TimeoutError)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def flush(self, timeout: float = 2.0) -> None:
        """Wait until queued messages are handed to the server (bounded by ``timeout``). A
        client still connecting with messages queued is given that time to connect first: a
        rank that fails in its first moments publishes its exception, then exits."""
        deadline = time.monotonic() + timeout
        if not self._connected.is_set() and not (self._pending and self.wait_connected(timeout)):
            return  # nothing can be handed over now; queued messages are dropped at close
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._connected.is_set():
            try:
                self.call(self.bus.flush(timeout), timeout + 0.5)
            except Exception:  # noqa: BLE001
                pass

    def close(self, timeout: float = 2.0) -> None:
        self.flush(timeout)
        if self.loop.is_running():
            if self._connected.is_set():
                try:
                    self.call(self.bus.close(), timeout)
                except Exception:  # noqa: BLE001
                    pass
            self.loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(timeout)

    def _shutdown(self) -> None:
        async def _drain() -> None:
            # cancel until none is left: a publish queued just before close() schedules its
            # task after a first sweep (left pending, it was reported at interpreter exit)
            while True:
                tasks = [t for t in asyncio.all_tasks(self.loop)
                         if t is not asyncio.current_task()]
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        self.loop.create_task(_drain())

"""The service that runs a reducer live (``trainguard.core.reducer``'s ``step``): subscribes to its
topics, steps every input one at a time, carries the effects out (publish, store and bus calls,
log lines), feeds replies back, probes the bus, and rebuilds a gained partition from the stream.
The reducer types and ``run_offline`` are ``trainguard.core.reducer``'s (pure: no I/O)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Collection, Generic, Sequence

from trainguard import schemas
from trainguard.schemas import Event

from trainguard.services import durable as consume

from trainguard.core import partitions as parts
from trainguard.services.membership import partition_key
from trainguard.core.reducer import (BusDown, BusUp, Call, Effect, Gained, Input, Log, Publish, Received, Released,
                      Reply, S, Tick)
from trainguard.services.base import Service, health_subject

__all__ = ["ReducerService"]

log = logging.getLogger("trainguard.core.reducer")


class ReducerService(Service, Generic[S]):
    """A ``Service`` whose logic is ``step``. Subclasses set ``name`` and ``topics`` (the
    subjects to subscribe) and implement ``initial_state`` and ``step``; ``targets`` adds
    call targets besides ``"state"``. Inputs are serialised through one lock (see the module
    docstring for the ordering)."""

    #: subjects this service consumes (NATS wildcards allowed)
    topics: Sequence[str] = ()
    partitioned = True
    #: seconds between pings of the bus; a ping unanswered for ``bus_probe_timeout_s`` is
    #: ``BusDown`` (1.5 s at most after the bus stops: before the shortest silence rule, the
    #: 3 s node timeout, can misread the outage as a lost node)
    bus_probe_s = 0.5
    bus_probe_timeout_s = 1.0

    def __init__(self, config=None):
        super().__init__(config)
        self.model: S = self.initial_state()
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self.effects_run = 0
        self.effect_errors = 0
        self.replayed_inputs = 0
        #: the last rebuild: seconds reading the streams, messages, seconds stepping them
        self.rebuild_stats: dict[str, Any] = {}
        self._replay_sem: asyncio.Semaphore | None = None
        self._probe: asyncio.Task | None = None
        self._down_since: float | None = None

    # ---- to implement -----------------------------------------------------------------------
    def initial_state(self) -> S:
        raise NotImplementedError

    def step(self, state: S, event: Input, now: float) -> tuple[S, list[Effect]]:
        raise NotImplementedError

    def in_flight(self, state: S) -> Collection[str]:
        """Event ids of the received inputs whose chain of effects has not completed in
        ``state`` (see the module docstring). Default: none (every message acked once
        stepped)."""
        return ()

    def unfinished(self) -> Collection[str]:
        return self.in_flight(self.model)

    def targets(self) -> dict[str, Any]:
        """Call targets by name; ``"state"`` is the state store."""
        return {"state": self.state, "bus": self.bus}

    def clock(self) -> float:
        return time.monotonic()

    def extra_stats(self) -> dict[str, Any]:
        return {"effects": self.effects_run, "effect_errors": self.effect_errors,
                "replayed": self.replayed_inputs, "last_rebuild": dict(self.rebuild_stats)}

    # ---- wiring -----------------------------------------------------------------------------
    def subscriptions(self):
        return [(t, self._on_message) for t in self.topics]

    async def _on_message(self, subject: str, ev: Event) -> None:
        await self.feed(Received(subject, ev, time.time_ns()))

    async def tick(self) -> None:
        await self.feed(Tick(time.time_ns()))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_bus())

    async def _probe_bus(self) -> None:
        """One ping of the bus (at most every ``bus_probe_s``): ``BusDown`` when it goes
        unanswered, ``BusUp`` when one is answered again."""
        t0 = time.monotonic()
        try:
            # a request to this replica's own health subject, not ``flush(timeout)``: a PONG
            # that arrives after that flush timed out kills nats-py's read loop (2.16)
            await self.bus.request(health_subject(self.name, self.config.replica),
                                   timeout=self.bus_probe_timeout_s)
            size = getattr(self.bus, "cluster_size", None)
            if getattr(self.bus, "nc", None) is not None and size is not None and size() > 1:
                # in a cluster the server may answer while a stream or consumer whose leader
                # died delivers nothing until another is elected (seconds): that silence is
                # the bus's too, not the ranks' (``bench/ha.py`` saw it read as a lost node)
                for dc in list(getattr(self, "_durables", ())):
                    await dc.js.consumer_info(dc.stream, dc.name,
                                              timeout=self.bus_probe_timeout_s)
            ok = True
        except Exception:  # noqa: BLE001 - timeout, not connected: the bus is not answering
            ok = False
        if not ok and self._down_since is None:
            self._down_since = t0
            await self.feed(BusDown(time.time_ns()))
        elif ok and self._down_since is not None:
            gap, self._down_since = time.monotonic() - self._down_since, None
            await self.feed(BusUp(gap, time.time_ns()))
        await asyncio.sleep(max(0.0, self.bus_probe_s - (time.monotonic() - t0)))

    async def feed(self, inp: Input) -> None:
        """Step ``inp`` and carry out its effects (and those of its replies)."""
        async with self._lock:
            await self._dispatch(inp)

    async def _dispatch(self, inp: Input, now: float | None = None) -> None:
        self.model, effects = self.step(self.model, inp, self.clock() if now is None else now)
        for eff in effects:
            await self._perform(eff)

    #: gained jobs above which a takeover reads each topic once for all of them (and keeps
    #: their messages) instead of once per job: one ephemeral consumer per (job, topic) costs a
    #: few milliseconds of round trips, one per topic reads the others' messages too
    bulk_replay_jobs = 8

    async def members_changed(self, gained: set[str], lost: set[str],
                              partitions: frozenset[int] = frozenset()) -> None:
        """Forget the lost jobs (``Released``); rebuild the gained jobs and stream partitions
        from the streams: the messages of their topics stored within their relevance
        (``consume.RELEVANCE``), stepped oldest first at the service time they arrived (``now``
        minus their age), then ``Gained`` for each job gained or found in a gained partition.
        Live messages already stepped by the replay are skipped (``Service.replayed``). Node
        keys are not replayed (every replica steps node events)."""
        jobs = sorted(k for k in gained if not k.startswith("node:"))
        async with self._lock:
            for key in sorted(lost):
                await self._dispatch(Released(key, time.time_ns()))
            found: set[str] = set()
            if jobs or partitions:
                found = await self._rebuild(jobs, partitions)
            for key in sorted(set(jobs) | found):
                await self._dispatch(Gained(key, time.time_ns()))

    #: short-lived replay consumers a takeover reads at once
    replay_concurrency = 16

    async def _replay_one(self, subject: str, since_ns: int,
                          filters: list[str] | None) -> list[tuple[Any, consume.Stored]]:
        if self._replay_sem is None:
            self._replay_sem = asyncio.Semaphore(self.replay_concurrency)
        assert self.bus.nc is not None
        async with self._replay_sem:
            return await consume.replay(self.bus.nc, subject, since_ns, filters=filters)

    async def _rebuild(self, jobs: list[str], partitions: frozenset[int] = frozenset()
                       ) -> set[str]:
        """Step again what the streams keep of ``jobs`` and of the stream ``partitions``
        (see ``members_changed``); returns the jobs whose messages it stepped. With
        partitioned streams short-lived consumers, one per (topic, partition), read exactly the
        gained partitions (at once); otherwise one per (job, topic), or one per topic for many
        jobs."""
        assert self.bus.nc is not None
        now_ns = time.time_ns()
        wanted = set(jobs)
        n = self.membership.partitions if partitions else 0
        got: list[tuple[int, str, Any, consume.Stored]] = []
        for topic in self.topics:
            tparts = topic.split(".")
            if len(tparts) < 3 or tparts[:2] != ["tg", "job"] or tparts[2] != "*":
                continue
            since = now_ns - int(min(consume.max_age_s(topic), 86400.0) * 1e9)
            reads: list[tuple[str, list[str] | None]]
            if n:  # one filter per partition: a multi-filter read is ~10x slower to serve
                reads = [(topic, [f]) for f in parts.stored_filters(topic, partitions, n)]
            elif len(jobs) > self.bulk_replay_jobs:
                reads = [(topic, None)]
            else:
                reads = [(".".join(["tg", "job", job] + tparts[3:]), None) for job in jobs]
            results = await asyncio.gather(
                *(self._replay_one(subject, since, filters) for subject, filters in reads),
                return_exceptions=True)
            for (subject, filters), res in zip(reads, results):
                if isinstance(res, BaseException):  # rebuild what can be read
                    log.warning("%s: replay of %s failed: %s", self.name,
                                ",".join(filters or [subject]), res)
                    continue
                for m, st in res:  # a partition read holds only what was gained
                    if n or partition_key(m.subject) in wanted:
                        got.append((st.stored_ns, m.subject, m.data, st))
        got.sort(key=lambda g: (g[0], g[3].seq))
        self.rebuild_stats = {"read_s": round(time.time_ns() / 1e9 - now_ns / 1e9, 4),
                              "messages": len(got)}
        t_step = time.monotonic()
        found: set[str] = set()
        for stored_ns, subject, data, st in got:
            pkey = partition_key(subject) or ""
            key = (st.stream, pkey)
            self.replayed[key] = max(self.replayed.get(key, 0), st.seq)
            found.add(pkey)
            try:
                ev = schemas.decode(data, subject)
            except schemas.DecodeError:
                continue
            self.replayed_inputs += 1
            await self._dispatch(Received(subject, ev, stored_ns), self.clock() - st.age_s)
        self.rebuild_stats["step_s"] = round(time.monotonic() - t_step, 4)
        self.known.update(found)
        return found

    async def _perform(self, eff: Effect) -> None:
        self.effects_run += 1
        if isinstance(eff, Publish) and eff.stored:
            call = Call("bus", "publish_stored", (eff.subject, eff.event), reply=eff.reply,
                        wait=False)
            task = asyncio.create_task(self._call_later(call))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        elif isinstance(eff, Publish):
            await self.bus.publish(eff.subject, eff.event, dedup=True)
        elif isinstance(eff, Log):
            logging.getLogger(f"trainguard.{self.name}").log(eff.level, "%s", eff.message)
        elif isinstance(eff, Call):
            if eff.wait:
                reply = await self._call(eff)
                if reply is not None:
                    await self._dispatch(reply)
            else:
                task = asyncio.create_task(self._call_later(eff))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        else:  # pragma: no cover - a reducer returned something that is not an effect
            raise TypeError(f"{self.name}: not an effect: {eff!r}")

    async def _call(self, eff: Call) -> Reply | None:
        target = self.targets().get(eff.target)
        try:
            if target is None:
                raise LookupError(f"no call target {eff.target!r}")
            res = getattr(target, eff.method)(*eff.args, **eff.kwargs)
            if asyncio.iscoroutine(res):
                res = await res
        except Exception as exc:  # noqa: BLE001 - a failed effect is an input, not a crash
            self.effect_errors += 1
            if eff.reply is None:
                log.warning("%s: %s.%s failed: %s: %s", self.name, eff.target, eff.method,
                            type(exc).__name__, exc)
                return None
            return Reply(eff.reply, None, f"{type(exc).__name__}: {exc}", time.time_ns())
        return None if eff.reply is None else Reply(eff.reply, res, None, time.time_ns())

    async def _call_later(self, eff: Call) -> None:
        reply = await self._call(eff)
        if reply is not None:
            await self.feed(reply)

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for background calls to finish (tests and shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await self.drain(2.0)
        await super().close()

"""The reducer base: effects carried out in order, replies fed back, failures as inputs.

A toy service counts rank heartbeats per job and writes the count to Valkey on every tenth; the
table test drives its ``step`` offline, the wiring test runs it against real servers."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from trainguard import schemas
from trainguard.clients.bus import Bus
from trainguard.core.reducer import Call, Publish, Received, Reply, Tick, run_offline, store
from trainguard.services.live_reducer import ReducerService
from trainguard.schemas import subjects
from trainguard.services.base import ServiceConfig


@dataclass(frozen=True)
class Counts:
    seen: dict = field(default_factory=dict)
    acked: tuple = ()
    errors: tuple = ()


def step(state: Counts, inp, now):
    if isinstance(inp, Received) and isinstance(inp.event, schemas.RankHeartbeat):
        job = inp.event.job
        n = state.seen.get(job, 0) + 1
        state = replace(state, seen={**state.seen, job: n})
        if n % 10 == 0:
            return state, [store("claim", f"toy:{job}:{n}", "toy", reply=("claimed", job, n))]
        return state, []
    if isinstance(inp, Reply) and inp.tag[0] == "claimed":
        _, job, n = inp.tag
        if inp.error:
            return replace(state, errors=state.errors + (inp.error,)), []
        if inp.value is not None:  # someone had it: nothing to announce
            return state, []
        return replace(state, acked=state.acked + (n,)), [Publish(
            subjects.job(job, "log"), schemas.LogLine(job=job, line=f"{n} heartbeats"))]
    return state, []


def hb(job="j", rank=0):
    return Received(subjects.rank_hb(job, rank),
                    schemas.RankHeartbeat(job=job, rank=rank, node="n"))


def test_offline_replies_come_back_before_the_next_input():
    claims = {}

    def answer(call: Call):
        assert call.target == "state" and call.method == "claim"
        return claims.setdefault(call.args[0], None) or claims.__setitem__(call.args[0], "x")

    inputs = [(float(i), hb()) for i in range(20)] + [(20.0, Tick())]
    state, effects = run_offline(step, Counts(), inputs, answer)
    assert state.seen == {"j": 20} and state.acked == (10, 20)
    kinds = [type(e).__name__ for e in effects]
    assert kinds == ["Call", "Publish", "Call", "Publish"]
    assert effects[1].event.line == "10 heartbeats"


def test_offline_a_failing_call_is_an_input_not_a_crash():
    def boom(call):
        raise ConnectionError("valkey gone")

    state, effects = run_offline(step, Counts(), [(0.0, hb())] * 10, boom)
    assert state.errors == ("ConnectionError: valkey gone",) and state.acked == ()
    assert not any(isinstance(e, Publish) for e in effects)


class Toy(ReducerService[Counts]):
    name = "toy"
    topics = ("tg.job.*.rank.*.hb",)

    def initial_state(self):
        return Counts()

    def step(self, state, inp, now):
        return step(state, inp, now)


@pytest.mark.timeout(30)
def test_wiring_against_real_servers(servers, redis_db):
    async def main():
        svc = Toy(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db, node="t"))
        task = asyncio.create_task(svc.run())
        bus = await Bus(servers.nats_url, "t").connect()
        lines = []
        await bus.subscribe(subjects.job("j", "log"), lambda s, e: lines.append(e.line))
        for _ in range(100):
            if svc.state is not None and svc.bus.connected:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        for i in range(10):
            await bus.publish(subjects.rank_hb("j", 0),
                              schemas.RankHeartbeat(job="j", rank=0, node="n"))
        for _ in range(100):
            if lines:
                break
            await asyncio.sleep(0.02)
        assert lines == ["10 heartbeats"]
        assert await svc.state.claimed_by("toy:j:10") == "toy"
        svc.stop()
        await task
        await bus.close()

    asyncio.run(main())

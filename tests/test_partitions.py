"""Job partitions: the Python partition function is the server's (checked against a real
nats-server), stored subjects map back to the published ones, and the filters select exactly
the partitions asked for."""
from __future__ import annotations

import asyncio

import pytest

from trainguard.core import partitions as P
from trainguard.services.membership import Membership, assign_partitions, owner


# ---- pure ---------------------------------------------------------------------------------------
def test_fnv1a_32_known_vectors():
    # the FNV reference vectors (Go's hash/fnv New32a gives the same)
    assert P.fnv1a_32(b"") == 0x811C9DC5
    assert P.fnv1a_32(b"a") == 0xE40C292C
    assert P.fnv1a_32(b"foobar") == 0xBF9CF968


def test_partition_uses_the_subject_token_and_is_in_range():
    assert P.partition("a", 32) == 0xE40C292C % 32
    assert P.partition("a.b", 16) == P.partition("a%2Eb", 16)  # the token, dots escaped
    assert all(0 <= P.partition(f"job-{i}", 7) < 7 for i in range(500))
    with pytest.raises(ValueError):
        P.partition("a", 0)


def test_stored_and_original_subjects_round_trip():
    s = "tg.job.j1.rank.3.hb"
    assert P.stored(s, 5) == "tg.p.5.job.j1.rank.3.hb"
    assert P.original(P.stored(s, 5)) == s
    assert P.original("tg.node.n1.heartbeat") == "tg.node.n1.heartbeat"
    assert P.original("tg.p.x") == "tg.p.x"  # not a stored job subject: as it is


def test_filters_select_the_partitions_asked_for_and_never_overlap():
    from trainguard.services.durable import matches

    t = "tg.job.*.rank.*.hb"
    assert P.stored_filters(t, [3, 1, 3]) == ["tg.p.1.job.*.rank.*.hb", "tg.p.3.job.*.rank.*.hb"]
    assert P.stored_filters(t, range(4), n=4) == ["tg.p.*.job.*.rank.*.hb"]  # all: one filter
    [none] = P.stored_filters(t, [])
    assert not matches(none, P.stored("tg.job.j.rank.0.hb", 0))
    both = P.stored_filters("tg.job.j.ckpt")  # N unknown: either form
    assert both == ["tg.job.j.ckpt", "tg.p.*.job.j.ckpt"]
    assert P.stored_filters("tg.node.*.heartbeat", [1]) == ["tg.node.*.heartbeat"]
    assert P.stored_filters("tg.>") == ["tg.>"]


def test_transform_and_its_count_parse_back():
    src, dest = P.transform(24)
    assert src == "tg.job.*.>" and dest == "tg.p.{{partition(24,1)}}.job.{{wildcard(1)}}.>"
    assert P.partitions_of(dest) == 24
    assert P.partitions_of(None) == 0 and P.partitions_of("x.{{wildcard(1)}}") == 0
    assert P.configured("") == P.DEFAULT_PARTITIONS and P.configured("0") == 0
    with pytest.raises(ValueError):
        P.configured("-1")


def test_membership_by_partition_owns_whole_partitions():
    names = ["ra", "rb", "rc"]
    ms = {r: Membership("detector", r) for r in names}
    for m in ms.values():
        m.update(names)
        m.set_partitions(32)
    owned = {r: m.owned_partitions() for r, m in ms.items()}
    assert set().union(*owned.values()) == set(range(32))
    assert sum(len(o) for o in owned.values()) == 32  # each partition exactly once
    for job in (f"j{i}" for i in range(300)):
        p = P.partition(job, 32)
        [who] = [r for r in names if ms[r].owns(job)]
        assert p in owned[who] and who == assign_partitions(32, names)[p]
    # node keys stay hashed by node (every detector steps node events; one publishes)
    assert [r for r in names if ms[r].owns("node:n1")] == [owner("node:n1", names)]
    # a member leaving: its partitions go to the others, who keep (nearly all of) theirs
    ms["ra"].update(["ra", "rc"])
    ms["rc"].update(["ra", "rc"])
    now = {r: ms[r].owned_partitions() for r in ("ra", "rc")}
    assert now["ra"] | now["rc"] == set(range(32)) and not now["ra"] & now["rc"]
    kept = len(now["ra"] & owned["ra"]) + len(now["rc"] & owned["rc"])
    assert kept >= len(owned["ra"]) + len(owned["rc"]) - 2, (owned, now)


def test_partitions_are_balanced_where_plain_rendezvous_is_not():
    import collections

    for names in (["ra", "rb", "rc"], ["r0", "r1", "r2"], ["a", "b", "c", "d"], ["x"]):
        loads = collections.Counter(assign_partitions(32, names)).values()
        assert max(loads) - min(loads) <= 1, (names, loads)
    plain = collections.Counter(owner(f"partition:{p}", ["ra", "rb", "rc"]) for p in range(32))
    assert max(plain.values()) >= 15  # why: 17 of 32 on one member
    assert assign_partitions(32, []) == () and len(assign_partitions(5, ["a"] * 3)) == 5
    # more members than partitions: some own none, each partition has one owner
    assert sorted(collections.Counter(assign_partitions(2, "abcde")).values()) == [1, 1]


# ---- against a real server ----------------------------------------------------------------------
async def _stored_partitions(url: str, n: int, jobs: list[str]) -> dict[str, int]:
    """Publish one message per job on a scratch stream with ``transform(n)`` and read back the
    partition the server stored each under."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig, SubjectTransform

    from trainguard.clients.bus import Bus

    bus = await Bus(url, "test-partitions").connect()
    js = bus.nc.jetstream()
    name = f"TGTEST_PART_{n}"
    src, dest = P.transform(n)
    try:
        await js.delete_stream(name)
    except Exception:  # noqa: BLE001 - none left from before
        pass
    await js.add_stream(StreamConfig(name=name, subjects=["tg.job.*.ptest"],
                                     subject_transform=SubjectTransform(src=src, dest=dest)))
    try:
        for job in jobs:
            await js.publish(f"tg.job.{job}.ptest", b"x", stream=name)
        psub = await js.pull_subscribe("tg.p.>", stream=name, config=ConsumerConfig(
            ack_policy=AckPolicy.NONE))
        got: dict[str, int] = {}
        while len(got) < len(jobs):
            for m in await psub.fetch(500, timeout=5):
                parts = m.subject.split(".")
                assert P.original(m.subject) == f"tg.job.{parts[4]}.ptest"
                got[parts[4]] = int(parts[2])
        return got
    finally:
        await js.delete_stream(name)
        await bus.close()


@pytest.mark.parametrize("n", [1, 7, 32, 1000])
def test_partition_equals_the_servers(servers, n):
    jobs = [f"job-{i}" for i in range(300)] + [f"s{i}" for i in range(300)] + \
        ["a", "Z", "x%2Ey%2Ez", "k8s:ns:train-7", "_", "0", "very-long-" + "q" * 120]
    got = asyncio.run(_stored_partitions(servers.nats_url, n, jobs))
    assert got == {j: P.partition(j, n) for j in jobs}

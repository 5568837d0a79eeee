"""Hostile messages against every service of a running embedded stack: each stays up, answers
its health request and counts every message it was sent (decoded, dead-lettered or a handler
error). The messages are drawn by hypothesis (``bench/fuzz.py`` has the long version), plus the
cases that once broke a service: a job name past the subject line limit, a job token no subject
may carry, a Horovod stall line naming rank 30,000,000."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from trainguard import schemas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVICES = ("detector", "attributor", "remediator", "checkpoint_validator")


@pytest.fixture(scope="module")
def F():
    spec = importlib.util.spec_from_file_location("bench_fuzz", os.path.join(ROOT, "bench",
                                                                             "fuzz.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_fuzz"] = mod
    spec.loader.exec_module(mod)
    return mod


def _families(F):
    return st.sampled_from(F.FAMILIES)


def _payloads():
    """Raw bytes, not-a-map MessagePack, and maps with hostile envelopes and fields."""
    names = st.sampled_from(sorted(schemas.EVENT_TYPES))
    value = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                  st.binary(max_size=30)),
        lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c,
                                                                     max_size=4)),
        max_leaves=12)
    fields = st.sampled_from(["job", "node", "rank", "step", "world_size", "generation", "line",
                              "path", "evidence", "culprit", "detail", "ts", "fault_class",
                              "layer", "action", "idempotency_key", "decision_id", "xid",
                              "phase", "gpus", "members", "ranks", "trace", "event_id"])
    envelope = st.fixed_dictionaries(
        {"schema": st.one_of(names, st.text(max_size=12)),
         "v": st.one_of(st.just(1), st.just(1), st.integers(-3, 3), st.none())},
        optional={"job": st.sampled_from(["fz-t", "a.b", "", "x" * 300]),
                  "rank": st.integers(-2**63, 2**63 - 1)})
    maps = st.builds(lambda env, extra: msgpack.packb({**extra, **env}, use_bin_type=True),
                     envelope, st.dictionaries(fields, value, max_size=8))
    return st.one_of(st.binary(max_size=300), maps,
                     st.builds(lambda v: msgpack.packb(v, use_bin_type=True), value))


def _long_job(ev: schemas.Event) -> bytes:
    """``ev`` (job ``fz-t``) with a 5,000-character job name: every service that publishes
    about such a job makes a subject past the server's 4 KiB protocol line and is cut off."""
    return schemas.encode(ev).replace(b"\xa4fz-t", msgpack.packb("j" * 5000), 1)


def _regressions() -> list[tuple[str, bytes]]:
    """The messages that broke a service before (see the module docstring)."""
    t = "fz-t"
    stall = schemas.encode(schemas.LogLine(job=t, rank=1, line="[ready ranks: 0, 30000000]"))
    valid = schemas.encode(schemas.RankHeartbeat(job=t, rank=0, step=1, world_size=2))
    return [
        ("tg.job.fz-t.log", _long_job(schemas.LogLine(
            job=t, rank=1, stream="exception", line="RuntimeError: CUDA error: out of memory"))),
        ("tg.job.fz-t.verdict", _long_job(schemas.Verdict(
            job=t, fault_class="crash", layer="application",
            culprit=schemas.Culprit(ranks=[1])))),
        ("tg.job.fz-t.anomaly", _long_job(schemas.Anomaly(
            job=t, kind="crash", fault_class="crash", culprit=schemas.Culprit(ranks=[1])))),
        ("tg.job.fz-t.ckpt", _long_job(schemas.CheckpointSaved(
            job=t, path="/nonexistent/ckpt", step=1, world_size=1))),
        ("tg.job.fz-t.log", stall), ("tg.job.fz\u00e9.worker", valid),
        ("tg.job.fz-t.rank.0.hb", valid)]


def _draw(F, n: int) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_families(F), st.sampled_from(["fz-t", "fz-u"]), st.integers(-5, 2**40), _payloads())
    def collect(family, job, rank, data):
        _, tmpl, _ = family
        out.append((tmpl.format(job=job, node="fzn", rank=rank), data))

    collect()
    return out


@pytest.mark.timeout(120)
def test_every_service_survives_and_counts_hostile_messages(F):
    from trainguard.stack.local import Stack

    msgs = _draw(F, 250) + _regressions()
    with Stack(services=SERVICES, rendezvous=False) as stack:
        res = asyncio.run(F.flood(
            stack.nats_url, list(SERVICES),
            (F.Message("t", "t", s, d) for s, d in msgs), rate=2000, settle_s=20,
            progress=False))
        assert stack.dead() == []
        for name in SERVICES:
            acct = res["accounting"][name]
            assert acct["answered"], f"{name} did not answer its health request"
            assert acct["expected"] > 0
            assert acct["lost"] == 0, (name, acct)
            assert acct["dlq_missing"] == 0, (name, acct)
            assert acct["bad"] > 0, (name, acct)  # the hostile ones were dead-lettered
        # the detector still tracks the valid job after the flood
        assert stack.health("detector")["jobs"] >= 1


def test_the_bench_makes_a_valid_event_of_every_schema(F):
    """``bench/fuzz.py`` builds valid events of every type for its "another type on the
    subject" messages; a schema added later with a required field once broke the 100,000-message
    run (``CheckpointRequest.request_id``). Every one must decode back to its type."""
    for name, cls in sorted(schemas.EVENT_TYPES.items()):
        d = F._valid_dict(cls, "fz-t", "fzn", 0)
        ev = schemas.decode(msgpack.packb(d, use_bin_type=True))
        assert type(ev) is cls and ev.job == "fz-t", name
    assert sum(1 for _ in F.hostile_messages(3000, seed=1)) == 3000


def test_the_monitor_counts_a_message_id_again_past_the_streams_duplicate_window(F):
    """A stream keeps one message per ``Nats-Msg-Id`` within its duplicate window only: the same
    event published again later is stored and delivered again, and counted again."""
    from types import SimpleNamespace

    mon = F.Monitor()
    msg = SimpleNamespace(subject="tg.job.j.verdict", headers={"Nats-Msg-Id": "a" * 32})
    w = F.DUPLICATE_WINDOW_S
    assert [mon._duplicate(msg, now=t) for t in (0.0, w / 2, w + 1, w + 2, 2 * w + 2)] == \
        [False, True, False, True, False]
    plain = SimpleNamespace(subject="tg.job.j.verdict", headers=None)
    assert not mon._duplicate(plain, now=0.0) and not mon._duplicate(plain, now=1.0)

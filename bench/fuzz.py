"""Fuzz benchmark: hostile messages on every subject a service reads, against a live stack.

    python bench/fuzz.py [--messages 100000] [--seed 0] [--rate 3000] [--json PATH] [--quick]
                         [--no-real-fault]

Starts the embedded stack the demo uses (NATS + Valkey with auth, two agents, detector,
attributor, remediator, checkpoint validator), then publishes ``--messages`` hostile messages
as the ``admin`` role (the only role the server lets publish on every subject) across the
subjects each service consumes: rank heartbeats, worker, log, ckpt, node heartbeat (the
agents' and the launchers') / xid / telemetry / kernel, anomaly, verdict, action, recovery.
The messages (``hostile_messages``):

* random bytes, truncated MessagePack, MessagePack that is not a map;
* unknown schema names, wrong schema versions, fields of the wrong type;
* valid envelopes of the subject's event types with absurd values drawn by ``hypothesis``
  strategies: negative or 2^62 ranks and steps, NaN/±inf, empty / dotted / unicode / 100 KiB
  strings, unknown fields, lists of 50,000 items, dicts nested 200 deep;
* strings close to the server's payload limit (``trainguard.security.server_config.MAX_PAYLOAD``, 1 MiB: a
  larger message is refused by the server before any service sees it);
* a valid event of another type on the subject, and job/node tokens never seen before.

The agents are stopped while the messages are sent (they publish on the subjects the detector
reads; with them quiet the accounting is exact) and restarted for the real fault.

Figures:

* ``deaths`` — service processes that exited (must be 0);
* ``rss`` — each service's resident memory (bytes): ``start`` (the stack up, warmed with
  valid traffic), ``before`` (after the first 10 % of the hostile messages, the services caught
  up: the one-time high-water mark of reading 1 MiB messages is reached by then) and ``after``
  (the flood done, the services quiet for one ``Service.memory_trim_s``, the period at which
  they return freed heap memory to the OS; ``rss_after_linger``: ``--linger`` seconds later, once
  in-memory windows expired); ``growth`` = after / before − 1 (target ≤ 0.10: what
  keeps growing with the flood), ``growth_from_start`` = after / start − 1;
* ``accounting`` — per service: ``expected`` (every message the bench saw on the bus on a
  subject the service subscribes, the services' own follow-up events included, less
  ``refused_by_stream``: messages over the ``max_msg_size`` of the stream that keeps their
  subject, which the stream refuses and no durable consumer is given, and messages published
  again under a ``Nats-Msg-Id`` seen within the stream's duplicate window, which it keeps
  once), its health
  counters ``received`` / ``bad`` (dead-lettered, by kind) / ``handler_errors``, the dead
  letters seen on ``tg.dlq.<service>``; ``lost`` = expected − received (must be 0) and
  ``dlq_missing`` = Σ bad − dead letters seen (must be 0); ``consumed`` (how the durable
  consumers took them; ``again``: deliveries of a message still handled or held) and
  ``holding`` (messages held unacked at the end);
* ``real_fault`` — afterwards a short real 4-rank job (``trainguard.demo.harness``) with one
  SIGKILL, on the same stack: recovered or not, seconds to recovery.

``--quick``: 5,000 messages, no real fault unless ``--real-fault``.
"""
from __future__ import annotations

import argparse
import asyncio
import enum
import json
import math
import os
import random
import sys
import tempfile
import typing
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

from trainguard import schemas
from trainguard.schemas import subjects
from trainguard.security.server_config import MAX_PAYLOAD
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/: provenance
import provenance  # noqa: E402

#: (family, subject template, event types a producer sends there). ``{job}``, ``{node}`` and
#: ``{rank}`` are filled per message. Source: ``schemas.subjects`` and the services' topics.
FAMILIES: tuple[tuple[str, str, tuple[type, ...]], ...] = (
    ("rank_hb", "tg.job.{job}.rank.{rank}.hb", (schemas.RankHeartbeat,)),
    ("worker", "tg.job.{job}.worker", (schemas.WorkerStarted, schemas.WorkerExited)),
    ("log", "tg.job.{job}.log", (schemas.LogLine,)),
    ("ckpt", "tg.job.{job}.ckpt", (schemas.CheckpointSaved, schemas.CheckpointValidated,
                                   schemas.CheckpointInvalid, schemas.CheckpointSaveFailed)),
    ("node_hb", "tg.node.{node}.heartbeat", (schemas.NodeHeartbeat,)),
    ("launcher_hb", "tg.node.{node}.launcher.{job}", (schemas.NodeHeartbeat,)),
    ("xid", "tg.node.{node}.xid", (schemas.XidEvent,)),
    ("telemetry", "tg.node.{node}.telemetry", (schemas.NodeTelemetry,)),
    ("kernel", "tg.node.{node}.kernel", (schemas.LogLine,)),
    ("anomaly", "tg.job.{job}.anomaly", (schemas.Anomaly,)),
    ("verdict", "tg.job.{job}.verdict", (schemas.Verdict,)),
    ("action", "tg.job.{job}.action", (schemas.ActionResult,)),
    ("recovery", "tg.job.{job}.recovery", (schemas.TrainingResumed, schemas.RecoveryVerified)),
)

#: Message categories and their share of the flood (weights). ``huge`` is rare: each is ~1 MiB.
CATEGORIES: dict[str, float] = {
    "random_bytes": 0.12, "truncated": 0.10, "not_a_map": 0.05, "unknown_schema": 0.06,
    "bad_version": 0.06, "wrong_type": 0.10, "absurd": 0.38, "foreign_event": 0.06,
    "deep": 0.02, "big_list": 0.02, "big_string": 0.025, "huge": 0.005,
}

#: Jobs and nodes most messages name (the rest name a fresh random token each).
JOBS = tuple(f"fz-{c}" for c in "abcdefgh")
NODES = tuple(f"fzn{i}" for i in range(8))
FRESH_TOKEN_SHARE = 0.05


def service_topics() -> dict[str, tuple[str, ...]]:
    """The subjects each service subscribes, read from the services themselves."""
    from trainguard.attributor.service import Attributor
    from trainguard.detector.reducer import TOPICS
    from trainguard.checkpoint_validator.service import CheckpointValidator
    from trainguard.remediator.service import Remediator

    return {"detector": tuple(TOPICS), "attributor": tuple(Attributor.topics),
            "remediator": tuple(Remediator.topics),
            "checkpoint_validator": tuple(CheckpointValidator.topics)}


# ---- hostile values (hypothesis) ---------------------------------------------------------------
def _strategies():
    from hypothesis import strategies as st

    ints = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from(
        [-1, -2**31, 2**31, 2**62, -2**62, 2**63 - 1, -2**63, 0]))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324]))
    texts = st.one_of(st.text(max_size=40), st.sampled_from(
        ["", ".", "a.b", "*", ">", " ", "tg.job.x", "\x00", "é☃𝄞", "a" * 300,
         "../../etc/passwd", "/dev/zero", "/proc/self/mem"]))
    scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=40))
    nested = st.recursive(scalars, lambda c: st.one_of(
        st.lists(c, max_size=5), st.dictionaries(st.text(max_size=8), c, max_size=5)),
        max_leaves=20)
    return {"int": ints, "float": floats, "str": texts, "any": nested}


def _typed(cls_field, pick, rnd: random.Random) -> Any:
    """An absurd value that still has the field's type (so the event decodes), now and then
    one of any type (so validation must refuse it)."""
    ann = str(cls_field.annotation)
    if rnd.random() < 0.03:
        return pick("any")
    if ann.startswith("list"):
        item = "int" if "int" in ann else "str"
        return [pick(item) for _ in range(rnd.randint(0, 8))] if "GpuSample" not in ann \
            and "Member" not in ann else []
    if ann.startswith("dict"):
        item = "float" if "float" in ann else "int" if "int]" in ann else \
            "str" if "str]" in ann else "any"
        return {pick("str"): pick(item) for _ in range(rnd.randint(0, 4))}
    if "bool" in ann:
        return rnd.choice([True, False])
    if "int" in ann and "float" not in ann:
        return pick("int")
    if "float" in ann:
        return pick("float")
    if "Culprit" in ann:
        return {"ranks": [pick("int") for _ in range(3)], "nodes": [pick("str")], "gpus": []}
    return pick("str")


def hypothesis_pool(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` hostile scalar/nested values drawn by hypothesis (seeded), keyed by kind."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    strat = _strategies()
    pool: list[dict[str, Any]] = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries(strat))
    def collect(values: dict[str, Any]) -> None:
        pool.append(values)

    collect()
    return pool


@dataclass
class Message:
    family: str
    category: str
    subject: str
    data: bytes


def _valid_dict(cls: type, job: str, node: str, rank: int) -> dict[str, Any]:
    """A valid event of ``cls`` as a plain dict (required fields filled with plain values)."""
    req = {"line": "x", "generation": 0, "world_size": 4, "restored_step": 0, "resumed_step": 1,
           "path": "/tmp/none", "step": 1, "error": "e", "xid": 79, "kind": "crash",
           "fault_class": "crash", "layer": "application", "decision_id": "d",
           "idempotency_key": "k", "executor": "x", "action": "restart_workers", "ok": True,
           "cpu_percent": 1.0, "mem_used_bytes": 1, "mem_total_bytes": 2}
    plain = {str: "x", int: 0, float: 0.0, bool: False, list: [], dict: {}}
    kw: dict[str, Any] = {}
    for k, f in cls.model_fields.items():
        if not f.is_required() or k in ("job", "node", "rank"):
            continue
        # a field not in the table (a schema added later): a plain value of its type (an
        # enum's first member: slurm.node's and slurm.job's ``change``)
        ann = f.annotation
        if k in req:
            kw[k] = req[k]
        elif isinstance(ann, type) and issubclass(ann, enum.Enum):
            kw[k] = next(iter(ann)).value
        else:
            kw[k] = plain.get(typing.get_origin(ann) or ann, "x")
    return cls(job=job, node=node, rank=rank, **kw).to_dict()


def hostile_messages(n: int, seed: int = 0, pool_size: int = 2000) -> Iterator[Message]:
    """``n`` hostile messages over ``FAMILIES`` and ``CATEGORIES`` (deterministic in ``seed``)."""
    rnd = random.Random(seed)
    pool = hypothesis_pool(min(pool_size, max(50, n)), seed)

    def pick(kind: str) -> Any:
        return rnd.choice(pool)[kind]

    cats, weights = list(CATEGORIES), list(CATEGORIES.values())
    others = list(schemas.EVENT_TYPES.values())
    for _ in range(n):
        family, tmpl, types = rnd.choice(FAMILIES)
        fresh = rnd.random() < FRESH_TOKEN_SHARE
        job = f"fzj{rnd.getrandbits(40):x}" if fresh else rnd.choice(JOBS)
        node = f"fzn{rnd.getrandbits(40):x}" if fresh else rnd.choice(NODES)
        rank = rnd.choice([0, 1, 2, 3, -1, 2**62, rnd.randint(0, 10**6)])
        subject = tmpl.format(job=job, node=node, rank=rank)
        cls = rnd.choice(types)
        cat = rnd.choices(cats, weights)[0]
        ev = _valid_dict(cls, job, node, rank if rank < 2**31 else 0)
        if cat == "random_bytes":
            data = rnd.randbytes(rnd.choice([0, 1, 7, 64, 600, 4000]))
        elif cat == "truncated":
            full = msgpack.packb(ev, use_bin_type=True)
            data = full[:rnd.randint(0, len(full) - 1)]
        elif cat == "not_a_map":
            data = msgpack.packb(rnd.choice([[ev], 5, "event", None, True, 1.5, b"\x00"]))
        elif cat == "unknown_schema":
            ev["schema"] = rnd.choice([pick("str"), "rank.heartbeat2", "", None, 7, "decision "])
            data = msgpack.packb(ev, use_bin_type=True)
        elif cat == "bad_version":
            ev["v"] = rnd.choice([0, 2, -1, "1", 1.0001, None, 2**63, [1]])
            data = msgpack.packb(ev, use_bin_type=True)
        elif cat == "wrong_type":
            f = rnd.choice(list(cls.model_fields))
            alias = cls.model_fields[f].alias or f
            ev[alias] = rnd.choice([[1, 2], {"a": 1}, "x", b"\xff", pick("float"), None])
            data = msgpack.packb(ev, use_bin_type=True)
        elif cat == "absurd":
            for f, fi in cls.model_fields.items():
                if f in ("schema_", "v") or rnd.random() < 0.4:
                    continue
                ev[fi.alias or f] = _typed(fi, pick, rnd)
            ev[pick("str") or "extra"] = pick("any")  # an unknown field
            data = _pack(ev)
        elif cat == "foreign_event":
            data = msgpack.packb(_valid_dict(rnd.choice(others), job, node, 0), use_bin_type=True)
        elif cat == "deep":
            depth = rnd.choice([100, 200, 600, 5000])
            deep = b"".join(b"\x81\xa1d" if rnd.random() < 0.5 else b"\x91"
                            for _ in range(depth)) + b"\x01"
            keys = [k for k in ("detail", "trace", "evidence", "culprit", "line") if k in ev]
            ev[rnd.choice(keys or ["junk"])] = "__DEEP__"
            data = _pack(ev).replace(msgpack.packb("__DEEP__"), deep, 1)
        elif cat == "big_list":
            size = rnd.choice([10_000, 50_000])
            for k in ("evidence", "source_event_ids", "anomaly_ids", "reasons", "gpus",
                      "members", "ranks", "nodes", "clock_event_names"):
                if k in ev:
                    ev[k] = [rnd.choice([0, -1, 2**62, "x" * 8]) for _ in range(size)]
            ev["junk"] = list(range(size))
            data = _pack(ev)
        elif cat == "big_string":
            s = "é" * rnd.choice([10_000, 50_000]) if rnd.random() < 0.5 else \
                "x" * rnd.choice([100_000, 200_000])
            for k in ("line", "job", "node", "path", "raw", "message", "reason", "detail",
                      "error", "phase", "stream", "event_id"):
                if k in ev and rnd.random() < 0.5:
                    ev[k] = s
            ev.setdefault("line", s)
            data = _pack(ev)
        else:  # huge: one string filling the payload limit
            ev[rnd.choice(["line", "raw", "path", "job", "junk"])] = ""
            room = MAX_PAYLOAD - len(msgpack.packb(ev, use_bin_type=True)) - 64
            key = next(k for k, v in ev.items() if v == "")
            ev[key] = "y" * room
            data = msgpack.packb(ev, use_bin_type=True)
        if len(data) > MAX_PAYLOAD - 1024:
            data = data[:MAX_PAYLOAD - 1024]  # the server refuses more; cut is a hostile case too
        yield Message(family, cat, subject, data)


def _pack(obj: Any) -> bytes:
    """MessagePack of ``obj`` as a hostile producer would send it (ints past 64 bits wrap)."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb(_wrap_ints(obj), use_bin_type=True)


def _wrap_ints(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {_wrap_ints(k): _wrap_ints(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wrap_ints(v) for v in obj]
    if isinstance(obj, int) and not isinstance(obj, bool) and not -2**63 <= obj < 2**64:
        return obj & (2**63 - 1)
    return obj


# ---- the live run ------------------------------------------------------------------------------
def rss_of(pid: int) -> int:
    """Resident set size of ``pid`` (bytes)."""
    import psutil

    return psutil.Process(pid).memory_info().rss


#: Seconds within which a stream keeps one message per ``Nats-Msg-Id``: JetStream's default
#: ``duplicate_window`` (2 minutes), which ``Bus.ensure_streams`` leaves as it is.
DUPLICATE_WINDOW_S = 120.0


class Monitor:
    """Counts every message on ``tg.job.>``, ``tg.node.>`` and ``tg.dlq.>`` by subject, so the
    services' health counters can be compared with what the bus carried."""

    def __init__(self) -> None:
        self.subjects: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # over their stream's max_msg_size: never stored
        self.dlq: dict[str, int] = {}
        self.total = 0
        self.deduplicated = 0
        self._ids: dict[tuple[str, str], float] = {}  # (subject, id) -> monotonic s first seen

    def _duplicate(self, msg: Any, now: float | None = None) -> bool:
        """Whether the stream keeping ``msg.subject`` stores ``msg`` not again: its
        ``Nats-Msg-Id`` was seen on that subject within ``DUPLICATE_WINDOW_S`` (a reducer
        publishing the same event again two minutes later has it stored and delivered twice)."""
        mid = (msg.headers or {}).get("Nats-Msg-Id")
        if not mid or stream_max_msg_size(msg.subject) == float("inf"):
            return False
        now = time.monotonic() if now is None else now
        key = (msg.subject, mid)
        first = self._ids.get(key)
        if first is not None and now - first < DUPLICATE_WINDOW_S:
            return True
        self._ids[key] = now
        return False

    async def _on(self, msg: Any) -> None:
        self.total += 1
        if msg.subject.startswith("tg.dlq."):
            name = msg.subject[len("tg.dlq."):]
            self.dlq[name] = self.dlq.get(name, 0) + 1
        elif self._duplicate(msg):
            # published again under the same Nats-Msg-Id (an outbox sweep, a retried publish):
            # the stream keeps it once, so a durable consumer gets it once
            self.deduplicated += 1
        elif len(msg.data) > stream_max_msg_size(msg.subject):
            # the stream refuses it (trainguard.clients.streams.STREAM_LIMITS), so no durable consumer is
            # ever given it: bounded by design, counted apart from what a service must receive
            self.refused[msg.subject] = self.refused.get(msg.subject, 0) + 1
        else:
            self.subjects[msg.subject] = self.subjects.get(msg.subject, 0) + 1

    async def start(self, nc: Any) -> None:
        self.subs = [await nc.subscribe(s, cb=self._on, pending_msgs_limit=-1,
                                        pending_bytes_limit=-1)
                     for s in ("tg.job.>", "tg.node.>", "tg.dlq.>")]

    def expected(self, topics: tuple[str, ...]) -> int:
        return sum(n for s, n in self.subjects.items()
                   if any(subjects.matches(t, s) for t in topics))

    def refused_of(self, topics: tuple[str, ...]) -> int:
        return sum(n for s, n in self.refused.items()
                   if any(subjects.matches(t, s) for t in topics))


def stream_max_msg_size(subject: str) -> float:
    """The ``max_msg_size`` (bytes) of the stream that keeps ``subject``; inf when none does
    (a plain subscription gets any message the server's payload limit lets through)."""
    from trainguard.clients.streams import STREAM_LIMITS, STREAMS

    for name, subs, _age in STREAMS:
        if any(subjects.matches(p, subject) for p in subs):
            return STREAM_LIMITS[name].max_msg_size
    return float("inf")


async def _health(nc: Any, name: str, timeout: float = 2.0) -> dict[str, Any] | None:
    from trainguard.services.base import health_subject

    try:
        return json.loads((await nc.request(health_subject(name), b"", timeout=timeout)).data)
    except Exception:  # noqa: BLE001 - no answer is what the caller reports
        return None


def _counters(h: dict[str, Any] | None) -> dict[str, int]:
    s = (h or {}).get("stats", {})
    return {"received": int(s.get("received", 0)), "bad": int(sum(s.get("bad", {}).values())),
            "handler_errors": int(s.get("handler_errors", 0))}


async def _quiet(nc: Any, names: list[str], mon: Monitor, settle_s: float
                 ) -> dict[str, Any]:
    """Wait (at most ``settle_s``) until the services' counters and the monitor have not moved
    for 3 s (their follow-up events included); returns the last health answers."""
    last, still = None, 0
    deadline = time.monotonic() + settle_s
    health: dict[str, Any] = {}
    while time.monotonic() < deadline:
        health = {n: await _health(nc, n) for n in names}
        snap = (mon.total, tuple(tuple(_counters(h).values()) for h in health.values()))
        still = still + 1 if snap == last else 0
        last = snap
        if still >= 3:
            break
        await asyncio.sleep(1.0)
    return health


async def flood(nats_url: str, names: list[str], messages: Iterator[Message], rate: float,
                settle_s: float = 300.0, progress: bool = True, mark: int = 0,
                on_mark: Any = None) -> dict[str, Any]:
    """Publish ``messages`` at ``rate`` msg/s as the given (admin) URL while a ``Monitor``
    counts; then wait until counters and the monitor are quiet. Returns sent counts by family
    and category, the per-service accounting and the health answers."""
    import nats

    topics = service_topics()
    nc = await nats.connect(nats_url, name="fuzz-bench", pending_size=64 * 1024 * 1024,
                            max_reconnect_attempts=-1)
    mon = Monitor()
    await mon.start(nc)
    await nc.flush()
    before = {n: _counters(await _health(nc, n)) for n in names}
    sent: dict[str, int] = {}
    by_cat: dict[str, int] = {}
    refused = 0
    t0 = time.monotonic()
    i = 0
    for i, m in enumerate(messages, 1):
        try:
            await nc.publish(m.subject, m.data)
        except Exception:  # noqa: BLE001 - refused by the client (payload limit): not sent
            refused += 1
            continue
        sent[m.family] = sent.get(m.family, 0) + 1
        by_cat[m.category] = by_cat.get(m.category, 0) + 1
        if i == mark and on_mark is not None:
            await nc.flush(timeout=30)
            await _quiet(nc, names, mon, settle_s)
            await asyncio.to_thread(on_mark)
        if i % 500 == 0:
            await nc.flush(timeout=30)
            ahead = i / rate - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        if progress and i % 5000 == 0:
            print(f"  sent {i} ({i / (time.monotonic() - t0):.0f}/s)", flush=True)
    await nc.flush(timeout=30)
    send_s = time.monotonic() - t0
    health = await _quiet(nc, names, mon, settle_s)
    acct: dict[str, Any] = {}
    for n in names:
        if n not in topics:
            continue
        c = _counters(health.get(n))
        d = {k: c[k] - before[n][k] for k in c}
        exp = mon.expected(topics[n])
        dl = mon.dlq.get(n, 0)
        acct[n] = {"expected": exp, **d, "bad_by_kind": (health.get(n) or {}).get(
            "stats", {}).get("bad", {}), "dead_letters_seen": dl,
            "refused_by_stream": mon.refused_of(topics[n]),
            "lost": exp - d["received"], "dlq_missing": d["bad"] - dl,
            "answered": health.get(n) is not None,
            # how the durable consumers took them: redeliveries ("again"), messages still
            # held unacked because their chain is unfinished ("holding")
            "consumed": (health.get(n) or {}).get("stats", {}).get("consumed", {}),
            "holding": (health.get(n) or {}).get("stats", {}).get("holding")}
    for s in mon.subs:
        await s.unsubscribe()
    await nc.close()
    return {"sent": sum(sent.values()), "refused_by_client": refused,
            "deduplicated_by_stream": mon.deduplicated, "by_family": sent,
            "by_category": by_cat, "send_s": round(send_s, 1),
            "rate": round(sum(sent.values()) / send_s, 1) if send_s else None,
            "accounting": acct, "health": health}


def warm_up(nats_url: str, n: int = 2000) -> None:
    """Valid traffic first, so the RSS baseline includes what a working service has loaded."""
    import nats

    async def go() -> None:
        nc = await nats.connect(nats_url, name="fuzz-warm")
        for i in range(n):
            job = JOBS[i % len(JOBS)]
            ev = schemas.RankHeartbeat(job=job, rank=i % 4, step=i, world_size=4)
            await nc.publish(f"tg.job.{job}.rank.{i % 4}.hb", schemas.encode(ev))
            if i % 100 == 0:
                await nc.flush()
                await asyncio.sleep(0.02)
        await nc.flush()
        await nc.close()

    asyncio.run(go())


def real_fault(stack: Any, job: str = "fuzz-real", timeout_s: float = 240.0) -> dict[str, Any]:
    """A short real job on ``stack`` with one SIGKILL (``trainguard.demo.harness``)."""
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo

    cfg = DemoConfig(job=job, steps=160, faults=[{"kind": "sigkill", "rank": 1, "step": 60}],
                     recovery_timeout_s=90.0, quiet=True,
                     run_dir=tempfile.mkdtemp(prefix="tg-fuzz-real-"))
    t0 = time.monotonic()
    rep = Demo(cfg, stack=stack).run()
    f = rep["faults"][0] if rep["faults"] else {}
    rec_s = ((f["resumed_ns"] - f["injected_ns"]) / 1e9 if f.get("resumed_ns") and
             f.get("injected_ns") else None)
    return {"recovered": bool(f.get("recovered")), "recovery_s": rec_s,
            "decision": (f.get("decision") or {}).get("action"),
            "accuracy": rep.get("accuracy"), "wall_s": round(time.monotonic() - t0, 1)}


def run(a: argparse.Namespace) -> dict[str, Any]:
    from trainguard.services.base import Service
    from trainguard.stack.local import Stack

    run_dir = tempfile.mkdtemp(prefix="tg-fuzz-")
    stack = Stack(agent_nodes=("node0", "node1"), rendezvous=True,
                  log_dir=os.path.join(run_dir, "logs"), kernel_log_dir=run_dir)
    stack.start(timeout=120)
    out: dict[str, Any] = {"messages": a.messages, "seed": a.seed, "rate": a.rate,
                           "log_dir": str(stack.log_dir)}
    try:
        names = stack.service_names()
        agents = [n for n in names if n.startswith("agent-")]
        services = [n for n in names if n not in agents]
        warm_up(stack.nats_url)
        time.sleep(2.0)
        rss0 = {n: rss_of(stack.procs[n].pid) for n in services}
        for n in agents:  # they publish on the detector's subjects: quiet for exact counts
            stack.kill_service(n, sig=15)
        print(f"fuzz: {a.messages} hostile messages at ≤ {a.rate:.0f}/s to "
              f"{', '.join(services)}", flush=True)
        rss_mark: dict[str, int] = {}
        mark = max(1, a.messages // 10)

        def on_mark() -> None:
            rss_mark.update({n: rss_of(stack.procs[n].pid) for n in services
                             if stack.procs[n].poll() is None})
        res = asyncio.run(flood(stack.nats_url, services, hostile_messages(a.messages, a.seed),
                                a.rate, mark=mark, on_mark=on_mark))
        # one return of freed heap memory to the OS after the services went quiet (every
        # Service.memory_trim_s): "after" is what they keep, not garbage waiting for its trim
        time.sleep(Service.memory_trim_s + 1.0)
        dead = [n for n in services if stack.procs[n].poll() is not None]
        rss1 = {n: (rss_of(stack.procs[n].pid) if n not in dead else None) for n in services}
        out.update({k: v for k, v in res.items() if k != "health"})
        out["deaths"] = dead
        if a.linger > 0:  # windows expire (the attributor keeps an incident 2 × 60 s)
            time.sleep(a.linger)
            out["rss_after_linger"] = {n: rss_of(stack.procs[n].pid) for n in services
                                       if stack.procs[n].poll() is None}
            out["linger_s"] = a.linger
        out["rss_mark_after_messages"] = mark
        out["rss"] = {n: {"start": rss0[n], "before": rss_mark.get(n), "after": rss1[n],
                          "growth": (round(rss1[n] / rss_mark[n] - 1, 4)
                                     if rss1[n] and rss_mark.get(n) else None),
                          "growth_from_start": (round(rss1[n] / rss0[n] - 1, 4)
                                                if rss1[n] else None)}
                      for n in services}
        if a.real_fault and not dead:
            for n in agents:
                stack._spawn(n, stack.commands[n], stack.roles[n])
            stack.wait_healthy(agents, 60)
            out["real_fault"] = real_fault(stack)
            out["deaths_after_real_fault"] = stack.dead()
    finally:
        stack.stop()
    acct = out.get("accounting", {})
    growth = [r["growth"] for r in out.get("rss", {}).values() if r["growth"] is not None]
    out["ok"] = {
        "no_deaths": not out.get("deaths"),
        "rss_growth_le_10pct": bool(growth) and max(growth) <= 0.10,
        "all_counted": all(r["lost"] == 0 for r in acct.values()),
        "all_dead_lettered": all(r["dlq_missing"] == 0 for r in acct.values()),
        "real_fault_recovered": (out["real_fault"]["recovered"] if "real_fault" in out
                                 else None),
    }
    return out


def print_report(r: dict[str, Any]) -> None:
    print(f"\nsent {r.get('sent')} messages in {r.get('send_s')} s ({r.get('rate')}/s); "
          f"refused by the client: {r.get('refused_by_client')}")
    print("by category: " + ", ".join(f"{k} {v}" for k, v in sorted(
        r.get("by_category", {}).items())))
    print(f"\n{'service':22} {'expected':>9} {'received':>9} {'bad':>7} {'hdl_err':>7} "
          f"{'dlq':>7} {'lost':>5} {'rss MiB start→mark→end':>24} {'growth':>7}")
    for n, a in r.get("accounting", {}).items():
        m = r["rss"].get(n, {})
        rss = (f"{m['start'] / 2**20:.0f}→{(m['before'] or 0) / 2**20:.0f}→"
               f"{m['after'] / 2**20:.0f}" if m.get("after") else "dead")
        g = f"{m['growth'] * 100:+.1f}%" if m.get("growth") is not None else "-"
        print(f"{n:22} {a['expected']:9} {a['received']:9} {a['bad']:7} "
              f"{a['handler_errors']:7} {a['dead_letters_seen']:7} {a['lost']:5} {rss:>24} "
              f"{g:>7}")
    if r.get("rss_after_linger"):
        print(f"RSS {r['linger_s']:.0f} s after the flood (MiB): " + ", ".join(
            f"{n} {v / 2**20:.0f}" for n, v in r["rss_after_linger"].items()))
    print(f"\ndeaths: {r.get('deaths') or 'none'}")
    if "real_fault" in r:
        rf = r["real_fault"]
        print(f"real SIGKILL afterwards: recovered={rf['recovered']} in "
              f"{rf['recovery_s'] if rf['recovery_s'] is None else round(rf['recovery_s'], 2)} s"
              f" ({rf['decision']})")
    print("checks: " + ", ".join(f"{k}={v}" for k, v in r["ok"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=None, help="hostile messages (100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=3000.0, help="publish rate cap, msg/s")
    p.add_argument("--json", default="", metavar="PATH", help="write the figures there")
    p.add_argument("--quick", action="store_true", help="5,000 messages, no real fault")
    p.add_argument("--linger", type=float, default=None, metavar="S",
                   help="measure RSS again S seconds after the flood, once the services' "
                        "windows expired (130; 0 with --quick)")
    p.add_argument("--real-fault", dest="real_fault", action="store_true", default=None)
    p.add_argument("--no-real-fault", dest="real_fault", action="store_false")
    a = p.parse_args(argv)
    if a.messages is None:
        a.messages = 5000 if a.quick else 100_000
    if a.linger is None:
        a.linger = 0.0 if a.quick else 130.0
    if a.real_fault is None:
        a.real_fault = not a.quick
    if a.messages < 1 or a.rate <= 0:
        p.error("--messages and --rate must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    load0 = provenance.loadavg()
    r = run(a)
    r["provenance"] = provenance.record(load0)
    print_report(r)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=2, default=str)
        print(f"figures written to {a.json}")
    return 0 if all(v is not False for v in r["ok"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Per-family size bounds (``schemas.sizes``): a message past its family's bound is refused as
``too_large`` before it is unpacked, the largest valid event of each family still decodes, and
families without a row (checkpoint events, anomalies) take what the server lets through."""
import msgpack
import pytest

from trainguard import schemas
from trainguard.schemas import DecodeError, sizes

#: The envelope at its largest: names of 128 characters (a node name of 4-byte characters),
#: a W3C trace with a 512-character tracestate.
BIG = dict(job="j" * 128, node="\U0001d11e" * 128, rank=2**31 - 1,
           trace={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                  "tracestate": "k=" + "v" * 510})
LINE = "\U0001d11e" * (131072 // 4)  # max_str_len bytes of 4-byte characters

#: (subject, the largest valid event of its family)
LARGEST = [
    ("tg.job.j.rank.3.hb", schemas.RankHeartbeat(
        **BIG, phase="\U0001d11e" * schemas.worker.MAX_PHASE_CHARS, step=2**62, loss=1.5,
        step_time_s=0.1, progress_ts=2**62, collective_seq=2**62, collectives_completed=2**62,
        compute_s=0.1, world_size=2**31, local_rank=2**31, pid=2**31, generation=2**31)),
    ("tg.node.n.heartbeat", schemas.NodeHeartbeat(**BIG, role="launcher", seq=2**62,
                                                  pid=2**31, ending=True)),
    ("tg.job.j.worker", schemas.WorkerExited(**BIG, exit_code=-(2**31), signal=9,
                                            oom_killed=True, pid=2**31, generation=2**31)),
    ("tg.job.j.recovery", schemas.TrainingResumed(
        **BIG, generation=2**31, world_size=2**31, restored_step=2**62, resumed_step=2**62,
        decision_id="d" * 64, path="checkpoint", reason="no peer held the step: " + "x" * 4000)),
    ("tg.node.n.xid", schemas.XidEvent(**BIG, xid=79, raw=LINE, message=LINE)),
    ("tg.node.n.kernel", schemas.LogLine(**BIG, stream="kernel", source="agent", line=LINE)),
    ("tg.job.j.log", schemas.LogLine(**BIG, line=LINE, step=2**62)),
    ("tg.node.n.telemetry", schemas.NodeTelemetry(
        **BIG, cpu_percent=1.0, mem_used_bytes=1, mem_total_bytes=2,
        net_latency_s={f"peer-{i:05d}.cluster.example.com": 0.001 for i in range(4000)},
        gpus=[schemas.GpuSample(index=i, uuid="GPU-" + "f" * 36, name="NVIDIA H100 80GB HBM3",
                                nvlink_errors={f"{link}.{c}": 2**40 for link in range(18)
                                               for c in ("replay", "recovery", "crc_flit")})
              for i in range(8)])),
]


def test_every_family_has_its_largest_valid_event():
    assert sorted(s.pattern for s in sizes.SIZE_LIMITS) == sorted(
        next(r.pattern for r in sizes.SIZE_LIMITS if sizes.matches(r.pattern, subj))
        for subj, _ in LARGEST)


@pytest.mark.parametrize("subject,event", LARGEST, ids=[s for s, _ in LARGEST])
def test_largest_valid_event_of_each_family_decodes(subject, event):
    data = schemas.encode(event)
    assert len(data) <= sizes.max_bytes(subject)
    assert type(schemas.decode(data, subject)) is type(event)


@pytest.mark.parametrize("row", sizes.SIZE_LIMITS, ids=[r.pattern for r in sizes.SIZE_LIMITS])
def test_a_message_past_its_family_bound_is_too_large(row):
    subject = row.pattern.replace("*", "x1")
    ev = schemas.LogLine(job="x1", line="")
    data = msgpack.packb({**ev.to_dict(), "junk": "y" * row.max_bytes})
    assert len(data) > row.max_bytes
    with pytest.raises(DecodeError) as ei:
        schemas.decode(data, subject)
    assert ei.value.kind == "too_large"
    assert str(row.max_bytes) in str(ei.value)


@pytest.mark.parametrize("subject", ["tg.job.x.rank.0.hb", "tg.node.x.heartbeat",
                                     "tg.job.x.worker"])
def test_garbage_past_the_bound_is_refused_by_its_length(subject):
    """Not unpacked: random bytes past the bound are ``too_large``, not ``malformed``."""
    with pytest.raises(DecodeError) as ei:
        schemas.decode(b"\xc1" * 5000, subject)
    assert ei.value.kind == "too_large"


def test_families_without_a_bound_take_large_valid_events():
    """A checkpoint verdict listing a problem per shard of a 4,096-rank checkpoint (≈ 600 KB),
    an anomaly naming 16,384 ranks: no size row, the server's limit bounds them."""
    reasons = [f"shard {i:05d}: sha256 mismatch in /ckpt/step-000100/rank-{i:05d}.pt "
               f"(manifest says {'e' * 64})" for i in range(4096)]
    inv = schemas.CheckpointInvalid(job="j", path="/ckpt/step-000100", step=100, reasons=reasons)
    data = schemas.encode(inv)
    assert len(data) > 512 * 1024
    assert sizes.max_bytes("tg.job.j.ckpt") is None
    assert len(schemas.decode(data, "tg.job.j.ckpt").reasons) == 4096
    an = schemas.Anomaly(job="j", kind="hang", fault_class="hang",
                         evidence=[f"rank {r} silent" for r in range(16384)])
    assert isinstance(schemas.decode(schemas.encode(an), "tg.job.j.anomaly"), schemas.Anomaly)


def test_no_subject_no_family_bound():
    data = schemas.encode(schemas.RankHeartbeat(job="j", rank=0, phase="x" * 64))
    padded = msgpack.packb({**msgpack.unpackb(data), "junk": "y" * 8000})
    assert isinstance(schemas.decode(padded), schemas.RankHeartbeat)  # offline readers
    with pytest.raises(DecodeError):
        schemas.decode(padded, "tg.job.j.rank.0.hb")


@pytest.mark.parametrize("subject,want", [
    ("tg.job.a.rank.3.hb", 4096), ("tg.job.a.b.c.hb", None), ("tg.node.n.heartbeat", 4096),
    ("tg.job.a.anomaly", None), ("tg.job.a.ckpt", None), ("tg.job.a.log", 136 * 1024),
    ("tg.node.n.log", None), ("x", None), ("", None), (None, None)])
def test_max_bytes_lookup(subject, want):
    assert sizes.max_bytes(subject) == want


def test_a_table_whose_rows_one_lookup_cannot_tell_apart_is_refused():
    with pytest.raises(ValueError):
        sizes._index((sizes.SizeLimit("tg.job.*.hb", 1, "r"), sizes.SizeLimit("tg.job.*.hb", 2, "r")))
    with pytest.raises(ValueError):
        sizes._index((sizes.SizeLimit("tg.*.x", 1, "r"),))


@pytest.mark.parametrize("event_id,ok", [("a" * 32, True), ("e1", True), ("a" * 64, True),
                                         ("a" * 65, False), ("x" * 100_000, False)])
def test_an_event_id_is_bounded(event_id, ok):
    data = msgpack.packb({**schemas.RankHeartbeat(job="j", rank=0).to_dict(),
                          "event_id": event_id})
    if ok:
        assert schemas.decode(data, "tg.job.j.rank.0.hb").event_id == event_id
    else:
        with pytest.raises(DecodeError) as ei:
            schemas.decode(data)
        assert ei.value.kind == "invalid"


def test_only_the_w3c_trace_headers_are_kept():
    tp = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    ev = schemas.RankHeartbeat(job="j", rank=0).to_dict()
    ev["trace"] = {"traceparent": tp, "tracestate": "k=v", "junk": "x", "é☃": "y" * 10}
    assert schemas.decode(msgpack.packb(ev)).trace == {"traceparent": tp, "tracestate": "k=v"}
    ev["trace"] = {"traceparent": "z" * 600}
    got = schemas.decode(msgpack.packb(ev)).trace
    assert set(got) == {"traceparent"} and len(got["traceparent"]) == 55  # made anew

"""Record events from a real bus and play them back: exact bytes, original spacing, the CLI."""
import asyncio
import io
import os
import subprocess
import sys

import pytest

from trainguard import schemas
from trainguard.schemas import LogLine, Verdict, subjects
from trainguard.clients.bus import Bus
from trainguard.tools.recording import Record, read_recording
from trainguard.tools.replay import play, record, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def test_record_then_play_keeps_bytes_and_spacing(servers):
    out = io.StringIO()
    stop = asyncio.Event()
    task = asyncio.create_task(record(servers.nats_url, out, "tg.job.rp.>", stop=stop))
    pub = await Bus(servers.nats_url, "rp-pub").connect()
    await asyncio.sleep(0.3)  # recorder subscribed
    v = Verdict(job="rp", fault_class="crash", layer="unknown", action="restart_workers")
    sent = [schemas.encode(LogLine(job="rp", line="first")), schemas.encode(v), b"\xc1junk"]
    await pub.nc.publish(subjects.job("rp", "log"), sent[0])
    await pub.flush()
    await asyncio.sleep(0.5)
    await pub.nc.publish(subjects.job("rp", "verdict"), sent[1])
    await pub.nc.publish(subjects.job("rp", "log"), sent[2])
    await pub.nc.publish("tg.other.x", b"not recorded")
    await pub.flush()
    await asyncio.sleep(0.2)
    stop.set()
    assert await task == 3
    recs = list(read_recording(io.StringIO(out.getvalue())))
    assert [r.data for r in recs] == sent
    assert [r.subject for r in recs] == ["tg.job.rp.log", "tg.job.rp.verdict", "tg.job.rp.log"]
    assert recs[1].recv_ns - recs[0].recv_ns >= 0.4e9
    assert summarize(recs) == {"log.line": 1, "verdict": 1, "<malformed>": 1}
    # the readable copy of the event is in the file too
    assert '"fault_class":"crash"' in out.getvalue().splitlines()[1]

    got = []

    async def on(msg):
        got.append((asyncio.get_running_loop().time(), msg.subject, msg.data))
    await pub.nc.subscribe("replayed.tg.job.rp.>", cb=on)
    await pub.flush()
    with pytest.raises(ValueError, match="cannot be a NATS subject token"):
        await play(servers.nats_url, recs, subject_prefix="bad prefix")
    # the prefix is subject tokens: "replayed" puts the events under replayed.tg.…
    assert await play(servers.nats_url, recs, speed=1.0, subject_prefix="replayed") == 3
    for _ in range(100):
        if len(got) == 3:
            break
        await asyncio.sleep(0.02)
    assert [g[2] for g in got] == sent
    assert got[1][0] - got[0][0] >= 0.8 * (recs[1].recv_ns - recs[0].recv_ns) / 1e9
    await pub.close()


def test_bad_recording_line_says_where():
    good = Record(1, "tg.job.a.log", b"\x80").to_json()
    try:
        list(read_recording(io.StringIO(good + "\n{\"subject\": 1}\n")))
    except ValueError as exc:
        assert "line 2" in str(exc)
    else:
        raise AssertionError("a bad line must be reported")


def test_cli_record_and_play(servers, tmp_path):
    path = tmp_path / "rec.jsonl"
    env = {**os.environ, "PYTHONPATH": ROOT, "NATS_URL": servers.nats_url}
    rec = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "replay", "record", "--out",
                            str(path), "--subject", "tg.job.rpcli.>", "--count", "2"], env=env,
                           stderr=subprocess.PIPE, text=True)

    async def feed():
        bus = await Bus(servers.nats_url, "rp-feed").connect()
        for i in range(300):
            if rec.poll() is not None:
                break
            await bus.publish(subjects.job("rpcli", "log"), LogLine(job="rpcli", line=str(i)))
            await bus.flush()
            await asyncio.sleep(0.1)
        await bus.close()
    asyncio.run(feed())
    assert rec.wait(10) == 0, rec.stderr.read()
    assert len(path.read_text().splitlines()) == 2

    async def replay():
        bus = await Bus(servers.nats_url, "rp-sub").connect()
        got = []
        await bus.subscribe("tg.job.rpcli.log", lambda s, e: got.append(e.line))
        await bus.flush()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "trainguard.cli", "replay", "play", str(path), "--speed", "0",
            env=env, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        for _ in range(100):
            if len(got) == 2:
                break
            await asyncio.sleep(0.02)
        await bus.close()
        return proc.returncode, err.decode(), got
    rc, err, got = asyncio.run(replay())
    assert rc == 0 and "replayed 2" in err
    assert len(got) == 2 and all(x.isdigit() for x in got)


async def test_history_reads_what_jetstream_kept_across_streams(servers):
    """``record --history``: events and heartbeats stored before the recorder ran come back
    oldest first, interleaved across the streams as they were published, exact bytes."""
    from trainguard.tools.replay import history

    pub = await Bus(servers.nats_url, "hist-pub").connect()
    await pub.ensure_streams()
    sent = []
    for i in range(3):
        for subj, ev in (("tg.job.hist.log", LogLine(job="hist", line=f"line {i}")),
                         (subjects.rank_hb("hist", 0), schemas.RankHeartbeat(
                             job="hist", rank=0, local_rank=0, world_size=1, step=i))):
            await pub.publish(subj, ev)
            await pub.flush()
            sent.append((subj, schemas.encode(ev)))
            await asyncio.sleep(0.01)
    await pub.publish("tg.job.other.log", LogLine(job="other", line="not this job"))
    await pub.flush()
    await asyncio.sleep(0.2)
    out = io.StringIO()
    assert await history(servers.nats_url, out, "tg.job.hist.>") == 6
    recs = list(read_recording(io.StringIO(out.getvalue())))
    assert [(r.subject, r.data) for r in recs] == sent
    assert all(b.recv_ns >= a.recv_ns for a, b in zip(recs, recs[1:]))
    out2 = io.StringIO()
    assert await history(servers.nats_url, out2, "tg.job.hist.>", count=2) == 2
    assert await history(servers.nats_url, io.StringIO(), "tg.job.nobody.>") == 0
    await pub.close()

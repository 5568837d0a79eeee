"""Replay decide's parts without servers: policy rows, the in-memory store, a synthetic
recording re-decided in virtual time. (The exact reproduction of a real run's decisions is in
tests/test_operator_e2e.py.)"""
import gzip
import json
import os

import pytest

from trainguard import schemas
from trainguard.tools.memstore import MemoryStore
from trainguard.remediator import plan
from trainguard.tools.recording import Record, read_recording
from trainguard.tools.replay_decide import (ReplayError, decide, load_policy_file, parse_row,
                                      policy_with)

B = 1_700_000_000 * 10**9


def test_rows_and_policy_files(tmp_path):
    assert parse_row("crash=stop_job_notify_user").fault_class == "crash"
    assert parse_row("crash/hardware=restart_workers").layer == "hardware"
    for bad, why in (("crash", "expected"), ("crush=none", "unknown fault class"),
                     ("crash/moon=none", "unknown layer"), ("crash=reboot", "unknown action")):
        with pytest.raises(ReplayError, match=why):
            parse_row(bad)
    p = policy_with([parse_row("crash=stop_job_notify_user")])
    assert plan.rule_for("crash", "unknown", p).action == "stop_job_notify_user"
    assert plan.rule_for("crash", "hardware", p).action == "exclude_node_and_requeue"  # kept
    assert plan.rule_for("crash", "unknown").action == "restart_workers"  # default untouched
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"rows": [{"fault_class": "hang", "layer": None,
                                       "action": "restart_in_process"}],
                             "default_retry_budget": 1}))
    rows, settings = load_policy_file(str(f))
    assert rows[0].action == "restart_in_process" and settings == {"default_retry_budget": 1}
    f.write_text("[1]")
    with pytest.raises(ReplayError, match="JSON object"):
        load_policy_file(str(f))


def test_memory_store_semantics():
    s = MemoryStore()
    assert s.claim("k", "a") is None and s.claim("k", "b") == "a" and s.claimed_by("k") == "a"
    s.seed("j", {"mode": "action", "retry_budget": 3})
    with pytest.raises(KeyError):
        s.seed("j", {"nope": 1})
    s.observe(schemas.WorkerStarted(job="j", rank=1, node="n1", local_rank=1, world_size=2,
                                    generation=4))
    s.observe(schemas.RankHeartbeat(job="j", rank=0, node="n0", local_rank=0, world_size=2,
                                    generation=4))
    r = s.job("j")
    assert r.generation == 4 and r.world_size == 2 and r.mode == "action"
    assert r.members == [{"rank": 0, "node": "n0", "local_rank": 0},
                         {"rank": 1, "node": "n1", "local_rank": 1}]
    assert s.bump_generation("j", 3) == 4 and s.bump_generation("j", 4) == 5
    s.commit_decision("j", retries_used=1, last_decision={"id": "d"}, stopped=True,
                      pending_decision={"deadline_ns": 5})
    r = s.job("j")
    assert r.status == "stopped" and r.pending_decision == {"deadline_ns": 5}
    s2 = MemoryStore()
    for r in range(2):
        s2.observe(schemas.WorkerStarted(job="f", rank=r, node="n0", local_rank=r))
    s2.observe(schemas.WorkerExited(job="f", rank=0, node="n0", exit_code=0))
    assert s2.job("f").status == "running"  # rank 1 of the node still runs
    s2.observe(schemas.WorkerExited(job="f", rank=1, node="n0", exit_code=0))
    assert s2.job("f").status == "finished"  # the node's launcher would end_run now
    s.record_fault("n1", "j", "sig", {"fault_class": "crash"}, ts_ns=10)
    s.record_fault("n1", "k", "sig", {"fault_class": "crash"}, ts_ns=20)
    assert [h["job"] for h in s.node_history("n1", 15)] == ["k"]
    assert s.signature_history("sig", 0) == [("j", "n1"), ("k", "n1")]


def _records(events):
    out = []
    for t, subject, ev in events:
        ev.ts = B + int(t * 1e9)
        out.append(Record(B + int(t * 1e9), subject, schemas.encode(ev)))
    return out


def test_a_crash_in_a_synthetic_recording_is_decided_in_virtual_time():
    evs = []
    for r in range(2):
        evs.append((0.0, "tg.job.s.worker", schemas.WorkerStarted(
            job="s", rank=r, node=f"n{r}", local_rank=0, world_size=2)))
    for i in range(20):
        for r in range(2):
            evs.append((0.1 + 0.1 * i, f"tg.job.s.rank.{r}.hb", schemas.RankHeartbeat(
                job="s", rank=r, node=f"n{r}", local_rank=0, world_size=2, step=i)))
    evs.append((2.05, "tg.job.s.worker", schemas.WorkerExited(
        job="s", rank=1, node="n1", signal=9)))
    evs.append((2.1, "tg.job.s.log", schemas.LogLine(job="s", line="\x00 not msgpack")))
    recs = _records(evs) + [Record(B + int(2.2e9), "tg.job.s.log", b"\xc1junk")]
    res = decide(recs, job_records={"s": {"mode": "action"}})
    assert res.skipped == 1
    (row,) = res.rows
    assert row["status"] == "new" and row["recorded"] is None
    d = row["replayed"]
    assert (d.action, d.ranks, d.nodes, d.generation) == ("restart_workers", [1], ["n1"], 1)
    assert 2.05 <= d.t_s < 2.5  # decided at the crash's virtual time, not the machine's
    with pytest.raises(ReplayError, match="job record"):
        decide(recs, job_records={"s": {"generation": "x", "nope": 1}})


FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "replay")


def _fixture():
    with gzip.open(os.path.join(FIXTURE, "demo-under-load.jsonl.gz"), "rt") as fh:
        recs = list(read_recording(fh))
    with open(os.path.join(FIXTURE, "demo-under-load.job.json")) as fh:
        return recs, {"ops-e2e": json.load(fh)}


def test_a_real_recording_is_re_decided_exactly():
    """A real demo run's stored history (``replay record --history``; the readable ``event``
    copies dropped to keep the file small), recorded on the 2-core machine at a load of ~40:
    ranks 0-2 took over 120 s to start (a start-up hang, restart_workers), then a SIGKILL, failed
    saves (flags), an exception and a SIGSTOP hang. Every decision comes out again: action,
    culprit and generation, the tick-driven hangs included."""
    recs, snap = _fixture()
    res = decide(recs, job_records=snap)
    assert res.changed == [], [(r["status"], r["recorded"], r["replayed"]) for r in res.changed]
    got = [(d.fault_class, d.action, d.ranks, d.generation) for d in res.replayed]
    assert got == [("hang", "restart_workers", [0, 1, 2], 1),
                   ("crash", "restart_workers", [1], 2),
                   ("checkpoint_save", "none", [2], 2),
                   ("app_exception", "restart_in_process", [2], 3),
                   ("checkpoint_save", "none", [3], 3),
                   ("hang", "restart_workers", [3], 4),
                   ("checkpoint_save", "none", [2], 4)]
    # backtest: hangs restart in process → that row changes, and so does every generation after
    res2 = decide(recs, policy_with([parse_row("hang=restart_in_process")]), job_records=snap)
    first = res2.rows[0]
    assert first["status"] == "changed" and first["differs"] == ["action"]
    assert first["replayed"].action == "restart_in_process"
    # without the snapshot the start-up allowance is the detector's default, not the job's
    # 120 s: the start-up hang is not found, and the generations after it move
    res3 = decide(recs)
    assert res3.changed and all(d.ranks != [0, 1, 2] for d in res3.replayed)

"""The Slurm watcher without servers: the snapshot reader over real ``squeue --json`` /
``sinfo --json`` outputs of Slurm 22.05 (captured from the one-machine cluster's slurmctld,
``tests/fixtures/slurm/``), the reducer's events and record writes over captured sequences,
its handling of failures, and what the detector and the attributor make of its events.

Fixture sequences (each file pair one poll, in order):

* ``a-*``: job 1 (``{"trainguard":{"mode":"action","job":"train-a"}}``, 2 nodes, ``--no-kill
  --requeue``) and job 2 (``{"trainguard":{}}``, node2) start; ``scontrol update
  nodename=node1 state=down`` (job 1 goes on on node0); node2's slurmd killed: NOT_RESPONDING,
  then DOWN with job 2 requeued; job 1 cancelled.
* ``b-*``: jobs 3 (observe, node0) and 4 (node2); node0 drained by trainguard (reason
  ``trainguard: …``), then node2's slurmd killed (NOT_RESPONDING).
* ``c-*``: job 1 (directive), job 2 (``just a note``), job 3 (an invalid directive); node0
  drained by trainguard, node2 (idle) by an operator.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainguard import schemas
from trainguard.attributor import incidents
from trainguard.attributor.decide import AttributorConfig
from trainguard.attributor.evidence import agreeing_sources
from trainguard.detector import scheduler
from trainguard.detector.state import DetectorServiceConfig, DetectorState
from trainguard.detector.reducer import step as detector_step
from trainguard.core.reducer import Call, Log, Publish, Received, Tick, run_offline
from trainguard.schemas import JobRecord, subjects
from trainguard.schemas.slurm import JobChange, NodeChange, SlurmJobEvent, SlurmNodeEvent
from trainguard.scheduler.slurm.watch.reducer import Observation, WatchState, job_changes, step
from trainguard.scheduler.slurm.watch.snapshot import (SlurmJob, SnapshotError, expand_hostlist,
                                             parse_sinfo, parse_squeue)

FIX = Path(__file__).parent / "fixtures" / "slurm"


def snapshot(name: str, wall_ns: int = 0) -> Observation:
    return Observation(parse_squeue((FIX / f"{name}.squeue.json").read_text()),
                       parse_sinfo((FIX / f"{name}.sinfo.json").read_text()), wall_ns=wall_ns)


def sequence(prefix: str) -> list[str]:
    return sorted(p.name[:-len(".squeue.json")] for p in FIX.glob(f"{prefix}-*.squeue.json"))


def events(effects):
    return [(type(e.event).__name__, e.subject, str(e.event.change)) for e in effects
            if isinstance(e, Publish)]


# ---- the snapshot reader ---------------------------------------------------------------------
@pytest.mark.parametrize("text,nodes", [
    ("node[0-1]", ["node0", "node1"]),
    ("node[0-2,5],gpu07", ["node0", "node1", "node2", "node5", "gpu07"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a1,b[3],c", ["a1", "b3", "c"]),
    ("", []), ("(null)", []),
])
def test_hostlists(text, nodes):
    assert expand_hostlist(text) == nodes


@pytest.mark.parametrize("text", ["node[0-1", "node]0[", "node[a-b]", "node[3-1]"])
def test_a_malformed_hostlist_raises(text):
    with pytest.raises(SnapshotError):
        expand_hostlist(text)


def test_real_squeue_and_sinfo_shapes():
    jobs = {j.job_id: j for j in parse_squeue((FIX / "a-02-start.squeue.json").read_text())}
    assert jobs["1"] == SlurmJob("1", "tg-train", "RUNNING", ("node0", "node1"), 0,
                                 '{"trainguard": {"mode": "action", "job": "train-a"}}', "tg",
                                 "None")
    assert jobs["2"].nodes == ("node2",)
    pending = parse_squeue((FIX / "a-08-cancel.squeue.json").read_text())
    assert {(j.job_id, j.state, j.nodes, j.restarts) for j in pending} == {
        ("1", "CANCELLED", ("node0",), 0), ("2", "PENDING", (), 1)}
    nodes = {n.name: n for n in parse_sinfo((FIX / "a-08-cancel.sinfo.json").read_text())}
    n2 = nodes["node2"]
    assert (n2.state, n2.flags, n2.reason, n2.down, n2.not_responding, n2.drained) == (
        "down", ("NOT_RESPONDING",), "Not responding", True, True, False)
    drained = {n.name: n for n in parse_sinfo((FIX / "c-03-drained.sinfo.json").read_text())}
    assert drained["node2"].reason == "admin: bad dimm" and drained["node2"].drained
    assert drained["node2"].reason_by == "root" and drained["node2"].reason_ts == \
        1796227243 * 10**9


@pytest.mark.parametrize("text,words", [
    ("", "no JSON"), ("squeue: error: Unable to contact slurm controller", "no JSON"),
    ('{"meta": {}}', "no 'jobs' list"),
    ('{"jobs": [], "errors": [{"error": "Unable to contact slurm controller"}]}',
     "reported errors"),
    ('{"jobs": [{"name": "x"}]}', "without job_id"),
])
def test_text_that_is_not_squeue_json_raises(text, words):
    with pytest.raises(SnapshotError) as exc:
        parse_squeue(text)
    assert words in str(exc.value)


# ---- the reducer over captured sequences -----------------------------------------------------
def test_sequence_a_registration_nodes_lost_down_not_responding_requeue_cancel():
    inputs = [(float(i), snapshot(n, i)) for i, n in enumerate(sequence("a"))]
    s, eff = run_offline(step, WatchState(), inputs)
    assert events(eff) == [
        ("SlurmJobEvent", "tg.job.train-a.slurm", "registered"),   # both pending at first
        ("SlurmJobEvent", "tg.job.slurm-2.slurm", "registered"),
        ("SlurmJobEvent", "tg.job.train-a.slurm", "started"),
        ("SlurmJobEvent", "tg.job.slurm-2.slurm", "started"),
        ("SlurmJobEvent", "tg.job.train-a.slurm", "nodes_lost"),   # --no-kill: on node0 alone
        ("SlurmNodeEvent", "tg.node.node1.slurm", "down"),         # the node it lost
        ("SlurmNodeEvent", "tg.node.node2.slurm", "not_responding"),
        ("SlurmJobEvent", "tg.job.train-a.slurm", "cancelled"),
        ("SlurmJobEvent", "tg.job.slurm-2.slurm", "requeued"),     # NODE_FAIL of a --requeue job
        ("SlurmNodeEvent", "tg.node.node2.slurm", "down"),         # …and its node DOWN
    ]
    pub = [e.event for e in eff if isinstance(e, Publish)]
    lost = pub[4]
    assert (lost.slurm_job_id, lost.nodes, lost.lost_nodes, lost.previous_state) == (
        "1", ["node0"], ["node1"], "RUNNING")
    assert lost.directive == {"mode": "action", "job": "train-a"}
    down1 = pub[5]
    assert (down1.jobs, down1.slurm_jobs, down1.reason, down1.by_trainguard) == (
        ["train-a"], ["1"], "operator: down", False)
    # job 2 was requeued off node2 in the same poll that showed node2 DOWN: still its node
    down2 = pub[9]
    assert (down2.jobs, down2.flags, down2.reason) == (["slurm-2"], ["NOT_RESPONDING"],
                                                       "Not responding")
    assert pub[8].restarts == 1 and pub[8].state == "PENDING"
    # the records: written at registration and on every change of state, nodes or restarts
    writes = [(e.args, e.kwargs["state"], tuple(e.kwargs["nodes"])) for e in eff
              if isinstance(e, Call)]
    assert writes[0] == (("train-a", "1"), "PENDING", ())
    assert writes[-1] == (("slurm-2", "2"), "PENDING", ())
    assert (("train-a", "1"), "RUNNING", ("node0",)) in writes
    assert s.jobs["1"].written == ("CANCELLED", ("node0",), 0)
    # the ids are derived: the same sequence seen by a second watcher publishes the same ids
    _, again = run_offline(step, WatchState(), inputs)
    assert [e.event.event_id for e in again if isinstance(e, Publish)] == \
        [e.event_id for e in pub]


def test_sequence_b_a_drain_by_trainguard_is_reported_as_such():
    # jobs 1 and 2 (of sequence a, kept in slurmctld's state) ended before the watcher saw
    # them: not watched; node0 was drained before its first poll: news at first sight
    s, eff = run_offline(step, WatchState(), [(1.0, snapshot("b-03-down")),
                                              (2.0, snapshot("b-04-lost"))])
    assert set(s.jobs) == {"3", "4"} and set(s.ignored) == {"1", "2"}
    pub = [e.event for e in eff if isinstance(e, Publish)]
    assert [(type(e).__name__, str(e.change)) for e in pub] == [
        ("SlurmJobEvent", "registered"), ("SlurmJobEvent", "registered"),
        ("SlurmNodeEvent", "drain"), ("SlurmNodeEvent", "not_responding")]
    assert [e.job for e in pub[:2]] == ["slurm-3", "slurm-4"]
    drain = pub[2]
    assert (drain.node, drain.by_trainguard, drain.reason, drain.jobs) == (
        "node0", True, "trainguard: rank 0 lost (node_lost)", ["slurm-3"])


def test_sequence_c_opt_in_invalid_directive_and_a_node_of_no_watched_job():
    s, eff = run_offline(step, WatchState(), [(0.0, snapshot("c-02-running")),
                                              (1.0, snapshot("c-03-drained"))])
    pub = [e.event for e in eff if isinstance(e, Publish)]
    assert [(e.job, str(e.change)) for e in pub if isinstance(e, SlurmJobEvent)] == [
        ("slurm-1", "registered"), ("slurm-3", "registered"), ("slurm-3", "directive_invalid")]
    bad = pub[2]
    assert "field 'mode'" not in bad.error and "not JSON" in bad.error  # cut-short JSON
    assert bad.directive == {"mode": "observe"}                          # it stays observe
    assert "2" in s.ignored and "2" not in s.jobs                        # "just a note"
    warn = [e for e in eff if isinstance(e, Log) and e.level == logging.WARNING]
    assert len(warn) == 1 and "stays in observe mode" in warn[0].message
    # node0 (jobs 1, 2) drained by trainguard; node2 (idle, no watched job) drained by an
    # operator: only node0 is news, and it is trainguard's own
    nodes = [(e.node, str(e.change), e.by_trainguard, e.jobs) for e in pub
             if isinstance(e, SlurmNodeEvent)]
    assert nodes == [("node0", "drain", True, ["slurm-1"])]


@pytest.mark.parametrize("prev,cur,changes", [
    (("PENDING", (), 0), ("RUNNING", ("a", "b"), 0), [JobChange.STARTED]),
    (("RUNNING", ("a", "b"), 0), ("RUNNING", ("a",), 0), [JobChange.NODES_LOST]),
    (("RUNNING", ("a", "b"), 0), ("RUNNING", ("a", "b"), 0), []),
    (("RUNNING", ("a",), 0), ("NODE_FAIL", ("a",), 0), [JobChange.NODE_FAIL]),
    (("RUNNING", ("a",), 0), ("PENDING", (), 1), [JobChange.REQUEUED]),
    (("RUNNING", ("a",), 0), ("REQUEUED", ("a",), 0), [JobChange.REQUEUED]),
    (("PENDING", (), 1), ("RUNNING", ("b",), 1), [JobChange.STARTED]),
    (("RUNNING", ("a",), 0), ("COMPLETING", ("a",), 0), []),
    (("COMPLETING", ("a",), 0), ("CANCELLED", ("a",), 0), [JobChange.CANCELLED]),
    (("RUNNING", ("a",), 0), ("TIMEOUT", ("a",), 0), [JobChange.ENDED]),
    (("CANCELLED", ("a",), 0), ("CANCELLED", ("a",), 0), []),
])
def test_job_transitions(prev, cur, changes):
    def job(t):
        return SlurmJob("9", state=t[0], nodes=t[1], restarts=t[2])
    assert job_changes(job(prev), job(cur)) == changes


def test_an_unreachable_slurmctld_is_logged_once_and_watching_goes_on():
    s, _ = run_offline(step, WatchState(), [(0.0, snapshot("a-02-start"))])
    err = "squeue --json --states=all exited 1: slurm_load_jobs error: Unable to contact slurm"
    bad = Observation(None, None, jobs_error=err, nodes_error="sinfo gave no answer in 10 s")
    s, eff = run_offline(step, s, [(1.0, bad), (2.0, bad)])
    logs = [e for e in eff if isinstance(e, Log)]
    assert [e.level for e in logs] == [logging.ERROR, logging.ERROR]  # once each, not per poll
    assert "Unable to contact slurm" in logs[0].message and "goes on" in logs[0].message
    assert not [e for e in eff if isinstance(e, Publish)]            # nothing made up
    assert set(s.jobs) == {"1", "2"}                                   # nothing forgotten
    s, eff = run_offline(step, s, [(3.0, snapshot("a-03-down"))])
    assert [e.message for e in eff if isinstance(e, Log)] == [
        "squeue --json answers again", "sinfo --json answers again"]
    assert ("SlurmNodeEvent", "tg.node.node1.slurm", "down") in events(eff)


def test_a_failed_record_write_is_tried_again_at_the_next_poll():
    def valkey_down(call):
        raise ConnectionError("valkey gone")
    s, eff = run_offline(step, WatchState(), [(0.0, snapshot("a-02-start"))], valkey_down)
    assert sum(isinstance(e, Call) for e in eff) == 2
    assert any(isinstance(e, Log) and "not written" in e.message for e in eff)
    s, eff = run_offline(step, s, [(1.0, snapshot("a-02-start"))])      # same snapshot
    assert sum(isinstance(e, Call) for e in eff) == 2 and not events(eff)
    s, eff = run_offline(step, s, [(2.0, snapshot("a-02-start"))])      # written: no more
    assert not eff


# ---- the detector's rows -------------------------------------------------------------------------
def test_every_change_has_a_row_with_a_reason():
    for change in NodeChange:
        for own in (True, False):
            assert scheduler.scheduler_row(SlurmNodeEvent.SCHEMA, change, own), change
    for change in JobChange:
        assert scheduler.scheduler_row(SlurmJobEvent.SCHEMA, change), change
    for row in scheduler.ROWS:
        assert row.reason and (row.kind is None) == (row.fault_class is None)


NS = 1_700_000_000 * 10**9
RECORD = JobRecord(runs=1, generation=2, members=[
    {"rank": 0, "node": "node0", "local_rank": 0}, {"rank": 1, "node": "node0", "local_rank": 1},
    {"rank": 2, "node": "node1", "local_rank": 0}, {"rank": 3, "node": "node1", "local_rank": 1}])


def detector_with(record=RECORD, job="train-a"):
    """A detector that has read ``job``'s record."""
    hb = schemas.RankHeartbeat(job=job, rank=0, node="node0", local_rank=0, step=1)
    s, _ = run_offline(detector_step, DetectorState(config=DetectorServiceConfig()),
                       [(100.0, Received(subjects.rank_hb(job, 0), hb, NS)), (100.1, Tick(NS))],
                       lambda call: {name: record for name in call.args[0]})
    assert job in s.records
    return s


def node_event(change, node="node1", reason="", flags=(), jobs=("train-a",), ts=NS):
    return Received(subjects.node(node, "slurm"), SlurmNodeEvent(
        node=node, change=change, state="down" if change == "down" else "mixed",
        flags=list(flags), reason=reason, by_trainguard=reason.startswith("trainguard: "),
        jobs=list(jobs), slurm_jobs=["1"] * len(jobs), ts=ts), ts)


def anomalies(eff):
    return [e.event for e in eff if isinstance(e, Publish) and e.subject.endswith(".anomaly")]


def test_a_node_slurm_marks_down_is_a_node_loss_of_its_ranks_once():
    s = detector_with()
    s, eff = run_offline(detector_step, s, [
        (101.0, node_event("not_responding", flags=["NOT_RESPONDING"])),
        (102.0, node_event("down", reason="Not responding", flags=["NOT_RESPONDING"])),
        (103.0, Received(subjects.job("train-a", "slurm"), SlurmJobEvent(
            job="train-a", change="nodes_lost", slurm_job_id="1", state="RUNNING",
            previous_state="RUNNING", nodes=["node0"], lost_nodes=["node1"], ts=NS), NS))])
    got = anomalies(eff)
    # one on the node's own subject, one for the job (its ranks there, its generation); the
    # DOWN after NOT_RESPONDING and the job's nodes_lost are the same incident key
    assert [(a.job, a.kind, a.fault_class, a.culprit.ranks, a.culprit.nodes, a.generation)
            for a in got] == [(None, "node_lost", "node_lost", [], ["node1"], None),
                              ("train-a", "node_lost", "node_lost", [2, 3], ["node1"], 2)]
    assert got[1].detail["slurm"]["change"] == "not_responding" and got[1].severity == "error"
    assert "Slurm: node node1 is MIXED+NOT_RESPONDING" in got[1].evidence[0]


def test_drains_and_nodes_out_of_the_job():
    s = detector_with()
    s, eff = run_offline(detector_step, s, [
        (101.0, node_event("drain", reason="trainguard: rank 2 lost (node_lost)",
                           flags=["DRAIN"])),
        (102.0, node_event("drain", node="node0", reason="nhc: disk /scratch full",
                           flags=["DRAIN"])),
        (103.0, node_event("down", node="node7", jobs=())),  # no member of the job there
        (104.0, node_event("resumed"))])
    got = anomalies(eff)
    assert [(a.job, a.kind, a.severity, a.culprit.ranks) for a in got] == [
        (None, "slurm_drain", "warning", []), ("train-a", "slurm_drain", "warning", [0, 1]),
        (None, "node_lost", "error", [])]


def test_a_job_the_detector_has_not_read_yet_gets_the_finding_and_a_read():
    s = DetectorState(config=DetectorServiceConfig())
    s, eff = run_offline(detector_step, s, [(100.0, node_event("down", jobs=("train-b",)))])
    got = anomalies(eff)
    assert [(a.job, a.generation) for a in got] == [(None, None), ("train-b", None)]
    assert "train-b" in s.due  # its record is read at the next tick


# ---- the attributor: corroborate, do not duplicate ----------------------------------------------
def heartbeat_lost(gen=2):
    return schemas.Anomaly(job="train-a", kind="node_lost", fault_class="node_lost",
                           first_ts=NS, culprit=schemas.Culprit(ranks=[2, 3], nodes=["node1"]),
                           evidence=["node node1: no heartbeat"], generation=gen,
                           detail={"silent_s": 3.0, "layer": "infrastructure", "weight": 0.9})


def slurm_lost(gen=2):
    s = detector_with()
    _, eff = run_offline(detector_step, s, [(101.0, node_event("down", reason="Not responding"))])
    a = anomalies(eff)[1]
    assert a.generation == gen
    return a


@pytest.mark.parametrize("order", ["heartbeat first", "slurm first"])
def test_slurm_corroborates_the_incident_trainguard_already_has(order):
    first, second = (heartbeat_lost(), slurm_lost())[::1 if order == "heartbeat first" else -1]
    st = incidents.AttributorState(config=AttributorConfig(symptom_hold_s=1.0))
    subject = subjects.job("train-a", "anomaly")
    st, eff = run_offline(incidents.step, st, [
        (10.0, Received(subject, first, NS)), (10.5, Received(subject, second, NS)),
        (12.0, Tick(NS))], lambda call: [])
    verdicts = [e.event for e in eff if isinstance(e, Publish)]
    assert len(verdicts) == 1 and verdicts[0].fault_class == "node_lost"
    assert verdicts[0].culprit.nodes == ["node1"]
    inc = st.incidents[("train-a", 2)]
    assert len(inc.anomalies) == 2
    assert agreeing_sources(inc.anomalies[0], inc.anomalies[1:], {}) == ["heartbeat",
                                                                         "scheduler"]

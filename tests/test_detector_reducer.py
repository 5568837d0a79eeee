"""The detector's reducer (``detector.reducer.step``) driven offline, no servers: dedup, fan-out of
node findings, job-record refreshes, the periodic rules' cadence and timestamps, memory
collection. The service test (``test_detector_service.py``) checks the same reducer's wiring.

Service time starts at 100 s: the rules read 0.0 as "never" (``RankState.last_hb``)."""
from __future__ import annotations

import logging

import pytest

from trainguard import schemas
from trainguard.detector.handlers import launcher_beat
from trainguard.detector.reducer import node_timeout, refresh_calls, step
from trainguard.detector.state import DetectorServiceConfig, DetectorState
from trainguard.detector.rules import DetectorConfig
from trainguard.core.reducer import Call, Log, Publish, Received, Reply, Tick, run_offline
from trainguard.schemas import JobRecord, subjects

T0 = 100.0
NS = 1_700_000_000_000_000_000  # Unix ns at service time T0


def wall(t: float) -> int:
    return NS + int(round((t - T0) * 1e9))


def state(**kw) -> DetectorState:
    rules = kw.pop("rules", None) or DetectorConfig(silence_timeout_s=1.0)
    return DetectorState(config=DetectorServiceConfig(rules=rules, **kw))


def hb(t, job="j", rank=0, node="n0", local_rank=0, step_=1, seq=1, **kw):
    return t, Received(subjects.rank_hb(job, rank), schemas.RankHeartbeat(
        job=job, rank=rank, node=node, local_rank=local_rank, step=step_, collective_seq=seq,
        **kw), wall(t))


def tick(t):
    return t, Tick(wall(t))


def exited(t, job="j", rank=0, node="n0", generation=0, signal=9):
    return t, Received(subjects.job(job, "worker"), schemas.WorkerExited(
        job=job, rank=rank, node=node, signal=signal, generation=generation, ts=wall(t)), wall(t))


def xid(t, node="g1", gpu_index=None, number=79):
    return t, Received(subjects.node(node, "xid"), schemas.XidEvent(
        node=node, xid=number, pci="0000:4e:00", gpu_index=gpu_index, raw=f"Xid {number}",
        ts=wall(t)), wall(t))


def node_beat(t, node, role, job=None, end=False):
    """A node heartbeat at ``t``: an agent's on ``tg.node.<node>.heartbeat``; a launcher's on
    its job's ``tg.node.<node>.launcher.<job>``."""
    subject = (subjects.launcher(node, job) if role == "launcher"
               else subjects.node(node, "heartbeat"))
    return t, Received(subject, schemas.NodeHeartbeat(node=node, role=role, job=job,
                                                      ending=end), wall(t))


def published(effects, kind=None):
    return [e for e in effects if isinstance(e, Publish)
            and (kind is None or e.event.kind == kind)]


def records(table):
    """A ``replies`` function for ``run_offline``: the record of each job read, from ``table``
    (a dict job -> JobRecord, or -> a list consumed one read at a time; an exception in it is
    raised as the store would)."""
    def answer(call: Call):
        assert (call.target, call.method) == ("state", "job_records") and call.wait is False
        out = {}
        for name in call.args[0]:
            rec = table[name]
            if isinstance(rec, list):
                rec = rec.pop(0) if len(rec) > 1 else rec[0]
            if isinstance(rec, Exception):
                raise rec  # the store fails the whole read, as a lost connection does
            out[name] = rec
        return out
    return answer


MEMBERS = {
    "a": JobRecord(runs=1, generation=3, members=[
        {"rank": 0, "node": "g1", "local_rank": 0}, {"rank": 1, "node": "g1", "local_rank": 1},
        {"rank": 2, "node": "g2", "local_rank": 0}]),
    "b": JobRecord(runs=1, generation=0, members=[
        {"rank": 0, "node": "g1", "local_rank": 0}, {"rank": 1, "node": "g3", "local_rank": 0}]),
    "c": JobRecord(runs=1, members=[{"rank": 0, "node": "g9", "local_rank": 0}]),
}


def learn_jobs(*jobs, t=T0):
    """Inputs that make the detector know ``jobs`` (one heartbeat each) and read their records."""
    return [hb(t, job=j) for j in jobs] + [tick(t + 0.05)]


# ---- dedup ----------------------------------------------------------------------------------
def test_one_anomaly_per_incident_key_and_again_after_the_ttl():
    inputs = [exited(T0), exited(T0 + 1), exited(T0 + 2, rank=1),   # another rank: another key
              exited(T0 + 3, generation=1),                            # another generation
              exited(T0 + 9.9), exited(T0 + 10.0)]                     # TTL 10 s from T0
    _, eff = run_offline(step, state(dedup_ttl_s=10.0), inputs)
    got = [(e.event.rank, e.event.generation, e.event.first_ts) for e in published(eff)]
    assert got == [(0, 0, wall(T0)), (1, 0, wall(T0 + 2)), (0, 1, wall(T0 + 3)),
                   (0, 0, wall(T0 + 10.0))]


def test_gc_forgets_expired_incident_keys():
    s, _ = run_offline(step, state(dedup_ttl_s=10.0, gc_s=5.0),
                       [exited(T0), tick(T0 + 1), tick(T0 + 6)])
    assert len(s.emitted) == 1
    s, _ = run_offline(step, s, [tick(T0 + 11)])
    assert s.emitted == {}


# ---- node findings fan out ------------------------------------------------------------------
def test_gpu_xid_goes_to_the_node_and_to_each_job_with_members_there_narrowed_to_the_gpu():
    inputs = learn_jobs("a", "b", "c") + [xid(T0 + 1, gpu_index=1)]
    s, eff = run_offline(step, state(), inputs, records(dict(MEMBERS)))
    assert s.node_jobs == {"g1": {"a", "b"}, "g2": {"a"}, "g3": {"b"}, "g9": {"c"}}
    by_subject = {e.subject: e.event for e in published(eff)}
    assert set(by_subject) == {"tg.node.g1.anomaly", "tg.job.a.anomaly", "tg.job.b.anomaly"}
    a, b = by_subject["tg.job.a.anomaly"], by_subject["tg.job.b.anomaly"]
    assert a.culprit.ranks == [1] and a.generation == 3      # the member on GPU 1 of g1
    assert b.culprit.ranks == [0] and b.generation == 0      # no member on GPU 1: all on g1
    assert by_subject["tg.node.g1.anomaly"].job is None
    assert all(e.event.fault_class == "gpu_xid" and e.event.culprit.nodes == ["g1"]
               for e in published(eff))


def kernel(t, line, node="g1"):
    return t, Received(subjects.node(node, "kernel"), schemas.LogLine(
        node=node, job=None, stream="kernel", source="agent", line=line, ts=wall(t)), wall(t))


def test_a_node_wide_kernel_line_goes_to_every_job_on_the_node():
    inputs = learn_jobs("a", "b", "c") + [
        kernel(T0 + 1, "nfs: server fs1 not responding, still trying")]
    _, eff = run_offline(step, state(), inputs, records(dict(MEMBERS)))
    by_subject = {e.subject: e.event for e in published(eff)}
    assert set(by_subject) == {"tg.node.g1.anomaly", "tg.job.a.anomaly", "tg.job.b.anomaly"}
    assert by_subject["tg.job.a.anomaly"].culprit.ranks == [0, 1]
    assert all(e.fault_class == "filesystem" and e.culprit.nodes == ["g1"]
               for e in by_subject.values())


def test_a_kernel_oom_kill_is_the_nodes_alone_no_job_is_blamed():
    """The kernel names a pid, not a job: the rank's own exit tells its job."""
    inputs = learn_jobs("a", "b") + [kernel(
        T0 + 1, "Memory cgroup out of memory: Killed process 77 (python) total-vm:1kB")]
    _, eff = run_offline(step, state(), inputs, records(dict(MEMBERS)))
    assert [(e.subject, e.event.fault_class) for e in published(eff)] == [
        ("tg.node.g1.anomaly", "oom_host")]


def test_node_lost_names_every_member_on_the_node_and_uses_the_jobs_node_timeout():
    recs = {"a": JobRecord(runs=1, node_timeout_s=10.0, members=MEMBERS["a"].members)}
    beat = (T0, Received(subjects.node("g1", "heartbeat"),
                         schemas.NodeHeartbeat(node="g1", role="agent"), wall(T0)))
    inputs = learn_jobs("a") + [beat] + [tick(T0 + k * 0.5) for k in range(1, 24)]
    s, eff = run_offline(step, state(), inputs, records(recs))
    assert node_timeout(s, "g1") == 10.0 and node_timeout(s, "g2") == 10.0
    assert node_timeout(s, "elsewhere") == 3.0                 # DetectorConfig.node_timeout_s
    lost = published(eff, "node_lost")
    assert [(e.subject, e.event.culprit.ranks) for e in lost] == [
        ("tg.node.g1.anomaly", []), ("tg.job.a.anomaly", [0, 1])]
    assert lost[0].event.first_ts == wall(T0 + 10.5)           # the first tick past 10 s


def _node_beat(t, node):
    return t, Received(subjects.node(node, "heartbeat"),
                       schemas.NodeHeartbeat(node=node, role="agent"), wall(t))


def _lost_at(eff):
    return [(e.subject, round(e.event.first_ts / 1e9 - wall(T0) / 1e9, 2))
            for e in published(eff, "node_lost") if e.subject.startswith("tg.node.")]


def test_the_nodes_are_looked_at_from_their_earliest_deadline_and_found_lost_on_time():
    """The tick skips the nodes until the earliest one could be lost (``nodes_due``); each is
    still found at the first tick past its own timeout (3 s): g1 silent from T0 + 1, g2 from
    T0 + 2.5, g3 first heard at T0 + 4 (nearer than the last look's earliest) then silent, and
    g1 heard again at T0 + 6 and silent anew (a lost node back: found lost again at T0 + 9.05,
    its anomaly the incident key's already published)."""
    beats = [_node_beat(T0 + 0.5 * k, "g1") for k in range(3)]
    beats += [_node_beat(T0 + 0.5 * k, "g2") for k in range(6)]
    beats += [_node_beat(T0 + 4.0, "g3"), _node_beat(T0 + 6.0, "g1")]
    ticks = [tick(T0 + 0.05 * k) for k in range(1, 240)]
    inputs = sorted(beats + ticks, key=lambda x: x[0])
    s, eff = run_offline(step, state(), inputs)
    assert _lost_at(eff) == [("tg.node.g1.anomaly", 4.05), ("tg.node.g2.anomaly", 5.55),
                             ("tg.node.g3.anomaly", 7.05)]
    s, _ = run_offline(step, state(), [i for i in inputs if i[0] <= T0 + 9.0])
    assert not s.nodes["g1"].lost
    s, _ = run_offline(step, s, [tick(T0 + 9.05)])
    assert s.nodes["g1"].lost
    assert s.nodes_due == float("inf")  # every node lost: nothing to look at until one beats


def test_a_record_that_shortens_a_node_timeout_is_judged_at_the_next_tick():
    """g1 beats at T0 (3 s default: due at T0 + 3); the record read at the next tick gives it
    a 1 s timeout: found lost at the first tick past T0 + 1, not at T0 + 3."""
    recs = {"a": JobRecord(runs=1, node_timeout_s=1.0, members=MEMBERS["a"].members)}
    inputs = [_node_beat(T0, "g1"), tick(T0 + 0.05)] + learn_jobs("a", t=T0 + 0.1)
    inputs += [tick(T0 + 0.1 + 0.05 * k) for k in range(1, 30)]
    _, eff = run_offline(step, state(), inputs, records(recs))
    assert _lost_at(eff) == [("tg.node.g1.anomaly", 1.05)]


# ---- job-record refresh ---------------------------------------------------------------------
def test_a_lost_launcher_on_a_live_node_is_published_to_its_job_only():
    node = "ip-10-0-1-2.ec2.internal"
    recs = {"a": JobRecord(runs=1, generation=3, members=[
                {"rank": 0, "node": node, "local_rank": 0},
                {"rank": 1, "node": "g2", "local_rank": 0}]),
            "b": JobRecord(runs=1, members=[{"rank": 0, "node": node, "local_rank": 0}])}

    def node_hb(t, role, job=None):
        return node_beat(t, node, role, job)

    inputs = [hb(T0, job="a", rank=0, node=node, generation=3), hb(T0, job="b", node=node),
              node_hb(T0, "launcher", "a"), node_hb(T0, "launcher", "b"), tick(T0 + 0.05)]
    for k in range(1, 10):  # a's launcher and rank 0 stop; b's and the agent go on
        t = T0 + k * 0.5
        inputs += [node_hb(t, "agent"), node_hb(t, "launcher", "b"),
                   hb(t, job="b", node=node), tick(t + 0.01)]
    s, eff = run_offline(step, state(rules=DetectorConfig(silence_timeout_s=60.0)), inputs,
                         records(recs))
    lost = published(eff, "launcher_lost")
    assert [(e.subject, e.event.culprit.ranks, e.event.culprit.nodes, e.event.generation)
            for e in lost] == [("tg.job.a.anomaly", [0], [node], 3)]
    # found at the first agent beat more than the timeout after the launcher's last
    assert lost[0].event.fault_class == "crash" and lost[0].event.first_ts == wall(T0 + 3.51)
    assert lost[0].event.detail["last_beat_ns"] == wall(T0)  # the launcher's last beat
    assert not published(eff, "node_lost")


@pytest.mark.parametrize("ending, status, lost", [
    (False, "running", 1), (True, "running", 0),
    # a run that is over without a last beat: its user revoked (``revoke_job`` marks it
    # stopped; the launcher fences itself unheard), or ended by the Slurm requeue
    (False, "stopped", 0), (False, "requeued", 0), (False, "finished", 0)])
def test_a_launcher_that_ends_on_purpose_is_no_lost_launcher(ending, status, lost):
    """A job stopped by a decision: its launcher kills its ranks and ends, with a last beat
    marked ``ending``; its silence after that must not become an infrastructure fault of the
    node (which cross-job history would hold against it). Nor the silence of a launcher whose
    run the job record says is over."""
    node = "vm"
    recs = {"a": JobRecord(runs=1, status=status,
                           members=[{"rank": 0, "node": node, "local_rank": 0}])}

    def node_hb(t, role, job=None, end=False):
        return node_beat(t, node, role, job, end)

    inputs = [hb(T0, job="a", rank=0, node=node), node_hb(T0, "launcher", "a"),
              tick(T0 + 0.05), node_hb(T0 + 0.1, "launcher", "a", end=ending)]
    for k in range(1, 10):  # only the agent goes on
        t = T0 + k * 0.5
        inputs += [node_hb(t, "agent"), tick(t + 0.01)]
    s, eff = run_offline(step, state(rules=DetectorConfig(silence_timeout_s=60.0)), inputs,
                         records(recs))
    assert len(published(eff, "launcher_lost")) == lost


def test_a_powered_off_node_is_lost_not_its_launcher():
    """The agent's last beat comes a moment after the launcher's (a power-off stops both):
    node lost only."""
    recs = {"a": JobRecord(runs=1, members=[{"rank": 0, "node": "g1", "local_rank": 0}])}

    def node_hb(t, role, job=None):
        return node_beat(t, "g1", role, job)

    inputs = [hb(T0, job="a", node="g1"), node_hb(T0, "launcher", "a"), node_hb(T0 + 0.9, "agent")]
    inputs += [tick(T0 + k * 0.25) for k in range(1, 24)]
    _, eff = run_offline(step, state(rules=DetectorConfig(silence_timeout_s=60.0)), inputs,
                         records(recs))
    assert [e.event.kind for e in published(eff) if e.subject == "tg.job.a.anomaly"] == [
        "node_lost"]


def test_a_node_with_only_launcher_beats_is_alive_while_they_go_on_then_lost():
    """No agent on the node (none deployed): its launcher's beats alone keep it alive; the
    node is lost the node timeout (3 s) after the last one."""
    recs = {"a": JobRecord(runs=1, members=[{"rank": 0, "node": "g1", "local_rank": 0}])}
    inputs = learn_jobs("a")
    for k in range(11):  # beats every 0.5 s up to T0 + 5
        inputs += [node_beat(T0 + k * 0.5, "g1", "launcher", "a"),
                   tick(T0 + k * 0.5 + 0.25)]
    inputs += [tick(T0 + 5 + k * 0.25) for k in range(1, 20)]
    s, eff = run_offline(step, state(rules=DetectorConfig(silence_timeout_s=60.0)), inputs,
                         records(recs))
    assert set(s.nodes["g1"].last) == {"launcher"} and "a" in s.nodes["g1"].launchers
    lost = published(eff, "node_lost")
    assert [(e.subject, e.event.culprit.ranks) for e in lost] == [
        ("tg.node.g1.anomaly", []), ("tg.job.a.anomaly", [0])]
    assert lost[0].event.first_ts == wall(T0 + 8.25)  # the first tick past 3 s of silence
    assert not published(eff, "launcher_lost")  # no agent: the node's loss, not the launcher's


@pytest.mark.parametrize("node, job", [("g1", "a"), ("ip-10-0-1-2.ec2.internal", "train.7"),
                                       ("g1", "heartbeat")])
def test_a_launcher_beat_takes_its_node_and_job_from_its_subject(node, job):
    """The subject is what the server checked against the publisher's rights: the beat's node
    and job come from it (dots decoded), whether the event names them or not."""
    subject = subjects.launcher(node, job)
    assert subjects.parse(subject) == {"scope": "node", "name": node, "kind": "launcher",
                                       "job": job}
    for ev in (schemas.NodeHeartbeat(role="launcher"),
               schemas.NodeHeartbeat(node=node, job=job, role="launcher")):
        assert launcher_beat(subject, ev) == (node, job)
        s, _ = step(state(), Received(subject, ev, wall(T0)), T0)
        assert set(s.nodes) == {node} and set(s.nodes[node].launchers) == {job}
        assert set(s.nodes[node].last) == {"launcher"}


@pytest.mark.parametrize("subject, ev, why", [
    # another job's launcher: a job's user may publish its own job's subject only, and the
    # event must not make it count for another job
    ("tg.node.g1.launcher.a", schemas.NodeHeartbeat(node="g1", job="b", role="launcher"),
     "names job 'b', its subject 'a'"),
    ("tg.node.g1.launcher.a", schemas.NodeHeartbeat(node="g2", job="a", role="launcher"),
     "names node 'g2', its subject 'g1'"),
    # a job's user posing as the node's agent (which vouches for the node and for the node
    # being alive while a launcher is lost)
    ("tg.node.g1.launcher.a", schemas.NodeHeartbeat(node="g1", job="a", role="agent"),
     "role 'agent'"),
    ("tg.node.g1.launcher.a", schemas.NodeHeartbeat(node="g1", job="a", role=""), "role ''"),
    ("tg.node.g1.launcher", schemas.NodeHeartbeat(node="g1", job="a", role="launcher"),
     "no launcher heartbeat subject"),
    ("tg.node.g1.launcher.a.b", schemas.NodeHeartbeat(role="launcher"),
     "no launcher heartbeat subject"),
    ("tg.node.g1.launcher.a%41", schemas.NodeHeartbeat(role="launcher"),
     "cannot be a NATS subject token"),
])
def test_a_launcher_beat_that_disagrees_with_its_subject_is_refused(subject, ev, why):
    """Refused as a bad name is (a ValueError, which the bus counts as a handler error), and
    nothing of it is kept."""
    s = state()
    with pytest.raises(ValueError, match=why):
        step(s, Received(subject, ev, wall(T0)), T0)
    assert s.nodes == {} and s.jobs == {}


def test_a_dotted_node_name_is_kept_from_the_subject_to_the_jobs_anomaly():
    """A Kubernetes node name (spec.nodeName, dots included) keys the node's windows as the
    members name it, whether the event or only its subject token (``%2E``) carries it."""
    node = "ip-10-0-1-3.ec2.internal"
    recs = {"a": JobRecord(runs=1, members=[{"rank": 0, "node": node, "local_rank": 0}])}
    beat = (T0, Received(subjects.node(node, "heartbeat"),
                         schemas.NodeHeartbeat(node=None, role="agent"), wall(T0)))
    s, eff = run_offline(step, state(), learn_jobs("a") + [beat, tick(T0 + 3.5)],
                         records(recs))
    assert set(s.nodes) == {node}
    lost = published(eff, "node_lost")
    assert [(e.subject, e.event.culprit.nodes, e.event.culprit.ranks) for e in lost] == [
        (subjects.node(node, "anomaly"), [node], []), ("tg.job.a.anomaly", [node], [0])]


def test_a_new_job_is_read_at_the_next_tick_then_every_job_refresh_s():
    inputs = [hb(T0), tick(T0 + 0.05), tick(T0 + 0.1), hb(T0 + 0.2, job="k"), tick(T0 + 0.25),
              tick(T0 + 2.0), tick(T0 + 2.1)]
    _, eff = run_offline(step, state(job_refresh_s=2.0), inputs,
                         records({"j": JobRecord(), "k": JobRecord()}))
    reads = [e.args[0] for e in eff if isinstance(e, Call)]
    assert reads == [["j"], ["k"], ["j", "k"]]          # one round trip per tick
    assert all(e.reply[0] == "jobs" and [n for n, _ in e.reply[1]] == e.args[0]
               and e.wait is False for e in eff if isinstance(e, Call))


def test_a_read_still_out_is_not_issued_again_and_a_superseded_reply_is_dropped():
    s = state(refresh_timeout_s=10.0)
    s, _ = step(s, hb(T0)[1], T0)
    [first] = refresh_calls(s, T0)
    assert refresh_calls(s, T0 + 5) == []                     # the first is still out
    [second] = refresh_calls(s, T0 + 11)                       # lost, presumably: again
    old, new = JobRecord(generation=1), JobRecord(generation=2)
    s, _ = step(s, Reply(second.reply, {"j": new}), T0 + 11.1)
    s, _ = step(s, Reply(first.reply, {"j": old}), T0 + 11.2)  # late reply of the old read
    assert s.records["j"].generation == 2 and s.reads == {}


def test_a_relaunched_job_starts_its_windows_over():
    recs = {"j": [JobRecord(runs=1, members=[{"rank": 0, "node": "n0"}, {"rank": 1, "node": "n0"}]),
                  JobRecord(runs=2, members=[{"rank": 0, "node": "n1"}])]}
    # rank 1 finished its run and fell silent; the next launch moved the job to n1
    inputs = [hb(T0, rank=0), hb(T0, rank=1), tick(T0 + 0.05)]
    s, _ = run_offline(step, state(job_refresh_s=1.0), inputs, records(recs))
    assert set(s.jobs["j"].ranks) == {0, 1} and s.records["j"].runs == 1
    s, eff = run_offline(step, s, [tick(T0 + 1.1)] + [tick(T0 + 1.1 + 0.25 * k)
                                                     for k in range(1, 12)], records(recs))
    assert s.records["j"].runs == 2 and s.jobs["j"].ranks == {}
    assert s.node_jobs == {"n1": {"j"}}
    assert published(eff) == []          # no silence anomaly for the old run's ranks


def test_a_failed_read_keeps_the_last_record():
    good = JobRecord(runs=1, hang_timeout_s=7.0, members=[{"rank": 0, "node": "g1"}])
    recs = {"j": [good, ConnectionError("valkey gone")]}
    inputs = [hb(T0), tick(T0 + 0.05), tick(T0 + 2.1)]
    s, eff = run_offline(step, state(job_refresh_s=2.0), inputs, records(recs))
    assert s.records["j"] is good and s.node_jobs == {"g1": {"j"}}
    [warning] = [e for e in eff if isinstance(e, Log)]
    assert warning.level == logging.WARNING
    assert "ConnectionError: valkey gone" in warning.message
    assert "keeping the last" in warning.message


def test_a_failed_first_read_stores_no_record_and_does_not_reset_later():
    recs = {"j": [ConnectionError("down"), JobRecord(runs=1)]}
    inputs = [hb(T0), tick(T0 + 0.05)]
    s, _ = run_offline(step, state(job_refresh_s=2.0), inputs, records(recs))
    assert "j" not in s.records
    s, _ = run_offline(step, s, [tick(T0 + 2.1)], records(recs))
    assert s.records["j"].runs == 1 and set(s.jobs["j"].ranks) == {0}   # windows kept


# ---- periodic rules ------------------------------------------------------------------------
def test_a_silent_rank_gives_exactly_one_hang_timed_from_its_last_progress():
    inputs = []
    for k in range(40):                                        # 0.1 s beats for 4 s
        t = T0 + 0.1 * k
        inputs += [hb(t, rank=0, phase="train", step_=k)]
        if k < 10:                                             # rank 1 stops at T0 + 0.9,
            inputs += [hb(t, rank=1, phase="train", step_=min(k, 7))]  # its last step at 0.7
        inputs += [tick(t + 0.05)]
    _, eff = run_offline(step, state(), inputs)
    [hang] = published(eff)
    a = hang.event
    assert (a.kind, a.culprit.ranks, a.detail["rule"]) == ("hang", [1], "silence")
    # the rank's allowance is silence_beats (15) x its 0.1 s interval = 1.5 s after its last beat
    # at T0 + 0.9: the first tick past it is T0 + 2.45, which is no evaluation tick (those are
    # T0 + 0.05 + k * eval_s 0.25): silence is judged on every tick
    assert a.detail["timeout_s"] == 1.5
    assert a.ts == wall(T0 + 2.45)                              # found by that tick
    # the fault is the rank's last progress (its step 7 at T0 + 0.7), not the tick that found
    # it: what is timed from the fault counts the 1.75 s of silence before detection
    assert a.first_ts == a.detail["last_progress_ts"] == wall(T0 + 0.7)
    assert a.detail["since_progress_s"] == 1.75
    assert hang.subject == "tg.job.j.anomaly"


def test_stragglers_are_judged_every_eval_s_not_every_tick():
    inputs = []
    for k in range(12):                    # rank 3 is 10x slower from its step 2 (T0 + 0.2)
        t = T0 + 0.1 * k
        for r in range(4):
            inputs.append(hb(t, rank=r, step_=k, seq=k, phase="train",
                             step_time_s=1.0 if r == 3 and k >= 2 else 0.1))
        inputs.append(tick(t + 0.01))
    s, eff = run_offline(step, state(eval_s=1.0), inputs)
    [st] = published(eff, "straggler")
    assert st.event.culprit.ranks == [3]
    # its median of 5 was slow from T0 + 0.4 on, but the evaluation after the first (T0 + 0.01)
    # ran only at the first tick eval_s later
    assert st.event.first_ts == wall(T0 + 1.01) and s.last_eval == pytest.approx(T0 + 1.01)


def test_missing_member_needs_the_record():
    rec = {"j": JobRecord(runs=1, startup_timeout_s=2.0, members=[
        {"rank": 0, "node": "n0"}, {"rank": 1, "node": "n1"}])}
    inputs = [hb(T0 + 0.5 * k, rank=0) for k in range(8)]
    inputs = [x for pair in zip(inputs, [tick(T0 + 0.5 * k + 0.1) for k in range(8)])
              for x in pair]
    _, without = run_offline(step, state(), inputs)
    assert published(without) == []
    _, eff = run_offline(step, state(), inputs, records(rec))
    [m] = published(eff)
    assert m.event.culprit.ranks == [1] and m.event.detail["rule"] == "never_started"
    assert m.event.first_ts == wall(T0 + 2.1)


# ---- events ----------------------------------------------------------------------------------
def test_nan_loss_gives_one_anomaly_stamped_with_the_heartbeats_time():
    ev_ts = NS - 5
    inputs = [hb(T0, loss=float("nan"), ts=ev_ts), hb(T0 + 0.1, loss=float("nan"), ts=ev_ts + 1)]
    _, eff = run_offline(step, state(), inputs)
    [a] = published(eff)
    assert (a.event.kind, a.event.first_ts, a.event.ts) == ("nan_loss", ev_ts, wall(T0))


def test_events_that_are_not_the_detectors_change_nothing():
    s = state()
    verdict = schemas.Verdict(job="j", fault_class="crash", layer="unknown", confidence="high")
    for inp in (Received(subjects.job("j", "verdict"), verdict, wall(T0)),
                Received(subjects.job("j", "worker"), schemas.TrainingResumed(
                    job="j", generation=1, world_size=2, restored_step=1, resumed_step=2)),
                Reply(("toy", 1), 3), Reply("not-a-tuple")):
        s, eff = step(s, inp, T0)
        assert eff == []
    assert s.jobs == {} and s.nodes == {} and s.emitted == {} and s.due == set()


def test_relayed_symptoms_are_ignored_and_skipped_saves_are_no_fault():
    line = "RuntimeError: [pair.cc:598] Connection closed by peer [127.0.0.1]:1234"
    relayed = (T0, Received(subjects.job("j", "log"), schemas.LogLine(
        job="j", rank=1, node="n0", line=line, source="launcher"), wall(T0)))
    own = (T0, Received(subjects.job("j", "log"), schemas.LogLine(
        job="j", rank=1, node="n0", line=line, stream="exception"), wall(T0)))
    skipped = (T0, Received(subjects.job("j", "ckpt"), schemas.CheckpointSaveFailed(
        job="j", rank=0, node="n0", step=5, error="skipped: busy"), wall(T0)))
    failed = (T0, Received(subjects.job("j", "ckpt"), schemas.CheckpointSaveFailed(
        job="j", rank=0, node="n0", step=5, error="[Errno 28] No space left"), wall(T0)))
    _, eff = run_offline(step, state(), [relayed, skipped])
    assert published(eff) == []
    _, eff = run_offline(step, state(), [own, failed])
    assert [(e.event.fault_class, e.event.detail.get("stream")) for e in published(eff)] == [
        ("network", "exception"), ("checkpoint_save", None)]


def test_input_events_are_not_changed():
    ev = schemas.XidEvent(node="g1", xid=79, pci="p", gpu_index=0, gpu_uuid="GPU-1", raw="x")
    log_ev = schemas.LogLine(job="a", rank=0, node="g1", line="CUDA error: an illegal memory "
                                                            "access was encountered")
    before = (ev.model_dump(), log_ev.model_dump())
    inputs = learn_jobs("a") + [(T0 + 1, Received("tg.node.g1.xid", ev, wall(T0 + 1))),
                                (T0 + 1, Received("tg.job.a.log", log_ev, wall(T0 + 1)))]
    _, eff = run_offline(step, state(), inputs, records(dict(MEMBERS)))
    assert len(published(eff)) == 3
    assert (ev.model_dump(), log_ev.model_dump()) == before


# ---- memory ---------------------------------------------------------------------------------
def test_gc_forgets_silent_ranks_then_the_job_and_its_record():
    inputs = learn_jobs("a") + [tick(T0 + 5), tick(T0 + 30.1)]
    s, _ = run_offline(step, state(forget_after_s=20.0, gc_s=10.0), inputs,
                       records(dict(MEMBERS)))
    assert s.jobs == {} and s.records == {} and s.node_jobs == {} and s.job_seen == {}


@pytest.mark.parametrize("wait", [False, True])
def test_refresh_calls_reads_every_known_job(wait):
    s = state()
    for j in ("x", "y"):
        s, _ = step(s, hb(T0, job=j)[1], T0)
    calls = refresh_calls(s, T0, wait=wait)
    assert [(c.method, c.args, c.wait) for c in calls] == [("job_records", (["x", "y"],), wait)]
    assert s.due == set()


def test_a_failed_loss_check_after_a_restore_is_an_anomaly_the_policy_stops_on():
    """recovery.verified with ok False → one checkpoint_corrupt anomaly per rank (layer hint
    application) → the attributor's verdict → the policy stops the job; ok True → nothing."""
    from trainguard.attributor.decide import decide as attribute
    from trainguard.remediator.policy import decide as remediate

    def verified(rank, ok, loss_after):
        return T0, Received(subjects.job("j", "recovery"), schemas.RecoveryVerified(
            job="j", rank=rank, node="n0", generation=2, restored_step=20, loss_at_save=0.31,
            loss_after=loss_after, tolerance=0.5, ok=ok), wall(T0))

    _, eff = run_offline(step, state(), [verified(0, True, 0.33)])
    assert published(eff) == []
    _, eff = run_offline(step, state(), [verified(0, False, 2.30), verified(1, False, 2.28),
                                         verified(1, False, 2.28)])
    found = [e.event for e in published(eff)]
    assert [(a.fault_class, a.kind, a.culprit.ranks) for a in found] == [
        ("checkpoint_corrupt", "recovery_check", [0]), ("checkpoint_corrupt", "recovery_check",
                                                        [1])]
    assert found[0].detail["step"] == 20 and "2.3" in found[0].evidence[0]
    spec = attribute(found)
    assert (spec.fault_class, spec.layer) == ("checkpoint_corrupt", "application")
    v = schemas.Verdict(job="j", fault_class=spec.fault_class, layer=spec.layer,
                        culprit={"ranks": spec.ranks, "nodes": spec.nodes}, generation=2,
                        detail=spec.detail)
    rec = JobRecord(mode="action", generation=2, world_size=2, retry_budget=5,
                    members=[{"rank": 0, "node": "n0", "local_rank": 0},
                             {"rank": 1, "node": "n0", "local_rank": 1}])
    d = remediate(v, rec)
    assert d is not None and d.action == "stop_job_notify_user", d


def _silences(rules, recs, inputs):
    s, eff = run_offline(step, state(rules=rules, job_refresh_s=1.0), inputs, records(recs))
    return s, [(e.event.culprit.ranks, round(e.event.first_ts / 1e9 - wall(T0) / 1e9, 2))
               for e in published(eff, "hang")]


def test_a_silent_rank_is_found_at_the_first_tick_past_its_timeout_whatever_ticks_skip():
    """The tick skips a job until its earliest possible silence (``JobState.silence_due``):
    rank 1 stops at T0 + 1 while rank 0 goes on; found at the first tick past 1 + 5 s."""
    rules = DetectorConfig(silence_timeout_s=5.0)
    beats = [hb(T0 + 0.1 * k, rank=0, step_=k) for k in range(80)]
    beats += [hb(T0 + 0.1 * k, rank=1, step_=k) for k in range(11)]
    ticks = [tick(T0 + 0.05 * k) for k in range(1, 160)]
    inputs = sorted(beats + ticks, key=lambda x: x[0])
    s, found = _silences(rules, {"j": JobRecord()}, inputs)
    [(ranks, _)] = found
    assert ranks == [1]
    [hang] = [e for e in run_offline(step, state(rules=rules, job_refresh_s=1.0), inputs,
                                     records({"j": JobRecord()}))[1]
              if isinstance(e, Publish) and e.event.kind == "hang"]
    assert abs(hang.event.ts / 1e9 - wall(T0 + 6.05) / 1e9) < 1e-6   # tick at 6.05 > 1.0 + 5
    assert s.jobs["j"].silence_due <= T0 + 7.9 + 5.0


def test_a_record_that_shortens_the_hang_timeout_is_judged_at_the_next_tick():
    """The job's deadline was set with the 5 s default; the record read at T0 + 3 says 2 s:
    rank 0, silent since T0, is found at the tick after the read, not at T0 + 5."""
    rules = DetectorConfig(silence_timeout_s=5.0)
    recs = {"j": [JobRecord(runs=1), JobRecord(runs=1, hang_timeout_s=2.0)]}
    inputs = [hb(T0), tick(T0 + 0.05)] + [tick(T0 + 0.5 * k) for k in range(1, 9)]
    _, found = _silences(rules, recs, inputs)
    assert found and found[0][0] == [0]
    [hang] = [e for e in run_offline(step, state(rules=rules, job_refresh_s=1.0), inputs,
                                     records({"j": [JobRecord(runs=1),
                                                    JobRecord(runs=1, hang_timeout_s=2.0)]}))[1]
              if isinstance(e, Publish) and e.event.kind == "hang"]
    assert wall(T0 + 2.0) <= hang.event.ts <= wall(T0 + 2.5)


def test_past_its_bounds_the_detector_refuses_new_jobs_ranks_and_nodes_and_keeps_the_rest():
    """``max_jobs`` / ``max_ranks`` / ``max_nodes``: an event that would track one more is
    refused and counted (one warning), what is tracked goes on being judged (a NaN loss of a
    tracked rank is still an anomaly), and a collection frees room."""
    s = state(max_jobs=2, max_ranks=3, max_nodes=1, forget_after_s=5.0, gc_s=1.0)
    inputs = [hb(T0, job="a", rank=0), hb(T0, job="a", rank=1), hb(T0, job="b", rank=0),
              hb(T0 + 0.1, job="c", rank=0),                     # a third job: refused
              hb(T0 + 0.1, job="a", rank=2),                     # a fourth rank: refused
              hb(T0 + 0.2, job="a", rank=1, loss=float("nan")),  # tracked: still judged
              (T0 + 0.2, Received(subjects.node("g1", "heartbeat"),
                                  schemas.NodeHeartbeat(node="g1", role="agent"), wall(T0))),
              (T0 + 0.2, Received(subjects.node("g2", "heartbeat"),
                                  schemas.NodeHeartbeat(node="g2", role="agent"), wall(T0)))]
    s, eff = run_offline(step, s, inputs, records({"a": JobRecord(), "b": JobRecord()}))
    assert set(s.jobs) == {"a", "b"} and set(s.jobs["a"].ranks) == {0, 1} and set(s.nodes) == {"g1"}
    assert s.refused == {"jobs": 1, "ranks": 1, "nodes": 1}
    assert [e.event.culprit.ranks for e in published(eff, "nan_loss")] == [[1]]
    [warning] = [e for e in eff if isinstance(e, Log) and "bound" in e.message]
    assert "tracking 2 jobs already" in warning.message
    # job b falls silent past forget_after_s and is collected: room for job c
    later = [hb(T0 + 6.0, job="a", rank=0), hb(T0 + 6.0, job="a", rank=1), tick(T0 + 6.1),
             hb(T0 + 6.2, job="c", rank=0)]
    s, _ = run_offline(step, s, later, records({"a": JobRecord(), "c": JobRecord()}))
    assert "c" in s.jobs and "b" not in s.jobs and s.ranks == 3


def test_a_launcher_beat_on_the_agents_subject_is_refused_and_changes_nothing():
    """Only the node agent beats on ``tg.node.<node>.heartbeat``: a beat of another role there
    (a worker vouching for a node, or a launcher on the wrong subject) is refused, and the node
    it names stays unknown."""
    s = state()
    t, inp = node_beat(T0, "g9", "agent")
    inp = Received(subjects.node("g9", "heartbeat"),
                   schemas.NodeHeartbeat(node="g9", role="launcher", job="a"), wall(T0))
    with pytest.raises(ValueError, match="not 'agent'"):
        step(s, inp, T0)
    assert "g9" not in s.nodes

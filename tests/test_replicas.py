"""Replicas and redeliveries, offline: rendezvous ownership, the relevance table, and what each
reducer does with an event delivered twice, a job gained or released, and the decision outbox.
The real-process versions are in ``test_durable_e2e.py``."""
from __future__ import annotations

import collections
import threading

import pytest

from test_attributor_reducer import History, at, crash as a_crash, run as a_run, verdicts
from test_detector_reducer import exited, state as d_state, tick, xid
from test_remediator_reducer import (Store, crash as v_crash, published, record, run as
                                           r_run, verdict_in)
from trainguard import schemas
from trainguard.services.durable import RELEVANCE, consumer_name, matches, max_age_s
from trainguard.detector import reducer as dred
from trainguard.services.membership import Membership, owner, partition_key
from trainguard.core.reducer import Call, Gained, Publish, Released, Reply, Tick, run_offline
from trainguard.remediator import reducer as rred
from trainguard.remediator.model import Pending, RemediatorConfig, RemediatorState
from trainguard.schemas import JobRecord, subjects

WALL = 1_700_000_000 * 10**9


# ---- ownership ----------------------------------------------------------------------------------
def test_rendezvous_spreads_jobs_and_a_leaving_member_moves_only_its_own():
    jobs = [f"job-{i}" for i in range(3000)]
    three = {j: owner(j, ["a", "b", "c"]) for j in jobs}
    share = collections.Counter(three.values())
    assert all(800 < n < 1200 for n in share.values()), share  # about a third each
    two = {j: owner(j, ["a", "c"]) for j in jobs}
    moved = [j for j in jobs if two[j] != three[j]]
    assert moved and all(three[j] == "b" for j in moved)  # only b's jobs moved
    assert owner("x", []) is None and owner("x", ["z"]) == "z"


def test_membership_owns_its_keys_and_everyone_serves_unkeyed_subjects():
    m = Membership("detector", "a")
    assert m.owns("j1") and m.owns(None)  # alone: everything
    assert all(m.owns(f"hostile-{i}") for i in range(100)) and m._cache == {}  # nothing kept
    m.update(["b", "c"])  # this replica stays a member while it runs
    assert m.members == ("a", "b", "c") and m.epoch == 1
    assert m.owns("j1") == (owner("j1", ["a", "b", "c"]) == "a")
    assert partition_key("tg.job.j1.rank.3.hb") == "j1"
    assert partition_key("tg.node.n4.xid") == "node:n4"
    assert partition_key("tg.svc.detector.health") is None


@pytest.mark.parametrize("partitions", [0, 32])
def test_a_dotted_name_has_one_owner_whichever_side_asks(partitions):
    """The key a message's subject gives (``partition_key``: the token, ``%2E`` for a dot) is
    the name a reducer asks ``serves`` about: a Kubernetes node named by its FQDN or a dotted
    job is owned by the same one replica of three both ways (the token's key went to another
    replica than the name's for some names, so a node's messages reached one replica while
    another, or none, emitted on the node's subject)."""
    members = ["r0", "r1", "r2"]
    for name in ("ip-10-0-1-%d.ec2.internal" % i for i in range(40)):
        node_subject = subjects.node(name, "heartbeat")
        job_subject = subjects.rank_hb(name, 0)
        assert partition_key(node_subject) == f"node:{name}"
        assert partition_key(job_subject) == name
        m = Membership("detector", "r0")
        m.update(members)
        m.set_partitions(partitions)
        assert m.owns(partition_key(node_subject)) == m.owns(f"node:{name}")
        assert m.owns(partition_key(job_subject)) == m.owns(name)
    # and the token's key would have disagreed for some of them (what the test guards)
    assert any(owner(f"node:{subjects.token(n)}", members) != owner(f"node:{n}", members)
               for n in ("ip-10-0-1-%d.ec2.internal" % i for i in range(40)))


@pytest.mark.parametrize("node", ["n4", "ip-10-0-1-2.ec2.internal"])
def test_a_launchers_beat_is_read_in_its_nodes_partition_as_the_agents_is(node):
    """``tg.node.<node>.launcher.<job>`` stays under the node: the same partition key as the
    agent's ``tg.node.<node>.heartbeat`` (the replica that judges the node hears both), kept
    by the same stream, read by the detector with the same relevance and in-flight bound."""
    from trainguard.clients.streams import STREAMS
    from trainguard.services.durable import max_ack_pending_for

    agent, launcher = subjects.node(node, "heartbeat"), subjects.launcher(node, "job.1")
    assert partition_key(launcher) == partition_key(agent) == f"node:{node}"
    assert max_age_s(launcher) == max_age_s(agent) == 3.0
    from trainguard.services.durable import batched_acks

    assert batched_acks(subjects.ALL_LAUNCHERS) and batched_acks("tg.node.*.heartbeat")
    assert max_ack_pending_for(subjects.ALL_LAUNCHERS) == max_ack_pending_for(
        "tg.node.*.heartbeat")
    kept = {name: subs for name, subs, _ in STREAMS}
    assert {"tg.node.*.heartbeat", subjects.ALL_LAUNCHERS} <= set(kept["TG_TELEMETRY"])
    assert {"tg.node.*.heartbeat", subjects.ALL_LAUNCHERS} <= set(dred.TOPICS)
    assert matches(subjects.ALL_LAUNCHERS, launcher) and not matches(subjects.ALL_LAUNCHERS,
                                                                      agent)
    assert consumer_name("detector", "r1", subjects.ALL_LAUNCHERS) != consumer_name(
        "detector", "r1", "tg.node.*.heartbeat")


def test_known_keys_are_another_replicas_and_this_ones_that_decoded():
    """A replica records the partition key of another replica's message as it acks it, and of
    its own once the message decoded: keys named only by undecodable messages (a hostile flood
    names a new one in each) are not kept."""
    from trainguard.services.base import Service, ServiceConfig

    class Svc(Service):
        name, partitioned, uses_state = "svc", True, False

    svc = Svc(ServiceConfig(nats_url="nats://127.0.0.1:1", redis_url="", replica="a"))
    svc.membership.update(["b"])
    mine = next(f"j{i}" for i in range(100) if svc.membership.owns(f"j{i}"))
    theirs = next(f"j{i}" for i in range(100) if not svc.membership.owns(f"j{i}"))
    assert svc.accepts(f"tg.job.{mine}.log") and svc.known == set()
    assert not svc.accepts(f"tg.job.{theirs}.log") and svc.known == {theirs}
    svc._seen(f"tg.job.{mine}.log")
    assert svc.known == {theirs, mine}


# ---- relevance ----------------------------------------------------------------------------------
def test_relevance_table_rows_and_matching():
    assert all(r.reason for r in RELEVANCE)
    assert matches("tg.job.*.rank.*.hb", "tg.job.j.rank.3.hb")
    assert not matches("tg.job.*.rank.*.hb", "tg.job.j.rank.3.hb.x")
    assert matches("tg.dlq.>", "tg.dlq.detector") and not matches("tg.dlq.>", "tg.dlq")
    assert max_age_s("tg.job.j.rank.0.hb") == 5.0  # a heartbeat: seconds
    assert max_age_s("tg.job.*.verdict") >= 3600  # a verdict: still decided after a restart
    assert max_age_s("tg.svc.x.health") == float("inf")
    assert "." not in consumer_name("detector", "r1", "tg.job.*.rank.*.hb")


def test_in_flight_bounds_keep_a_backlog_within_its_ack_wait():
    from trainguard.services.durable import (ACK_WAIT_S, HELD_ACK_WAIT_S, HELD_IN_FLIGHT, IN_FLIGHT,
                                    max_ack_pending_for)

    assert all(r.reason for r in IN_FLIGHT)
    # heartbeats: a 10,000-rank burst fits; at ≈ 56 µs a step the last waits < the ack wait
    assert max_ack_pending_for("tg.job.*.rank.*.hb") >= 10_000
    assert max_ack_pending_for("tg.job.*.rank.*.hb") * 56e-6 < ACK_WAIT_S / 3
    # events cost milliseconds: at 5 ms each the last one in flight is handled in time
    assert max_ack_pending_for("tg.job.*.verdict") * 5e-3 < ACK_WAIT_S
    assert max_ack_pending_for("tg.node.*.xid") == max_ack_pending_for("tg.job.*.worker")
    # a held topic's 6 s wait: 10 ms each
    assert max_ack_pending_for("tg.job.*.verdict", holds=True) == HELD_IN_FLIGHT
    assert HELD_IN_FLIGHT * 10e-3 < HELD_ACK_WAIT_S


# ---- detector: redelivery, node scope, release --------------------------------------------------
def test_detector_redelivered_event_gives_the_same_anomaly_id():
    ev = exited(100.0, rank=1)
    _, eff1 = run_offline(dred.step, d_state(), [ev])
    _, eff2 = run_offline(dred.step, d_state(), [ev])  # a restarted replica sees it again
    [a1], [a2] = [e.event for e in eff1 if isinstance(e, Publish)], \
        [e.event for e in eff2 if isinstance(e, Publish)]
    assert a1.event_id == a2.event_id and len(a1.event_id) == 32
    _, eff3 = run_offline(dred.step, d_state(), [exited(101.0, rank=1)])  # another exit
    assert [e.event.event_id for e in eff3 if isinstance(e, Publish)] != [a1.event_id]


def test_detector_node_finding_published_for_the_node_only_by_its_owner():
    st = d_state()
    st.records["j"] = JobRecord(members=[{"rank": 0, "node": "g1", "local_rank": 0}])
    st.node_jobs["g1"] = {"j"}
    st.serves = lambda key: key != "node:g1"
    _, eff = run_offline(dred.step, st, [xid(100.0, node="g1")])
    subs = [e.subject for e in eff if isinstance(e, Publish)]
    assert subs == [subjects.job("j", "anomaly")]  # the job's, not tg.node.g1.anomaly


def test_detector_released_job_is_forgotten():
    st, _ = run_offline(dred.step, d_state(), [exited(100.0, rank=1), tick(100.1)])
    assert "j" in st.jobs
    st, eff = run_offline(dred.step, st, [(101.0, Released("j"))])
    assert "j" not in st.jobs and "j" not in st.job_seen and eff == []


# ---- attributor: redelivery, verdict id, release ------------------------------------------------
def test_attributor_redelivered_anomaly_changes_nothing_and_verdict_ids_repeat():
    a = a_crash()
    _, eff = a_run([at(0.0, a), at(0.5, a)])
    [v] = verdicts(eff)
    _, eff2 = a_run([at(3.0, a)])  # another replica (or a restart) reaches the same conclusion
    [v2] = verdicts(eff2)
    assert v2.event_id == v.event_id


def test_attributor_released_job_drops_its_incidents():
    st, _ = a_run([at(0.0, a_crash())])
    assert st.incidents
    st, _ = run_offline(__import__("trainguard.attributor.incidents", fromlist=["step"]).step,
                        st, [(1.0, Released("j"))], History())
    assert not st.incidents and "j" not in st.latest_gen


# ---- remediator: outbox order, sweep, gained / released -----------------------------------------
def test_decision_is_in_the_outbox_before_it_is_published_and_leaves_it_once_stored():
    st = Store(j=record())
    _, eff = r_run(st, [verdict_in(v_crash(rank=3))])
    kinds = [(type(e).__name__, getattr(e, "method", "")) for e in eff]
    commit = kinds.index(("Call", "commit_decision"))
    pub = next(i for i, e in enumerate(eff) if isinstance(e, Publish))
    assert commit < pub and eff[commit].kwargs["outbox"]["event_id"] == eff[pub].event.event_id
    assert eff[pub].stored  # with a JetStream ack
    assert kinds.index(("Call", "outbox_done")) > pub and st.outboxes["j"] == {}


def test_observe_mode_decision_goes_through_the_outbox_too():
    st = Store(j=record(mode="observe"))
    _, eff = r_run(st, [verdict_in(v_crash(rank=3))])
    methods = [getattr(e, "method", type(e).__name__) for e in eff]
    assert methods.index("outbox_put") < methods.index("Publish")


def test_sweep_publishes_again_what_no_stream_acknowledged_once_per_sweep():
    st = Store(j=record())
    dec = schemas.Decision(job="j", action="restart_workers", mode="action", generation=1,
                           idempotency_key="j:g0", reason="left by a killed instance")
    st.outbox_put("j", dec.to_dict())
    state = RemediatorState(config=RemediatorConfig(decision_timeout_s=60, controller="local",
                                                    outbox_sweep_s=2.0), armed=True)
    state, eff = run_offline(rred.step, state, [(0.0, Tick(WALL)), (0.5, Tick(WALL)),
                                                (1.0, Tick(WALL))], st)
    [d] = published(eff)
    assert d.event_id == dec.event_id and st.outboxes["j"] == {}
    assert state.outbox_counts == {"stored": 1, "republished": 1}
    # a replica that does not serve the job leaves its outbox alone
    st.outbox_put("j", dec.to_dict())
    other = RemediatorState(config=state.config, armed=True, serves=lambda job: False)
    _, eff = run_offline(rred.step, other, [(0.0, Tick(WALL))], st)
    assert published(eff) == [] and st.outboxes["j"]


def test_a_failed_stored_publish_stays_in_the_outbox():
    state = RemediatorState(publishing=frozenset({"d1"}))
    state, eff = rred.step(state, Reply(("published", "j", "d1"), None, "NotStored: gone"), 0.0)
    assert "d1" not in state.publishing and not [e for e in eff if isinstance(e, Call)]


def test_gained_job_is_rearmed_and_released_job_loses_its_pending_decision():
    dec = schemas.Decision(job="j", action="restart_workers", mode="action", generation=1,
                           idempotency_key="j:g0", reason="r")
    state = RemediatorState(pending={"j": Pending(dec, 60.0)}, armed=True)
    state, eff = rred.step(state, Released("j"), 1.0)
    assert "j" not in state.pending and eff == []
    state, eff = rred.step(state, Gained("j"), 2.0)
    assert [(c.method, c.reply) for c in eff] == [("job", ("rearm_job", "j"))]


# ---- executors: at most once per idempotency key ------------------------------------------------
def test_decision_inbox_takes_each_key_once():
    from trainguard.rank.state import DecisionInbox
    from trainguard.rank.state import WorkerConfig

    cfg = WorkerConfig(job="j", rank=1, world_size=2, node="n1", local_rank=1, generation=0)
    inbox = DecisionInbox(cfg)
    d = schemas.Decision(job="j", action="restart_in_process", mode="action", execute=True,
                         generation=1, ranks=[1], nodes=["n1"], idempotency_key="j:g0",
                         reason="r")
    assert inbox.offer(d)
    assert not inbox.offer(d)  # delivered again (the last stored one, a republished copy)
    copy = d.model_copy(update={"event_id": schemas.new_event_id()})
    assert not inbox.offer(copy) and len(inbox.decisions) == 1
    ok = threading.Event()
    threading.Thread(target=lambda: ok.set() if inbox.wait(1.0) is d else None).start()
    assert ok.wait(2.0)


@pytest.mark.parametrize("subject", ["tg.job.j.rank.0.hb", "tg.node.n.heartbeat"])
def test_heartbeats_are_short_lived(subject):
    assert max_age_s(subject) <= 5.0


# ---- a bus outage is not a silence of the ranks --------------------------------------------------
def test_detector_judges_no_silence_while_the_bus_is_down_and_restarts_the_clocks_after():
    from test_detector_reducer import hb

    from trainguard.core.reducer import BusDown, BusUp, Received

    def node_hb(t):
        return t, Received(subjects.launcher("n0", "j"),
                           schemas.NodeHeartbeat(node="n0", job="j", role="launcher"), WALL)

    st, _ = run_offline(dred.step, d_state(), [hb(100.0), node_hb(100.0), tick(100.05)])
    # the bus stops answering at 100.5; ticks go on for 20 s: nothing is judged
    st, eff = run_offline(dred.step, st, [(100.5, BusDown(WALL))]
                          + [tick(100.5 + 0.5 * i) for i in range(40)])
    assert not [e for e in eff if isinstance(e, Publish)]
    # it answers again: the silence clocks restart there, a rank and node heard again is fine
    st, eff = run_offline(dred.step, st, [(121.0, BusUp(20.5, WALL)), tick(121.5),
                                          hb(122.0), node_hb(122.0), tick(122.5)])
    assert not [e for e in eff if isinstance(e, Publish)]
    # and one still silent long after the bus came back is judged as usual
    _, eff = run_offline(dred.step, st, [tick(140.0)])
    kinds = {e.event.kind for e in eff if isinstance(e, Publish)}
    assert "node_lost" in kinds, kinds


def test_remediator_watchdog_deadlines_move_on_by_the_outage():
    from trainguard.core.reducer import BusUp

    dec = schemas.Decision(job="j", action="restart_workers", mode="action", generation=1,
                           idempotency_key="j:g0", reason="r")
    state = RemediatorState(pending={"j": Pending(dec, 60.0)}, armed=True)
    state, _ = rred.step(state, BusUp(30.0, WALL), 50.0)
    assert state.pending["j"].deadline == 90.0


def test_stack_runs_named_replicas_of_the_partitioned_services(tmp_path):
    from trainguard.stack.local import Stack

    st = Stack(services=("agent", "detector", "remediator"), agent_nodes=("a",), replicas=2,
               log_dir=tmp_path)
    assert st.service_names() == ["agent-a", "detector-0", "detector-1", "remediator-0",
                                  "remediator-1"]
    cmd, role = st._service_cmd("detector-1")
    assert cmd[-2:] == ["--replica", "detector-1"] and role == "detector"
    assert st._health_subject("detector-1") == "tg.svc.detector.health.detector-1"
    assert st._health_subject("agent-a") == "tg.svc.agent-a.health"
    one = Stack(services=("detector",), replicas=1, log_dir=tmp_path)
    assert one.service_names() == ["detector"]
    assert one._service_cmd("detector")[0][-2:] == ["--replica", "detector"]
    with pytest.raises(ValueError):
        Stack(services=("detector",), replicas=0, log_dir=tmp_path)

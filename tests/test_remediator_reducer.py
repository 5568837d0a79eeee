"""The remediator's reducer as a table, without servers: ``run_offline`` drives
``remediator.reducer.step`` and a small in-memory store answers its calls (claim: the previous
owner or None; job: a ``JobRecord``; bump_generation; commit_decision; the controller)."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from trainguard import schemas
from trainguard.scheduler.local import ControllerResult
from trainguard.core.reducer import Call, Log, Publish, Received, Tick, run_offline
from trainguard.remediator import reducer
from trainguard.remediator.model import decision_id, verdict_token
from trainguard.remediator.reducer import RemediatorConfig, RemediatorState
from trainguard.schemas import (ActionResult, Decision, JobRecord, TrainingResumed, Verdict,
                                subjects)

MEMBERS = [{"rank": 0, "node": "n1", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 1},
           {"rank": 2, "node": "n2", "local_rank": 0}, {"rank": 3, "node": "n2", "local_rank": 1}]
WALL = 1_700_000_000 * 10**9  # Unix ns of the inputs


def record(**kw) -> JobRecord:
    fields = dict(mode="action", generation=0, world_size=4, min_world_size=2, retry_budget=5,
                  retries_used=0, members=copy.deepcopy(MEMBERS), status="running")
    fields.update(kw)
    return JobRecord(**fields)


class Store:
    """In-memory answerer of the reducer's calls, with the semantics of ``StateStore``."""

    def __init__(self, **records: JobRecord):
        self.records = dict(records)
        self.claims: dict[str, str] = {}
        self.controller: dict[str, object] = {}  # node -> ControllerResult or an exception
        self.fail: set[str] = set()               # methods that raise ConnectionError
        self.fail_times: dict[str, int] = {}      # method -> how many more calls raise
        self.excluded: list[str] = []
        self.restarted: list[tuple] = []          # restart_pod calls: (node, job, before_ns)
        self.stopped: list[tuple] = []            # stop calls: (job, reason, generation)
        self.outboxes: dict[str, dict[str, dict]] = {}  # job -> decision id -> decision
        # the fleet breaker and its shadow over observe-mode jobs (compare-and-set)
        self.breakers = {"": schemas.BreakerState(), "observe": schemas.BreakerState()}
        self.breaker_trail: list[dict] = []

    def breaker_view(self, which=""):
        nodes = {m["node"] for r in self.records.values() for m in r.members}
        return self.breakers[which], len(nodes)

    def put_breaker(self, state, expected, which=""):
        if self.breakers[which].version != expected:
            return None
        self.breakers[which] = dataclasses.replace(state, version=expected + 1)
        return expected + 1

    def breaker_audit(self, record):
        self.breaker_trail.append(record)

    def __call__(self, call: Call):
        if self.fail_times.get(call.method, 0) > 0:
            self.fail_times[call.method] -= 1
            raise ConnectionError(f"{call.method}: valkey restarting")
        if call.method in self.fail:
            raise ConnectionError(f"{call.method}: valkey gone")
        if call.target == "controller":
            node = call.args[0]  # stop: the job
            if call.method == "stop":
                self.stopped.append(call.args)
            elif call.method == "restart_pod":
                self.restarted.append(call.args)
            else:
                self.excluded.append(node)
            res = self.controller.get(node, ControllerResult(True, f"node {node} {call.method}"))
            if isinstance(res, Exception):
                raise res
            return res
        assert call.target == "state"
        return getattr(self, call.method)(*call.args, **call.kwargs)

    def claim(self, key, owner):
        prev = self.claims.get(key)
        if prev is None:
            self.claims[key] = owner
        return prev

    def take_claim(self, key, old, owner):
        if self.claims.get(key) == old:
            self.claims[key] = owner
            return None
        return self.claims.get(key)

    def settle(self, key, outcome):
        self.claims[key] = outcome

    def claimed_by(self, key):
        return self.claims.get(key)

    def job(self, job):
        return copy.deepcopy(self.records.get(job, JobRecord()))

    def jobs(self):
        return sorted(self.records)

    def outbox_put(self, job, decision, settles=None):
        self.outboxes.setdefault(job, {})[decision["event_id"]] = copy.deepcopy(decision)
        if settles is not None:
            self.claims[settles] = f"decided:{decision['event_id']}"

    def outbox_done(self, job, decision_id):
        self.outboxes.get(job, {}).pop(decision_id, None)

    def outbox(self, jobs=None):
        return {j: list(v.values()) for j, v in self.outboxes.items() if v}

    def bump_generation(self, job, expected, by=""):
        rec = self.records[job]
        if rec.generation == expected:
            rec.generation += 1
            rec.generation_by = by
        return rec.generation

    def commit_decision(self, job, *, retries_used, last_decision, last_fault=None,
                        members=None, world_size=None, spare_nodes=None, stopped=False,
                        pending_decision=None, outbox=None, settles=None):
        rec = self.records[job]
        if outbox is not None:
            self.outbox_put(job, outbox, settles)
        rec.retries_used, rec.last_decision = retries_used, last_decision
        rec.pending_decision = pending_decision
        for k, v in dict(last_fault=last_fault, members=members, world_size=world_size,
                         spare_nodes=spare_nodes).items():
            if v is not None:
                setattr(rec, k, v)
        if stopped:
            rec.status = "stopped"


def run(store, inputs, state=None, timeout_s=60.0):
    state = state or RemediatorState(config=RemediatorConfig(decision_timeout_s=timeout_s,
                                                             controller="local"),
                                     armed=True)
    return run_offline(reducer.step, state, inputs, store)


def verdict_in(v: Verdict, now=0.0):
    return (now, Received(subjects.job(v.job, "verdict"), v, WALL + int(now * 1e9)))


def crash(job="j", rank=1, gen=0):
    return Verdict(job=job, fault_class="crash", layer="unknown", culprit={"ranks": [rank]},
                   generation=gen, first_ts=1000)


def node_lost(job="j", node="n2", gen=0):
    return Verdict(job=job, fault_class="node_lost", layer="infrastructure",
                   culprit={"nodes": [node]}, generation=gen, first_ts=2000)


def published(effects, kind=Decision):
    return [e.event for e in effects if isinstance(e, Publish) and isinstance(e.event, kind)]


def calls(effects, method):
    return [e for e in effects if isinstance(e, Call) and e.method == method]


def audits(effects, type_=None):
    recs = [c.args[1] for c in calls(effects, "audit")]
    return [r for r in recs if type_ is None or r["type"] == type_]


# ---- fold or decide -----------------------------------------------------------------------------
def test_one_decision_then_the_same_verdict_is_folded():
    st = Store(j=record())
    v = crash(rank=3)
    state, eff = run(st, [verdict_in(v), verdict_in(v, 1.0)])
    [d] = published(eff)
    assert (d.action, d.generation, d.execute, d.ranks, d.nodes, d.idempotency_key) == (
        "restart_workers", 1, True, [3], ["n2"], "j:g0")
    assert d.ts == WALL  # wall-clock fields from the input
    assert d.event_id == decision_id(v.event_id)  # the verdict's own decision id
    assert st.claims[f"j:verdict:{v.event_id}"] == f"decided:{d.event_id}"  # settled
    assert st.claims["j:g0"] == f"{d.event_id}/restart_workers"
    rec = st.records["j"]
    assert rec.generation == 1 and rec.retries_used == 1
    assert rec.last_fault["generation"] == 0 and rec.last_fault["fault_class"] == "crash"
    assert rec.pending_decision["event_id"] == d.event_id
    assert rec.pending_decision["deadline_ns"] == WALL + 60 * 10**9
    [dec_rec, fold] = audits(eff)
    assert dec_rec["type"] == "decision" and dec_rec["decision_id"] == d.event_id
    assert fold["type"] == "folded" and fold["reason"] == "this verdict was already decided"
    assert state.counts == {"decisions": 1, "folded": 1, "escalations": 0, "ignored": 0}
    assert state.pending["j"].decision.event_id == d.event_id
    assert state.pending["j"].deadline == pytest.approx(60.0)
    assert state.work == {}


@pytest.mark.parametrize("status", ["stopped", "finished", "failed"])
def test_an_ended_job_is_folded(status):
    st = Store(j=record(status=status))
    state, eff = run(st, [verdict_in(crash())])
    assert published(eff) == [] and "j:g0" not in st.claims
    [fold] = audits(eff)
    assert fold["type"] == "folded" and fold["reason"] == f"job is {status}: no further decisions"
    assert calls(eff, "bump_generation") == [] and state.counts["folded"] == 1


def test_a_flag_for_a_decided_generation_is_folded():
    st = Store(j=record())
    slow = Verdict(job="j", fault_class="straggler", layer="unknown",
                   culprit={"ranks": [3], "nodes": ["n2"]}, generation=0)
    state, eff = run(st, [verdict_in(crash()), verdict_in(slow, 1.0)])
    assert [d.action for d in published(eff)] == ["restart_workers"]
    [asked] = calls(eff, "claimed_by")
    assert asked.args == ("j:g0",)
    fold = audits(eff, "folded")[0]
    assert fold["reason"] == "generation already decided (restart_workers)"
    assert fold["into"].endswith("/restart_workers")
    # the same flag for an undecided generation is published (action none, not executed)
    st2 = Store(j=record())
    _, eff2 = run(st2, [verdict_in(slow)])
    [flag] = published(eff2)
    assert (flag.action, flag.execute, flag.generation) == ("none", False, 0)
    assert calls(eff2, "bump_generation") == [] and calls(eff2, "commit_decision") == []


@pytest.mark.parametrize("second", [
    crash(rank=2),                                                      # equal action
    Verdict(job="j", fault_class="app_exception", layer="application",  # weaker action
            culprit={"ranks": [1]}, generation=0),
])
def test_same_generation_weaker_or_equal_action_is_folded(second):
    st = Store(j=record())
    state, eff = run(st, [verdict_in(crash()), verdict_in(second, 1.0)])
    assert len(published(eff)) == 1 and st.records["j"].generation == 1
    fold = audits(eff, "folded")[0]
    assert fold["reason"] == "generation already decided (restart_workers)"
    assert fold["verdict_id"] == second.event_id
    assert not any(k.startswith("j:g0:") for k in st.claims)


def test_stronger_action_escalates_with_its_own_key_and_the_next_generation():
    st = Store(j=record())
    state, eff = run(st, [verdict_in(crash(rank=2)), verdict_in(node_lost(), 1.0)])
    first, second = published(eff)
    assert (second.action, second.generation) == ("exclude_node_and_requeue", 2)
    assert second.idempotency_key == "j:g0:exclude_node_and_requeue"
    assert "stronger than the restart_workers" in second.reason
    assert st.claims["j:g0:exclude_node_and_requeue"] == (
        f"{second.event_id}/exclude_node_and_requeue")
    assert [(m.rank, m.node) for m in second.members] == [(0, "n1"), (1, "n1")]
    rec = st.records["j"]
    assert rec.generation == 2 and rec.world_size == 2
    assert [m["node"] for m in rec.members] == ["n1", "n1"]


def test_an_escalation_already_decided_is_folded():
    st = Store(j=record())
    st.claims["j:g0:exclude_node_and_requeue"] = "other/exclude_node_and_requeue"
    state, eff = run(st, [verdict_in(crash(rank=2)), verdict_in(node_lost(), 1.0)])
    assert [d.action for d in published(eff)] == ["restart_workers"]
    fold = audits(eff, "folded")[0]
    assert fold["reason"] == "escalation already decided (exclude_node_and_requeue)"
    assert st.excluded == [] and st.records["j"].generation == 1


def test_observe_mode_changes_no_job_field():
    st = Store(j=record(mode="observe"))
    before = copy.deepcopy(st.records["j"])
    state, eff = run(st, [verdict_in(node_lost(node="n1")), verdict_in(crash(rank=3), 1.0)])
    assert [(d.action, d.execute, d.mode) for d in published(eff)] == [
        ("exclude_node_and_requeue", False, "observe"), ("restart_workers", False, "observe")]
    assert calls(eff, "bump_generation") == [] and calls(eff, "commit_decision") == []
    assert st.records["j"] == before and st.excluded == [] and state.pending == {}
    assert [r["type"] for r in audits(eff)] == ["decision", "decision"]


def test_bump_retries_from_the_generation_in_force():
    st = Store(j=record())
    real_job = st.job

    def stale(job):  # the record as read before another decision moved the generation to 3
        rec = real_job(job)
        return dataclasses.replace(rec, generation=0)

    st.job = stale
    st.records["j"].generation = 3
    _, eff = run(st, [verdict_in(crash())])
    [d] = published(eff)
    assert [c.args for c in calls(eff, "bump_generation")] == [("j", 0, d.event_id),
                                                                ("j", 3, d.event_id)]
    assert d.generation == 4 and st.records["j"].generation == 4
    assert st.records["j"].generation_by == d.event_id


def test_a_chain_resumed_after_its_bump_landed_does_not_bump_again():
    """Killed between the generation bump and the commit (the bump's reply lost with it): the
    verdict comes again, the record shows the bump made by this decision (``generation_by``),
    and the chain commits at that generation instead of moving it a second time."""
    st = Store(j=record())
    v = crash(rank=3)
    _died(st, v, "commit_decision")  # claimed, bumped to 1, the commit failed, then killed
    assert st.records["j"].generation == 1
    assert st.records["j"].generation_by == decision_id(v.event_id)
    state, eff = run(st, [verdict_in(v, 10.0)] + ticks(10.5, 14.0), state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1"))
    [d] = published(eff)
    assert d.generation == 1 and st.records["j"].generation == 1
    assert calls(eff, "bump_generation") == []
    assert st.records["j"].last_decision["id"] == d.event_id


def ticks(t0, t1, every=0.5):
    return [(t0 + i * every, Tick(WALL + int((t0 + i * every) * 1e9)))
            for i in range(int((t1 - t0) / every) + 1)]


def test_a_record_write_that_keeps_failing_publishes_nothing_and_gives_up():
    st = Store(j=record())
    st.fail.add("commit_decision")
    state, eff = run(st, [verdict_in(crash())] + ticks(0.5, 200.0))
    assert published(eff) == [] and audits(eff) == [] and state.pending == {}
    tries = calls(eff, "commit_decision")
    assert len(tries) == RemediatorConfig().store_retries + 1
    assert any(isinstance(e, Log) and "commit failed" in e.message
               and "not carried further after 25 tries" in e.message for e in eff)
    assert state.work == {}


@pytest.mark.parametrize("method", ["claim", "job", "commit_decision", "bump_generation"])
def test_a_verdict_that_arrives_while_valkey_restarts_is_decided_once_it_is_back(method):
    """bench/chaos.py found it: a verdict whose claim failed (Valkey SIGKILLed) was dropped and
    the job stayed stuck. Now the failed call is issued again at later ticks."""
    st = Store(j=record())
    st.fail_times[method] = 3
    state, eff = run(st, [verdict_in(crash(rank=3))] + ticks(0.5, 10.0))
    [d] = published(eff)
    assert (d.action, d.ranks, d.generation) == ("restart_workers", [3], 1)
    assert len(calls(eff, method)) >= 4 and st.fail_times[method] == 0
    assert state.work == {} and "j" in state.pending


def test_a_retried_claim_that_had_landed_is_this_chains_own():
    """A claim whose write landed but whose reply was lost: the retry finds its own token."""
    st = Store(j=record())
    lost = {"n": 0}

    def answer(call):
        val = st(call)
        if call.method == "claim" and lost["n"] == 0:
            lost["n"] = 1
            raise ConnectionError("connection closed after the write")
        return val

    state, eff = run(answer, [verdict_in(crash(rank=3))] + ticks(0.5, 5.0))
    [d] = published(eff)
    assert d.ranks == [3] and lost["n"] == 1


# ---- in flight: a verdict's message is acked only once its chain completed ---------------------
def test_a_verdict_waiting_on_valkey_is_in_flight_until_decided():
    st = Store(j=record())
    st.fail.add("claim")
    v = crash(rank=3)
    state, eff = run(st, [verdict_in(v)] + ticks(0.5, 2.0))
    assert reducer.in_flight(state) == {v.event_id} and published(eff) == []
    st.fail.clear()
    state, eff = run_offline(reducer.step, state, ticks(2.5, 10.0), st)
    [d] = published(eff)
    assert d.event_id == decision_id(v.event_id) and reducer.in_flight(state) == frozenset()


def test_a_verdict_given_up_leaves_in_flight():
    st = Store(j=record())
    st.fail.add("job")
    state, _ = run(st, [verdict_in(crash())] + ticks(0.5, 200.0))
    assert reducer.in_flight(state) == frozenset() and state.work == {}


def test_the_same_verdict_delivered_again_while_in_flight_is_stepped_as_nothing():
    st = Store(j=record())
    st.fail.add("claim")
    v = crash(rank=3)
    state, eff = run(st, [verdict_in(v), verdict_in(v, 0.1)])
    assert len(state.work) == 1 and len(calls(eff, "claim")) == 1
    st.fail.clear()
    state, eff = run_offline(reducer.step, state, ticks(0.5, 10.0), st)
    assert len(published(eff)) == 1 and state.work == {}


def _died(st: Store, v: Verdict, method: str, replica: str = "r1") -> None:
    """A first process of ``replica`` steps ``v`` with every ``method`` call failing (Valkey
    went away at that stage), a few ticks, and is killed: its state is gone, Valkey's stays."""
    st.fail.add(method)
    run(st, [verdict_in(v)] + ticks(0.5, 3.0), state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica=replica))
    st.fail.clear()


#: how far the killed process got before Valkey went away → what its restart finds
RESUMED = [
    # (stage whose call failed, the verdict claim the restart finds)
    ("claim", None),                      # nothing landed: decided as new
    ("job", "own"),                       # verdict claimed: its own token, carried on
    ("bump_generation", "own"),           # and the decision's key claimed: its own owner
]


@pytest.mark.parametrize("method,found", RESUMED)
def test_a_verdict_delivered_again_after_a_restart_is_decided_once(method, found):
    """bench/chaos.py found it: Valkey was down when a verdict arrived, and the remediator was
    SIGKILLed while it waited to try again. Its message is redelivered to the restarted
    replica; the chain resumes from what Valkey holds and decides it once."""
    st = Store(j=record())
    v = crash(rank=3)
    _died(st, v, method)
    key = f"j:verdict:{v.event_id}"
    assert st.claims.get(key) == (verdict_token("r1", v.event_id) if found else None)
    state, eff = run(st, [verdict_in(v, 10.0)] + ticks(10.5, 14.0), state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1"))
    [d] = published(eff)
    assert d.event_id == decision_id(v.event_id) and d.ranks == [3]
    assert st.claims["j:g0"] == f"{d.event_id}/restart_workers"
    assert st.claims[key] == f"decided:{d.event_id}"
    assert st.records["j"].last_decision["id"] == d.event_id
    assert [c.args for c in calls(eff, "outbox_done")] == [("j", d.event_id)]
    assert len(audits(eff, "decision")) == 1 and audits(eff, "folded") == []


def test_a_verdict_delivered_again_after_its_decision_was_stored_is_folded():
    """Killed after the commit, before its ack: the verdict comes again and folds; the stored
    decision (same id) is what the outbox sweep publishes."""
    st = Store(j=record())
    v = crash(rank=3)
    _died(st, v, "outbox_done")  # committed and published; not acked
    gen = st.records["j"].generation
    state, eff = run(st, [verdict_in(v, 10.0)], state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1"))
    assert published(eff) == [] and calls(eff, "commit_decision") == []
    [fold] = audits(eff, "folded")
    assert fold["reason"] == "this verdict was already decided"
    assert st.records["j"].generation == gen == 1
    [(job, [kept])] = st.outbox().items()
    assert kept["event_id"] == decision_id(v.event_id)


def test_a_folded_verdict_stepped_again_by_its_replica_folds_at_its_claim():
    """A replica that gets a job back replays its verdicts of the last hour: one it folded
    before (its claim settled ``folded``) is not decided anew with a later record."""
    st = Store(j=record(status="finished"))
    v = crash(rank=3)
    mine = RemediatorState(config=RemediatorConfig(controller="local"), armed=True,
                           replica="r1")
    _, eff = run(st, [verdict_in(v)], state=mine)
    for c in calls(eff, "settle"):  # a call without a reply: run_offline leaves it to us
        st(c)
    assert st.claims[f"j:verdict:{v.event_id}"] == "folded"
    st.records["j"].status = "running"
    _, eff = run(st, [verdict_in(v, 5.0)], state=mine)
    assert published(eff) == [] and calls(eff, "job") == []
    [fold] = audits(eff, "folded")
    assert fold["reason"] == "this verdict was already handled"


def test_a_live_replicas_claim_of_the_verdict_folds():
    st = Store(j=record())
    v = crash(rank=3)
    st.claims[f"j:verdict:{v.event_id}"] = verdict_token("r2", v.event_id)
    state, eff = run(st, [verdict_in(v)], state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1",
        alive=lambda r: r == "r2"))
    assert published(eff) == [] and "j:g0" not in st.claims
    [fold] = audits(eff, "folded")
    assert fold["reason"] == "this verdict was already handled"
    assert calls(eff, "take_claim") == []


@pytest.mark.parametrize("method", ["job", "bump_generation", "commit_decision"])
def test_a_replica_that_died_mid_chain_leaves_its_verdict_to_the_one_taking_over(method):
    """Replica r2 claimed the verdict and died at ``method`` (its lease ran out: not alive);
    r1, which took the job over and replays its verdicts, takes the claim over and decides it
    once, reusing the decision id (and so the claims) r2's try left."""
    st = Store(j=record())
    v = crash(rank=3)
    _died(st, v, method, replica="r2")
    key = f"j:verdict:{v.event_id}"
    assert st.claims[key] == verdict_token("r2", v.event_id)
    state, eff = run(st, [verdict_in(v, 10.0)] + ticks(10.5, 14.0), state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1",
        alive=lambda r: r == "r1"))
    [d] = published(eff)
    assert d.event_id == decision_id(v.event_id) and d.ranks == [3]
    assert st.claims[key] == f"decided:{d.event_id}"
    assert [c.args[1:] for c in calls(eff, "take_claim")] == [
        (verdict_token("r2", v.event_id), verdict_token("r1", v.event_id))]
    assert len(audits(eff, "decision")) == 1 and audits(eff, "folded") == []
    # a third replica stepping it later folds: the claim is settled
    _, eff = run(st, [verdict_in(v, 20.0)], state=RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r3"))
    assert published(eff) == [] and calls(eff, "take_claim") == []


def test_two_replicas_taking_over_the_same_dead_claim_decide_once():
    st = Store(j=record())
    v = crash(rank=3)
    _died(st, v, "job", replica="r2")
    states = {r: RemediatorState(config=RemediatorConfig(controller="local"), armed=True,
                                 replica=r, alive=lambda x, r=r: x == r) for r in ("r1", "r3")}
    out = [run(st, [verdict_in(v, 10.0)] + ticks(10.5, 14.0), state=states[r])[1]
           for r in ("r1", "r3")]
    assert sum(len(published(e)) for e in out) == 1


# ---- exclusion through the controller --------------------------------------------------------------
def test_exclusion_calls_the_controller_once_per_node_and_publishes_its_result():
    st = Store(j=record(min_world_size=1))
    gpu = Verdict(job="j", fault_class="gpu_xid", layer="hardware",
                  culprit={"nodes": ["n1", "n2"]}, generation=0)
    state, eff = run(st, [verdict_in(gpu)])
    [d] = published(eff)
    assert d.action == "stop_job_notify_user"  # no node left: min_world_size 1 > 0
    st = Store(j=record(min_world_size=2))
    state, eff = run(st, [verdict_in(node_lost(node="n2")),
                          verdict_in(node_lost(node="n2").model_copy(
                              update={"event_id": schemas.new_event_id()}), 1.0)])
    [d] = published(eff)
    assert st.excluded == ["n2"]
    [ctl] = [c for c in eff if isinstance(c, Call) and c.target == "controller"]
    assert ctl.method == "exclude" and ctl.args == ("n2", "j", d.reason)
    assert ctl.wait is False  # a slow drain holds up no other input
    [ar] = published(eff, ActionResult)
    assert (ar.ok, ar.node, ar.executor, ar.decision_id, ar.idempotency_key) == (
        True, "n2", "controller:local", d.event_id, d.idempotency_key)
    assert st.claims[f"{d.idempotency_key}:exclude:n2"] == d.event_id
    assert audits(eff, "controller_failed") == []


def test_an_exclusion_already_carried_out_is_not_repeated():
    st = Store(j=record())
    v = node_lost(node="n2")
    # a previous instance claimed the exclusion of n2 under the key this decision gets
    st.claims["j:g0:exclude:n2"] = "previous"
    state, eff = run(st, [verdict_in(v)])
    assert len(published(eff)) == 1
    assert st.excluded == [] and published(eff, ActionResult) == []


@pytest.mark.parametrize("failure", [ControllerResult(False, "scontrol not found"),
                                     RuntimeError("api server down")])
def test_a_failed_drain_is_audited_not_escalated(failure):
    st = Store(j=record())
    st.controller["n2"] = failure
    state, eff = run(st, [verdict_in(node_lost())])
    [d] = published(eff)
    [ar] = published(eff, ActionResult)
    assert not ar.ok
    assert ar.detail == ("scontrol not found" if isinstance(failure, ControllerResult)
                         else "RuntimeError: api server down")
    [failed] = audits(eff, "controller_failed")
    assert (failed["node"], failed["controller"], failed["decision_id"]) == (
        "n2", "local", d.event_id)
    assert "j" in state.pending
    # the controller's own failed result does not escalate either
    state, eff = run(st, [(1.0, Received(subjects.job("j", "action"), ar, WALL))], state)
    assert published(eff) == [] and "j" in state.pending


def launcher_lost(node="n2", gen=0):
    return Verdict(job="j", fault_class="crash", layer="infrastructure",
                   culprit={"ranks": [2, 3], "nodes": [node]}, generation=gen, first_ts=3000,
                   detail={"root_kind": "launcher_lost", "launcher_lost": [node],
                           "last_beat_ns": 2900})


def pods_state(restarts_pods=True):
    return RemediatorState(config=RemediatorConfig(decision_timeout_s=60.0,
                                                   controller="kubernetes"),
                           controller="kubernetes", restarts_pods=restarts_pods, armed=True)


def test_a_lost_launcher_has_its_pod_replaced_once_not_its_node_excluded():
    st = Store(j=record())
    v = launcher_lost()
    again = v.model_copy(update={"event_id": schemas.new_event_id()})
    state, eff = run(st, [verdict_in(v), verdict_in(again, 1.0)], pods_state())
    [d] = published(eff)
    assert (d.action, d.ranks, d.nodes, d.execute) == ("restart_workers", [2, 3], ["n2"], True)
    assert st.excluded == [] and st.restarted == [("n2", "j", 2900)]  # the launcher's last beat
    [ctl] = [c for c in eff if isinstance(c, Call) and c.target == "controller"]
    assert ctl.method == "restart_pod" and ctl.wait is False
    [ar] = published(eff, ActionResult)
    assert (ar.ok, ar.node, ar.executor, ar.action, ar.decision_id) == (
        True, "n2", "controller:kubernetes", "restart_workers", d.event_id)
    for c in calls(eff, "settle"):  # calls without a reply: run_offline leaves them to us
        st(c)
    assert st.claims[f"{d.idempotency_key}:restart_pod:n2"] == f"done:{d.event_id}"
    assert "j" in state.pending  # the watchdog waits for training to resume
    # a restarted remediator replays the verdict: the step is done, no second deletion
    state, eff = run(st, [verdict_in(v, 2.0)], pods_state())
    assert st.restarted == [("n2", "j", 2900)]


def test_an_exclusion_begun_by_a_killed_remediator_is_carried_out_after_its_restart():
    """Killed after the commit, with the exclusion claimed and the controller not answered
    yet: the verdict (held until the steps end) comes again, folds at its claim no more, and
    the resumed chain asks the controller again, once; a third delivery does nothing."""
    st = Store(j=record(min_world_size=1))
    gpu = Verdict(job="j", fault_class="gpu_xid", layer="hardware",
                  culprit={"ranks": [2, 3], "nodes": ["n1"]}, generation=0, first_ts=1000,
                  detail={"xid": 79})
    st.controller["n1"] = ConnectionError("the remediator died while the drain ran")
    state, eff = run(st, [verdict_in(gpu)], RemediatorState(
        config=RemediatorConfig(controller="local"), armed=True, replica="r1"))
    [d] = published(eff)
    assert d.action == "exclude_node_and_requeue" and d.nodes == ["n1"]
    key = f"{d.idempotency_key}:exclude:n1"
    assert st.claims[key] == d.event_id  # claimed; its answer and settle died with it
    st.controller.pop("n1")
    again = RemediatorState(config=RemediatorConfig(controller="local"), armed=True,
                            replica="r1")
    state, eff = run(st, [verdict_in(gpu, 10.0)], again)
    assert published(eff) == [] and calls(eff, "commit_decision") == []
    assert st.excluded == ["n1", "n1"]  # the first (died) and the resumed one
    [res] = audits(eff, "resumed")
    assert res["decision_id"] == d.event_id and res["nodes"] == ["n1"]
    for c in calls(eff, "settle"):
        st(c)
    assert st.claims[key] == f"done:{d.event_id}"
    _, eff = run(st, [verdict_in(gpu, 20.0)], again)
    assert st.excluded == ["n1", "n1"] and audits(eff, "resumed") != []


def test_a_lost_launcher_found_after_its_ranks_hang_was_decided_still_gets_its_pod_replaced():
    st = Store(j=record())
    hang = Verdict(job="j", fault_class="hang", layer="unknown",
                   culprit={"ranks": [2, 3], "nodes": ["n2"]}, generation=0, first_ts=2500)
    state, eff = run(st, [verdict_in(hang), verdict_in(launcher_lost(), 1.0)], pods_state())
    [d] = published(eff)
    assert d.action == "restart_workers" and "JobSet" not in d.reason
    assert st.restarted == [("n2", "j", 2900)] and st.excluded == []  # the launcher's fault
    [ar] = published(eff, ActionResult)
    assert ar.decision_id == d.event_id and ar.ok
    [folded] = audits(eff, "folded")
    assert "pod restart on n2" in folded["reason"]
    assert state.counts["folded"] == 1 and state.work == {}


@pytest.mark.parametrize("restarts_pods,mode", [(False, "action"), (True, "observe")])
def test_no_pod_restart_without_a_pod_controller_or_in_observe_mode(restarts_pods, mode):
    st = Store(j=record(mode=mode))
    state, eff = run(st, [verdict_in(launcher_lost())], pods_state(restarts_pods))
    [d] = published(eff)
    assert d.action == "restart_workers" and st.restarted == [] and st.excluded == []
    assert ("JobSet" in d.reason) is restarts_pods


def test_a_failed_pod_restart_is_audited_and_left_to_the_watchdog():
    st = Store(j=record())
    st.controller["n2"] = RuntimeError("HTTP 403 Forbidden")
    state, eff = run(st, [verdict_in(launcher_lost())], pods_state())
    [ar] = published(eff, ActionResult)
    assert not ar.ok and "HTTP 403" in ar.detail
    [failed] = audits(eff, "controller_failed")
    assert failed["step"] == "restart_pod" and failed["node"] == "n2"
    assert "j" in state.pending


# ---- a stop through a scheduler that holds the job (Slurm) ---------------------------------------
def slurm_state(cancels_jobs=True, timeout_s=60.0):
    return RemediatorState(config=RemediatorConfig(decision_timeout_s=timeout_s,
                                                   controller="slurm"),
                           controller="slurm", cancels_jobs=cancels_jobs, armed=True)


def gpu_both_nodes():
    return Verdict(job="j", fault_class="gpu_xid", layer="hardware",
                   culprit={"nodes": ["n1", "n2"]}, generation=0)


def test_a_stop_is_carried_out_by_the_scheduler_once_for_its_generation():
    st = Store(j=record(min_world_size=1))
    state, eff = run(st, [verdict_in(gpu_both_nodes())], slurm_state())
    [d] = published(eff)
    assert (d.action, d.execute, d.generation) == ("stop_job_notify_user", True, 1)
    assert st.stopped == [("j", d.reason, 1)] and st.excluded == []
    [ctl] = [c for c in eff if isinstance(c, Call) and c.target == "controller"]
    assert ctl.method == "stop" and ctl.wait is False
    [ar] = published(eff, ActionResult)
    assert (ar.ok, ar.node, ar.executor, ar.action, ar.decision_id, ar.idempotency_key) == (
        True, None, "controller:slurm", "stop_job_notify_user", d.event_id, d.idempotency_key)
    assert st.claims[f"{d.idempotency_key}:stop"] == d.event_id
    # a restarted remediator replays the verdict: the job is stopped, nothing more
    state, eff = run(st, [verdict_in(gpu_both_nodes(), 1.0)], slurm_state())
    assert published(eff) == [] and st.stopped == [("j", d.reason, 1)]


def test_a_stop_already_carried_out_is_not_repeated():
    st = Store(j=record(min_world_size=1))
    st.claims["j:g0:stop"] = "previous"
    state, eff = run(st, [verdict_in(gpu_both_nodes())], slurm_state())
    [d] = published(eff)
    assert d.idempotency_key == "j:g0" and st.stopped == [] and published(eff, ActionResult) == []


@pytest.mark.parametrize("cancels_jobs,mode", [(False, "action"), (True, "observe")])
def test_no_scheduler_stop_without_a_controller_that_cancels_or_in_observe_mode(cancels_jobs,
                                                                               mode):
    st = Store(j=record(min_world_size=1, mode=mode))
    state, eff = run(st, [verdict_in(gpu_both_nodes())], slurm_state(cancels_jobs))
    [d] = published(eff)
    assert d.action == "stop_job_notify_user" and d.execute is (mode == "action")
    assert st.stopped == [] and published(eff, ActionResult) == []
    assert [c for c in eff if isinstance(c, Call) and c.target == "controller"] == []


def test_a_failed_scancel_is_audited_and_the_job_stays_stopped():
    st = Store(j=record(min_world_size=1))
    st.controller["j"] = ControllerResult(False, "scancel 42 exited 1: access denied")
    state, eff = run(st, [verdict_in(gpu_both_nodes())], slurm_state())
    [ar] = published(eff, ActionResult)
    assert not ar.ok and ar.detail == "scancel 42 exited 1: access denied"
    [failed] = audits(eff, "controller_failed")
    assert (failed["controller"], failed["node"]) == ("slurm", "")
    assert st.records["j"].status == "stopped" and state.pending == {}


def test_the_watchdogs_stop_goes_to_the_scheduler_too():
    st = Store(j=record(min_world_size=4))
    state, eff = run(st, [verdict_in(crash(rank=2)), (0.2, Tick(WALL)), (0.31, Tick(WALL))],
                     slurm_state(timeout_s=0.3))
    restart, stop = published(eff)
    assert stop.action == "stop_job_notify_user" and stop.idempotency_key == "j:g0:wd"
    assert st.stopped == [("j", stop.reason, 2)]
    assert st.claims["j:g0:wd:stop"] == stop.event_id


# ---- watchdog ---------------------------------------------------------------------------------------
def test_watchdog_deadline_escalates_along_the_ladder():
    st = Store(j=record(min_world_size=4))
    state, eff = run(st, [verdict_in(crash(rank=2)), (0.2, Tick(WALL)), (0.31, Tick(WALL))],
                     timeout_s=0.3)
    restart, stop = published(eff)
    assert (restart.action, restart.generation) == ("restart_workers", 1)
    # exclude n2 would leave 2 < 4 ranks: the rung after the restart becomes a stop
    assert (stop.action, stop.generation, stop.idempotency_key) == (
        "stop_job_notify_user", 2, "j:g0:wd")
    assert "watchdog" in stop.reason and "min_world_size 4" in stop.reason
    assert "within 0.3 s" in stop.reason
    assert state.counts["escalations"] == 1 and state.pending == {}
    assert st.records["j"].status == "stopped"


def test_watchdog_ladder_restart_exclude_stop():
    st = Store(j=record(min_world_size=2))
    state, eff = run(st, [verdict_in(crash(rank=2)), (1.1, Tick(WALL)), (2.2, Tick(WALL)),
                          (3.3, Tick(WALL))], timeout_s=1.0)
    assert [(d.action, d.generation) for d in published(eff)] == [
        ("restart_workers", 1), ("exclude_node_and_requeue", 2), ("stop_job_notify_user", 3)]
    assert [d.idempotency_key for d in published(eff)] == ["j:g0", "j:g0:wd", "j:g0:wd:wd"]
    assert st.excluded == ["n2"] and state.counts["escalations"] == 2


def test_resumed_clears_and_an_older_generation_does_not():
    st = Store(j=record())
    state, eff = run(st, [verdict_in(crash())])
    old = TrainingResumed(job="j", rank=0, generation=0, world_size=4,
                          restored_step=10, resumed_step=11)
    state, eff = run(st, [(1.0, Received(subjects.job("j", "recovery"), old, WALL))], state)
    assert "j" in state.pending and eff == []
    new = TrainingResumed(job="j", rank=0, generation=1, world_size=4,
                          restored_step=10, resumed_step=11)
    state, eff = run(st, [(1.0, Received(subjects.job("j", "recovery"), new, WALL)),
                          (100.0, Tick(WALL))], state)
    assert state.pending == {}
    assert [c.args for c in calls(eff, "clear_pending")] == [("j",)]
    assert published(eff) == []  # no escalation after the deadline


def test_a_failed_action_result_escalates_at_once():
    st = Store(j=record())
    state, eff = run(st, [verdict_in(crash(rank=3))])
    [d] = published(eff)
    bad = ActionResult(job="j", decision_id=d.event_id, idempotency_key=d.idempotency_key,
                       executor="launcher:n2", action="restart_workers", ok=False,
                       detail="spawn failed")
    state, eff = run(st, [(1.0, Received(subjects.job("j", "action"), bad, WALL))], state)
    [d2] = published(eff)
    assert (d2.action, d2.nodes, d2.generation) == ("exclude_node_and_requeue", ["n2"], 2)
    assert "spawn failed" in d2.reason
    # a result of another decision escalates nothing
    other = bad.model_copy(update={"decision_id": "x", "idempotency_key": "y"})
    _, eff = run(st, [(2.0, Received(subjects.job("j", "action"), other, WALL))], state)
    assert published(eff) == []


def test_a_superseded_generation_does_not_escalate():
    st = Store(j=record())
    state, eff = run(st, [verdict_in(crash())])
    st.records["j"].generation = 5  # a later decision (or a new run) moved it
    state, eff = run(st, [(100.0, Tick(WALL))], state)
    assert published(eff) == [] and calls(eff, "claim") == [] and state.pending == {}
    assert [c.args for c in calls(eff, "job")] == [("j",)]


def test_rearm_after_a_restart():
    st = Store(j=record())
    _, eff = run(st, [verdict_in(crash(rank=3))])
    [d] = published(eff)
    # a new instance: the first tick re-arms from the record, deadline_ns - wall_ns left
    st.records["j"].pending_decision["deadline_ns"] = WALL + 5 * 10**9
    fresh = RemediatorState(config=RemediatorConfig(decision_timeout_s=60, controller="local"))
    state, eff = run(st, [(10.0, Tick(WALL)), (14.0, Tick(WALL + 4 * 10**9))], fresh)
    assert [c.method for c in eff if isinstance(c, Call) and c.method not in ("outbox", "breaker_view")] == [
        "jobs", "job"]
    assert state.armed and state.pending["j"].decision.event_id == d.event_id
    assert state.pending["j"].deadline == pytest.approx(15.0)
    state, eff = run(st, [(15.0, Tick(WALL))], state)
    [esc] = published(eff)
    assert esc.action == "exclude_node_and_requeue" and esc.idempotency_key == "j:g0:wd"
    # the re-armed instance folds the verdict it did not decide
    state, eff = run(st, [verdict_in(crash(rank=0), 16.0)], state)
    assert published(eff) == [] and state.counts["folded"] == 1


def test_rearm_skips_an_unreadable_record():
    st = Store(j=record(pending_decision={"schema": "nope"}), k=record())
    fresh = RemediatorState(config=RemediatorConfig(decision_timeout_s=60, controller="local"))
    state, eff = run(st, [(0.0, Tick(WALL))], fresh)
    assert state.pending == {} and state.armed
    assert any(isinstance(e, Log) and "j: unreadable pending decision" in e.message for e in eff)


def test_inputs_are_not_changed():
    st = Store(j=record())
    v = crash(rank=3).model_copy(update={"job": None})
    before = v.model_dump()
    run(st, [verdict_in(crash(rank=3)), (0.5, Received("tg.job.j.verdict", v, WALL))])
    assert v.model_dump() == before  # the job is taken from the subject on a copy


def test_rearm_is_tried_again_when_the_job_list_is_unreadable():
    st = Store(j=record(pending_decision={**Decision(
        job="j", action="restart_workers", idempotency_key="j:g0", generation=1).to_dict(),
        "deadline_ns": WALL + 10**9}))
    st.fail.add("jobs")
    fresh = RemediatorState(config=RemediatorConfig(decision_timeout_s=60, controller="local"))
    state, eff = run(st, [(0.0, Tick(WALL))], fresh)
    assert not state.armed and state.pending == {}
    assert any(isinstance(e, Log) and "job list unreadable" in e.message for e in eff)
    st.fail.clear()
    state, eff = run(st, [(0.1, Tick(WALL))], state)
    assert state.armed and state.pending["j"].deadline == pytest.approx(1.1)


def test_step_leaves_the_state_it_was_given_alone():
    st = Store(j=record())
    s1, _ = run(st, [verdict_in(crash(rank=3))])
    snap = copy.deepcopy(s1)
    s2, eff = run(st, [verdict_in(node_lost(), 1.0), (100.0, Tick(WALL))], s1)
    assert s1 == snap and s2 != s1 and len(published(eff)) >= 1

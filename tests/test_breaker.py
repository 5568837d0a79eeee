"""The fleet breaker as a table (``remediator.breaker``), the no-node fallback of a held
decision (``remediator.holds``) and the progress count of restarts (``remediator.progress``):
pure, no servers."""
from __future__ import annotations

import copy

import pytest

from trainguard.remediator import breaker as br
from trainguard.remediator import policy as pol
from trainguard.remediator import policy_table
from trainguard.remediator import progress
from trainguard.remediator.holds import no_node_decision
from trainguard.schemas import BreakerState, JobRecord, Verdict
from trainguard.schemas.breaker import decode_breaker, encode_breaker

S = 10**9
T0 = 1_700_000_000 * S
CFG = br.BreakerConfig(mode="action", window_s=300, fraction=0.5, min_nodes=4, max_nodes=None,
                       fleet_nodes=0)


def req(nodes, i=0, ts=T0, action="exclude_node_and_requeue"):
    return br.Request("j", f"d{i}", action, tuple(nodes), ts)


def feed(state, reqs, known, cfg=CFG):
    outs = []
    for r in reqs:
        state, out = br.admit(state, r, known, cfg)
        outs.append(out)
    return state, outs


@pytest.mark.parametrize("known,cfg,expected", [
    (64, CFG, 32),                                       # the anchor's 50 %
    (2, CFG, 4),                                         # a small fleet: the count floor
    (9, CFG, 4),                                         # floor(4.5) = 4
    (1000, br.BreakerConfig(mode="action", max_nodes=50, min_nodes=4), 50),   # the count cap
    (0, br.BreakerConfig(mode="action", fleet_nodes=40, min_nodes=4), 20),    # declared fleet
    (64, br.BreakerConfig(mode="action", fraction=0.25, min_nodes=0), 16),
])
def test_limit(known, cfg, expected):
    assert br.limit(cfg, known) == expected


def test_a_single_exclusion_in_a_small_fleet_passes():
    # a job of 2 nodes excluding one: 50 % of the known nodes, under the count floor
    state, (out,) = feed(BreakerState(), [req(["n1"])], known=2)
    assert out.allowed and out.transition == "" and state.status == "closed"
    assert [t["node"] for t in state.taken] == ["n1"]


def test_trips_past_the_limit_and_holds_until_reset():
    state, outs = feed(BreakerState(), [req([f"n{i}"], i, T0 + i * S) for i in range(34)],
                       known=64)
    assert [o.allowed for o in outs] == [True] * 32 + [False, False]
    assert outs[32].transition == "tripped" and outs[33].transition == "held"
    assert state.status == "tripped" and state.held == 2 and len(state.taken) == 32
    assert "33 node(s)" in state.trip_reason and "limit of 32" in state.trip_reason
    # it never closes by itself, even once the window is empty
    later = T0 + 3600 * S
    state, (out,) = feed(state, [req(["m1"], 99, later)], known=64)
    assert not out.allowed and state.status == "tripped"
    state = br.reset(state, "ops@site", "driver 550 rolled back", later)
    assert state.status == "closed" and state.taken == () and state.held == 0
    assert state.last_reset["by"] == "ops@site" and state.last_reset["was"] == "tripped"
    state, (out,) = feed(state, [req(["m1"], 99, later)], known=64)
    assert out.allowed


def test_a_decision_taking_several_nodes_past_the_limit_is_held_whole():
    state, outs = feed(BreakerState(), [req(["a", "b", "c"], 0), req(["d", "e"], 1)], known=8)
    assert outs[0].allowed and not outs[1].allowed and outs[1].transition == "tripped"
    assert {t["node"] for t in state.taken} == {"a", "b", "c"}


def test_the_window_slides():
    reqs = [req([f"n{i}"], i, T0 + i * 100 * S) for i in range(8)]  # one node each 100 s
    state, outs = feed(BreakerState(), reqs, known=8)              # limit 4, window 300 s
    assert all(o.allowed for o in outs) and state.status == "closed"
    assert len(br.window(state, CFG, T0 + 700 * S)) == 3


def test_the_same_node_counts_once_and_a_decision_asked_again_passes_unchanged():
    state, outs = feed(BreakerState(), [req(["a"], 0), req(["a"], 1), req(["b"], 2)], known=8)
    assert all(o.allowed for o in outs) and len(state.taken) == 2
    again, out = br.admit(state, req(["a"], 0), 8, CFG)
    assert out.allowed and out.reason == "admitted already" and again == state
    # asked again even once tripped: a decision let through before a restart stays let through
    tripped, _ = feed(state, [req(["c", "d", "e"], 3)], known=8)
    assert tripped.status == "tripped"
    _, out = br.admit(tripped, req(["a"], 0), 8, CFG)
    assert out.allowed


@pytest.mark.parametrize("action,counted", [
    ("exclude_node_and_requeue", True), ("reset_gpu", True), ("restart_workers", False),
    ("stop_job_notify_user", False), ("none", False)])
def test_only_node_taking_actions_count(action, counted):
    state, (out,) = feed(BreakerState(), [req(["a"], action=action)], known=8)
    assert out.allowed and bool(state.taken) == counted


def test_observe_mode_records_when_it_would_have_tripped_and_holds_nothing():
    cfg = br.BreakerConfig(mode="observe", min_nodes=4)
    state, outs = feed(BreakerState(), [req([f"n{i}"], i) for i in range(6)], 8, cfg)
    assert all(o.allowed for o in outs) and state.status == "closed"
    assert [o.transition for o in outs] == ["", "", "", "", "would_trip", "would_hold"]
    assert state.would_trip_ts == T0 and "5 node(s)" in state.would_trip_reason


def test_off_counts_nothing():
    cfg = br.BreakerConfig(mode="off")
    state, outs = feed(BreakerState(), [req([f"n{i}"], i) for i in range(6)], 8, cfg)
    assert all(o.allowed for o in outs) and state == BreakerState()


@pytest.mark.parametrize("by,reason", [("ops", ""), ("ops", "  "), ("", "fixed")])
def test_a_reset_needs_who_and_why(by, reason):
    with pytest.raises(br.BreakerError):
        br.reset(BreakerState(status="tripped"), by, reason, T0)


def test_bad_settings_are_refused():
    with pytest.raises(br.BreakerError, match="TG_BREAKER"):
        br.BreakerConfig(mode="sometimes")
    with pytest.raises(br.BreakerError, match="fraction"):
        br.BreakerConfig(fraction=1.5)


def test_the_state_round_trips_through_its_hash_encoding():
    state, _ = feed(BreakerState(), [req([f"n{i}"], i) for i in range(6)], known=8)
    state = br.reset(state, "ops", "why", T0)
    assert decode_breaker(encode_breaker(state)) == state
    assert decode_breaker({}) == BreakerState()
    with pytest.raises(ValueError, match="held"):
        decode_breaker({"held": "many"})


# ---- the no-node fallback of a held decision -----------------------------------------------
MEMBERS = [{"rank": 0, "node": "n1", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 1},
           {"rank": 2, "node": "n2", "local_rank": 0}, {"rank": 3, "node": "n2", "local_rank": 1}]


def job(**kw) -> JobRecord:
    f = dict(mode="action", generation=3, world_size=4, min_world_size=2, retry_budget=5,
             members=copy.deepcopy(MEMBERS))
    f.update(kw)
    return JobRecord(**f)


def xid(node="n2", fault_class="gpu_xid", **detail) -> Verdict:
    return Verdict(job="j", fault_class=fault_class, layer="hardware",
                   culprit={"nodes": [node]}, detail=detail, ts=T0, first_ts=T0)


def test_a_held_exclusion_respawns_the_ranks_of_its_node_in_place():
    v = xid()
    dec = pol.decide(v, job())
    assert dec.action == "exclude_node_and_requeue" and dec.members
    held = no_node_decision(dec, v, job(), "breaker", "breaker tripped")
    assert held.action == "restart_workers" and held.ranks == [2, 3] and held.nodes == ["n2"]
    assert held.members == [] and held.world_size == 4
    assert held.held == {"action": "exclude_node_and_requeue", "nodes": ["n2"],
                         "by": "breaker", "reason": "breaker tripped"}
    assert held.event_id == dec.event_id and held.idempotency_key == dec.idempotency_key
    assert "held by the fleet breaker" in held.reason


@pytest.mark.parametrize("fault_class,verdict_given", [("node_lost", True), ("gpu_xid", False)])
def test_a_held_exclusion_of_a_lost_node_or_a_failed_respawn_stops(fault_class, verdict_given):
    v = xid(fault_class=fault_class)
    dec = pol.decide(v, job())
    held = no_node_decision(dec, v if verdict_given else None, job(), "breaker", "tripped")
    assert held.action == "stop_job_notify_user" and held.held["action"] == dec.action
    assert "stops" in held.reason


def test_a_held_exclusion_still_obeys_the_retry_budget():
    v = xid()
    dec = pol.decide(v, job())
    held = no_node_decision(dec, v, job(retries_used=5), "breaker", "tripped")
    assert held.action == "stop_job_notify_user" and "retry budget spent" in held.reason


def test_a_shared_cause_takes_no_node_out():
    cause = {"layer": "system_software", "count": 40, "signature": "gpu_xid:79",
             "window_s": 60, "common": {"driver": "550.54"}}
    d = pol.decide(xid(shared_cause=cause), job())
    assert d.action == "restart_workers" and d.ranks == [2, 3]
    assert d.held["by"] == "shared_cause" and "driver=550.54" in d.reason


# ---- restarts count progress ----------------------------------------------------------------
def run_faults(steps, gap_s=60.0, budget=10, policy=policy_table.DEFAULT_POLICY):
    """Decide a crash at each step in turn, committing each decision's bookkeeping as the
    remediator does; returns the actions."""
    rec = job(retry_budget=budget, generation=0)
    actions = []
    for i, step in enumerate(steps):
        v = Verdict(job="j", fault_class="crash", layer="unknown", culprit={"ranks": [i % 4]},
                    detail={} if step is None else {"step": step},
                    ts=T0 + int(i * gap_s * S), first_ts=T0 + int(i * gap_s * S))
        d = pol.decide(v, rec, policy)
        actions.append(d.action)
        if d.action == "stop_job_notify_user":
            break
        rec.last_fault = progress.next_last_fault(v, rec, rec.generation, policy.progress_s)
        rec.retries_used, rec.generation = d.retries_used, rec.generation + 1
    return actions, d.reason


def test_progress_between_faults_survives_more_faults_than_the_budget():
    actions, _ = run_faults([100 * (i + 1) for i in range(12)], budget=5)
    assert actions == ["restart_workers"] * 12


def test_a_restart_loop_with_a_drifting_step_stops():
    actions, reason = run_faults([103, 102, 101, 103, 102], budget=10)
    assert actions == ["restart_workers"] * 3 + ["stop_job_notify_user"]
    assert "restart loop: 3 restarts in a row" in reason and "past step 103" in reason


def test_without_steps_quick_failures_spend_the_budget_and_slow_ones_do_not():
    actions, reason = run_faults([None] * 8, gap_s=30, budget=5)
    assert actions == ["restart_workers"] * 5 + ["stop_job_notify_user"]
    assert "retry budget spent (5 of 5" in reason
    actions, _ = run_faults([None] * 8, gap_s=3600, budget=5)
    assert actions == ["restart_workers"] * 8


def test_progress_resets_the_count():
    # two stalled restarts, progress, two stalled again: never three in a row
    actions, _ = run_faults([50, 40, 45, 300, 290, 280, 500], budget=10)
    assert actions == ["restart_workers"] * 7


def test_the_remediator_exports_the_breaker_as_gauges():
    """``/metrics`` of the remediator (``trainguard.services.metrics.mount`` registers
    ``metric_families``): tripped, nodes taken in the window, limit, known nodes, held."""
    import time
    from dataclasses import replace

    from trainguard.remediator.service import Remediator, RemediatorConfig
    from trainguard.services.base import ServiceConfig

    svc = Remediator(ServiceConfig(nats_url="nats://127.0.0.1:1", redis_url="redis://127.0.0.1:1"),
                     RemediatorConfig(breaker=CFG))
    assert svc.breaker()["status"] == "unknown"
    now = time.time_ns()
    state, _ = feed(BreakerState(), [req([f"n{i}"], i, now) for i in range(6)], known=8)
    svc.model = replace(svc.model, breaker_seen=(state, 8))
    gauges = {f.name: f.samples[0].value for f in svc.metric_families()}
    assert gauges == {"tg_breaker_tripped": 1.0, "tg_breaker_nodes_taken": 4.0,
                      "tg_breaker_limit": 4.0, "tg_breaker_known_nodes": 8.0,
                      "tg_breaker_held": 2.0}

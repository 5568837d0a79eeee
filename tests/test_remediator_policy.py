"""The remediator's pure decide(): the policy table, escalations and the new world."""
import pytest

from trainguard.remediator import plan

from trainguard.remediator import policy_table
from trainguard.remediator.policy import decide
from trainguard.remediator.plan import escalate, new_world
from trainguard.schemas import JobRecord, Verdict
from trainguard.schemas.vocabulary import signature

MEMBERS = [{"rank": 0, "node": "n1", "local_rank": 0}, {"rank": 1, "node": "n1", "local_rank": 1},
           {"rank": 2, "node": "n2", "local_rank": 0}, {"rank": 3, "node": "n2", "local_rank": 1}]


def job(**kw):
    st = {"mode": "action", "generation": 3, "world_size": 4, "min_world_size": 2,
          "retry_budget": 5, "retries_used": 0, "members": MEMBERS, "spare_nodes": []}
    st.update(kw)
    return JobRecord(**st)


def verdict(fault_class, layer="application", ranks=(), nodes=(), **kw):
    return Verdict(job="j", fault_class=fault_class, layer=layer,
                   culprit={"ranks": list(ranks), "nodes": list(nodes)}, generation=3, **kw)


@pytest.mark.parametrize("fault_class,layer,expected", [
    ("app_exception", "application", "restart_in_process"),
    ("nan_loss", "application", "restart_in_process"),
    ("checkpoint_corrupt", "infrastructure", "restart_in_process"),
    ("checkpoint_corrupt", "application", "stop_job_notify_user"),  # a restore's loss check
    ("crash", "unknown", "restart_workers"),
    ("crash", "hardware", "exclude_node_and_requeue"),
    ("oom_host", "application", "restart_workers"),
    ("hang", "unknown", "restart_workers"),
    ("rendezvous", "infrastructure", "restart_workers"),
    ("network", "infrastructure", "restart_workers"),
    ("network", "hardware", "exclude_node_and_requeue"),
    ("node_lost", "infrastructure", "exclude_node_and_requeue"),
    ("gpu_xid", "hardware", "exclude_node_and_requeue"),
    ("gpu_xid", "application", "restart_workers"),
    ("ecc", "hardware", "exclude_node_and_requeue"),
    ("nvlink", "hardware", "exclude_node_and_requeue"),
    ("filesystem", "infrastructure", "stop_job_notify_user"),
    ("thermal", "hardware", "none"),
    ("straggler", "hardware", "none"),          # no spare registered: flag only
    ("no_such_class", "unknown", "none"),       # unknown: flagged, never acted on
])
def test_table(fault_class, layer, expected):
    d = decide(verdict(fault_class, layer, ranks=[2], nodes=["n2"]), job())
    assert d.action == expected, d.reason
    assert d.execute is (expected != "none")
    if expected in policy_table.RECOVERY_ACTIONS or expected == "stop_job_notify_user":
        assert d.generation == 4 and d.idempotency_key == "j:g3"
    else:
        assert d.generation == 3 and d.idempotency_key.startswith("j:g3:none:")


def test_every_fault_class_has_a_row():
    from trainguard.schemas import FAULT_CLASSES
    for fc in FAULT_CLASSES:
        assert plan.rule_for(fc, "unknown") is not policy_table.DEFAULT_RULE, fc


def test_restart_names_culprit_ranks_and_their_nodes():
    d = decide(verdict("crash", "unknown", ranks=[3]), job())
    assert d.ranks == [3] and d.nodes == ["n2"] and d.members == [] and d.world_size == 4
    assert d.retries_used == 1 and d.retry_budget == 5


def test_restart_without_culprit_restarts_every_rank():
    d = decide(verdict("hang", "unknown"), job())
    assert d.action == "restart_workers" and d.ranks == [0, 1, 2, 3]


def test_timeline_from_verdict():
    v = verdict("crash", "unknown", ranks=[1], first_ts=111, detail={"detected_ts": 222})
    d = decide(v, job())
    assert (d.fault_ts, d.detected_ts, d.verdict_id) == (111, 222, v.event_id)
    assert d.trace["traceparent"].split("-")[1] == v.trace_id


def test_budget_spent_stops():
    d = decide(verdict("crash", "unknown", ranks=[1]), job(retries_used=5))
    assert d.action == "stop_job_notify_user" and "retry budget spent (5 of 5" in d.reason


def test_same_fault_same_step_after_restart_is_a_loop():
    v = verdict("app_exception", ranks=[1], evidence=["ValueError: bad batch 17"],
                detail={"step": 30})
    last = {"fault_class": "app_exception", "step": 30, "signature": signature(v),
            "generation": 2}
    d = decide(v, job(last_fault=last))
    assert d.action == "stop_job_notify_user" and "would loop" in d.reason
    # another step, or the same incident (same generation), is not a loop
    assert decide(v, job(last_fault={**last, "step": 29})).action == "restart_in_process"
    assert decide(v, job(last_fault={**last, "generation": 3})).action == "restart_in_process"
    # numbers in the message do not change the derived signature
    v2 = verdict("app_exception", ranks=[1], evidence=["ValueError: bad batch 99"],
                 detail={"step": 30})
    assert signature(v2) == signature(v)


def test_same_exception_before_the_first_step_again_is_a_loop():
    """A script that raises before its first step fails alike after every restart: the second
    time is a loop (no step to compare: both have none); a crash without a step is not."""
    v = verdict("app_exception", ranks=[1], evidence=["RuntimeError: no such dataset /data/x"])
    last = {"fault_class": "app_exception", "step": None, "signature": signature(v),
            "generation": 0}
    d = decide(v, job(last_fault=last))
    assert d.action == "stop_job_notify_user" and "at an unknown step (no report of either fault named one) again" in d.reason
    assert decide(v, job(last_fault={**last, "step": 12})).action == "restart_in_process"
    c = verdict("crash", "unknown", ranks=[1], evidence=["rank 1 exited with signal 9"])
    assert decide(c, job(last_fault={**last, "fault_class": "crash",
                                     "signature": signature(c)})).action \
        == "restart_workers"


def test_exclude_renumbers_members():
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1"]), job())
    assert d.action == "exclude_node_and_requeue"
    assert d.nodes == ["n1"] and d.ranks == [0, 1]
    assert [m.model_dump() for m in d.members] == [
        {"rank": 0, "node": "n2", "local_rank": 0}, {"rank": 1, "node": "n2", "local_rank": 1}]
    assert d.world_size == 2


def test_exclude_nodes_found_from_culprit_ranks():
    d = decide(verdict("gpu_xid", "hardware", ranks=[2]), job())
    assert d.nodes == ["n2"] and d.world_size == 2


def test_exclude_uses_spare():
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1"]),
               job(spare_nodes=["s1"], min_world_size=4))
    assert d.action == "exclude_node_and_requeue" and d.world_size == 4
    assert [(m.rank, m.node, m.local_rank) for m in d.members] == [
        (0, "n2", 0), (1, "n2", 1), (2, "s1", 0), (3, "s1", 1)]


def test_exclude_below_min_world_size_stops():
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1"]), job(min_world_size=3))
    assert d.action == "stop_job_notify_user"
    assert "min_world_size 3" in d.reason and d.members == []


def test_exclude_below_min_world_size_requeues_where_the_scheduler_can():
    v = verdict("node_lost", "infrastructure", nodes=["n1"])
    d = decide(v, job(min_world_size=4), requeues=True)
    # the exclusion with the world it leaves (below the minimum): the controller requeues on
    # it, the survivors stop their ranks and wait for the scheduler
    assert d.action == "exclude_node_and_requeue" and d.execute and d.nodes == ["n1"]
    assert d.world_size == 2 and {m.node for m in d.members} == {"n2"}
    assert "requeues the job without n1" in d.reason and "world 4" in d.reason
    # a spare is still the first choice: no requeue needed
    d = decide(v, job(min_world_size=4, spare_nodes=["s1"]), requeues=True)
    assert d.world_size == 4 and "requeues" not in d.reason
    # a job on the excluded node alone: no world is left in the allocation, the scheduler
    # requeues it elsewhere (world 0, no members); without a requeueing scheduler, a stop
    lone = [m for m in MEMBERS if m["node"] == "n1"]
    d = decide(v, job(min_world_size=2, members=lone, world_size=2), requeues=True)
    assert d.action == "exclude_node_and_requeue" and d.execute, d
    assert (d.world_size, d.members, d.nodes) == (0, [], ["n1"])
    assert "on another allocation (no node of the job is left)" in d.reason
    d = decide(v, job(min_world_size=2, members=lone, world_size=2))
    assert d.action == "stop_job_notify_user"


def test_straggler_replaced_only_with_spare():
    v = verdict("straggler", "hardware", ranks=[3], nodes=["n2"])
    assert decide(v, job()).action == "none"
    d = decide(v, job(spare_nodes=["s9"]))
    assert d.action == "exclude_node_and_requeue"
    assert {m.node for m in d.members} == {"n1", "s9"}


def test_observe_mode_never_executes():
    d = decide(verdict("crash", "unknown", ranks=[1]), job(mode="observe"))
    assert d.action == "restart_workers" and d.execute is False and d.mode == "observe"
    assert d.idempotency_key.startswith("j:g3:observe:crash:")
    # a job that never chose a mode is observed (default)
    assert decide(verdict("crash", "unknown", ranks=[1]), JobRecord()).execute is False


def test_attributor_facts_strengthen_only_when_stronger_and_confident():
    strong = verdict("crash", "unknown", ranks=[2], confidence="medium",
                     detail={"repeat_offender": ["n2"]})
    d = decide(strong, job())
    assert d.action == "exclude_node_and_requeue" and "repeat offender (n2" in d.reason
    weak = verdict("crash", "unknown", ranks=[2], confidence="low",
                   detail={"repeat_offender": ["n2"]})
    assert decide(weak, job()).action == "restart_workers"
    # a single exception is not stopped: restart in process ...
    stop = verdict("app_exception", ranks=[1], confidence="high")
    assert decide(stop, job()).action == "restart_in_process"
    # ... but a systematic one (same failure on different nodes) is
    stop.detail["systematic"] = ["n1", "n2"]
    assert decide(stop, job()).action == "stop_job_notify_user"
    # a fact weaker than the table's action changes nothing
    disk = verdict("filesystem", "infrastructure", ranks=[1], confidence="high",
                   detail={"repeat_offender": ["n1"]})
    assert decide(disk, job()).action == "stop_job_notify_user"
    # the verdict's own (advisory) action is never followed
    told = verdict("crash", "unknown", ranks=[2], action="exclude_node_and_requeue",
                   confidence="high")
    assert decide(told, job()).action == "restart_workers"


def test_actions_without_executor_are_aliased():
    # reset_gpu has no executor: a policy row that names it is carried out as an exclusion
    own = policy_table.Policy(table=(policy_table.Rule("gpu_xid", None, "reset_gpu", "mine"),))
    d = decide(verdict("gpu_xid", "hardware", ranks=[0]), job(), own)
    assert d.action == "exclude_node_and_requeue" and "reset_gpu is carried out" in d.reason


def test_verdict_generation_missing_uses_job_generation():
    v = Verdict(job="j", fault_class="crash", layer="unknown", action="restart_workers",
                culprit={"ranks": [0]})
    assert decide(v, job(generation=7)).idempotency_key == "j:g7"


def test_no_job_no_decision():
    v = Verdict(fault_class="crash", layer="unknown", action="restart_workers")
    assert decide(v, job()) is None


def test_watchdog_ladder():
    d1 = decide(verdict("crash", "unknown", ranks=[3]), job())
    d2 = escalate(d1, job(generation=4), "timed out")
    assert d2.action == "exclude_node_and_requeue" and d2.nodes == ["n2"]
    assert d2.generation == 5 and d2.idempotency_key == "j:g3:wd" and "watchdog" in d2.reason
    d3 = escalate(d2, job(generation=5), "timed out")
    assert d3.action == "stop_job_notify_user" and d3.idempotency_key == "j:g3:wd:wd"
    assert escalate(d3, job(generation=6), "timed out") is None


def test_new_world_keeps_survivor_order():
    members, used = new_world(MEMBERS, ["n1"], ["s1", "s2"])
    assert used == ["s1"]
    assert [(m.rank, m.node, m.local_rank) for m in members] == [
        (0, "n2", 0), (1, "n2", 1), (2, "s1", 0), (3, "s1", 1)]


def test_thermal_and_straggler_rules_are_not_overridden():
    hot = verdict("thermal", "hardware", nodes=["n2"], confidence="high",
                  detail={"repeat_offender": ["n2"]})
    assert decide(hot, job()).action == "none"
    slow = verdict("straggler", "hardware", ranks=[3], confidence="high",
                   detail={"repeat_offender": ["n2"]})
    assert decide(slow, job()).action == "none"


def test_thermal_node_replaced_only_with_spare():
    v = verdict("thermal", "hardware", nodes=["n2"])
    assert decide(v, job()).action == "none"
    d = decide(v, job(spare_nodes=["s9"]))
    assert d.action == "exclude_node_and_requeue" and d.nodes == ["n2"]
    assert {m.node for m in d.members} == {"n1", "s9"}


def test_network_fault_without_culprit_reforms_in_place():
    d = decide(verdict("network", "infrastructure"), job())
    assert d.action == "restart_in_process" and d.ranks == [0, 1, 2, 3]


def test_late_verdict_without_generation_joins_the_incident_it_belongs_to():
    last = {"id": "d1", "action": "restart_workers", "generation": 4, "fault_generation": 3,
            "ts": 5_000}
    late = Verdict(job="j", fault_class="network", layer="infrastructure", action="none",
                   culprit={"ranks": [0]}, first_ts=4_000)
    assert decide(late, job(generation=4, last_decision=last)).idempotency_key == "j:g3"
    fresh = late.model_copy(update={"first_ts": 6_000})
    assert decide(fresh, job(generation=4, last_decision=last)).idempotency_key == "j:g4"


def test_node_already_out_of_the_job_is_not_excluded_again():
    after = [{"rank": 0, "node": "n2", "local_rank": 0}, {"rank": 1, "node": "n2", "local_rank": 1}]
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1"]),
               job(members=after, world_size=2, generation=4))
    assert d.action == "none" and "already out of the job" in d.reason
    assert d.generation == 4 and d.execute is False
    # only the nodes still in the job are excluded
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1", "n2"]),
               job(min_world_size=0))
    assert d.nodes == ["n1", "n2"]
    d = decide(verdict("node_lost", "infrastructure", nodes=["n1", "n9"]), job())
    assert d.nodes == ["n1"] and d.world_size == 2


def test_reset_without_culprit_reforms_in_place():
    d = decide(verdict("network", "infrastructure"), job())
    assert d.action == "restart_in_process"
    assert "in place" in d.reason


def test_plan_and_escalate_change_none_of_their_inputs():
    v = verdict("crash", "unknown", ranks=[2])
    rec = job(retries_used=5, members=[dict(m) for m in MEMBERS])
    reasons = ["crash/unknown: the table"]
    before = (v.model_dump(), rec.to_dict())
    d = plan.plan(v, rec, "restart_workers", reasons, 3)
    assert d.action == "stop_job_notify_user" and "retry budget spent" in d.reason
    assert reasons == ["crash/unknown: the table"]  # the caller's list is not appended to
    assert (v.model_dump(), rec.to_dict()) == before
    prev = decide(verdict("crash", "unknown", ranks=[2]), job())
    snap = prev.model_dump()
    nxt = escalate(prev, job(), "not followed by training")
    assert nxt.action == "exclude_node_and_requeue" and prev.model_dump() == snap


@pytest.mark.parametrize("fault_class,layer,root_kind,ranks,nodes,spares,expected", [
    # a throughput drop naming its slowest rank: replaced by a spare, flagged without one
    ("straggler", "unknown", "throughput_drop", [3], ["n2"], ["s1"], "exclude_node_and_requeue"),
    ("straggler", "unknown", "throughput_drop", [3], ["n2"], [], "none"),
    # ... and naming none: flagged even with a spare (it once became a stop: "exclusion needs
    # a culprit node")
    ("straggler", "unknown", "throughput_drop", [], [], ["s1"], "none"),
    # telemetry and counter warnings are flagged whatever their class's row does for an error
    ("gpu_xid", "hardware", "pcie_replay_rate", [2], ["n2"], ["s1"], "none"),
    ("nvlink", "hardware", "nvlink_errors", [2], ["n2"], ["s1"], "none"),
    ("network", "infrastructure", "peer_latency", [], ["n2"], [], "none"),
    ("straggler", "system_software", "cpu_saturated", [], ["n2"], ["s1"], "none"),
    ("ecc", "hardware", "ecc_corrected", [2], ["n2"], ["s1"], "none"),  # a row remap: a repair
    # a measured straggler and a throttled GPU keep their rows
    ("straggler", "unknown", "straggler", [3], ["n2"], ["s1"], "exclude_node_and_requeue"),
    ("thermal", "hardware", "thermal", [3], ["n2"], ["s1"], "exclude_node_and_requeue"),
])
def test_warnings_flag_unless_a_spare_replaces_a_measured_slow_rank(
        fault_class, layer, root_kind, ranks, nodes, spares, expected):
    v = verdict(fault_class, layer, ranks=ranks, nodes=nodes,
                detail={"severity": "warning", "root_kind": root_kind})
    d = decide(v, job(spare_nodes=spares))
    assert d.action == expected, d.reason
    assert d.action != "stop_job_notify_user"
    # the same classes as errors keep their rows
    if fault_class in ("gpu_xid", "nvlink", "ecc"):
        err = verdict(fault_class, layer, ranks=ranks, nodes=nodes,
                      detail={"severity": "error", "root_kind": "gpu_fault"})
        assert decide(err, job(spare_nodes=spares)).action == "exclude_node_and_requeue"


def test_a_systematic_stop_quotes_the_roots_error_and_the_nodes():
    v = verdict("app_exception", ranks=[0, 2], nodes=["n1", "n2"], confidence="high",
                evidence=["[symptom log_pattern rank 1] RuntimeError: Connection closed by peer",
                          "[root log_pattern rank 0] ValueError: bad batch at step 50"],
                detail={"systematic": ["n1", "n2"]})
    d = decide(v, job())
    assert d.action == "stop_job_notify_user"
    assert "systematic (n1, n2, high confidence)" in d.reason
    assert d.reason.endswith("the error: ValueError: bad batch at step 50"), d.reason


# ---- pod restart: a lost launcher on a healthy node, under a controller that recreates pods ----
def launcher_lost(node="n2", ranks=(2, 3), **detail):
    return verdict("crash", "infrastructure", ranks=ranks, nodes=[node],
                   detail={"root_kind": "launcher_lost", "launcher_lost": [node], **detail})


#: (case, verdict, job, controller recreates pods, action, nodes whose pod is replaced)
POD_CASES = [
    ("kubernetes: the lost launcher's pod is replaced, the node stays in service",
     launcher_lost(), job(), True, "restart_workers", ["n2"]),
    ("local or Slurm: no pod to replace, the reason says to start the launcher again",
     launcher_lost(), job(), False, "restart_workers", []),
    ("a plain crash is the launcher's to restart", verdict("crash", "unknown", ranks=[2]),
     job(), True, "restart_workers", []),
    ("the node failed in other jobs too: excluded (cordoned), no pod restart",
     launcher_lost(repeat_offender=["n2"]).model_copy(update={"layer": "hardware"}), job(),
     True, "exclude_node_and_requeue", []),
    ("retry budget spent: a stop, no pod restart", launcher_lost(), job(retries_used=5), True,
     "stop_job_notify_user", []),
    ("a node outside the decision is not touched",
     launcher_lost().model_copy(update={"detail": {"root_kind": "launcher_lost",
                                                   "launcher_lost": ["n9"]}}),
     job(), True, "restart_workers", []),
]


@pytest.mark.parametrize("case,v,rec,pods,action,nodes", POD_CASES,
                         ids=[c[0] for c in POD_CASES])
def test_pod_restart(case, v, rec, pods, action, nodes):
    d = decide(v, rec, restarts_pods=pods)
    assert d.action == action, d.reason
    got, why = plan.pod_restart(d, v, pods)
    assert got == nodes, case
    if nodes:
        assert d.ranks == [2, 3] and d.nodes == ["n2"] and d.members == []  # world unchanged
        assert "JobSet, PyTorchJob" in d.reason and why in d.reason
    elif action == "restart_workers" and v.detail.get("launcher_lost") == ["n2"]:
        assert "start the launcher on that node again" in d.reason


def test_every_pod_restart_row_has_a_source_and_an_acting_action():
    for row in policy_table.POD_RESTARTS:
        assert row.source and row.elsewhere and row.action in policy_table.RECOVERY_ACTIONS
        assert row.action != "exclude_node_and_requeue"  # a pod restart keeps the node


@pytest.mark.parametrize("fault_class,layer,root_kind,nodes,spares,expected", [
    # a degrading node with a spare: a planned migration of its ranks to the spare
    ("ecc", "hardware", "ecc_corrected_rate", ["n2"], ["s1"], "exclude_node_and_requeue"),
    ("oom_host", "application", "host_memory_trend", ["n2"], ["s1"], "exclude_node_and_requeue"),
    ("oom_host", "application", "host_memory_exhausted", ["n2"], ["s1"],
     "exclude_node_and_requeue"),
    # without a spare: flagged, as today (never a shrink of the world for a warning)
    ("ecc", "hardware", "ecc_corrected_rate", ["n2"], [], "none"),
    ("oom_host", "application", "host_memory_trend", ["n2"], [], "none"),
    ("oom_host", "application", "host_memory_exhausted", ["n2"], [], "none"),
    # without a culprit node: flagged
    ("oom_host", "application", "host_memory_trend", [], ["s1"], "none"),
    # a spare that is the degrading node itself is no spare
    ("ecc", "hardware", "ecc_corrected_rate", ["s1"], ["s1"], "none"),
])
def test_a_degrading_node_migrates_to_a_spare_before_any_rank_dies(
        fault_class, layer, root_kind, nodes, spares, expected):
    v = verdict(fault_class, layer, nodes=nodes, confidence="low",
                detail={"severity": "warning", "root_kind": root_kind})
    d = decide(v, job(spare_nodes=spares))
    assert d.action == expected, d.reason
    assert d.reason.startswith("planned migration"), d.reason
    if expected == "none":
        assert not d.members and d.generation == 3 and "flag only" in d.reason
        return
    # the node's ranks, all of them, move to the spare: the world size is kept
    assert d.nodes == ["n2"] and d.ranks == [2, 3] and d.world_size == 4, d
    assert sorted((m.rank, m.node) for m in d.members) == [
        (0, "n1"), (1, "n1"), (2, "s1"), (3, "s1")]
    assert d.execute and d.generation == 4 and d.retries_used == 1
    assert "spare node(s) s1 replace n2" in d.reason


def test_a_planned_migration_is_no_new_fault_once_the_node_is_out():
    """The warnings go on after the move (the counter keeps rising on the excluded node): the
    node is no member any more, nothing is excluded again."""
    moved = [m if m["node"] != "n2" else {**m, "node": "s1"} for m in MEMBERS]
    v = verdict("ecc", "hardware", nodes=["n2"],
                detail={"severity": "warning", "root_kind": "ecc_corrected_rate"})
    d = decide(v, job(members=moved, spare_nodes=["s1", "s2"]))
    assert d.action == "none" and "already out of the job" in d.reason


def test_a_planned_migration_respects_the_retry_budget():
    v = verdict("oom_host", "application", nodes=["n2"],
                detail={"severity": "warning", "root_kind": "host_memory_trend"})
    d = decide(v, job(spare_nodes=["s1"], retries_used=5))
    assert d.action == "stop_job_notify_user" and "retry budget spent" in d.reason


def test_every_migration_row_has_a_source_and_a_detector_kind():
    from trainguard.detector import scheduler
    from trainguard.detector import telemetry as tel

    assert {m.root_kind for m in policy_table.MIGRATIONS} == {
        "ecc_corrected_rate", "host_memory_trend", "host_memory_exhausted", "slurm_drain"}
    kinds = set(tel.RULES) | {r.kind for r in scheduler.ROWS if r.severity == "warning"}
    for m in policy_table.MIGRATIONS:
        assert m.source and m.root_kind in kinds
        assert m.root_kind not in policy_table.ACTING_WARNINGS

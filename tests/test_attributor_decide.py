"""Pure attribution: root cause, cascades, hung vs blocked, XIDs, cross-job history."""
from __future__ import annotations

import pytest

from trainguard import schemas
from trainguard.attributor.decide import History, choose_root, conclusion, decide, history_from_records


def anomaly(kind, fc, ts, ranks=(), nodes=(), gpus=(), symptom=False, **detail):
    return schemas.Anomaly(job="j", kind=kind, fault_class=fc, first_ts=ts,
                           culprit=schemas.Culprit(ranks=list(ranks), nodes=list(nodes),
                                                   gpus=list(gpus)),
                           symptom=symptom, evidence=[f"{kind} {fc} {ranks}"], detail=detail,
                           generation=0)


def crash(rank, ts, node="n1", sig=9):
    return anomaly("crash", "crash", ts, [rank], [node], signal=sig, layer="unknown", weight=0.8)


def reset(rank, ts, node="n0"):
    return anomaly("log_pattern", "network", ts, [rank], [node], symptom=True,
                   pattern="gloo_peer_reset", layer="infrastructure", weight=0.5)


def test_death_cascade_names_the_dead_rank_not_the_victims():
    # the victims' lines can arrive first on the bus: time order is by first_ts
    v = decide([reset(1, 120), reset(3, 125), crash(2, 100)])
    assert v.fault_class == "crash" and v.ranks == [2] and v.nodes == ["n1"]
    assert v.layer == "unknown" and not hasattr(v, "action")  # the remediator chooses
    assert v.detail["symptoms"] == 2 and "victims" in " ".join(v.detail["notes"])
    assert v.evidence[0].startswith("[root crash rank 2]")   # time order: the death first


def test_a_lost_launcher_explains_the_silence_of_its_ranks():
    node = "ip-10-0-1-2.ec2.internal"
    lost = anomaly("launcher_lost", "crash", 100, [4, 5], [node], rule="launcher_lost",
                   launcher_lost=[node], last_beat_ns=97, layer="infrastructure", weight=0.85)
    hangs = [anomaly("hang", "hang", 101, [r], [node], rule="silence", layer="unknown",
                     weight=0.85) for r in (4, 5)]
    v = decide([lost, *hangs])
    assert (v.fault_class, v.layer) == ("crash", "infrastructure")
    assert v.ranks == [4, 5] and v.nodes == [node]
    assert v.detail["root_kind"] == "launcher_lost" and v.detail["launcher_lost"] == [node]
    assert v.detail["last_beat_ns"] == 97  # when the launcher went silent: the fault's onset


def test_symptoms_alone_are_attributed_with_low_confidence():
    v = decide([reset(1, 10), reset(3, 11)])
    assert v.fault_class == "network" and v.confidence == "low" and v.detail["symptom_only"]
    # the reporters of a reset are its victims: no culprit, re-form the group in place
    assert v.ranks == [] and v.nodes == []


def test_hardware_explains_the_crash_of_its_rank():
    x = anomaly("gpu_fault", "gpu_xid", 105, [], ["n1"], ["n1:2"], xid=79, layer="hardware", weight=0.95)
    v = decide([crash(2, 100), x, reset(1, 110)])
    assert (v.fault_class, v.layer) == ("gpu_xid", "hardware")
    assert v.nodes == ["n1"] and v.gpus == ["n1:2"] and v.confidence == "high"


def test_hung_rank_vs_blocked_ranks():
    hang = anomaly("hang", "hang", 200, [2], ["n1"], rule="silence", layer="unknown", weight=0.85)
    wd = [anomaly("log_pattern", "hang", 300 + r, [r], symptom=True, seq="40",
                  pattern="nccl_watchdog_timeout") for r in (0, 1, 3)]
    v = decide(wd + [hang])
    assert v.fault_class == "hang" and v.ranks == [2]


def test_watchdogs_alone_name_the_lowest_sequence():
    wd = [anomaly("log_pattern", "hang", 10 + r, [r], symptom=True, seq=str(s),
                  pattern="nccl_watchdog_timeout") for r, s in ((0, 41), (1, 41), (3, 40))]
    v = decide(wd)
    assert v.ranks == [3] and v.confidence == "low"
    same = [anomaly("log_pattern", "hang", 10 + r, [r], symptom=True, seq="41") for r in (0, 1)]
    assert decide(same).ranks == []   # every reporter is blocked; the hung peer is unnamed


def test_oom_kill_explains_sigkill():
    oom = anomaly("log_pattern", "oom_host", 101, [2], ["n1"], pattern="host_oom_kill",
                  layer="application", weight=0.95)
    v = decide([crash(2, 100), oom])
    assert v.fault_class == "oom_host" and v.ranks == [2]


def test_node_failing_across_jobs_is_excluded():
    c = crash(0, 1, node="bad-node", sig=11)
    h = History(job="j", node_jobs={"bad-node": {"other-job"}})
    v = decide([c], h)
    assert v.detail["repeat_offender"] == ["bad-node"] and v.layer == "hardware"
    assert v.confidence in ("medium", "high")
    assert any("different jobs" in n for n in v.detail["notes"])
    alone = decide([c], History(job="j"))
    assert "repeat_offender" not in alone.detail and alone.layer == "unknown"
    assert conclusion(alone) != conclusion(v)  # a new fact: the verdict is published again


def test_same_failure_on_different_nodes_is_application():
    bug = anomaly("log_pattern", "app_exception", 1, [0], ["n2"], pattern="python_exception",
                  layer="application", weight=0.5)
    v = decide([bug], History(job="j", signature_nodes={"n1"}))
    assert v.layer == "application" and v.detail["systematic"] == ["n1", "n2"]
    assert v.confidence == "high"
    # a signal says nothing about the code: two crashes on two nodes are not one bug
    c = decide([crash(0, 1, node="n2", sig=11)], History(job="j", signature_nodes={"n1"}))
    assert "systematic" not in c.detail
    # the same exception on every rank of several nodes in one incident
    ex = [anomaly("log_pattern", "app_exception", 5 + r, [r], [f"n{r // 2}"],
                  pattern="python_exception", layer="application", weight=0.5) for r in range(4)]
    assert decide(ex).detail["systematic"] == ["n0", "n1"]


def test_app_xids_recurring_on_one_gpu_make_it_suspect():
    x = anomaly("gpu_fault", "gpu_xid", 1, [], ["n1"], ["0000:61:00"], xid=13, pid=50,
                layer="application", weight=0.95)
    assert decide([x]).layer == "application"
    h = history_from_records("j", {"n1": [
        {"job": "a", "ts": 5, "xid": 13, "gpu": "0000:61:00", "pid": 10, "layer": "application"},
        {"job": "b", "ts": 6, "xid": 31, "gpu": "0000:61:00", "pid": 20, "layer": "application"},
    ]}, [], {"0000:61:00": {50}})
    v = decide([x], h)
    assert (v.fault_class, v.layer) == ("gpu_xid", "hardware")
    assert v.detail["suspect_gpu"] == "0000:61:00"
    assert h.node_jobs == {}  # application XIDs never count as node faults


def test_choose_root():
    assert choose_root([reset(1, 1), crash(2, 5)]).kind == "crash"
    with pytest.raises(ValueError):
        decide([])


def _warning(kind, fc, ts, ranks=(), nodes=(), weight=0.5, layer="hardware"):
    a = anomaly(kind, fc, ts, ranks, nodes, pattern=kind, layer=layer, weight=weight)
    return a.model_copy(update={"severity": "warning"})


def test_among_warnings_the_strongest_leads_not_the_first():
    """A failed save of rank 1 (a flag) seen first must not hide the warning of a degrading
    node that came after it: neither caused the other, and only the second calls for an action
    (a planned migration with a spare)."""
    save = _warning("log_pattern", "checkpoint_save", 100, [1], ["node0"], 0.8, "infrastructure")
    mem = _warning("host_memory_trend", "oom_host", 105, [], ["node1"], 0.5, "application")
    ecc = _warning("ecc_corrected_rate", "ecc", 107, [], ["node1"], 0.5)
    for seen in ([save, mem], [mem, save]):
        v = decide(seen)
        assert (v.fault_class, v.nodes) == ("oom_host", ["node1"]), v
        assert v.detail["root_kind"] == "host_memory_trend" and v.detail["severity"] == "warning"
    assert decide([save, ecc]).fault_class == "ecc"
    # an error still wins by time order: the earliest error explains what follows it
    assert decide([mem, crash(2, 90, node="node1")]).fault_class == "crash"


def _sigkill_guess(rank, ts):
    return anomaly("log_pattern", "oom_host", ts, [rank], pattern="sigkill", layer="application",
                   weight=0.45)


def _sigterm(rank, ts):
    return anomaly("log_pattern", "crash", ts, [rank], symptom=True, pattern="rank_sigterm",
                   layer="system_software", weight=0.3)


@pytest.mark.parametrize("others, fault_class, layer", [
    ([], "oom_host", "application"),                         # a bare SIGKILL: the OOM guess
    ([_sigterm(1, 120), _sigterm(2, 121)], "crash", "system_software"),   # a job torn down
    ([reset(1, 110)], "oom_host", "application"),             # victims' resets change nothing
])
def test_a_guessed_sigkill_is_read_again_by_what_else_the_incident_shows(others, fault_class,
                                                                          layer):
    v = decide([_sigkill_guess(0, 100), *others])
    assert (v.fault_class, v.layer, v.ranks) == (fault_class, layer, [0])
    assert any("tore the job down" in n for n in v.detail["notes"]) == (fault_class == "crash")


def test_an_observed_oom_kill_is_not_read_again():
    oom = anomaly("log_pattern", "oom_host", 100, [0], pattern="host_oom_kill",
                  layer="application", weight=0.9)
    v = decide([oom, _sigkill_guess(0, 101), _sigterm(1, 120)])
    assert (v.fault_class, v.layer) == ("oom_host", "application")


def test_one_exception_reported_twice_keeps_the_ranks_step():
    """The launcher relays a rank's traceback as it is printed (no step) before the rank's own
    report (with its step) arrives: the verdict carries the rank's step either way, which the
    remediator's loop check compares (a user's trial: an HF job failing again at step 250 after
    reporting steps 205-245 was said to have failed 'before any step was reported')."""
    relayed = anomaly("log_pattern", "app_exception", 100, [1], ["n1"], pattern="python_exception",
                      layer="application", weight=0.6, step=None)
    own = anomaly("log_pattern", "app_exception", 101, [1], ["n1"], pattern="exception",
                  layer="application", weight=0.6, step=249)
    other_rank = anomaly("log_pattern", "app_exception", 101, [0], ["n1"], pattern="exception",
                         layer="application", weight=0.6, step=7)
    assert decide([relayed, own]).detail["step"] == 249
    assert decide([own, relayed]).detail["step"] == 249
    # another rank's step is not this rank's
    assert "step" not in decide([relayed, other_rank]).detail
    assert "step" not in decide([relayed]).detail


def test_a_flag_in_a_crashs_incident_neither_times_its_fault_nor_its_detection():
    """A straggler flag of rank 3 (a loaded host) seen a second before rank 1's crash joins the
    crash's incident: the fault and its detection are the crash's, not the flag's (the goodput
    ledger's fault-free step time stops at the first fault; the console times detection)."""
    flag = _warning("straggler", "straggler", 100, [3], ["n0"], 0.5, "application")
    flag = flag.model_copy(update={"ts": 100})
    c = crash(1, 1_000, node="n1").model_copy(update={"ts": 1_006})
    v = decide([flag, c])
    assert v.fault_class == "crash" and v.ranks == [1]
    assert v.first_ts == 1_000 and v.detail["detected_ts"] == 1_006
    # a verdict of flags alone is timed by them
    w = decide([flag])
    assert w.first_ts == 100 and w.detail["detected_ts"] == 100

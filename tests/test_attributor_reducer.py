"""The attributor's reducer as a table, without servers: ``run_offline`` drives
``attributor.incidents.step``; a small in-memory history answers its ``fault_history``
calls."""
from __future__ import annotations

import pytest

from trainguard import schemas
from trainguard.attributor import incidents
from trainguard.attributor.decide import AttributorConfig
from trainguard.attributor.incidents import AttributorState
from trainguard.core.reducer import Call, Log, Publish, Received, Tick, run_offline
from trainguard.schemas import subjects

WALL = 1_700_000_000 * 10**9  # Unix ns of the inputs
DAY_NS = 86400 * 10**9


class History:
    """In-memory cross-job history: node → records, signature → [(job, node)]."""

    def __init__(self, nodes=None, sigs=None, fail=()):
        self.nodes, self.sigs, self.fail = nodes or {}, sigs or {}, set(fail)
        self.asked: list[tuple] = []

    def __call__(self, call: Call):
        assert call.target == "state"
        self.asked.append((call.method, *call.args))
        if call.method in self.fail:
            raise ConnectionError("valkey gone")
        if call.method == "fault_history":
            nodes, sig, since = call.args
            return ({n: [r for r in self.nodes.get(n, []) if r["ts"] >= since] for n in nodes},
                    list(self.sigs.get(sig, [])))
        raise AssertionError(f"unexpected call {call}")


def anomaly(kind, fc, ts, ranks=(), nodes=(), symptom=False, severity="error", gen=0, **detail):
    return schemas.Anomaly(job="j", kind=kind, fault_class=fc, first_ts=ts, symptom=symptom,
                           severity=severity,
                           culprit=schemas.Culprit(ranks=list(ranks), nodes=list(nodes)),
                           evidence=[f"{kind} {fc} {list(ranks)}"], detail=detail,
                           generation=gen)


def crash(rank=2, ts=100, node="n1", gen=0):
    return anomaly("crash", "crash", ts, [rank], [node], signal=9, layer="unknown", weight=0.8,
                   gen=gen)


def reset(rank=1, ts=120, node="n0"):
    return anomaly("log_pattern", "network", ts, [rank], [node], symptom=True,
                   pattern="gloo_peer_reset", layer="infrastructure", weight=0.5)


def lost(node="n1", ts=150):
    return anomaly("node_lost", "node_lost", ts, [], [node], layer="infrastructure",
                   weight=0.9)


def at(now, a):
    return (now, Received(subjects.job("j", "anomaly"), a, WALL + int(now * 1e9)))


def tick(now):
    return (now, Tick(WALL + int(now * 1e9)))


def run(inputs, history=None, state=None, **cfg):
    state = state or AttributorState(config=AttributorConfig(**{"symptom_hold_s": 1.0, **cfg}))
    return run_offline(incidents.step, state, inputs, history or History())


def verdicts(effects):
    return [e.event for e in effects if isinstance(e, Publish)]


def writes(effects):
    return [e for e in effects if isinstance(e, Call) and e.method == "record_fault"]


def test_a_symptom_is_held_then_attributed_alone():
    h = History()
    state, eff = run([at(0.0, reset()), tick(0.5), tick(0.99)], h)
    assert eff == [] and h.asked == []           # held: no read, no verdict
    state, eff = run([tick(1.0), tick(1.5)], h, state)
    [v] = verdicts(eff)
    assert (v.fault_class, v.confidence, v.generation) == ("network", "low", 0)
    assert v.culprit.ranks == [] and v.detail["symptom_only"] and v.detail["revision"] == 0
    assert v.ts == WALL + 10**9                   # from the tick's wall clock
    # one read: the culprit nodes' records and the signature's pairs
    assert h.asked == [("fault_history", ("n0",), v.detail["signature"],
                        WALL + 10**9 - DAY_NS)]
    assert writes(eff) == []  # no culprit node: nothing for the node history
    assert state.published == 1 and state.reading == {}


def test_a_root_folds_the_held_symptoms():
    state, eff = run([at(0.0, reset(1, 120)), at(0.02, reset(3, 125)), at(0.05, crash(2, 100)),
                      tick(1.5), tick(3.0)])
    [v] = verdicts(eff)
    assert (v.fault_class, v.culprit.ranks, v.culprit.nodes) == ("crash", [2], ["n1"])
    assert v.detail["symptoms"] == 2 and v.first_ts == 100
    [w] = writes(eff)
    assert w.args[:3] == ("n1", "j", v.detail["signature"])
    assert w.args[3] == {"fault_class": "crash", "layer": "unknown", "generation": 0}
    assert w.reply is None and w.kwargs == {"ts_ns": WALL + int(0.05e9)}
    inc = state.incidents[("j", 0)]
    assert inc.settled and inc.hold_until is None and inc.verdicts == 1


def test_a_later_stronger_root_republishes():
    state, eff = run([at(0.0, crash(2, 100, node="n1")), at(0.1, lost("n1", 150))])
    first, second = verdicts(eff)
    assert (first.fault_class, second.fault_class) == ("crash", "node_lost")
    assert (first.detail["revision"], second.detail["revision"]) == (0, 1)
    assert state.published == 2


def test_the_same_conclusion_is_folded():
    state, eff = run([at(0.0, crash(2, 100)), at(0.1, crash(3, 105)), at(0.2, reset())])
    [v] = verdicts(eff)
    assert v.culprit.ranks == [2]
    assert state.incidents[("j", 0)].anomalies[-1].symptom  # folded in, not published
    # the second crash was attributed again (history read) and folded
    assert len([e for e in eff if isinstance(e, Call) and e.method == "fault_history"]) == 2


def test_a_failed_history_read_still_attributes():
    h = History(nodes={"n1": [{"job": "other", "layer": "hardware", "ts": WALL - 10}]},
                fail={"fault_history"})
    state, eff = run([at(0.0, crash(node="n1"))], h)
    [v] = verdicts(eff)
    assert v.fault_class == "crash" and "repeat_offender" not in v.detail
    assert [m for m, *_ in h.asked] == ["fault_history"] and state.reading == {}
    [warn] = [e for e in eff if isinstance(e, Log)]
    assert "history unavailable" in warn.message and "valkey gone" in warn.message


def test_cross_job_history_makes_a_repeat_offender_and_a_new_fact_republishes():
    h = History(nodes={"n1": [{"job": "other", "layer": "hardware", "ts": WALL - 10}]})
    _, eff = run([at(0.0, crash(node="n1"))], h)
    [v] = verdicts(eff)
    assert v.detail["repeat_offender"] == ["n1"] and v.layer == "hardware"
    # the history keeps what the evidence said of this crash (unknown), not the conclusion the
    # history drew: one node fault and a SIGKILL in another job never make a third crash there
    # a node fault by themselves
    [rec] = [e for e in eff if isinstance(e, Call) and e.method == "record_fault"
             and e.args[0] == "n1"]
    assert v.detail["evidence_layer"] == "unknown" and rec.args[3]["layer"] == "unknown", rec
    # older than the window: not counted
    old = History(nodes={"n1": [{"job": "other", "layer": "hardware", "ts": WALL - 2 * DAY_NS}]})
    _, eff = run([at(0.0, crash(node="n1"))], old)
    assert "repeat_offender" not in verdicts(eff)[0].detail


def test_a_warning_does_not_settle_the_incident():
    slow = anomaly("straggler", "straggler", 50, [3], ["n1"], severity="warning", weight=0.4)
    state, eff = run([at(0.0, slow), at(0.1, reset(1, 120))])
    [flag] = verdicts(eff)
    inc = state.incidents[("j", 0)]
    assert flag.fault_class == "straggler" and not inc.settled
    assert inc.hold_until == pytest.approx(1.1)  # the symptom after a flag still waits
    state, eff = run([tick(0.5)], state=state)
    assert eff == []
    state, eff = run([tick(1.2)], state=state)
    assert [(e.method, e.args[0]) for e in eff if isinstance(e, Call)][:1] == [
        ("fault_history", ("n0", "n1"))]
    assert verdicts(eff) == []  # same conclusion: folded into the flag
    assert state.incidents[("j", 0)].hold_until is None
    # after a root-cause verdict a symptom is not held
    state, eff = run([at(0.0, crash()), at(0.1, reset()), tick(1.2)])
    assert len(verdicts(eff)) == 1 and state.incidents[("j", 0)].hold_until is None
    assert [e for e in eff if isinstance(e, Call) and e.method == "fault_history"] == [
        eff[0]]


def test_incidents_by_generation_window_and_expiry():
    state, eff = run([at(0.0, crash(gen=0)), at(1.0, crash(gen=1)),
                      at(70.0, crash(rank=2, gen=1))], incident_window_s=60.0)
    assert [v.generation for v in verdicts(eff)] == [0, 1, 1]  # past the window: a new one
    assert state.incidents[("j", 1)].started == 70.0
    state, eff = run([tick(125.0)], state=state)
    assert sorted(state.incidents) == [("j", 1)] and eff == []
    # an anomaly without a generation joins the newest one of its job
    a = crash(rank=0).model_copy(update={"generation": None})
    state, _ = run([at(126.0, a)], state=state)
    assert len(state.incidents[("j", 1)].anomalies) == 2


def test_xid_anomalies_are_written_with_their_gpu_and_pid():
    x = schemas.Anomaly(job="j", kind="gpu_fault", fault_class="gpu_xid", first_ts=5,
                        culprit=schemas.Culprit(nodes=["g1"], gpus=["g1:1"]), evidence=["xid 79"],
                        detail={"xid": 79, "pid": 31877, "layer": "hardware", "weight": 0.95},
                        generation=0)
    _, eff = run([at(0.0, x)])
    node_w, xid_w = writes(eff)
    assert node_w.args[0] == "g1" and xid_w.args[:3] == ("g1", "j", "xid|79")
    assert xid_w.args[3] == {"fault_class": "gpu_xid", "layer": "hardware", "xid": 79,
                             "pid": 31877, "gpu": "g1:1"}


@pytest.mark.parametrize("ev", [schemas.LogLine(job="j", line="x")])
def test_other_events_change_nothing(ev):
    state = AttributorState()
    new, eff = run([(0.0, Received("tg.job.j.anomaly", ev, WALL))], state=state)
    assert new == state and eff == []


def test_step_leaves_the_state_it_was_given_alone():
    import copy
    s1, _ = run([at(0.0, reset())])
    snap = copy.deepcopy(s1)
    s2, eff = run([at(0.1, crash()), tick(1.5), tick(500.0)], state=s1)
    assert s1 == snap and s2.incidents == {} and len(verdicts(eff)) == 1


def test_a_flood_into_one_incident_is_counted_not_kept():
    """Past ``MAX_INCIDENT_ANOMALIES`` a symptom is counted in ``Incident.dropped``, not kept;
    a root cause still is (up to twice as many); an anomaly's evidence is cut to what
    attribution reads (``KEPT_EVIDENCE_LINES`` lines of ``KEPT_EVIDENCE_CHARS``), its source
    event ids to ``KEPT_SOURCE_IDS``."""
    cap = incidents.MAX_INCIDENT_ANOMALIES
    floods = [at(0.001 * i, reset(rank=i % 64, ts=100 + i)) for i in range(cap + 50)]
    state, _ = run(floods)
    [inc] = state.incidents.values()
    assert len(inc.anomalies) == cap and inc.dropped == 50
    big = crash(rank=7).model_copy(update={"evidence": ["x" * 100_000] * 40,
                                           "source_event_ids": [f"{i:032x}" for i in range(20000)]})
    state, eff = run([at(3.0, big)], state=state)
    [inc] = state.incidents.values()
    kept = inc.anomalies[-1]
    assert kept.event_id == big.event_id and len(kept.evidence) == incidents.KEPT_EVIDENCE_LINES
    assert {len(x) for x in kept.evidence} == {incidents.KEPT_EVIDENCE_CHARS}
    assert kept.source_event_ids == big.source_event_ids[:incidents.KEPT_SOURCE_IDS]
    assert verdicts(eff) == [] or verdicts(eff)[0].culprit.ranks == [7]


def test_an_incident_keeps_a_bounded_detail_and_the_facts_attribution_reads():
    """A hostile anomaly's ``detail`` (maps of 16,384 entries, lists of 32,768 items, nesting)
    is kept to the keys attribution reads (``READ_DETAIL_KEYS``), each within
    ``KEPT_DETAIL_*``; a detector's own detail of read keys only is kept as it came (the same
    object), and the verdict still carries its facts."""
    real = crash(rank=3)
    assert real.detail and real.detail.keys() <= incidents.READ_DETAIL_KEYS
    state, eff = run([at(0.0, real), tick(5.0)])
    [inc] = state.incidents.values()
    assert inc.anomalies[0].detail is real.detail
    assert verdicts(eff)[0].culprit.ranks == [3]
    huge = {f"k{i}": list(range(32768)) for i in range(200)}
    huge.update({"deep": {"a": {"b": {"c": {"d": {"e": 1}}}}}, "s": "y" * 100_000,
                 "in_compute": list(range(32768)), "op": "x" * 100_000,
                 "blocked": [[[[[1]]]]]})
    big = crash(rank=5).model_copy(update={"detail": {"signal": 9, "layer": "unknown",
                                                      "weight": 0.8, **huge}})
    state, eff = run([at(0.0, big), tick(5.0)])
    [inc] = state.incidents.values()
    kept = inc.anomalies[0].detail
    assert set(kept) == {"signal", "layer", "weight", "in_compute", "op", "blocked"}
    assert kept["signal"] == 9 and kept["weight"] == 0.8 and kept["layer"] == "unknown"
    assert kept["in_compute"] == list(range(incidents.KEPT_DETAIL_ITEMS))
    assert kept["op"] == "x" * incidents.KEPT_EVIDENCE_CHARS
    assert kept["blocked"] == [[[[]]]]  # nesting cut at KEPT_DETAIL_DEPTH below the top
    [v] = verdicts(eff)
    assert v.culprit.ranks == [5] and v.detail["signal"] == 9
    assert v.detail["in_compute"] == list(range(incidents.KEPT_DETAIL_ITEMS))
    assert incidents._bounded({"a": {"b": {"c": {"d": {"e": 1}}}}}) == {"a": {"b": {"c": {
        "d": {}}}}}
    assert len(incidents._bounded("z" * 100_000)) == incidents.KEPT_EVIDENCE_CHARS


def test_a_flood_of_generations_into_one_job_keeps_its_newest_incidents():
    """Past ``MAX_JOB_INCIDENTS`` incidents of one job a new generation drops the job's oldest
    (hostile anomalies with a fresh generation each opened one incident per message); other
    jobs' incidents stay, and the newest generation is still attributed."""
    cap = incidents.MAX_JOB_INCIDENTS
    other = at(0.0, crash(gen=0).model_copy(update={"job": "k"}))
    flood = [at(0.01 * (g + 1), crash(rank=g % 4, ts=100 + g, gen=g)) for g in range(cap + 40)]
    state, eff = run([other, *flood])
    mine = sorted(g for j, g in state.incidents if j == "j")
    assert mine == list(range(40, cap + 40))
    assert ("k", 0) in state.incidents
    assert state.reading == {}
    assert verdicts(eff)[-1].generation == cap + 39


def test_every_detail_key_attribution_reads_is_kept():
    """``READ_DETAIL_KEYS`` names every key the attributor's code reads of an anomaly's detail
    (``detail.get("k")``, ``detail["k"]``, ``_hint(a, "k", …)`` in attributor/*.py): a key read
    but not kept would read as absent on every anomaly an incident holds."""
    import re
    from pathlib import Path

    src = "".join(p.read_text() for p in (Path(incidents.__file__).parent).glob("*.py"))
    read = set(re.findall(r'(?<!spec)(?<!self)\.detail(?:\.get\(|\[)"([a-z_]+)"', src))
    read |= set(re.findall(r'_hint\(\w+, "([a-z_]+)"', src))
    assert read >= {"layer", "seq", "pattern", "xid", "pid", "weight", "stream"}  # the scan works
    assert read <= incidents.READ_DETAIL_KEYS, read - incidents.READ_DETAIL_KEYS


def test_a_launcher_stopped_from_outside_does_not_count_against_its_node():
    """A launcher silent while its node's agent beats (a pod deleted, a user's Ctrl-C) is
    recovered from, but it says nothing of the node: its history record says ``unknown``, so a
    later SIGKILL in another job on that node is not made a hardware fault by it."""
    gone = anomaly("launcher_lost", "crash", 100, [0, 1], ["n1"], layer="infrastructure",
                   weight=0.9, launcher_lost=["n1"])
    _, eff = run([at(0.0, gone)])
    [v] = verdicts(eff)
    assert v.layer == "infrastructure"  # the verdict itself is unchanged
    [rec] = [w for w in writes(eff) if w.args[0] == "n1"]
    assert rec.args[3]["layer"] == "unknown"
    # fed back as the next job's history, the record makes no repeat offender
    h = History(nodes={"n1": [{"job": "stopped-job", "layer": rec.args[3]["layer"],
                               "ts": WALL - 10}]})
    _, eff = run([at(0.0, crash(node="n1"))], h)
    [v2] = verdicts(eff)
    assert "repeat_offender" not in v2.detail and v2.layer == "unknown"

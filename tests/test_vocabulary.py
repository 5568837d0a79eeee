"""One fault vocabulary: every fault class has one row, every row is reachable from the detector,
every policy rule speaks the vocabulary, and the facts the attributor finds become actions only in
the remediator."""
from __future__ import annotations

import collections

import pytest

from trainguard import schemas
from trainguard.attributor.decide import History, decide as attribute
from trainguard.detector import patterns as pat
from trainguard.detector import rules
from trainguard.remediator import policy as pol
from trainguard.remediator import plan
from trainguard.remediator import policy_table
from trainguard.schemas.vocabulary import (ROWS, VOCABULARY, Action, FaultClass, Layer, signature, strength,
                                stronger)
from trainguard.core.xid import xid_table

LAYERS = set(Layer)
ACTIONS = set(Action)


def test_every_fault_class_has_exactly_one_row():
    counts = collections.Counter(r.fault_class for r in ROWS)
    assert set(counts) == set(FaultClass)
    assert all(n == 1 for n in counts.values()), counts
    for fc, row in VOCABULARY.items():
        assert row.fault_class is fc and row.layer in LAYERS and row.why
    # distinct priorities where a tie would make the root cause depend on arrival order alone,
    # except the two OOMs (they never explain each other)
    prios = collections.Counter(r.priority for r in ROWS)
    assert {p for p, n in prios.items() if n > 1} <= {VOCABULARY[FaultClass.OOM_GPU].priority}


def _detector_classes() -> dict[str, str]:
    """Every fault class the detector can report -> one place that reports it."""
    out: dict[str, str] = {}
    for p in pat.PATTERNS:
        out.setdefault(p.fault_class, f"pattern {p.name}")
    for sig, (fc, _layer, name) in rules.SIGNALS.items():
        out.setdefault(fc, f"signal {name}")
    for fld, (_kind, fc, _sev) in {**rules.COUNTER_RULES, **rules.FLAG_RULES}.items():
        out.setdefault(fc, f"GPU counter {fld}")
    for x, info in xid_table().items():
        out.setdefault(info.fault_class, f"XID {x}")
    found = [
        rules.crash_rule(1, "n", None, 9, True, False, 0, 1),
        rules.nan_loss_rule(float("nan"), 1, "n", 5, 0, 1),
        rules.save_failed_finding(1, "n", 5, "disk full", 28, 0, 1),
        rules.log_rule("ValueError: x", "exception", 1, "n", 0, 1),
    ]
    ns = rules.NodeState("n")
    rules.observe_node_heartbeat(ns, "agent", 0.0)
    found.append(rules.node_lost_rule(ns, 100.0, 3.0))
    js = rules.JobState("j")
    for step in range(10):
        for r in range(4):
            rules.observe_heartbeat(js, r, "n", r, 0, step, step, "train",
                                    1.0 if r == 3 else 0.1, float(step), rules.DetectorConfig())
    found += rules.straggler_rule(js, rules.DetectorConfig())
    found += rules.silence_rule(js, 1000.0, rules.DetectorConfig())
    for f in found:
        out.setdefault(f.fault_class, f"rule {f.kind}")
    return out


def test_every_row_is_reachable_and_nothing_else_is_reported():
    reported = _detector_classes()
    assert set(reported) == set(FaultClass), set(FaultClass) ^ set(reported)


def test_detector_tables_carry_layers_not_actions():
    for p in pat.PATTERNS:
        assert p.layer in LAYERS and not hasattr(p, "action"), p.name
    for fc, layer, _name in rules.SIGNALS.values():
        assert fc in VOCABULARY and layer in LAYERS
    for info in xid_table().values():
        assert info.fault_class in VOCABULARY and info.layer in LAYERS
        assert not hasattr(info, "action")


def test_every_policy_rule_speaks_the_vocabulary():
    for r in policy_table.TABLE:
        assert r.fault_class in VOCABULARY, r
        assert r.layer is None or r.layer in LAYERS, r
        assert r.action in ACTIONS and r.fallback in ACTIONS and r.source, r
    # one policy row per fault class (its any-layer row), and (class, layer) pairs unique
    any_layer = collections.Counter(r.fault_class for r in policy_table.TABLE if r.layer is None)
    assert set(any_layer) == set(FaultClass) and set(any_layer.values()) == {1}
    pairs = collections.Counter((r.fault_class, r.layer) for r in policy_table.TABLE)
    assert set(pairs.values()) == {1}
    for f in policy_table.FACT_RULES:
        assert f.action in ACTIONS and f.min_confidence in policy_table.CONFIDENCE and f.source
    for a, b in {**policy_table.ACTION_ALIASES, **policy_table.WATCHDOG_LADDER}.items():
        assert a in ACTIONS and b in ACTIONS
    for a, b in policy_table.WATCHDOG_LADDER.items():
        assert stronger(b, a), (a, b)  # the watchdog only escalates
    for e in policy_table.ESCALATIONS:
        assert e.then in ACTIONS and set(e.applies_to) <= ACTIONS and e.check in plan.CHECKS


def test_action_order_is_its_strength():
    order = list(Action)
    assert [strength(a) for a in order] == list(range(len(order)))
    assert order[0] is Action.NONE and order[-1] is Action.STOP_JOB_NOTIFY_USER
    assert stronger("exclude_node_and_requeue", "restart_workers")
    assert not stronger("restart_in_process", "restart_workers")
    assert stronger("stop_job_notify_user", "fix_config")  # one order: no ties
    assert stronger("fix_config", "reset_gpu")
    assert strength("no_such_action") == strength("none")


def test_enums_are_the_wire_strings():
    assert Action.NONE == "none" and f"{Layer.HARDWARE}" == "hardware"
    v = schemas.Verdict(job="j", fault_class=FaultClass.ECC, layer=Layer.HARDWARE)
    d = schemas.decode(schemas.encode(v))
    assert type(d.fault_class) is str and d.fault_class == "ecc" and d.action == ""
    assert schemas.FAULT_CLASSES == tuple(f.value for f in FaultClass)


def test_one_signature_for_an_anomaly_and_its_verdict():
    a = schemas.Anomaly(job="j", kind="log_pattern", fault_class="app_exception",
                        evidence=["ValueError: bad batch 17 in /data/x.bin"],
                        detail={"pattern": "python_exception"})
    b = a.model_copy(update={"evidence": ["ValueError: bad batch 99 in /data/y.bin"]})
    assert signature(a) == signature(b) == "app_exception|python_exception|ValueError: bad " \
        "batch # in #"
    spec = attribute([a])
    assert spec.signature == signature(a)
    v = schemas.Verdict(job="j", fault_class=spec.fault_class, layer=spec.layer,
                        evidence=spec.evidence, detail=spec.detail)
    assert signature(v) == signature(a)  # signed from its own fields, no "signature" given
    assert signature(v.model_copy(update={"detail": {"signature": "s"}})) == "s"


MEMBERS = [{"rank": r, "node": f"n{r // 2}", "local_rank": r % 2} for r in range(4)]
JOB = schemas.JobRecord(mode="action", generation=0, world_size=4, members=MEMBERS,
                        retry_budget=5)


def _policy_action(spec) -> str:
    v = schemas.Verdict(job="j", fault_class=spec.fault_class, layer=spec.layer,
                        confidence=spec.confidence, evidence=spec.evidence, detail=spec.detail,
                        culprit=schemas.Culprit(ranks=spec.ranks, nodes=spec.nodes),
                        generation=0)
    return pol.decide(v, JOB).action


CRASH = schemas.Anomaly(job="j", kind="crash", fault_class="crash", first_ts=1,
                        culprit=schemas.Culprit(ranks=[2], nodes=["n1"]),
                        evidence=["rank 2 killed by SIGSEGV"],
                        detail={"signal": 11, "layer": "unknown", "weight": 0.8})
BUG = schemas.Anomaly(job="j", kind="log_pattern", fault_class="app_exception", first_ts=1,
                      culprit=schemas.Culprit(ranks=[2], nodes=["n1"]),
                      evidence=["ValueError: bad shape (3, 4)"],
                      detail={"layer": "application", "pattern": "python_exception",
                              "weight": 0.8})


@pytest.mark.parametrize("anomaly,history,expected", [
    (CRASH, History(job="j"), "restart_workers"),
    (CRASH, History(job="j", node_jobs={"n1": {"other"}}), "exclude_node_and_requeue"),
    # the same exception on another node of the job: the program's bug (systematic)
    (BUG, History(job="j", signature_nodes={"n0"}), "stop_job_notify_user"),
    # two crashes on two nodes are two incidents: a signal says nothing about the code
    (CRASH, History(job="j", signature_nodes={"n0"}), "restart_workers"),
])
def test_attributor_facts_become_actions_in_the_remediator(anomaly, history, expected):
    assert _policy_action(attribute([anomaly], history)) == expected

"""A systematic application fault, end to end through the pure parts of three services: the
same exception on two nodes of a job (two incidents, one generation apart) is recognised from
the cross-job history the attributor writes and reads, the verdict carries ``systematic`` and
the error, and the remediator's reducer stops the job with that evidence instead of restarting
it again. The detector's log rule turns the shim's real traceback into the anomaly; a small
in-memory store answers the attributor's and the remediator's calls with ``StateStore``'s
semantics."""
from __future__ import annotations

import traceback

import pytest

from trainguard import schemas
from trainguard.attributor import incidents
from trainguard.attributor.incidents import AttributorState
from trainguard.detector import reducer as detector
from trainguard.core.reducer import Call, Publish, Received, run_offline
from trainguard.schemas import subjects

import test_remediator_reducer as rem  # the remediator's in-memory store and helpers

WALL = 1_700_000_000 * 10**9


class History:
    """``record_fault`` / ``fault_history`` as ``StateStore`` keeps them."""

    def __init__(self):
        self.nodes: dict[str, list[dict]] = {}
        self.sigs: dict[str, list[tuple[str, str]]] = {}

    def __call__(self, call: Call):
        if call.method == "fault_history":
            nodes, sig, since = call.args
            return ({n: [r for r in self.nodes.get(n, []) if r["ts"] >= since] for n in nodes},
                    list(self.sigs.get(sig, [])))
        raise AssertionError(call)

    def write(self, effects):
        for e in effects:
            if isinstance(e, Call) and e.method == "record_fault":
                node, job, sig, rec = e.args
                ts = e.kwargs.get("ts_ns", 0)
                self.nodes.setdefault(node, []).append({**rec, "job": job, "signature": sig,
                                                        "ts": ts})
                self.sigs.setdefault(sig, []).append((job, node))


def shim_traceback(step: int) -> str:
    try:
        raise ValueError(f"bad batch at step {step}: shape (32, {step % 7})")
    except ValueError as e:
        return "".join(traceback.format_exception(e))


def test_the_same_exception_on_two_nodes_stops_the_job_with_the_evidence():
    hist, det, att = History(), detector.DetectorState(), AttributorState()
    store = rem.Store(j=rem.record())
    rstate, actions = None, []
    for gen, (node, rank, step) in enumerate([("n1", 0, 50), ("n2", 2, 80)]):
        t = 100.0 * gen
        line = schemas.LogLine(job="j", node=node, rank=rank, stream="exception",
                               line=shim_traceback(step), step=step, generation=gen,
                               source="shim")
        det, eff = detector.step(det, Received(subjects.job("j", "log"), line,
                                               WALL + int(t * 1e9)), t)
        inputs = [(t + 0.01, Received(subjects.job("j", "anomaly"), e.event, WALL + int(t * 1e9)))
                  for e in eff if isinstance(e, Publish)]
        assert len(inputs) == 1
        att, eff = run_offline(incidents.step, att, inputs, hist)
        hist.write(eff)
        [v] = [e.event for e in eff if isinstance(e, Publish)]
        rstate, reff = rem.run(store, [rem.verdict_in(v, t + 0.02)], rstate)
        [d] = rem.published(reff)
        actions.append((v, d))
    (v1, d1), (v2, d2) = actions
    assert "systematic" not in v1.detail and d1.action == "restart_in_process"
    assert v2.detail["systematic"] == ["n1", "n2"] and v2.layer == "application"
    assert v2.confidence == "high" and v2.detail["sources"] == ["history", "log"]
    assert v2.detail["systematic_error"].startswith("ValueError: bad batch at step")
    assert d2.action == "stop_job_notify_user" and d2.execute
    assert "systematic (n1, n2, high confidence)" in d2.reason
    assert "the error: ValueError: bad batch at step" in d2.reason
    assert store.records["j"].status == "stopped"


@pytest.mark.parametrize("signal", [9, 11])
def test_two_crashes_on_two_nodes_are_not_systematic(signal):
    hist, att = History(), AttributorState()
    verdicts = []
    for gen, node in enumerate(["n1", "n2"]):
        a = schemas.Anomaly(job="j", kind="crash", fault_class="crash", first_ts=WALL + gen,
                            culprit=schemas.Culprit(ranks=[gen], nodes=[node]),
                            evidence=[f"rank {gen} killed by signal {signal}"],
                            detail={"signal": signal, "layer": "unknown", "weight": 0.8},
                            generation=gen)
        att, eff = run_offline(incidents.step, att, [(gen * 100.0, Received(
            subjects.job("j", "anomaly"), a, WALL + gen))], hist)
        hist.write(eff)
        verdicts += [e.event for e in eff if isinstance(e, Publish)]
    assert [("systematic" in v.detail) for v in verdicts] == [False, False]

"""A hang's fault time is the rank's last progress, so "detected" includes the silence before the
detector found it: the detector's anomaly carries the last progress (``detail
["last_progress_ts"]``, its ``first_ts``), the attributor's verdict and the remediator's decision
carry it on (``first_ts``, ``fault_ts``; ``detected_ts`` the anomaly's time), and the goodput
ledger, the report and the console's job page count detection from it.

The real reducers and pure functions, driven offline with the detector's own clock: no servers
(the live chain is ``tests/test_operator_e2e.py``'s)."""
from __future__ import annotations

from trainguard import schemas
from trainguard.attributor.decide import decide as attribute
from trainguard.tools.console_page import job_page
from trainguard.tools.console_timeline import timeline
from trainguard.detector.reducer import step
from trainguard.detector.state import DetectorServiceConfig, DetectorState
from trainguard.detector.rules import DetectorConfig
from trainguard.core.goodput import ledger
from trainguard.core.reducer import Publish, Received, Tick, run_offline
from trainguard.remediator.policy import decide as remediate
from trainguard.tools.report import build_report
from trainguard.schemas import JobRecord, subjects

T0 = 100.0                     # the detector's monotonic clock
NS = 1_700_000_000_000_000_000  # Unix ns at T0
MEMBERS = [{"rank": 0, "node": "n0", "local_rank": 0}, {"rank": 1, "node": "n0", "local_rank": 1}]


def wall(t: float) -> int:
    return NS + int(round((t - T0) * 1e9))


def _heartbeats() -> list[schemas.RankHeartbeat]:
    """Two ranks stepping every 0.1 s; rank 1 completes its step 7 at T0 + 0.7, beats twice more
    without progress, and falls silent at T0 + 0.9 (SIGSTOP)."""
    out = []
    for k in range(40):
        t = T0 + 0.1 * k
        for rank, s in ((0, k), (1, min(k, 7))):
            if rank == 1 and k >= 10:
                continue
            last = T0 + 0.1 * s
            out.append(schemas.RankHeartbeat(
                job="j", rank=rank, node="n0", local_rank=rank, world_size=2, step=s,
                collective_seq=s, phase="train", step_time_s=0.1, progress_ts=wall(last),
                ts=wall(t)))
    return out


def _hang_anomaly(hbs: list[schemas.RankHeartbeat]) -> schemas.Anomaly:
    inputs = []
    for h in hbs:
        t = T0 + (h.ts - NS) / 1e9
        inputs.append((t, Received(subjects.rank_hb("j", h.rank), h, h.ts)))
        if h.rank == 0:
            inputs.append((t + 0.05, Tick(wall(t + 0.05))))
    state = DetectorState(config=DetectorServiceConfig(
        rules=DetectorConfig(silence_timeout_s=1.0)))
    _, effects = run_offline(step, state, inputs)
    [a] = [e.event for e in effects if isinstance(e, Publish) and e.event.kind == "hang"]
    return a


def _decided(a, spec):
    """The verdict the attributor's ``spec`` gives 4 ms after anomaly ``a``, the job record, and
    the remediator's decision 2 ms later."""
    verdict = schemas.Verdict(job="j", fault_class=spec.fault_class, layer=spec.layer,
                              culprit=schemas.Culprit(ranks=spec.ranks, nodes=spec.nodes),
                              confidence=spec.confidence, first_ts=spec.first_ts,
                              generation=0, detail=spec.detail, ts=a.ts + 4_000_000)
    job = JobRecord(mode="action", generation=0, world_size=2, min_world_size=1,
                    retry_budget=5, retries_used=0, members=MEMBERS, spare_nodes=[])
    return verdict, job, remediate(verdict, job).model_copy(update={"ts": a.ts + 6_000_000})


def test_a_hang_is_timed_from_the_ranks_last_progress_everywhere():
    hbs = _heartbeats()
    a = _hang_anomaly(hbs)
    # found by the tick at T0 + 2.45 (1.5 s allowance after rank 1's last beat at T0 + 0.9)
    assert a.culprit.ranks == [1] and a.ts == wall(T0 + 2.45)
    # ... but the fault is rank 1's last progress: its step 7, seen at T0 + 0.7
    assert a.detail["last_progress_ts"] == a.first_ts == wall(T0 + 0.7)

    spec = attribute([a])
    assert spec.first_ts == wall(T0 + 0.7)
    assert spec.detail["detected_ts"] == a.ts
    assert spec.detail["last_progress_ts"] == wall(T0 + 0.7)
    verdict, job, dec = _decided(a, spec)
    assert dec.action == "restart_workers" and dec.ranks == [1]
    assert dec.fault_ts == wall(T0 + 0.7) and dec.detected_ts == a.ts

    resumed = [schemas.TrainingResumed(job="j", rank=r, node="n0", generation=1, world_size=2,
                                       restored_step=5, resumed_step=6,
                                       ts=wall(T0 + 4.0) + r) for r in (0, 1)]
    events = [*hbs, a, verdict, dec, *resumed]
    [inc] = ledger(events, "j").incidents
    assert inc.fault_ns == wall(T0 + 0.7)
    assert inc.seconds["detection"] == 1.75       # the silence: last progress → anomaly
    assert inc.seconds["decision"] == 0.006

    rep = build_report("j", events)
    [r] = rep["recoveries"]
    assert r["seconds_from_fault"] == {"detected": 1.75, "decided": 1.756, "resumed": 3.3}

    tl = timeline(events, rep["recoveries"], rep["goodput"])
    assert tl["incidents"][0]["times_s"]["fault"] == 0.7  # from the first heartbeat, T0
    assert [len(segs) for segs in tl["ranks"].values()] == [1, 1]
    page = job_page("j", job.to_dict(), {"source": "the stored history",
                                         "goodput": rep["goodput"],
                                         "incidents": rep["recoveries"], "flags": []},
                    [], [], [], timeline=tl)
    assert '<span class="num">+1.750 s</span>' in page   # detected, from the last progress
    # the picture: the incident's silence shaded from the last progress to the detection
    assert page.count('<svg id="timeline"') == 1
    assert '<g class="incident" data-fault-class="hang" data-action="restart_workers" ' \
           'data-ranks="1" data-detected-s="1.750">' in page
    assert '<rect class="silence"' in page and '<rect class="restart"' in page
    assert "hang rank 1: detected +1.750 s" in page
    # no history: the page says why there is no picture
    bare = job_page("j", job.to_dict(), {"source": "the audit trail", "goodput": None,
                                         "incidents": [], "flags": []}, [], [], [])
    assert 'id="no-timeline"' in bare and "<svg" not in bare


def test_a_script_that_restores_itself_has_an_unknown_restored_step_in_the_report():
    """An unmodified torchrun script restores from its own checkpoint and tells trainguard no
    step: its ranks' ``recovery.resumed`` say -1. The report says "unknown", never step -1 nor
    a count of replayed steps computed from it."""
    from trainguard.tools.report import to_markdown

    hbs = _heartbeats()
    a = _hang_anomaly(hbs)
    spec = attribute([a])
    verdict, job, dec = _decided(a, spec)
    resumed = [schemas.TrainingResumed(job="j", rank=r, node="n0", generation=1, world_size=2,
                                       restored_step=-1, resumed_step=0,
                                       ts=wall(T0 + 4.0) + r) for r in (0, 1)]
    rep = build_report("j", [*hbs, a, verdict, dec, *resumed])
    [r] = rep["recoveries"]
    assert r["restored_step"] is None and r["steps_replayed"] is None
    md = to_markdown(rep)
    assert "restored step unknown" in md and "restored step -1" not in md

"""The goodput ledger on event tables whose answers are computed by hand (in the comments)."""
import pytest

from trainguard import schemas
from trainguard.core.goodput import ledger

B = 1_700_000_000 * 10**9  # a Unix ns origin


def T(s: float) -> int:
    return B + int(round(s * 1e9))


def hb(rank, step, t, world=4):
    return schemas.RankHeartbeat(job="j", rank=rank, node=f"n{rank // 2}", local_rank=rank % 2,
                                 world_size=world, step=step, progress_ts=T(t), ts=T(t))


def steps(ranks, first, last, t0, dt=1.0):
    """Heartbeats: step ``first`` .. ``last`` completed at t0, t0+dt, … on every rank."""
    return [hb(r, s, t0 + (s - first) * dt) for s in range(first, last + 1) for r in ranks]


def decision(fault, detected, decided, gen, action="restart_workers", execute=True, **kw):
    return schemas.Decision(job="j", action=action, idempotency_key=f"j:g{gen}", execute=execute,
                            mode="action", generation=gen, world_size=4, fault_ts=T(fault),
                            detected_ts=T(detected), ts=T(decided), fault_class="crash", **kw)


def resumed(rank, t, gen, restored, rolled):
    return schemas.TrainingResumed(job="j", rank=rank, generation=gen, world_size=4,
                                   restored_step=restored, resumed_step=restored + 1,
                                   steps_rolled_back=rolled, ts=T(t))


R = range(4)


def one_crash():
    # step -1 at t=0; steps 0..9 done at t=1..10 (1 s per step); fault at 10.5; anomaly at
    # 11.0; decision at 11.5; ranks resume (first step after the restore, step 6) at
    # 13.2 .. 13.5; steps 7..15 at 14.5 .. 22.5
    evs = [hb(r, -1, 0.0) for r in R] + steps(R, 0, 9, 1.0)
    evs += [schemas.CheckpointSaved(job="j", rank=0, step=5, path="/c/5", world_size=4,
                                   ts=T(6.1))]
    evs += [decision(10.5, 11.0, 11.5, 1)]
    evs += [resumed(r, 13.2 + 0.1 * r, 1, 5, 4) for r in R]
    evs += steps(R, 6, 15, 13.5)
    return evs


def test_one_crash_by_hand():
    led = ledger(one_crash())
    assert led.world_size == 4 and led.ref_step_s == pytest.approx(1.0)
    # start-up 1 s (step -1 at 0, step 0 done at 1); wall from step 0 at 1.0 to 22.5: 21.5 s;
    # steps 0 → 15: 15 useful; goodput 15 × 1 / 21.5
    assert led.startup_s == pytest.approx(1.0) and led.start_ns == T(1.0)
    assert led.wall_s == pytest.approx(21.5) and led.useful_steps == 15
    assert led.training_goodput == pytest.approx(round(15 / 21.5, 4))
    (inc,) = led.incidents
    # detection 0.5 s, decision 0.5 s, restart 13.5 - 11.5 - 1 (step 6's own time) = 1.0 s,
    # rollback 4 steps × 1 s; × 4 ranks
    assert inc.seconds == pytest.approx({"detection": 0.5, "decision": 0.5, "restart": 1.0,
                                         "rollback": 4.0})
    assert inc.gpu_seconds == pytest.approx({"detection": 2.0, "decision": 2.0, "restart": 4.0,
                                             "rollback": 16.0})
    assert inc.restored_step == 5 and inc.resumed_ns == T(13.5)
    # 86 GPU-s in all = 60 useful + 24 lost + 2 other (the half step in flight at the fault)
    assert led.gpu_s_total == pytest.approx(86.0) and led.gpu_s_useful == pytest.approx(60.0)
    assert led.gpu_s_other == pytest.approx(2.0)


def test_rollback_from_the_checkpoints_when_the_resume_gives_no_count():
    evs = [e for e in one_crash() if not isinstance(e, schemas.TrainingResumed)]
    evs += [resumed(r, 13.5, 1, -1, 0) for r in R]  # no restored step, no count
    (inc,) = ledger(evs).incidents
    # last step before the fault: 9; newest checkpoint before it: 5 → 4 steps
    assert inc.steps_rolled_back == 4 and inc.seconds["rollback"] == pytest.approx(4.0)


def test_escalation_is_one_incident_a_flag_none_and_a_stop_never_resumes():
    evs = [hb(r, -1, 0.0) for r in R] + steps(R, 0, 9, 1.0)
    evs += [decision(10.5, 11.0, 11.5, 1, action="restart_in_process")]
    # the watchdog escalates at 20.0 (same fault_ts); training again at 23.0 in generation 2
    evs += [decision(10.5, 11.0, 20.0, 2)]
    evs += [resumed(r, 23.0, 2, 8, 1) for r in R]
    evs += steps(R, 9, 12, 23.0)  # step 9 again at 23.0, 12 at 26.0
    evs += [decision(26.2, 26.4, 26.5, 2, action="none", execute=False)]  # a flag
    evs += [decision(26.6, 27.0, 27.5, 3, action="stop_job_notify_user")]
    led = ledger(evs)
    inc, stop = led.incidents
    assert inc.action == "restart_workers" and inc.generation == 2
    # restart: 23.0 - 11.5 - 1 = 10.5 s; rollback 1 step
    assert inc.seconds == pytest.approx({"detection": 0.5, "decision": 0.5, "restart": 10.5,
                                         "rollback": 1.0})
    assert stop.resumed_ns is None and stop.seconds["restart"] is None
    assert stop.seconds["rollback"] is None
    assert stop.seconds["detection"] == pytest.approx(0.4)
    # lost detection: (0.5 + 0.4) × 4 GPU-s
    assert led.gpu_s_lost["detection"] == pytest.approx(3.6)
    # steps 0 → 12 = 12 useful over 1.0 .. 26.0 = 25 s
    assert led.useful_steps == 12 and led.training_goodput == pytest.approx(0.48)


def test_no_heartbeats_no_goodput():
    led = ledger([decision(1, 2, 3, 1)])
    assert led.training_goodput is None and led.wall_s == 0
    assert led.incidents[0].resumed_ns is None


def test_report_of_the_hand_computed_run(tmp_path):
    from trainguard.tools.report import build_report, to_markdown, write

    evs = one_crash()
    v = schemas.Verdict(job="j", fault_class="crash", layer="unknown", confidence="high",
                        culprit=schemas.Culprit(ranks=[1], nodes=["n0"]), ts=T(11.2))
    for e in evs:
        if isinstance(e, schemas.Decision):
            e.verdict_id = v.event_id
        if isinstance(e, schemas.RankHeartbeat) and e.rank == 0:
            e.loss = 10.0 - e.step * 0.1 if e.step >= 0 else None
    rep = build_report("j", evs + [v], audit=[{"type": "decision"}, {"type": "folded"}])
    (r,) = rep["recoveries"]
    assert r["seconds_from_fault"] == {"detected": 0.5, "decided": 1.0, "resumed": 3.0}
    assert r["restored_step"] == 5 and r["steps_replayed"] == 4
    # rank 0's loss: step 9 (9.1) before the fault, step 6 (9.4) after the resume
    assert r["loss_before"] == pytest.approx(9.1) and r["loss_after"] == pytest.approx(9.4)
    assert r["verdict"]["ranks"] == [1] and r["decision"]["action"] == "restart_workers"
    assert rep["audit"]["by_type"] == {"decision": 1, "folded": 1}
    # the timeline: the last step before the fault, the verdict the decision answered, every
    # rank's first step after the resume (from the heartbeats)
    tl = r["timeline"]["seconds"]
    assert (tl["last_progress"], tl["detected"], tl["verdict"], tl["decision"],
            tl["first_step"]) == (-0.5, 0.5, 0.7, 1.0, 3.0)
    md = to_markdown(rep)
    assert "| verdict | 0.700 | 0.200 |" in md
    assert "## Recovery 1: crash → restart_workers (generation 1)" in md
    assert "training goodput **69.8%**" in md
    assert "start-up 1.0 s, then 21.5 s training on 4 ranks" in md
    paths = write("j", evs + [v], None, str(tmp_path))
    assert open(paths["png"], "rb").read(4) == b"\x89PNG"
    assert "not read (no REDIS_URL)" in open(paths["md"]).read()

"""The drain handshake's reducer (``trainguard.scheduler.k8s.drain.step``), table-driven with
``run_offline``: no server. What it publishes and calls, in order, for an annotated node."""
from __future__ import annotations

from trainguard import schemas
from trainguard.scheduler.local import ControllerResult
from trainguard.scheduler.k8s.api import DRAIN_READY, DRAIN_STATUS
from trainguard.scheduler.k8s.drain import DrainConfig, DrainState, step
from trainguard.core.reducer import Call, Publish, Received, Tick, run_offline

NODE = "ip-10-0-1-2.ec2.internal"


def _replies(jobs, status="valid"):
    def answer(call: Call):
        return {"drain_requested": [NODE], "jobs_on_node": jobs, "checkpoint_status": status,
                "evict_node": ControllerResult(True, "evicted 1 of 1 pod(s)")}.get(call.method)
    return answer


def _calls(fx, method):
    return [e for e in fx if isinstance(e, Call) and e.method == method]


def _requests(fx):
    return [e for e in fx if isinstance(e, Publish)
            and isinstance(e.event, schemas.CheckpointRequest)]


def _done(job, rid, ok=True, step_=40, detail=""):
    return Received(f"tg.job.{job}.action", schemas.CheckpointRequestDone(
        job=job, request_id=rid, ok=ok, step=step_, path=f"/ckpt/{job}/s{step_}", detail=detail))


def test_annotated_node_is_checkpointed_validated_then_ready_then_evicted():
    cfg = DrainConfig(poll_s=1.0)
    st, fx = run_offline(step, DrainState(config=cfg), [(0.0, Tick(1))], _replies(["a", "b"]))
    reqs = _requests(fx)
    assert [r.subject for r in reqs] == ["tg.job.a.control", "tg.job.b.control"]
    assert all(r.event.hold_s == cfg.hold_s and r.event.node == NODE for r in reqs)
    assert st.nodes[NODE].phase == "checkpointing" and not _calls(fx, "evict_node")
    ids = {r.event.job: r.event.request_id for r in reqs}
    st, fx = run_offline(step, st, [(1.0, _done("a", ids["a"])), (1.1, _done("b", ids["b"]))],
                         _replies(["a", "b"]))
    assert not _calls(fx, "evict_node")  # committed, but the validator has not said yet
    st, fx = run_offline(step, st, [(2.5, Tick(2))], _replies(["a", "b"], "valid"))
    ann = [c for c in _calls(fx, "annotate") if DRAIN_READY in c.args[1]]
    assert ann and ann[0].args[1][DRAIN_READY] == "a@40,b@40"
    assert ann[0].args[1][DRAIN_STATUS] == "ready"
    ev = _calls(fx, "evict_node")
    assert ev and fx.index(ev[0]) > fx.index(ann[0])  # ready first, eviction after
    results = [e.event for e in fx if isinstance(e, Publish)
               and isinstance(e.event, schemas.ActionResult)]
    assert [(r.job, r.action, r.ok) for r in results] == [("a", "drain_node", True),
                                                          ("b", "drain_node", True)]
    assert "step 40" in results[0].detail and st.nodes[NODE].phase == "done"


def test_a_failed_save_is_asked_again_then_the_deadline_releases_the_drain():
    cfg = DrainConfig(poll_s=1.0, attempts=2, deadline_s=30.0)
    st, fx = run_offline(step, DrainState(config=cfg), [(0.0, Tick(1))], _replies(["a"]))
    rid = _requests(fx)[0].event.request_id
    st, fx = run_offline(step, st, [(1.0, _done("a", rid, ok=False, detail="late rank"))],
                         _replies(["a"]))
    again = _requests(fx)
    assert len(again) == 1 and again[0].event.request_id != rid  # a new request, a new id
    st, fx = run_offline(step, st, [(3.0, Tick(3))], _replies(["a"], "pending"))
    assert not _calls(fx, "evict_node")
    st, fx = run_offline(step, st, [(31.0, Tick(31))], _replies(["a"], "pending"))
    ann = [c for c in _calls(fx, "annotate") if DRAIN_READY in c.args[1]][0]
    assert ann.args[1][DRAIN_READY] == "a:none"
    assert "without a checkpoint" in ann.args[1][DRAIN_STATUS]
    assert _calls(fx, "evict_node")


def test_unanswered_requests_are_resent_and_a_node_without_jobs_is_ready_at_once():
    cfg = DrainConfig(poll_s=100.0, resend_s=5.0)
    st, fx = run_offline(step, DrainState(config=cfg), [(0.0, Tick(1))], _replies(["a"]))
    rid = _requests(fx)[0].event.request_id
    st, fx = run_offline(step, st, [(2.0, Tick(2)), (6.0, Tick(6))], _replies(["a"]))
    assert [r.event.request_id for r in _requests(fx)] == [rid]  # once, after resend_s
    st, fx = run_offline(step, DrainState(config=cfg), [(0.0, Tick(1))], _replies([]))
    assert [c.args[1][DRAIN_READY] for c in _calls(fx, "annotate")
            if DRAIN_READY in c.args[1]] == ["no-jobs"]


def test_observe_only_drain_annotates_and_does_not_evict():
    st, fx = run_offline(step, DrainState(config=DrainConfig(evict=False)), [(0.0, Tick(1))],
                         _replies([]))
    assert not _calls(fx, "evict_node") and st.nodes[NODE].phase == "done"


def test_a_committed_checkpoint_is_polled_every_poll_s_until_the_validator_answers():
    cfg = DrainConfig(poll_s=1.0)
    st, fx = run_offline(step, DrainState(config=cfg), [(0.0, Tick(1))], _replies(["a"]))
    rid = _requests(fx)[0].event.request_id
    ticks = [(1.0 + 0.1 * i, Tick(2 + i)) for i in range(35)]  # 3.5 s of 0.1 s ticks
    st, fx = run_offline(step, st, [(1.0, _done("a", rid))] + ticks, _replies(["a"], "pending"))
    polls = _calls(fx, "checkpoint_status")
    assert 3 <= len(polls) <= 5, len(polls)  # about once a second, not never, not every tick

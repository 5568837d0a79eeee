"""Which CUDA errors a rank survives in process: the sticky-error table (the CUDA context is lost:
respawn), the OOM table (in-process recovery, the caching allocator emptied), the policy's
escalation of a sticky error's ``restart_in_process``, and the chain detector → attributor →
remediator on real torch tracebacks."""
from __future__ import annotations

import pytest

from trainguard import schemas
from trainguard.attributor.decide import decide as attribute
from trainguard.core.cuda_errors import (STICKY_ERRORS, cuda_error_is_sticky, is_cuda_oom,
                                         recover_from_oom, sticky_error)
from trainguard.detector import rules
from trainguard.remediator import policy as pol
from trainguard.schemas import JobRecord

T0 = 1_700_000_000 * 10**9
MEMBERS = [{"rank": 0, "node": "n0", "local_rank": 0}, {"rank": 1, "node": "n0", "local_rank": 1},
           {"rank": 2, "node": "n1", "local_rank": 0}, {"rank": 3, "node": "n1", "local_rank": 1}]

HINT = ("CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.\nFor debugging consider passing "
        "CUDA_LAUNCH_BLOCKING=1")
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
       "capacity of 79.15 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this "
       "process has 78.09 GiB memory in use. Of the allocated memory 76.50 GiB is allocated by "
       "PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated.")


def traceback_of(msg: str) -> str:
    return ("Traceback (most recent call last):\n  File \"/job/train.py\", line 88, in step\n"
            "    loss.backward()\n" + msg)


# ---- the table: exact messages torch prints -----------------------------------------------------
@pytest.mark.parametrize("text,sticky,oom", [
    (f"RuntimeError: CUDA error: an illegal memory access was encountered\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: device-side assert triggered\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: misaligned address\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: unspecified launch failure\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: uncorrectable ECC error encountered\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: an illegal instruction was encountered\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: the launch timed out and was terminated\n{HINT}", True, False),
    (f"RuntimeError: CUDA error: unknown error\n{HINT}", True, False),
    (OOM, False, True),
    (f"RuntimeError: CUDA error: out of memory\n{HINT}", False, True),
    ("ValueError: loss is NaN at step 120", False, False),
    ("RuntimeError: CUDA error: invalid device ordinal", False, False),
])
def test_sticky_and_oom_rows(text, sticky, oom):
    assert cuda_error_is_sticky(text) is sticky
    assert is_cuda_oom(text) is oom
    assert cuda_error_is_sticky(RuntimeError(text)) is sticky


def test_every_sticky_row_has_a_source_and_matches_its_own_name():
    for row in STICKY_ERRORS:
        assert row.source and sticky_error(row.name) is row, row.name


def test_a_sticky_cause_makes_the_exception_sticky():
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("step failed") from inner
    except ValueError as exc:
        assert cuda_error_is_sticky(exc) and not is_cuda_oom(exc)


# ---- OOM recovery with injected CUDA calls -------------------------------------------------------
def test_oom_recovery_reads_the_summary_then_empties_the_cache():
    calls = []
    summary = recover_from_oom(lambda: True, lambda: calls.append("empty"),
                               lambda: calls.append("summary") or "x" * 10_000)
    assert calls == ["summary", "empty"]
    assert summary == "x" * 4096


def test_oom_recovery_without_cuda_calls_nothing():
    calls = []
    assert recover_from_oom(lambda: False, lambda: calls.append("empty"),
                            lambda: calls.append("summary") or "s") is None
    assert calls == []


def test_oom_recovery_reports_a_failing_call_and_still_empties():
    calls = []

    def broken():
        raise RuntimeError("CUDA driver gone")

    summary = recover_from_oom(lambda: True, lambda: calls.append("empty"), broken)
    assert calls == ["empty"] and "memory_summary failed: RuntimeError: CUDA driver gone" in summary


# ---- the remediator's escalation -----------------------------------------------------------------
def verdict(fault_class, layer, pattern=None, evidence=()):
    return schemas.Verdict(job="j", fault_class=fault_class, layer=layer,
                           culprit=schemas.Culprit(ranks=[1], nodes=["n0"]), generation=0,
                           detail={"pattern": pattern} if pattern else {},
                           evidence=list(evidence))


def decide(v):
    return pol.decide(v, JobRecord(mode="action", members=MEMBERS, world_size=4))


@pytest.mark.parametrize("v,expected", [
    (verdict("app_exception", "application", "cuda_device_assert"), "restart_workers"),
    (verdict("app_exception", "application", None,
             ["[root log_pattern rank 1] RuntimeError: CUDA error: misaligned address"]),
     "restart_workers"),
    (verdict("app_exception", "application", "python_exception"), "restart_in_process"),
    (verdict("oom_gpu", "application", "cuda_oom"), "restart_in_process"),
    (verdict("crash", "unknown", "cuda_illegal_access"), "restart_workers"),
    (verdict("ecc", "hardware", "uncorrectable_ecc"), "exclude_node_and_requeue"),
])
def test_policy_never_restarts_a_lost_context_in_process(v, expected):
    d = decide(v)
    assert d.action == expected, d.reason
    if expected == "restart_workers" and v.fault_class == "app_exception":
        assert "CUDA context is lost" in d.reason


# ---- detector → attributor → remediator on a rank's exception ------------------------------------
def chain(text: str, rank: int = 1) -> schemas.Decision:
    f = rules.log_rule(text, "exception", rank, "n0", 0, T0)
    assert f is not None, text
    a = schemas.Anomaly(job="j", kind=f.kind, fault_class=f.fault_class,
                        culprit=schemas.Culprit(ranks=f.ranks, nodes=f.nodes, gpus=f.gpus),
                        symptom=f.symptom, severity=f.severity, first_ts=f.ts,
                        evidence=f.evidence, detail=f.detail, generation=0)
    v = attribute([a])
    return decide(schemas.Verdict(job="j", fault_class=v.fault_class, layer=v.layer,
                                  culprit=schemas.Culprit(ranks=v.ranks, nodes=v.nodes),
                                  confidence=v.confidence, generation=0, detail=v.detail,
                                  evidence=v.evidence))


@pytest.mark.parametrize("msg", [
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "RuntimeError: CUDA error: device-side assert triggered",
    "RuntimeError: CUDA error: unspecified launch failure",
])
def test_a_sticky_error_of_rank_1_respawns_it(msg):
    d = chain(traceback_of(f"{msg}\n{HINT}"))
    assert d.action == "restart_workers", d.reason
    assert d.ranks == [1]


def test_an_ecc_error_of_rank_1_moves_off_its_node():
    d = chain(traceback_of(f"RuntimeError: CUDA error: uncorrectable ECC error encountered\n{HINT}"))
    assert d.action == "exclude_node_and_requeue", d.reason


def test_an_oom_of_rank_1_recovers_in_process():
    d = chain(traceback_of(OOM))
    assert d.action == "restart_in_process", d.reason


# ---- the rank: a sticky error leaves the process, an OOM frees the failed step ------------------
def test_a_rank_leaves_its_process_after_a_sticky_error_but_rejoins_after_another():
    from trainguard.rank.runtime import _Runtime
    from trainguard.rank.state import WorkerConfig

    rt = _Runtime(WorkerConfig(job="j", mode="action", decision_timeout_s=0.1))
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as caught:
        rt.on_fault(sticky)
    assert caught.value is sticky and rt.restarts == 0 and rt.cfg.generation == 0
    rt.on_fault(ValueError("loss is NaN"))  # no decision within 0.1 s: rejoins on its own
    assert rt.restarts == 1 and rt.cfg.generation == 1


def test_an_oom_clears_the_failed_steps_frames():
    import gc
    import weakref

    import torch  # noqa: F401 - the rank has loaded torch
    from trainguard.rank.runtime import cuda_oom_summary

    class Activations:
        pass

    refs = []

    def step():
        acts = Activations()  # held by this frame, which the traceback keeps, until cleared
        refs.append(weakref.ref(acts))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    try:
        step()
    except torch.OutOfMemoryError as exc:
        gc.collect()
        assert refs[0]() is not None  # the traceback still holds the failed step
        summary = cuda_oom_summary(exc)
        assert refs[0]() is None
        assert summary is None if not torch.cuda.is_available() else "memory" in summary.lower()
    other = ValueError("not an OOM")
    assert cuda_oom_summary(other) is None

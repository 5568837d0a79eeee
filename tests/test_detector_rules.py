"""Pure detector rules and the log-pattern table, on lines written for these tests."""
from __future__ import annotations

import math

import pytest

from trainguard.detector import patterns as pat
from trainguard.detector import rules
from trainguard.detector.rules import DetectorConfig, JobState, NodeState
from trainguard.schemas import JobRecord

CFG = DetectorConfig()


def beat(js, rank, step, now, st=0.2, seq=None, phase="train", gen=0, node="n0"):
    return rules.observe_heartbeat(js, rank, node, rank % 2, gen, step,
                                   step if seq is None else seq, phase, st, now, CFG)


# ---- crash ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("code,sig,oom,fc,layer", [
    (None, 9, False, "crash", "unknown"),
    (None, 9, True, "oom_host", "application"),
    (None, 7, False, "crash", "infrastructure"),
    (137, None, False, "crash", "unknown"),        # 128 + SIGKILL
    (1, None, False, "crash", "unknown"),
])
def test_crash_rule(code, sig, oom, fc, layer):
    f = rules.crash_rule(2, "n1", code, sig, oom, False, 3, 123)
    assert f.fault_class == fc and f.detail["layer"] == layer
    assert f.ranks == [2] and f.nodes == ["n1"] and f.generation == 3 and not f.symptom


def test_crash_rule_ignores_clean_and_expected_exits():
    assert rules.crash_rule(0, "n", 0, None, False, False, 0, 0) is None
    assert rules.crash_rule(0, "n", None, 9, False, True, 0, 0) is None


# ---- hang ----------------------------------------------------------------------------------------
def test_a_member_that_never_beats_is_missing_once_per_generation():
    """The start-up allowance of a rank that never sent a heartbeat runs from the job's start,
    and again from each new generation: a rank started again by a decision gets its own."""
    js, jc = JobState("j"), JobRecord(startup_timeout_s=100.0,
                                      members=[{"rank": 0, "node": "n0"}, {"rank": 1, "node": "n0"}])
    beat(js, 0, 1, 5.0, phase="startup")
    assert rules.missing_member_rule(js, jc, 0.0, 99.0, CFG) == []
    [f] = rules.missing_member_rule(js, jc, 0.0, 101.0, CFG)
    assert f.ranks == [1] and f.fault_class == "hang" and f.detail["rule"] == "never_started"
    beat(js, 0, 1, 102.0, phase="startup", gen=1)  # the job moved on: rank 1 started again
    assert rules.missing_member_rule(js, jc, 0.0, 150.0, CFG) == []
    assert [f.ranks for f in rules.missing_member_rule(js, jc, 0.0, 203.0, CFG)] == [[1]]


def test_silence_names_the_silent_rank_only():
    js = JobState("j")
    for r in range(4):
        beat(js, r, 10, now=100.0)
    T = CFG.silence_timeout_s
    for r in (0, 1, 3):  # rank 2 stopped (SIGSTOP): its heartbeat thread stops too
        beat(js, r, 10, now=100.0 + T - 0.1)
    assert rules.silence_rule(js, 100.0 + T - 0.05, CFG) == []
    found = rules.silence_rule(js, 100.0 + T + 0.1, CFG)
    assert [f.ranks for f in found] == [[2]]
    assert found[0].detail["rule"] == "silence"


def test_silence_respects_done_exited_and_explicit_timeout():
    js = JobState("j")
    beat(js, 0, 5, 1.0, phase="done")
    beat(js, 1, 5, 1.0)
    js.ranks[1].exited = True
    assert rules.silence_rule(js, 50.0, CFG) == []
    beat(js, 2, 5, 1.0)
    assert rules.silence_rule(js, 5.0, CFG, JobRecord(hang_timeout_s=5.0)) == []
    assert [f.ranks for f in rules.silence_rule(js, 6.1, CFG, JobRecord(hang_timeout_s=5.0))] \
        == [[2]]


def test_stall_names_the_rank_behind():
    js = JobState("j")
    t = 0.0
    for step in range(20):          # learn the step time: 0.2 s
        t += 0.2
        for r in range(4):
            beat(js, r, step, t)
    # rank 1 stuck computing step 20; the others entered the collective of step 20 and block
    for r in (0, 2, 3):
        beat(js, r, 19, t + 0.1, seq=20)
    timeout = rules.learned_step_timeout(js, CFG)
    assert timeout == CFG.step_timeout_floor_s  # 5 × 0.2 s is below the floor
    # everyone keeps beating, nobody advances
    floor = CFG.step_timeout_floor_s
    for k in range(1, int(floor * 10) + 10):
        for r in range(4):
            beat(js, r, 19, t + 0.1 * k, seq=20 if r != 1 else 19)
    assert rules.stall_rule(js, t + floor, CFG) == []
    f = rules.stall_rule(js, t + floor + 0.95, CFG)
    assert len(f) == 1 and f[0].ranks == [1] and f[0].detail["collective_seq"] == 19
    # the fault is rank 1's last progress (its step 19 at t), not the others' entry into the
    # next collective (t + 0.1) nor the evaluation that found it
    assert f[0].detail["since_progress_s"] == pytest.approx(floor + 0.95)
    assert f[0].detail["stalled_s"] == pytest.approx(floor + 0.85)


@pytest.mark.parametrize("counts,culprit,in_compute,blocked", [
    # rank 1 busy in its step (entered = completed), rank 0 inside the allreduce waiting
    ({0: (41, 40), 1: (40, 40)}, [1], [1], [0]),
    # both inside the same collective: a collective that never completes, nobody singled out
    ({0: (41, 40), 1: (41, 40)}, [], [], [0, 1]),
    # a rank still in an earlier collective is the one behind, and it is not in compute
    ({0: (42, 41), 1: (41, 40), 2: (42, 41)}, [1], [], [0, 1, 2]),
])
def test_stall_with_collective_counts_names_the_rank_behind_not_the_blocked(
        counts, culprit, in_compute, blocked):
    """The hooks of an unmodified script report collectives entered (``collective_seq``) and
    completed: at the same step, the rank with fewer entered is behind; the ranks with more
    entered than completed wait inside a collective."""
    js = JobState("j")
    jc = JobRecord(hang_timeout_s=2.0)
    for k in range(40):
        for r, (seq, done) in counts.items():
            rules.observe_heartbeat(js, r, "n0", r, 0, 7, seq, "train", 0.2, 0.1 * k, CFG,
                                    completed=done)
    assert rules.stall_rule(js, 1.9, CFG, jc) == []  # still within the timeout
    [f] = rules.stall_rule(js, 2.2, CFG, jc)
    assert f.ranks == culprit and f.fault_class == "hang"
    assert (f.detail["in_compute"], f.detail["blocked"]) == (in_compute, blocked)
    assert "inside a collective waiting" in f.evidence[0]


def test_a_completed_collective_is_progress():
    js = JobState("j")
    jc = JobRecord(hang_timeout_s=2.0)
    for k in range(30):  # rank 0 waits in a long collective that completes at 2.0 s
        done = 40 if k < 20 else 41
        rules.observe_heartbeat(js, 0, "n0", 0, 0, 7, 41, "train", 0.2, 0.1 * k, CFG,
                                completed=done)
    assert rules.stall_rule(js, 3.0, CFG, jc) == []


def test_learned_timeout_clamps_and_phase_allowances():
    js = JobState("j")
    assert rules.learned_step_timeout(js, CFG) == CFG.unlearned_timeout_s
    for _ in range(50):
        js.add_time(2.0)
    assert rules.learned_step_timeout(js, CFG) == pytest.approx(10.0)
    assert rules.learned_step_timeout(js, CFG, explicit=7.0) == 7.0
    assert rules.phase_timeout(["train", "checkpoint"], js, CFG) == 600.0
    assert rules.phase_timeout(["startup"], js, CFG, JobRecord(startup_timeout_s=42.0)) == 42.0
    for _ in range(300):
        js.add_time(1000.0)
    assert rules.learned_step_timeout(js, CFG) == CFG.step_timeout_ceiling_s


def test_new_generation_resets_progress():
    js = JobState("j")
    beat(js, 0, 50, 1.0)
    rs = beat(js, 0, 40, 2.0, gen=1)     # restored from a checkpoint at step 40
    assert rs.step == 40 and rs.last_advance == 2.0 and js.max_step == 40


# ---- straggler / throughput ----------------------------------------------------------------------
def test_straggler_flagged_within_ten_steps_of_a_3x_slowdown():
    js = JobState("j")
    for step in range(20):
        for r in range(8):
            beat(js, r, step, float(step), st=0.3 + 0.01 * r)
    assert rules.straggler_rule(js, CFG) == []
    flagged_at = None
    for step in range(20, 30):
        for r in range(8):
            beat(js, r, step, float(step), st=(0.9 if r == 5 else 0.3 + 0.01 * r))
        f = rules.straggler_rule(js, CFG)
        if f:
            flagged_at = step - 20 + 1
            assert [x.ranks for x in f] == [[5]]
            break
    assert flagged_at is not None and flagged_at <= 10


def test_straggler_two_ranks_uses_ratio():
    assert rules.straggler_scores({0: [0.2] * 5, 1: [0.21] * 5}, CFG) == []
    hit = rules.straggler_scores({0: [0.2] * 5, 1: [0.5] * 5}, CFG)
    assert [h[0] for h in hit] == [1]


def test_throughput_drop_against_own_baseline():
    cfg = DetectorConfig(throughput_window_s=1.0, throughput_warmup_windows=3)
    js = JobState("j")
    t, step, found = 0.0, 0, []
    for w in range(12):
        rate = 10 if w < 8 else 3
        for _ in range(10):
            t += 0.1
            step += rate / 10
            js.max_step = int(step)
            f = rules.throughput_rule(js, t, cfg)
            if f:
                found.append((w, f))
    assert found and found[0][0] >= 8 and found[0][1].fault_class == "straggler"
    assert found[0][1].ranks == []  # no rank heartbeats: no culprit to name


@pytest.mark.parametrize("times,culprit", [
    ({0: 0.10, 1: 0.11, 2: 0.30, 3: 0.10}, [2]),   # rank 2 computes 3x longer: named
    ({0: 0.10, 1: 0.11, 2: 0.12, 3: 0.10}, []),    # all alike: the job slowed, no culprit
])
def test_a_throughput_drop_names_the_slowest_rank(times, culprit):
    cfg = DetectorConfig(throughput_window_s=1.0, throughput_warmup_windows=3)
    js = JobState("j")
    for r, st in times.items():
        for k in range(6):
            rules.observe_heartbeat(js, r, f"n{r // 2}", r % 2, 0, k, k, "train", st,
                                    0.0, cfg, compute_s=st)
    t, step, found = 0.0, 0, []
    for w in range(12):
        for _ in range(10):
            t += 0.1
            step += (10 if w < 8 else 3) / 10
            js.max_step = int(step)
            f = rules.throughput_rule(js, t, cfg)
            if f:
                found.append(f)
    assert found[0].ranks == culprit and found[0].nodes == [f"n{r // 2}" for r in culprit]
    assert ("slowest: rank 2" in " ".join(found[0].evidence)) == bool(culprit)


# ---- nodes ---------------------------------------------------------------------------------------
def test_node_lost_needs_every_role_silent_and_fires_once():
    ns = NodeState("n7")
    rules.observe_node_heartbeat(ns, "agent", 0.0)
    rules.observe_node_heartbeat(ns, "launcher", 2.0)
    assert rules.node_lost_rule(ns, 4.0, 3.0) is None      # launcher still recent
    f = rules.node_lost_rule(ns, 5.1, 3.0)
    assert f.fault_class == "node_lost" and f.nodes == ["n7"]
    assert rules.node_lost_rule(ns, 6.0, 3.0) is None
    rules.observe_node_heartbeat(ns, "agent", 7.0)
    assert rules.node_lost_rule(ns, 10.5, 3.0) is not None


#: (case, agent's last beat, ranks' last beats, now, expected): the launcher of job j on node
#: ip-10-0-1-2.ec2.internal last beat at 0.0; timeout 3 s.
LAUNCHER_LOST_CASES = [
    ("launcher and ranks silent, agent beating: its pod is lost", 4.0, [0.1, 0.1], 4.0, True),
    ("not yet past the timeout", 2.5, [0.1], 2.9, False),
    ("the agent is silent too: the node is lost (node_lost_rule's)", 0.5, [0.1], 4.0, False),
    ("the agent stopped a beat after the launcher: a power-off, not a lost pod", 0.9, [0.1],
     3.5, False),
    ("a rank still beats: the launcher's heartbeat alone stopped", 4.0, [0.1, 3.9], 4.0, False),
    ("every rank ended (exited, done): a launcher that finished", 4.0, [], 4.0, False),
]


@pytest.mark.parametrize("case,agent,ranks,now,lost", LAUNCHER_LOST_CASES,
                         ids=[c[0] for c in LAUNCHER_LOST_CASES])
def test_launcher_lost_rule(case, agent, ranks, now, lost):
    node = "ip-10-0-1-2.ec2.internal"
    ns = NodeState(node)
    rules.observe_node_heartbeat(ns, "launcher", 0.0, job="j")
    rules.observe_node_heartbeat(ns, "launcher", 0.0, job="other")
    rules.observe_node_heartbeat(ns, "agent", agent)
    f = rules.launcher_lost_rule(ns, "j", [4, 5], ranks, now, 3.0)
    assert (f is not None) is lost, case
    if lost:
        assert (f.kind, f.fault_class, f.detail["layer"]) == (
            "launcher_lost", "crash", "infrastructure")
        assert f.nodes == [node] and f.ranks == [4, 5] and f.detail["launcher_lost"] == [node]
        assert rules.launcher_lost_rule(ns, "j", [4, 5], ranks, now + 1, 3.0) is None  # once
        rules.observe_node_heartbeat(ns, "launcher", now + 2, job="j")  # back (a new pod)…
        rules.observe_node_heartbeat(ns, "agent", now + 5.5)
        assert rules.launcher_lost_rule(ns, "j", [4, 5], [now + 2], now + 5.6, 3.0) is not None


def test_launcher_lost_needs_members_and_a_launcher_that_beat():
    ns = NodeState("n1")
    rules.observe_node_heartbeat(ns, "agent", 10.0)
    assert rules.launcher_lost_rule(ns, "j", [0], [0.1], 10.0, 3.0) is None  # never beat
    rules.observe_node_heartbeat(ns, "launcher", 0.0, job="j")
    assert rules.launcher_lost_rule(ns, "j", [], [0.1], 10.0, 3.0) is None  # node left the job


def test_xid_rule_uses_table():
    f = rules.xid_rule(79, "n3", "0000:4e:00", 2, 100, "NVRM: Xid …: 79, …", 5)
    assert (f.fault_class, f.detail["layer"]) == ("gpu_xid", "hardware")
    assert "action" not in f.detail  # the detector reports evidence; the remediator decides
    assert f.gpus == ["n3:2"] and f.severity == "error"
    assert rules.xid_rule(63, "n3", "x", None, None, "", 0).severity == "warning"


def test_telemetry_thermal_and_ecc():
    ns = NodeState("n1")
    cool = {"index": 0, "clock_event_reasons": 0, "ecc_volatile_uncorrected": 0}
    hot = {"index": 0, "clock_event_reasons": 0x40, "ecc_volatile_uncorrected": 0,
           "temperature_c": 91}
    assert rules.telemetry_rule(ns, [cool], CFG) == []
    assert rules.telemetry_rule(ns, [hot], CFG) == []          # one sample is not enough
    f = rules.telemetry_rule(ns, [hot], CFG)
    assert [x.kind for x in f] == ["thermal"] and f[0].gpus == ["n1:0"]
    f = rules.telemetry_rule(ns, [{**cool, "ecc_volatile_uncorrected": 2}], CFG)
    assert [(x.kind, x.severity) for x in f] == [("ecc", "error")]
    named = {"index": 1, "clock_event_names": ["SwThermalSlowdown"]}
    rules.telemetry_rule(ns, [named], CFG)
    assert [x.kind for x in rules.telemetry_rule(ns, [named], CFG)] == ["thermal"]


def test_nan_loss_rule():
    assert rules.nan_loss_rule(1.0, 0, "n", 1, 0, 0) is None
    assert rules.nan_loss_rule(float("nan"), 3, "n", 9, 0, 0).ranks == [3]
    assert rules.nan_loss_rule(math.inf, 3, "n", 9, 0, 0).fault_class == "nan_loss"


# ---- log patterns --------------------------------------------------------------------------------
LINES = [
    ("[rank2]:[E0101 00:00:00.0 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective "
     "operation timeout: WorkNCCL(SeqNum=77, OpType=BROADCAST, NumelIn=8, NumelOut=8, "
     "Timeout(ms)=60000) ran for 60001 milliseconds before timing out.",
     "nccl_watchdog_timeout", "hang", True),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
     "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
     "nccl_system_error", "network", True),
    ("gpu7:1122:1187 [3] NCCL INFO NET/IB : Got completion from peer 10.1.2.3<33012> with error "
     "12, opcode 0, len 0, vendor err 129 (Send)", "ib_completion_error", "network", False),
    ("RuntimeError: [/opt/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
     "[10.0.0.4]:29501: Connection reset by peer", "gloo_peer_reset", "network", True),
    ("RuntimeError: CUDA error: an illegal memory access was encountered",
     "cuda_illegal_access", "crash", False),
    ("RuntimeError: CUDA error: device-side assert triggered", "cuda_device_assert",
     "app_exception", False),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
     "capacity of 79.15 GiB", "cuda_oom", "oom_gpu", False),
    ("[Mon Jun  3 11:02:01 2024] Out of memory: Killed process 55102 (python3) total-vm:912345kB",
     "host_oom_kill", "oom_host", False),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
     "shared memory (shm).", "sigbus", "crash", False),
    ("Fatal Python error: Segmentation fault", "sigsegv", "crash", False),
    ("OSError: [Errno 28] No space left on device: '/ckpt/step_100/__0_0.distcp'",
     "disk_full", "filesystem", False),
    ("_pickle.UnpicklingError: invalid load key, '\\x00'.", "checkpoint_corrupt",
     "checkpoint_corrupt", False),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
     "rendezvous_timeout", "rendezvous", False),
    ("trainguard.rendezvous.store.RendezvousError: rendezvous of generation 2: 1/2 ranks arrived "
     "after 120s", "rendezvous_timeout", "rendezvous", False),
    ("iteration 1200 | lm loss: nan | grad norm: nan", "nan_loss", "nan_loss", False),
    ("[deepspeed] OVERFLOW! Current loss scale already at minimum - cannot decrease scale anymore",
     "loss_scale_collapse", "nan_loss", False),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "uncorrectable_ecc",
     "ecc", False),
    ("ValueError: expected 3 channels, got 4", "python_exception", "app_exception", False),
]


@pytest.mark.parametrize("line,name,fc,symptom", LINES)
def test_pattern_table(line, name, fc, symptom):
    m = pat.match_line(line)
    assert m is not None and m.name == name
    assert m.pattern.fault_class == fc and m.pattern.symptom is symptom


def test_watchdog_groups_and_rank():
    f = rules.log_rule(LINES[0][0], "stderr", None, "n1", 0, 1)
    assert f.ranks == [2] and f.detail["seq"] == "77" and f.detail["op"] == "BROADCAST"


def test_benign_lines_do_not_match():
    for line in ("step 100 loss 2.31 lr 3e-4", "Saving checkpoint to /ckpt/step_100",
                 "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, "
                 "reducing to 32768", "INFO: information about inference",
                 # the Checkpointer's own report: its ckpt.save_failed event is what counts
                 "2026-11-30 15:50:01,123 trainguard.checkpoint WARNING checkpoint of step 40 "
                 "failed: [Errno 30] Read-only file system: '/ckpt/.tmp-step_40'"):
        assert pat.match_line(line) is None, line


def test_exception_stream_is_app_exception_of_sender_unless_symptom():
    f = rules.log_rule("Traceback (most recent call last):\n  File \"t.py\", line 3\n"
                       "KeyError: 'labels'", "exception", 1, "n0", 2, 5)
    assert (f.fault_class, f.ranks, f.symptom, f.generation) == ("app_exception", [1], False, 2)
    f = rules.log_rule("my custom failure without a known form", "exception", 3, "n0", 0, 5)
    assert f.fault_class == "app_exception" and f.ranks == [3]
    f = rules.log_rule("RuntimeError: [pair.cc:598] Connection closed by peer [127.0.0.1]:1234",
                       "exception", 1, "n0", 0, 5)
    assert f.symptom and f.fault_class == "network"
    assert rules.log_rule("plain stdout line", "stdout", 0, "n0", 0, 1) is None


def test_line_rank_forms():
    assert pat.line_rank("[rank3]:[E ...] boom") == 3
    assert pat.line_rank("[2]<stderr>:Killed") == 2
    assert pat.line_rank("Tue Jan 1 2019[1,5]<stderr>:INFO") == 5
    assert pat.line_rank("  rank      : 6 (local_rank: 2)") == 6
    assert pat.line_rank("nothing here") is None


def test_ddp_unused_parameters_warning_is_no_fault():
    """torch warns when ``find_unused_parameters=True`` found none unused (the Hugging Face
    Trainer sets it by default); only the error that names the unfinished reduction is a fault."""
    warning = ("[W1201 23:10:01.123456789 reducer.cpp:1529] Warning: find_unused_parameters=True "
               "was specified in DDP constructor, but did not find any unused parameters in the "
               "forward pass. This flag results in an extra traversal of the autograd graph every "
               "iteration, which can adversely affect performance.")
    assert pat.match_line(warning) is None
    error = ("RuntimeError: Expected to have finished reduction in the prior iteration before "
             "starting a new one. … by passing the keyword argument `find_unused_parameters=True`")
    assert pat.match_line(error).pattern.name == "collective_mismatch"

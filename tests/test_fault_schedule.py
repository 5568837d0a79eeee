"""The fault schedule (``trainguard.core.fault_schedule``): what parses, what is refused and how;
``trainguard launch --faults`` reading it; the rank side (``trainguard.rank.fault_inject``) firing a
fault once at its step; the launcher fencing itself when its lease is lost."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from trainguard.rank import fault_inject

from trainguard.core import fault_schedule
from trainguard.core.fault_schedule import FaultScheduleError


def test_every_kind_parses_with_its_fields(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("""
faults:
  - {kind: sigkill, rank: 1, step: 40}
  - {kind: exception, rank: 2, step: 60}
  - {kind: hang, rank: 3, at_s: 30}
  - {kind: power-off, node: node1, step: 50}
  - {kind: partition, node: 1, step: 50, heal_after_s: 15, id: 9}
  - {kind: slow-link, node: node0, at_s: 20, rate: 1mbit, duration_s: 10}
""")
    fs = fault_schedule.load(str(path))
    assert [f.kind for f in fs] == ["sigkill", "exception", "hang", "power_off", "partition",
                                   "slow_link"]
    assert [f.id for f in fs] == [1, 2, 3, 4, 9, 6]
    assert fs[2].at_s == 30.0 and fs[2].step is None
    assert [f.on_rank for f in fs] == [True, True, True, False, False, False]
    assert fs[4].node_name(["node0", "node1"]) == "node1" and fs[4].heal_after_s == 15.0
    assert fs[5].rate == "1mbit" and fs[5].duration_s == 10.0
    # the JSON form the launcher hands its ranks holds the same faults
    assert fault_schedule.parse(json.loads(fault_schedule.dumps(fs))) == fs
    js = tmp_path / "s.json"
    js.write_text(json.dumps([{"kind": "sigkill", "rank": 0, "step": 3}]))
    assert fault_schedule.load(str(js))[0].kind == "sigkill"


@pytest.mark.parametrize("entry,says", [
    ({"kind": "meteor", "rank": 1, "step": 3}, "kind 'meteor': use one of sigkill"),
    ({"kind": "sigkill", "rank": 1}, "exactly one trigger"),
    ({"kind": "sigkill", "rank": 1, "step": 3, "at_s": 2}, "exactly one trigger"),
    ({"kind": "sigkill", "step": 3}, "needs rank"),
    ({"kind": "hang", "rank": 1, "step": 3, "node": "n1"}, "node is for node faults"),
    ({"kind": "partition", "step": 3}, "needs node"),
    ({"kind": "partition", "node": 1, "step": 3, "rate": "1mbit"}, "are for slow_link"),
    ({"kind": "power_off", "node": 1, "step": 3, "heal_after_s": 3}, "for partition"),
    ({"kind": "slow_link", "node": 1, "step": 3, "rate": "fast"}, "give a tc rate"),
    ({"kind": "sigkill", "rank": 1, "step": -1}, "must be ≥ 0"),
    ({"kind": "sigkill", "rank": "one", "step": 3}, "rank must be int"),
    ({"kind": "sigkill", "rank": 1, "step": 3, "when": "now"}, "unknown field(s) when"),
    ("sigkill", "each fault is a mapping"),
])
def test_bad_entries_are_refused_with_what_to_write(entry, says):
    with pytest.raises(FaultScheduleError, match="entry 1") as exc:
        fault_schedule.parse([entry], "s.yaml")
    assert says in str(exc.value)


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(FaultScheduleError, match="cannot read"):
        fault_schedule.load(str(tmp_path / "missing.yaml"))
    (tmp_path / "b.json").write_text("[{")
    with pytest.raises(FaultScheduleError, match="not valid JSON"):
        fault_schedule.load(str(tmp_path / "b.json"))
    with pytest.raises(FaultScheduleError, match="unknown top-level"):
        fault_schedule.parse({"faults": [], "extra": 1})
    with pytest.raises(FaultScheduleError, match="id 2 is used twice"):
        fault_schedule.parse([{"kind": "sigkill", "rank": 0, "step": 1, "id": 2},
                              {"kind": "hang", "rank": 0, "step": 2, "id": 2}])
    f = fault_schedule.parse([{"kind": "power_off", "node": "node7", "step": 1}])[0]
    with pytest.raises(FaultScheduleError, match="node 'node7' is not one of node0, node1"):
        f.node_name(["node0", "node1"])


def test_launch_reads_the_schedule_and_refuses_a_bad_one(tmp_path, capsys):
    from trainguard.launch.launcher import parse_args

    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    good = tmp_path / "f.yaml"
    good.write_text("- {kind: exception, rank: 1, step: 5}\n- {kind: power_off, node: 1, "
                    "step: 5}\n")
    cfg = parse_args(["--faults", str(good), "--job", "fj", "--nproc-per-node", "2",
                      str(script)])
    assert json.loads(cfg.faults) == {"faults": [{"id": 1, "kind": "exception", "rank": 1,
                                                  "step": 5}]}
    assert cfg.faults_dir == str(good) + ".fired" + os.sep + "fj"
    assert "carried out by the cluster harness" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {kind: sigkill, step: 5}\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--faults", str(bad), str(script)])
    assert exc.value.code == 2
    assert "--faults: fault schedule bad.yaml entry 1: a sigkill fault needs rank" in \
        capsys.readouterr().err


def test_a_rank_fault_fires_once_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TG_FAULTS", fault_schedule.dumps(fault_schedule.parse(
        [{"kind": "exception", "rank": 1, "step": 4}])))
    monkeypatch.setenv("TG_FAULTS_DIR", str(tmp_path / "fired"))
    fault_inject.reset()
    try:
        fault_inject.at_step(0, 4)  # another rank
        fault_inject.at_step(1, 3)  # another step
        with pytest.raises(fault_inject.InjectedFault, match="rank 1 at step 4"):
            fault_inject.at_step(1, 4)
        fault_inject.at_step(1, 4)  # replayed after a rollback: fired already
        marker = json.loads((tmp_path / "fired" / "fault-1.fired").read_text())
        assert marker["rank"] == 1 and marker["step"] == 4 and marker["ts"] > 0
    finally:
        fault_inject.reset()


def test_sigkill_and_hang_are_real_signals(tmp_path):
    code = ("import trainguard.rank.fault_inject as f\nfor s in range(10):\n    f.at_step(0, s)\n"
            "print('survived')\n")
    for kind, sig in (("sigkill", signal.SIGKILL), ("hang", signal.SIGSTOP)):
        env = {**os.environ, "TG_FAULTS_DIR": str(tmp_path / kind), "TG_FAULTS": json.dumps(
            {"faults": [{"id": 1, "kind": kind, "rank": 0, "step": 5}]})}
        p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
        if kind == "hang":
            _, status = os.waitpid(p.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == sig
            p.kill()
            p.wait()
        else:
            assert p.wait(30) == -sig
        assert (tmp_path / kind / "fault-1.fired").exists()


def test_a_launcher_that_lost_its_lease_fences_itself():
    from test_launcher_loop import _loop  # the stub pool, lease and bus: no processes

    from trainguard.launch.loop import LaunchState, LeaseLost

    loop = _loop(mode="action")
    loop.handle(LeaseLost(10.4))
    assert loop.state == LaunchState.FAILED and loop.exit_status == 1 and loop.fenced
    assert "kill_all" in loop.pool.calls


def test_in_observe_mode_a_lost_lease_stops_nothing():
    """Observe mode executes no decision, so nothing can have moved the ranks: a control plane
    out of reach (a stack restarted for 20 s) leaves training as it is, as under torchrun."""
    from test_launcher_loop import _loop

    from trainguard.launch.loop import LaunchState, LeaseLost

    loop = _loop(mode="observe")
    loop.handle(LeaseLost(20.0))
    assert loop.state == LaunchState.HEALTHY and not loop.fenced and loop.exit_status is None
    assert "kill_all" not in loop.pool.calls


def test_a_node_fault_fires_only_on_its_nodes_rank(tmp_path):
    """A partition of node1 "when rank 3 completes step 15" waits for node1's rank 3: a job
    that already moved rank 3 to the spare node (a decision before the fault) does not fire it
    there (seen: a straggler exclusion at start-up, then the partition of a node out of the job,
    counted as a recovery that never came)."""
    from types import SimpleNamespace

    from trainguard.core import fault_schedule
    from trainguard.cluster import FaultRunner

    recs: list[dict] = [{"rank": 3, "step": s, "host": "node1", "gen": 0} for s in range(10)]
    cluster = SimpleNamespace(net=SimpleNamespace(names=["node0", "node1", "node2"]),
                              steps=lambda job: recs)
    (f,) = fault_schedule.parse([{"kind": "partition", "node": "node1", "step": 15, "rank": 3}])
    runner = FaultRunner(cluster, "j", [f])
    assert not runner._due(f)
    recs += [{"rank": 3, "step": s, "host": "node2", "gen": 1} for s in range(10, 20)]
    assert not runner._due(f)  # rank 3 on the spare node: not node1's
    recs.append({"rank": 3, "step": 15, "host": "node1", "gen": 0})
    assert runner._due(f)

"""The launcher's run loop (``trainguard.launch.loop.RunLoop``) driven with a stub pool, lease and
bus: no processes, no servers. Each test feeds typed events and checks the states entered, the
exit status and what the loop asked of the pool, the lease and the bus — the transitions of
``LaunchState``'s docstring, as the launcher carries them out."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from trainguard import schemas
from trainguard.core.recovery_plan import EXIT_STOPPED, LocalRank
from trainguard.launch.launcher import LaunchConfig
from trainguard.launch.loop import (DecisionReceived, GroupRestarted, LaunchState,
                                      LeaseRenewalFailed, RankExited, RefillPool,
                                      RenewSpares, RunLoop, StopRequested)
from trainguard.schemas import Member

S = LaunchState


@dataclass(eq=False)
class StubProc:
    local_rank: int
    rank: int
    generation: int
    pid: int
    in_process: bool = False
    returncode: int | None = None
    expected_exit: bool = False

    @property
    def alive(self) -> bool:
        return self.returncode is None


class StubPool:
    """The pool's interface over plain objects; ``spawned`` records every start."""

    def __init__(self, in_process: bool = False):
        self.workers: dict[int, StubProc] = {}
        self.spawned: list[dict] = []
        self.calls: list[str] = []
        self.in_process = in_process
        self._pid = 100

    def ranks(self):
        return [LocalRank(lr, p.rank, p.alive and not p.expected_exit, p.in_process)
                for lr, p in self.workers.items()]

    def current(self, local_rank):
        return self.workers.get(local_rank)

    def spawn(self, local_rank, rank, *, generation, world_size, attempt, restart_count,
              decision=None, refill=True):
        self._pid += 1
        p = StubProc(local_rank, rank, generation, self._pid, self.in_process)
        self.workers[local_rank] = p
        self.spawned.append(dict(local_rank=local_rank, rank=rank, generation=generation,
                                 world_size=world_size, attempt=attempt,
                                 restart_count=restart_count, decision=decision, refill=refill))
        return p

    def fill(self):
        self.calls.append("fill")

    def renew_spares(self):
        self.calls.append("renew_spares")

    def kill(self, local_rank):
        self.calls.append(f"kill {local_rank}")
        self._kill(self.workers[local_rank])

    def kill_all(self):
        self.calls.append("kill_all")
        for p in self.workers.values():
            self._kill(p)

    def stop_ranks(self, wait_s):
        self.calls.append("stop_ranks")
        for p in self.workers.values():
            self._kill(p)

    @staticmethod
    def _kill(p):
        p.expected_exit = True
        if p.returncode is None:
            p.returncode = -9

    def rerank(self, local_rank, rank):
        self.workers[local_rank].rank = rank

    def forget(self, local_rank):
        del self.workers[local_rank]

    def advance_generation(self, generation):
        for p in self.workers.values():
            p.generation = max(p.generation, generation)


class StubLease:
    def __init__(self):
        self.attempts: list[tuple[int, int]] = []

    def publish_attempt(self, generation, attempt):
        self.attempts.append((generation, attempt))


class StubBus:
    def __init__(self):
        self.published: list[tuple[str, schemas.Event]] = []

    def publish(self, subject, event):
        self.published.append((subject, event))

    def of(self, kind):
        return [e for _, e in self.published if isinstance(e, kind)]


def _loop(generation=0, in_process=False, **cfg):
    base = dict(script="train.py", job="j", node="n0", nproc_per_node=2)
    base.update(cfg)
    loop = RunLoop(LaunchConfig(**base), StubPool(in_process), StubLease(), StubBus())
    loop.start(generation)
    return loop


def _exit(loop, local_rank, rc):
    """The current process of ``local_rank`` ends with ``rc`` (negative: a signal)."""
    p = loop.pool.workers[local_rank]
    p.returncode = rc
    return RankExited(p)


def _decision(action, generation, ranks=(), nodes=(), members=(), execute=True, key=None):
    return DecisionReceived(schemas.Decision(
        job="j", action=action, mode="action" if execute else "observe", execute=execute,
        generation=generation, ranks=list(ranks), nodes=list(nodes), members=list(members),
        idempotency_key=key or f"j:g{generation - 1}:{action}"))


def test_start_spawns_this_nodes_ranks_then_the_spares():
    loop = _loop(generation=4, node_rank=1)
    assert loop.history == [S.INIT, S.HEALTHY]
    assert [(s["local_rank"], s["rank"], s["generation"], s["refill"])
            for s in loop.pool.spawned] == [(0, 2, 4, False), (1, 3, 4, False)]
    assert loop.pool.calls == ["fill"]


def test_a_spare_node_starts_no_rank():
    loop = _loop(spare_node=True)
    assert loop.pool.spawned == [] and loop.state is S.HEALTHY


def test_every_rank_exits_0_succeeded():
    loop = _loop()
    loop.handle(_exit(loop, 0, 0))
    assert loop.state is S.HEALTHY  # one rank still runs
    loop.handle(_exit(loop, 1, 0))
    assert loop.history == [S.INIT, S.HEALTHY, S.SUCCEEDED] and loop.exit_status == 0
    exited = loop.bus.of(schemas.WorkerExited)
    assert [(e.rank, e.exit_code, e.expected) for e in exited] == [(0, 0, True), (1, 0, True)]


@pytest.mark.parametrize("codes, status, state", [
    ((3, 3), EXIT_STOPPED, S.STOPPED),       # the shim's JobStopped in every rank
    ((0, 3), EXIT_STOPPED, S.STOPPED),       # the last rank's status is the node's
    ((3, 0), 0, S.SUCCEEDED),
])
def test_ranks_that_exit_0_or_3_end_the_launch(codes, status, state):
    loop = _loop(mode="action")
    for lr, rc in enumerate(codes):
        loop.handle(_exit(loop, lr, rc))
    assert (loop.state, loop.exit_status) == (state, status)
    assert "kill_all" not in loop.pool.calls


def test_run_answers_events_until_a_terminal_state():
    loop = _loop()
    loop.post(RefillPool())
    loop.post(_exit(loop, 0, 0))
    loop.post(_exit(loop, 1, 0))
    assert loop.run() == 0
    assert loop.pool.calls == ["fill", "fill"]


def test_spares_are_renewed_once_the_template_has_the_jobs_imports_not_after_the_end():
    loop = _loop()
    loop.handle(RenewSpares())
    assert loop.pool.calls[-1] == "renew_spares"
    loop.handle(StopRequested(143))
    n = len(loop.pool.calls)
    loop.handle(RenewSpares())  # a late answer from the template: the launch is over
    assert len(loop.pool.calls) == n


@pytest.mark.parametrize("nnodes, published", [(1, []), (2, [(0, 1)])])
def test_observe_mode_failure_with_restarts_left_restarts_the_group(nnodes, published):
    loop = _loop(mode="observe", max_restarts=2, nnodes=nnodes)
    first = dict(loop.pool.workers)
    loop.handle(_exit(loop, 1, -9))
    assert loop.history == [S.INIT, S.HEALTHY, S.RESTARTING, S.HEALTHY]
    assert (loop.attempt, loop.restart_count) == (1, 1)
    assert "stop_ranks" in loop.pool.calls
    assert [(s["local_rank"], s["rank"], s["attempt"], s["restart_count"], s["refill"])
            for s in loop.pool.spawned[2:]] == [(0, 0, 1, 1, True), (1, 1, 1, 1, True)]
    assert loop.lease.attempts == published  # the other nodes follow the job record
    # the killed ranks' own exits afterwards are no new fault
    for p in first.values():
        loop.handle(RankExited(p))
    assert loop.state is S.HEALTHY and len(loop.pool.spawned) == 4
    assert [e.expected for e in loop.bus.of(schemas.WorkerExited)] == [False, True, True]


def test_observe_mode_restarts_spent_failed():
    loop = _loop(mode="observe", max_restarts=1)
    loop.handle(_exit(loop, 0, 1))
    assert loop.attempt == 1
    loop.handle(_exit(loop, 0, 7))
    assert loop.history[-2:] == [S.STOPPING, S.FAILED] and loop.exit_status == 1
    assert loop.pool.calls[-1] == "kill_all"
    assert loop.bus.of(schemas.WorkerExited)[-1].exit_code == 7


def test_observe_mode_without_restarts_fails_at_once():
    loop = _loop(mode="observe")
    loop.handle(_exit(loop, 1, -11))
    assert (loop.state, loop.exit_status, loop.attempt) == (S.FAILED, 1, 0)
    assert loop.bus.of(schemas.WorkerExited)[0].signal == 11


def test_action_mode_failure_waits_for_the_decision():
    loop = _loop(mode="action")
    loop.handle(_exit(loop, 1, -9))
    assert loop.state is S.UNHEALTHY and len(loop.pool.spawned) == 2
    loop.handle(_exit(loop, 0, 0))  # the failed rank is still this node's: no end
    assert loop.state is S.UNHEALTHY
    loop.handle(_decision("restart_workers", 1, ranks=[1]))
    assert loop.history[-2:] == [S.RESTARTING, S.HEALTHY]
    assert [(s["local_rank"], s["rank"], s["generation"]) for s in loop.pool.spawned[2:]] == \
        [(1, 1, 1)]


def test_executed_decision_restarts_a_plain_scripts_group_at_its_generation():
    loop = _loop(mode="action")
    loop.handle(_decision("restart_workers", 1, ranks=[1]))
    assert sorted(c for c in loop.pool.calls if c.startswith("kill")) == ["kill 0", "kill 1"]
    new = loop.pool.spawned[2:]
    assert [(s["local_rank"], s["generation"], s["restart_count"]) for s in new] == \
        [(0, 1, 1), (1, 1, 1)]
    assert all(s["decision"].action == "restart_workers" for s in new)
    assert loop.generation == 1 and loop.state is S.HEALTHY
    (result,) = loop.bus.of(schemas.ActionResult)
    assert result.ok and result.action == "restart_workers" and result.node == "n0"


def test_in_process_ranks_keep_running_and_move_to_the_generation():
    loop = _loop(mode="action", in_process=True)
    loop.handle(_decision("restart_in_process", 1, ranks=[0]))
    assert len(loop.pool.spawned) == 2 and not any(c.startswith("kill") for c in loop.pool.calls)
    assert {p.generation for p in loop.pool.workers.values()} == {1}
    assert loop.restart_count == 0 and len(loop.bus.of(schemas.ActionResult)) == 0  # no plan


@pytest.mark.parametrize("generation", [0, 2])
def test_a_decision_for_a_generation_already_past_is_ignored(generation):
    loop = _loop(generation=2, mode="action")
    loop.handle(_decision("restart_workers", generation, ranks=[1]))
    assert loop.history == [S.INIT, S.HEALTHY] and len(loop.pool.spawned) == 2
    assert loop.generation == 2 and not loop.bus.of(schemas.ActionResult)


def test_a_decision_seen_before_or_not_executed_changes_nothing():
    loop = _loop(mode="action")
    d = _decision("restart_workers", 1, ranks=[1])
    loop.handle(d)
    loop.handle(d)  # the same idempotency key again
    assert len(loop.pool.spawned) == 4 and len(loop.bus.of(schemas.ActionResult)) == 1
    loop.handle(_decision("restart_workers", 2, ranks=[1], execute=False))
    assert len(loop.pool.spawned) == 4 and loop.generation == 1


def test_stop_decision_stopping_then_exit_3():
    loop = _loop(mode="action")
    loop.handle(_decision("stop_job_notify_user", 1))
    assert loop.history[-2:] == [S.STOPPING, S.STOPPED] and loop.exit_status == EXIT_STOPPED
    assert "kill_all" in loop.pool.calls
    assert loop.bus.of(schemas.ActionResult)[0].action == "stop_job_notify_user"
    assert loop.run() == EXIT_STOPPED  # a terminal state ends the loop at once


def test_excluded_node_stops_with_0_and_the_others_re_rank():
    loop = _loop(mode="action")
    d = _decision("exclude_node_and_requeue", 1, ranks=[0, 1], nodes=["n0"],
                  members=[Member(rank=0, node="n1", local_rank=0)])
    d.decision.world_size = 1
    loop.handle(d)
    assert (loop.state, loop.exit_status) == (S.STOPPED, 0)
    # the job's only node excluded (world 0: its scheduler requeues it): the ranks stop, and
    # the launch waits for the scheduler instead of ending the job's only step itself
    alone = _loop(mode="action")
    alone.handle(_decision("exclude_node_and_requeue", 1, ranks=[0, 1], nodes=["n0"]))
    assert alone.exit_status is None and "kill" in " ".join(map(str, alone.pool.calls)), \
        alone.pool.calls
    members = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node="n0", local_rank=0),
               Member(rank=2, node="n0", local_rank=1)]
    other = _loop(mode="action", in_process=True, node_rank=1)
    d = _decision("exclude_node_and_requeue", 1, ranks=[0], nodes=["dead"], members=members)
    d.decision.world_size = 3
    other.handle(d)
    assert {lr: p.rank for lr, p in other.pool.workers.items()} == {0: 1, 1: 2}
    assert len(other.pool.spawned) == 2 and other.world_size == 3
    assert other.history[-2:] == [S.RESTARTING, S.HEALTHY]


def test_another_nodes_group_restart_is_followed_once():
    loop = _loop(mode="observe", max_restarts=3, nnodes=2)
    loop.handle(GroupRestarted(2))
    assert (loop.attempt, loop.restart_count) == (2, 1)
    assert loop.lease.attempts == []  # taken from the record, not written back
    assert {s["attempt"] for s in loop.pool.spawned[2:]} == {2}
    loop.handle(GroupRestarted(2))
    loop.handle(GroupRestarted(1))
    assert len(loop.pool.spawned) == 4
    spare = _loop(mode="observe", max_restarts=3, nnodes=2, spare_node=True)
    spare.handle(GroupRestarted(5))
    assert spare.attempt == 0  # a node with no ranks has nothing to restart


@pytest.mark.parametrize("status,fenced,slurm,ending", [
    (0, False, False, True), (3, False, False, True), (1, False, False, True),
    (143, False, False, False),  # SIGTERM from outside (a pod deleted): its ranks are lost
    (143, False, True, True),    # SIGTERM from Slurm (scancel, a requeue): the step ends
    (130, False, True, False),   # Ctrl-C
    (0, True, False, False),     # fenced: the job may have moved on without it
    (143, True, True, False), (None, False, True, False)])
def test_which_ends_say_ending_in_the_last_heartbeat(status, fenced, slurm, ending):
    from trainguard.launch.launcher import ends_on_purpose

    assert ends_on_purpose(status, fenced, slurm) is ending


@pytest.mark.parametrize("status", [143, 130])
def test_stop_request_stopping_then_its_status(status):
    loop = _loop()
    loop.handle(StopRequested(status))
    assert loop.history[-2:] == [S.STOPPING, S.STOPPED] and loop.exit_status == status


def test_lease_renewal_failure_is_a_warning(caplog):
    loop = _loop()
    with caplog.at_level(logging.WARNING, logger="trainguard.launch.launcher"):
        loop.handle(LeaseRenewalFailed("connection refused"))
    assert loop.state is S.HEALTHY and "connection refused" in caplog.text


def test_states_are_terminal_only_at_the_end():
    assert {s for s in S if s.terminal} == {S.SUCCEEDED, S.STOPPED, S.FAILED}


def test_a_decision_read_back_from_the_stream_is_carried_out_once_and_an_earlier_runs_quietly(
        capsys):
    """The launcher reads its job's newest stored decision at the start and after every
    reconnect (a decision published while it was off the bus): one it missed is carried out,
    one it has seen is not carried out again, and an earlier run's is dropped without a word."""
    import time

    loop = _loop(generation=3)
    old = _decision("restart_workers", 3, ranks=[1], key="j:g2")
    old.decision.ts = loop.started_ns - 10**9  # the previous run's, stored before this start
    loop.handle(old)
    assert len(loop.pool.spawned) == 2 and "stale" not in capsys.readouterr().err
    missed = _decision("restart_workers", 4, ranks=[1], key="j:g3")
    missed.decision.ts = time.time_ns()
    loop.handle(missed)  # published while this launcher was away, read back when it returned
    assert loop.generation == 4 and [s["generation"] for s in loop.pool.spawned][2:] == [4, 4]
    loop.handle(missed)  # read back again at the next reconnect
    assert [s["generation"] for s in loop.pool.spawned][2:] == [4, 4]

"""What an executed decision means for one node's ranks (``trainguard.core.recovery_plan.plan_node``) and
for one rank (``plan_rank``): the executor table of docs/protocol.md, with and without ranks that
rejoin in process. The table's rows are read from the doc: every row is tested here, and a row
added to the doc without a test here fails ``test_every_row_of_the_doc_is_tested``."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainguard import schemas
from trainguard.schemas import Member
from trainguard.core.recovery_plan import (EXIT_STOPPED, LocalRank, RankAction, ThisRank, plan_node,
                                 plan_rank)

NODE = "n0"


def _d(action, ranks=(), nodes=(), members=(), generation=1):
    return schemas.Decision(job="j", action=action, mode="action", execute=True,
                            generation=generation, ranks=list(ranks), nodes=list(nodes),
                            members=list(members), idempotency_key="j:g0")


RUN = [LocalRank(0, 0, True, True), LocalRank(1, 1, True, True)]        # trainguard.run ranks
PLAIN = [LocalRank(0, 0, True, False), LocalRank(1, 1, True, False)]    # unmodified script


@pytest.mark.parametrize("decision, ranks, kill, start, rerank, status", [
    # in-process ranks: only the named (or dead) rank is replaced
    (_d("restart_workers", [1]), RUN, [1], [(1, 1)], {}, None),
    (_d("restart_in_process", [1]), RUN, [], [], {}, None),
    (_d("restart_in_process", [1]), [RUN[0], LocalRank(1, 1, False, True)], [], [(1, 1)], {},
     None),
    # an unmodified script: any recovery restarts the whole worker group
    (_d("restart_workers", [1]), PLAIN, [0, 1], [(0, 0), (1, 1)], {}, None),
    (_d("restart_in_process", [0]), PLAIN, [0, 1], [(0, 0), (1, 1)], {}, None),
    (_d("restart_workers", [5]), PLAIN, [0, 1], [(0, 0), (1, 1)], {}, None),  # peer elsewhere
    (_d("restart_workers", [1]), [PLAIN[0], LocalRank(1, 1, False, False)], [0], [(0, 0), (1, 1)],
     {}, None),
    # a rank that has not reached trainguard.run yet cannot rejoin in process either
    (_d("restart_workers", [3]), [RUN[0], LocalRank(1, 1, True, False)], [1], [(1, 1)], {}, None),
    # stop and exclusion
    (_d("stop_job_notify_user"), RUN, [0, 1], [], {}, EXIT_STOPPED),
    (_d("exclude_node_and_requeue", [0, 1], [NODE]).model_copy(update={"world_size": 2}),
     PLAIN, [0, 1], [], {}, 0),
    # the job's only node excluded (world 0, the scheduler requeues it): stopped, no exit —
    # ending the launch would end the job before its requeue
    (_d("exclude_node_and_requeue", [0, 1], [NODE]), PLAIN, [0, 1], [], {}, None),
    (_d("none"), PLAIN, [], [], {}, None),
])
def test_plan_table(decision, ranks, kill, start, rerank, status):
    plan = plan_node(decision, NODE, ranks)
    assert (sorted(plan.kill), plan.start, plan.rerank, plan.exit_status) == \
        (kill, start, rerank, status)


def test_exclusion_elsewhere_reranks_in_process_ranks_and_restarts_plain_ones():
    members = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node=NODE, local_rank=0),
               Member(rank=2, node=NODE, local_rank=1)]
    d = _d("exclude_node_and_requeue", [0], ["dead"], members)
    ranks = [LocalRank(0, 2, True, True), LocalRank(1, 3, True, True)]
    plan = plan_node(d, NODE, ranks)
    assert (plan.kill, plan.start, plan.rerank) == ([], [], {0: 1, 1: 2})
    plan = plan_node(d, NODE, [LocalRank(0, 2, True, False), LocalRank(1, 3, True, False)])
    assert (sorted(plan.kill), plan.start) == ([0, 1], [(0, 1), (1, 2)])
    assert "restarted with the worker group" in plan.why


def test_an_exclusion_below_the_minimum_world_stops_the_ranks_and_waits_for_the_requeue():
    members = [Member(rank=0, node=NODE, local_rank=0), Member(rank=1, node=NODE, local_rank=1)]
    d = _d("exclude_node_and_requeue", [2, 3], ["dead"], members).model_copy(
        update={"world_size": 2})
    for ranks in (RUN, PLAIN):
        plan = plan_node(d, NODE, ranks, min_world_size=4)
        # every rank stopped, none started, and the launch does not end itself
        assert (sorted(plan.kill), plan.start, plan.rerank, plan.exit_status) == (
            [0, 1], [], {}, None)
        assert "requeues" in plan.why
    # at or above the minimum the survivors go on in place
    assert plan_node(d, NODE, RUN, min_world_size=2).rerank == {} and \
        plan_node(d, NODE, RUN, min_world_size=2).kill == []


def test_spare_node_starts_its_share_of_the_members():
    members = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node=NODE, local_rank=0)]
    plan = plan_node(_d("exclude_node_and_requeue", [1], ["dead"], members), NODE, [])
    assert (plan.kill, plan.start) == ([], [(0, 1)])


def test_a_node_that_runs_fewer_ranks_stops_the_others():
    members = [Member(rank=0, node=NODE, local_rank=0)]
    plan = plan_node(_d("exclude_node_and_requeue", [9], ["dead"], members), NODE, RUN)
    assert plan.kill == [1] and plan.start == []


# ---- the rank's side (plan_rank) ----------------------------------------------------------------

def _me(local_rank=0, rank=0, world=2, in_process=True, node=NODE):
    return ThisRank(node=node, local_rank=local_rank, rank=rank, world_size=world,
                    in_process=in_process)


@pytest.mark.parametrize("decision, generation, why", [
    (schemas.Decision(job="j", action="restart_workers", mode="observe", execute=False,
                      generation=1, idempotency_key="k"), 0, "not executed"),
    (_d("restart_workers", [1], generation=1), 1, "not after"),   # carried out already
    (_d("restart_workers", [1], generation=1), 4, "not after"),   # replayed from the stream
    (_d("stop_job_notify_user", generation=2), 2, "not after"),
    (_d("none", generation=5), 0, "no action"),
])
def test_rank_ignores_what_is_not_ahead_of_it(decision, generation, why):
    plan = plan_rank(decision, _me(), generation)
    assert plan.action is RankAction.IGNORE and why in plan.why
    assert (plan.generation, plan.rank, plan.world_size, plan.exit_status) == (generation, 0, 2,
                                                                                None)


def test_rank_rejoins_at_the_decided_generation_with_its_seat_from_members():
    members = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node=NODE, local_rank=1)]
    d = _d("exclude_node_and_requeue", [0], ["dead"], members, generation=3)
    plan = plan_rank(d, _me(local_rank=1, rank=3, world=4), 2)
    assert (plan.action, plan.generation, plan.rank, plan.world_size) == (RankAction.REJOIN, 3, 1,
                                                                          2)
    d.world_size = 5  # the decision's world size wins over the number of members
    assert plan_rank(d, _me(local_rank=1, rank=3, world=4), 2).world_size == 5


def test_rank_without_a_seat_in_the_new_world_stops():
    members = [Member(rank=0, node="n1", local_rank=0)]
    d = _d("exclude_node_and_requeue", [1], [NODE], members)
    d.reason = "node lost"
    plan = plan_rank(d, _me(), 0)
    assert plan.action is RankAction.STOP and plan.exit_status == EXIT_STOPPED
    assert plan.why == f"this rank ({NODE}/0) was excluded: node lost"


def test_stop_carries_the_reason_or_says_who_stopped():
    d = _d("stop_job_notify_user")
    assert plan_rank(d, _me(), 0).why == "stopped by the remediator"
    d.reason = "retry budget spent"
    assert plan_rank(d, _me(), 0).why == "retry budget spent"


# ---- both sides against docs/protocol.md's executor table ---------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _doc_rows() -> dict[str, tuple[str, str]]:
    """action → (launcher cell, shim cell) of the executor table in docs/protocol.md."""
    section = DOC.read_text().split("\n## Executors", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in section.splitlines() if line.startswith("| action |"))
    assert header.split("|")[2:4] == [" launcher of every node ", " shim of every in-process rank "]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`(\w+)`[^|]*\|([^|]*)\|([^|]*)\|\s*$", line)
        if m:
            rows[m[1]] = (m[2].strip(), m[3].strip())
    return rows


KEPT = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node=NODE, local_rank=0),
        Member(rank=2, node=NODE, local_rank=1)]  # an exclusion elsewhere: this node shifts down
RUN_2 = [LocalRank(0, 2, True, True), LocalRank(1, 3, True, True)]
PLAIN_2 = [LocalRank(0, 2, True, False), LocalRank(1, 3, True, False)]

#: One entry per row of the doc's table: (decision, this node's ranks in process / plain, the
#: node plan of each (kill, start, rerank, exit status), the rank plan of local rank 0 in each,
#: words that cell of the doc must hold).
ROWS = {
    "restart_in_process": (
        _d("restart_in_process", [1]), RUN, PLAIN,
        ([], [], {}, None), ([0, 1], [(0, 0), (1, 1)], {}, None),
        (RankAction.REJOIN, 0), (RankAction.RESTART_GROUP, 0),
        ("SIGKILL", "warm spare", "generation"), ("rejoin",)),
    "restart_workers": (
        _d("restart_workers", [1]), RUN, PLAIN,
        ([1], [(1, 1)], {}, None), ([0, 1], [(0, 0), (1, 1)], {}, None),
        (RankAction.REJOIN, 0), (RankAction.RESTART_GROUP, 0),
        ("SIGKILL", "named ranks", "cannot rejoin"), ("abort", "rejoin")),
    "exclude_node_and_requeue": (
        _d("exclude_node_and_requeue", [0], ["dead"], KEPT), RUN_2, PLAIN_2,
        ([], [], {0: 1, 1: 2}, None), ([0, 1], [(0, 1), (1, 2)], {}, None),
        (RankAction.REJOIN, 1), (RankAction.RESTART_GROUP, 1),
        ("named nodes", "re-rank", "new rank"), ("rejoin", "members", "local rank")),
    "stop_job_notify_user": (
        _d("stop_job_notify_user"), RUN, PLAIN,
        ([0, 1], [], {}, EXIT_STOPPED), ([0, 1], [], {}, EXIT_STOPPED),
        (RankAction.STOP, 0), (RankAction.STOP, 0),
        ("kill workers", f"exit {EXIT_STOPPED}"), ("exit",)),
}


def test_every_row_of_the_doc_is_tested():
    assert sorted(_doc_rows()) == sorted(ROWS)


@pytest.mark.parametrize("action", sorted(ROWS))
def test_row_of_the_executor_table(action):
    (d, run, plain, node_run, node_plain, rank_run, rank_plain, launcher_words,
     shim_words) = ROWS[action]
    launcher_cell, shim_cell = _doc_rows()[action]
    assert all(w in launcher_cell for w in launcher_words), (launcher_words, launcher_cell)
    assert all(w in shim_cell for w in shim_words), (shim_words, shim_cell)
    for ranks, want_node, want_rank in ((run, node_run, rank_run), (plain, node_plain,
                                                                     rank_plain)):
        plan = plan_node(d, NODE, ranks)
        assert (sorted(plan.kill), plan.start, plan.rerank, plan.exit_status) == want_node
        r0 = ranks[0]
        rp = plan_rank(d, _me(r0.local_rank, r0.rank, 4, r0.in_process), 0)
        assert (rp.action, rp.rank) == want_rank
    # the exclusion's named node: its launcher stops (exit 0), its ranks have no seat
    if action == "exclude_node_and_requeue":
        named = _d(action, [2, 3], [NODE], KEPT[:1])
        assert plan_node(named, NODE, RUN_2).exit_status == 0
        assert plan_rank(named, _me(0, 2, 4), 0).action is RankAction.STOP


@pytest.mark.parametrize("decision, ranks", [
    (row[0], ranks) for row in ROWS.values() for ranks in (row[1], row[2])  # in process, plain
] + [
    (_d("restart_workers", [3]), [RUN[0], LocalRank(1, 1, True, False)]),
    (_d("exclude_node_and_requeue", [9], ["dead"], [Member(rank=0, node=NODE, local_rank=0)]),
     RUN),
])
def test_node_and_rank_plans_agree(decision, ranks):
    """Every live rank's own plan is what its launcher's plan does to it: a rank that rejoins
    keeps running (re-ranked as the launcher records it) unless the launcher replaces it under
    the same rank; a group restart is a start under the same rank; a stop is a kill."""
    plan = plan_node(decision, NODE, ranks)
    for r in ranks:
        rp = plan_rank(decision, _me(r.local_rank, r.rank, 4, r.in_process), 0)
        if rp.action is RankAction.STOP:
            assert r.local_rank in plan.kill and r.local_rank not in dict(plan.start)
        elif rp.action is RankAction.RESTART_GROUP:
            assert (r.local_rank, rp.rank) in plan.start
        else:
            assert rp.action is RankAction.REJOIN
            if r.local_rank in dict(plan.start):  # named: replaced by a fresh rank
                assert dict(plan.start)[r.local_rank] == rp.rank and r.local_rank in plan.kill
            else:
                assert plan.rerank.get(r.local_rank, r.rank) == rp.rank
                assert r.local_rank not in plan.kill

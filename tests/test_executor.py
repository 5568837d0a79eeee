"""What an executed decision means for one node's ranks (``trainguard.executor.plan_node``): the
executor table of docs/protocol.md, with and without ranks that rejoin in process."""
from __future__ import annotations

import pytest

from trainguard import schemas
from trainguard.schemas import Member
from trainguard.executor import EXIT_STOPPED, LocalRank, plan_node

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
    (_d("exclude_node_and_requeue", [0, 1], [NODE]), PLAIN, [0, 1], [], {}, 0),
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


def test_spare_node_starts_its_share_of_the_members():
    members = [Member(rank=0, node="n1", local_rank=0), Member(rank=1, node=NODE, local_rank=0)]
    plan = plan_node(_d("exclude_node_and_requeue", [1], ["dead"], members), NODE, [])
    assert (plan.kill, plan.start) == ([], [(0, 1)])


def test_a_node_that_runs_fewer_ranks_stops_the_others():
    members = [Member(rank=0, node=NODE, local_rank=0)]
    plan = plan_node(_d("exclude_node_and_requeue", [9], ["dead"], members), NODE, RUN)
    assert plan.kill == [1] and plan.start == []

"""What an executed decision means for one node's ranks (``plan_node``, the launcher's) and for
one rank (``plan_rank``, the shim's): pure, table-tested against the executor table of
``docs/protocol.md`` ("Executors").

A rank rejoins in process only when it runs ``trainguard.run`` (``in_process``: it told its
launcher so). Every other rank — an unmodified torchrun script, Lightning, Hugging Face, or a
``trainguard.run`` rank that has not reached the shim yet — cannot leave its process group and
join another one, so any recovery of the job restarts it from a warm spare: the whole worker
group of such a script restarts together, into the decision's generation, and the script
resumes from its own checkpoint (as under torchrun, without the interpreter start-up).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from trainguard import schemas

__all__ = ["EXIT_STOPPED", "LocalRank", "NodePlan", "plan_node", "ThisRank", "RankAction",
           "RankPlan", "plan_rank"]

#: Exit status of a launcher (and a rank) stopped by a decision.
EXIT_STOPPED = 3


@dataclass(frozen=True)
class LocalRank:
    """One live or dead rank of this node, as the launcher knows it."""

    local_rank: int
    rank: int
    alive: bool = True
    in_process: bool = False


@dataclass
class NodePlan:
    """What the launcher does: SIGKILL ``kill`` (local ranks), then start ``start``
    (``(local_rank, rank)`` pairs) at the decision's generation, tell the live ranks in
    ``rerank`` their new rank; with ``exit_status`` set, stop every rank and end with it."""

    kill: list[int] = field(default_factory=list)
    start: list[tuple[int, int]] = field(default_factory=list)
    rerank: dict[int, int] = field(default_factory=dict)
    exit_status: int | None = None
    why: str = ""

    @property
    def empty(self) -> bool:
        return not (self.kill or self.start or self.rerank) and self.exit_status is None


def plan_node(d: schemas.Decision, node: str, ranks: list[LocalRank],
              min_world_size: int = 1) -> NodePlan:
    """The plan of ``node`` for executed decision ``d`` given its ranks.

    * ``stop_job_notify_user``: stop, exit ``EXIT_STOPPED``.
    * ``exclude_node_and_requeue`` naming this node: stop, exit 0 (the job goes on elsewhere);
      when it leaves no node at all (world 0: the job ran on this node alone and the scheduler
      requeues it), stop the ranks and wait, as below: exiting would end the job's only step,
      and with it the job, before its requeue.
    * ``exclude_node_and_requeue`` leaving a world below the job's ``min_world_size`` (the
      policy chose it because the scheduler requeues the job without the node): stop the
      ranks, and nothing else — the launch waits for its scheduler to end it (Slurm's requeue
      signals it) rather than end its part of the job first.
    * any other recovery: the ranks this node must run are ``d.members`` on it (or the current
      ones); a named rank (``restart_workers``), a dead one, and every rank that cannot rejoin
      in process are killed and started again; the others keep running under their new rank.
    * ``none``: nothing.
    """
    if d.action == "none":
        return NodePlan()
    if d.action == "stop_job_notify_user":
        return NodePlan(kill=[r.local_rank for r in ranks if r.alive],
                        exit_status=EXIT_STOPPED, why="workers stopped")
    if d.action == "exclude_node_and_requeue" and node in d.nodes and not d.members \
            and d.world_size == 0:
        return NodePlan(kill=[r.local_rank for r in ranks if r.alive],
                        why=f"node {node} excluded, and no node of the job is left: workers "
                            f"stopped; the scheduler requeues the job elsewhere")
    if d.action == "exclude_node_and_requeue" and node in d.nodes:
        return NodePlan(kill=[r.local_rank for r in ranks if r.alive], exit_status=0,
                        why=f"node {node} excluded: workers stopped")
    if d.action == "exclude_node_and_requeue" and 0 < d.world_size < min_world_size:
        return NodePlan(kill=[r.local_rank for r in ranks if r.alive],
                        why=f"a world of {d.world_size} < min_world_size {min_world_size}: "
                            f"workers stopped; the scheduler requeues the job")
    by_local = {r.local_rank: r for r in ranks}
    wanted = ([(m.local_rank, m.rank) for m in d.members if m.node == node] if d.members
              else [(r.local_rank, r.rank) for r in ranks])
    named = set(d.ranks) if d.action == "restart_workers" else set()
    plan = NodePlan()
    keep = {lr for lr, _ in wanted}
    for r in ranks:  # ranks this node no longer runs (re-ranked away): stop them
        if r.alive and r.local_rank not in keep:
            plan.kill.append(r.local_rank)
    for lr, rank in wanted:
        cur = by_local.get(lr)
        if cur is not None and cur.alive and cur.in_process and cur.rank not in named:
            if cur.rank != rank:
                plan.rerank[lr] = rank
            continue
        if cur is not None and cur.alive:
            plan.kill.append(lr)
        plan.start.append((lr, rank))
    group = [lr for lr, _ in plan.start if lr in by_local and not by_local[lr].in_process
             and by_local[lr].rank not in named and by_local[lr].alive]
    parts = []
    if plan.start:
        parts.append("started " + ", ".join(f"rank {rk} (local {lr})" for lr, rk in plan.start))
    if group:
        parts.append(f"local rank(s) {', '.join(map(str, group))} restarted with the worker "
                     f"group: a script that does not run under trainguard.run cannot restart "
                     f"in process, so its processes are replaced")
    plan.why = "; ".join(parts)
    return plan


@dataclass(frozen=True)
class ThisRank:
    """One rank as it knows itself: where it runs (``node``, ``local_rank``: what ``members``
    are looked up by), its rank and world in the generation it is in, and whether it rejoins in
    process (it runs ``trainguard.run``)."""

    node: str
    local_rank: int
    rank: int
    world_size: int
    in_process: bool = True


class RankAction(StrEnum):
    """What a rank does with a decision (the shim's column of the executor table)."""

    IGNORE = "ignore"                # not executed, no recovery, or for a generation not ahead
    REJOIN = "rejoin"                # abort its groups, rejoin in process at ``generation``
    RESTART_GROUP = "restart_group"  # cannot rejoin: its launcher restarts it with its group
    STOP = "stop"                    # the job stops, or this rank was excluded: exit


@dataclass(frozen=True)
class RankPlan:
    """``plan_rank``'s answer: ``action``, and the ``generation``, ``rank`` and ``world_size``
    the rank has after it (unchanged for IGNORE and STOP); ``why`` says why in words (for
    STOP, the reason ``JobStopped`` carries)."""

    action: RankAction
    generation: int
    rank: int
    world_size: int
    why: str = ""

    @property
    def exit_status(self) -> int | None:
        """The rank's exit status: ``EXIT_STOPPED`` for STOP, else None (it goes on)."""
        return EXIT_STOPPED if self.action is RankAction.STOP else None


def plan_rank(d: schemas.Decision, me: ThisRank, generation: int) -> RankPlan:
    """What decision ``d`` means for rank ``me``, now in ``generation``.

    * not executed (observe mode), ``none``, or for a generation not after ``generation``:
      IGNORE (stale: e.g. a decision the rank already carried out, replayed from the stream);
    * ``stop_job_notify_user``: STOP with ``d.reason``;
    * a rank that cannot rejoin in process (``me.in_process`` False): RESTART_GROUP — its
      launcher kills it and starts it again with its worker group (``plan_node``);
    * a new world (``d.members``): this rank's seat is the member with its node and local rank;
      none: STOP (excluded); else REJOIN with that member's rank and ``d.world_size`` (or the
      number of members);
    * any other recovery: REJOIN at ``d.generation`` with the same rank and world.
    """
    if not d.execute or d.action == "none" or d.generation <= generation:
        why = ("not executed" if not d.execute else "no action" if d.action == "none" else
               f"generation {d.generation} is not after {generation}")
        return RankPlan(RankAction.IGNORE, generation, me.rank, me.world_size, why)
    if d.action == "stop_job_notify_user":
        return RankPlan(RankAction.STOP, generation, me.rank, me.world_size,
                        d.reason or "stopped by the remediator")
    rank, world = me.rank, me.world_size
    if d.members:
        mine = [m for m in d.members if m.node == me.node and m.local_rank == me.local_rank]
        if not mine:
            return RankPlan(RankAction.STOP, generation, me.rank, me.world_size,
                            f"this rank ({me.node}/{me.local_rank}) was excluded: {d.reason}")
        rank, world = mine[0].rank, d.world_size or len(d.members)
    if not me.in_process:
        return RankPlan(RankAction.RESTART_GROUP, d.generation, rank, world,
                        "restarted by its launcher with its worker group (no in-process "
                        "restart)")
    return RankPlan(RankAction.REJOIN, d.generation, rank, world,
                    f"rejoin in process as rank {rank} of {world}")

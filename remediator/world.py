"""The new world after a decision: which nodes host which ranks. Pure.

``new_world`` renumbers the members of a job after excluding nodes and bringing in spares; the
helpers map between culprit ranks and their nodes in a job's ``members`` list
(``[{"rank", "node", "local_rank"}]``, ``StateStore.job``).
"""
from __future__ import annotations

from typing import Any

from trainguard.schemas import Member


def nodes_of(ranks: list[int], members: list[dict[str, Any]]) -> list[str]:
    """The nodes (sorted) that host ``ranks`` in ``members``."""
    by_rank = {int(m["rank"]): str(m["node"]) for m in members if "rank" in m and "node" in m}
    return sorted({by_rank[r] for r in ranks if r in by_rank})


def ranks_on(nodes: list[str], members: list[dict[str, Any]]) -> list[int]:
    """The ranks (sorted) that ``members`` places on ``nodes``."""
    return sorted(int(m["rank"]) for m in members if m.get("node") in nodes)


def new_world(members: list[dict[str, Any]], exclude: list[str], spares: list[str],
              nproc_per_node: int = 0) -> tuple[list[Member], list[str]]:
    """Members after excluding ``exclude`` nodes: survivors keep their relative order (old rank,
    which for a standard launch is (node rank, local rank) order), then one spare per excluded
    node (in ``spares`` order) takes that node's local ranks; ranks renumbered 0..n-1.

    Returns ``(members, spares_used)``. ``nproc_per_node`` gives a spare's rank count when the
    excluded node's members are unknown.
    """
    survivors = sorted((m for m in members if m.get("node") not in exclude),
                       key=lambda m: int(m["rank"]))
    world = [(str(m["node"]), int(m.get("local_rank", 0))) for m in survivors]
    used: list[str] = []
    available = [s for s in spares if s not in exclude and s not in {n for n, _ in world}]
    for node in exclude:
        if not available:
            break
        spare = available.pop(0)
        locals_ = sorted(int(m.get("local_rank", 0)) for m in members if m.get("node") == node)
        if not locals_:
            locals_ = list(range(nproc_per_node))
        if not locals_:
            continue
        world += [(spare, lr) for lr in locals_]
        used.append(spare)
    return [Member(rank=i, node=n, local_rank=lr) for i, (n, lr) in enumerate(world)], used

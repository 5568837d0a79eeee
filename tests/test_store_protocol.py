"""``ReducerStore``: the state calls the reducers make, answered by the Valkey store and by the
replays' in-memory store under the same names and parameters; the in-memory store's claim
semantics are the live store's."""
from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

from trainguard.clients.store import StateStore
from trainguard.clients.store_protocol import ReducerStore
from trainguard.tools.memstore import MemoryStore

ROOT = Path(__file__).resolve().parent.parent
#: the folders of the reducers a replay runs (detector, attributor, remediator)
REDUCERS = ("detector", "attributor", "remediator")


def _members() -> list[str]:
    return sorted(n for n, v in vars(ReducerStore).items()
                  if callable(v) and not n.startswith("_"))


def _state_calls() -> set[str]:
    """Every method a reducer names on the state store: ``store("m", …)`` and
    ``Call("state", "m", …)``, found in the source (lazy and nested calls too)."""
    found: set[str] = set()
    for folder in REDUCERS:
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                    continue
                args = [a.value for a in node.args if isinstance(a, ast.Constant)]
                if node.func.id == "store" and args and isinstance(node.args[0], ast.Constant):
                    found.add(args[0])
                elif node.func.id == "Call" and args[:1] == ["state"] and len(args) > 1:
                    found.add(args[1])
    return found


def test_the_scan_finds_the_reducers_calls():
    calls = _state_calls()
    assert {"claim", "commit_decision", "job_records", "fault_history", "put_breaker"} <= calls


def test_every_state_call_of_a_reducer_is_in_the_protocol():
    missing = sorted(_state_calls() - set(_members()))
    assert not missing, f"add these to ReducerStore and to both stores: {missing}"


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("store", [StateStore, MemoryStore], ids=["valkey", "memory"])
@pytest.mark.parametrize("name", _members())
def test_both_stores_answer_each_call_with_its_parameters(store, name):
    fn = getattr(store, name, None)
    assert fn is not None, f"{store.__name__} has no {name}"
    assert _params(fn) == _params(getattr(ReducerStore, name)), name
    assert inspect.iscoroutinefunction(fn) == (store is StateStore), name


def test_a_claim_passes_on_only_from_its_holder_in_both_stores(redis_db):
    """``take_claim`` compare-and-set: the same answers from Valkey and from the replay's
    dictionaries."""
    async def answers(st) -> list:
        async def call(name, *args):
            res = getattr(st, name)(*args)
            return await res if asyncio.iscoroutine(res) else res

        return [await call("claim", "j:v1", "r1/v1"),
                await call("take_claim", "j:v1", "r0/v1", "r2/v1"),  # not its holder
                await call("take_claim", "j:v1", "r1/v1", "r2/v1"),  # its holder: passes
                await call("claimed_by", "j:v1"),
                await call("take_claim", "j:v9", "r1/v9", "r2/v9")]  # nobody holds it

    async def both():
        live = StateStore(redis_db)
        try:
            return await answers(live), await answers(MemoryStore())
        finally:
            await live.close()

    live, mem = asyncio.run(both())
    assert live == mem == [None, "r1/v1", None, "r2/v1", None]

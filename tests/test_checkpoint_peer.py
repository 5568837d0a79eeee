"""The peer transfer on a real 3-rank gloo group (forked ranks): two survivors hand their
state, generators included, to a new rank; a transfer that arrives damaged, or survivors that
disagree, send every rank to the checkpoint instead."""
from __future__ import annotations

import json
import os
import traceback

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _rank(rank: int, port: int, scenario: str, out: str) -> None:
    import torch.distributed as dist

    from trainguard.checkpoint import live as L
    from trainguard.checkpoint import statedict

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    group = dist.new_group(backend="gloo")
    prev = None
    if rank != 1:  # survivors: trained 6 steps alike (rank 2 differently in "disagree")
        m, opt = _model(0)
        for s in range(6):
            g = torch.Generator().manual_seed(s + (100 if scenario == "disagree" and rank == 2
                                                   else 0))
            opt.zero_grad()
            m(torch.randn(4, 8, generator=g)).sum().backward()
            opt.step()
        prev = L.LiveState(m, opt)
        prev.mark(5)
    if scenario == "damaged" and rank == 1:
        real = statedict.apply_state

        def damaged(model, optimizer, sd):
            real(model, optimizer, sd)
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1.0

        L.statedict.apply_state = damaged
    torch.manual_seed(1000 + rank)  # the new generation's script seeds as it likes
    new_m, new_opt = _model(7)
    live = L.LiveState(new_m, new_opt)
    plan = L.peer_restore(live, prev, rank, 3, group)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"path": plan.path, "step": plan.step, "receivers": list(plan.receivers),
                   "reason": plan.reason, "digest": live.digest(),
                   "rand": torch.rand(3).tolist()}, fh)
    dist.destroy_process_group()


def _job(tmp_path, scenario: str) -> list[dict]:
    from trainguard.stack.process import free_port

    port, out, pids = free_port(), str(tmp_path / scenario), []
    for r in range(3):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank(r, port, scenario, out)
            except BaseException:  # noqa: BLE001 - say why, then leave the fork
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert codes == [0, 0, 0]
    return [json.load(open(f"{out}.{r}")) for r in range(3)]


def test_survivors_send_their_state_and_generators_to_the_new_rank(tmp_path):
    res = _job(tmp_path, "ok")
    assert {r["path"] for r in res} == {"peer"}
    assert all(r["step"] == 5 and r["receivers"] == [1] for r in res)
    assert len({r["digest"] for r in res}) == 1  # the same model and optimizer everywhere
    # the generators continue where the survivors' stood at step 5, on the new rank too
    assert res[0]["rand"] == res[1]["rand"] == res[2]["rand"]


def test_a_damaged_transfer_sends_everyone_to_the_checkpoint(tmp_path):
    res = _job(tmp_path, "damaged")
    assert {r["path"] for r in res} == {"checkpoint"}
    assert all("rank 1: the state it holds now fails the agreed digest" in r["reason"]
               for r in res), res[0]["reason"]


def test_survivors_that_disagree_send_everyone_to_the_checkpoint(tmp_path):
    res = _job(tmp_path, "disagree")
    assert {r["path"] for r in res} == {"checkpoint"}
    assert all("disagree on the state of step 5" in r["reason"] for r in res)

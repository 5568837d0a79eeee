"""The replicas' decisions, table-tested: the recovery plan from the survivors' reports, the
certificate of a save (digest comparison, suspects, stale state), the state digest, and the
live state's bookkeeping (clean after a mark, dirty once an optimizer step began; generators
captured and put back)."""
from __future__ import annotations

import random

import pytest
import torch

from trainguard.checkpoint.live import LiveState, apply_rng, capture_rng, rng_digest
from trainguard.checkpoint.replicas import NO_STATE, Report, certify, plan_recovery, state_digest

R = Report

# (name, reports, world, want path, want step, want src, want receivers, reason contains)
PLANS = [
    ("fresh job: nobody holds state", [R(0), R(1)], 2, "checkpoint", NO_STATE, None, (),
     "no surviving replica"),
    ("one rank replaced: the survivors send it", [R(0, 41, "d", "r"), R(1), R(2, 41, "d", "r")],
     3, "peer", 41, 0, (1,), "2 of 3 ranks hold step 41"),
    ("rank 0 replaced: the lowest survivor sends", [R(0), R(1, 7, "d", "r"), R(2, 7, "d", "r")],
     3, "peer", 7, 1, (0,), "sent to ranks [0]"),
    ("exception before its optimizer step: that rank is one step behind and receives",
     [R(0, 300, "a", "r"), R(1, 300, "a", "r"), R(2, 299, "b", "r"), R(3, 300, "a", "r")], 4,
     "peer", 300, 0, (2,), "3 of 4"),
    ("every rank kept the same state: nothing to send", [R(0, 5, "d", "r"), R(1, 5, "d", "r")],
     2, "peer", 5, 0, (), "2 of 2"),
    ("single survivor of two: a complete replica", [R(0, 9, "d", "r"), R(1)], 2, "peer", 9, 0,
     (1,), "1 of 2"),
    ("survivors disagree at the newest step: checkpoint",
     [R(0, 9, "d", "r"), R(1, 9, "e", "r"), R(2)], 3, "checkpoint", NO_STATE, None, (),
     "disagree on the state of step 9"),
    ("a dirty rank holds nothing", [R(0, why="an optimizer step began after step 3"), R(1)], 2,
     "checkpoint", NO_STATE, None, (), "optimizer step began"),
    ("reports missing a rank: checkpoint", [R(0, 3, "d", "r")], 2, "checkpoint", NO_STATE, None,
     (), "do not cover the world"),
]


@pytest.mark.parametrize("name,reports,world,path,step,src,receivers,why", PLANS,
                         ids=[p[0] for p in PLANS])
def test_plan_recovery(name, reports, world, path, step, src, receivers, why):
    plan = plan_recovery(reports, world)
    assert (plan.path, plan.step, plan.src, plan.receivers) == (path, step, src, receivers)
    assert why in plan.reason
    if path == "peer":
        assert plan.next_step == step + 1 and plan.digest


def test_plan_sends_only_the_generators_every_source_holds_alike():
    same = plan_recovery([R(0, 3, "d", "torch=a;random=b"), R(1, 3, "d", "torch=a;random=b"),
                          R(2)], 3)
    assert same.rng_shared == ("random", "torch") and "differ" not in same.reason
    # Python's generator seeded from entropy in each process: torch's still goes
    mixed = plan_recovery([R(0, 3, "d", "torch=a;random=b"), R(1, 3, "d", "torch=a;random=c"),
                           R(2)], 3)
    assert mixed.path == "peer" and mixed.rng_shared == ("torch",)
    assert "generators ['random'] differ" in mixed.reason


# (name, digests, step, previous, ok, suspects, stale)
CERTS = [
    ("all equal", ["a", "a", "a"], 20, None, True, (), False),
    ("one of three flipped: the minority is the suspect", ["a", "b", "a"], 20, None, False,
     (1,), False),
    ("two replicas disagree: both suspects", ["a", "b"], 20, None, False, (0, 1), False),
    ("two against two: all suspects", ["a", "b", "a", "b"], 20, None, False, (0, 1, 2, 3),
     False),
    ("same state as the previous save, step advanced: stale", ["a", "a"], 40, (20, "a"), False,
     (), True),
    ("same step saved again (after a restore): not stale", ["a", "a"], 20, (20, "a"), True, (),
     False),
    ("state changed since the previous save", ["b", "b"], 40, (20, "a"), True, (), False),
    ("sharded state: nothing to compare", [None, None], 40, (20, "a"), True, (), False),
    ("single rank: stale detection still works", ["a"], 40, (20, "a"), False, (), True),
]


@pytest.mark.parametrize("name,digests,step,prev,ok,suspects,stale", CERTS,
                         ids=[c[0] for c in CERTS])
def test_certify(name, digests, step, prev, ok, suspects, stale):
    c = certify(digests, step, prev)
    assert (c.ok, c.suspects, c.stale) == (ok, suspects, stale)
    assert bool(c.reasons) == (not ok)
    if suspects:
        assert "silent data corruption" in c.reasons[0]


def _flat(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    return {"model.weight": m.weight.detach().clone(), "model.bias": m.bias.detach().clone(),
            "optimizer.param_groups.0.lr": 0.1, "optimizer.state.step": torch.tensor(3.0)}


def test_state_digest_sees_one_flipped_bit_and_nothing_else():
    a, b = _flat(), _flat()
    assert state_digest(a) == state_digest(b)
    assert state_digest(dict(reversed(list(a.items())))) == state_digest(a)  # key order
    w = b["model.weight"].view(-1).view(torch.int32)
    w[5] ^= 1 << 7  # one bit of one float
    assert state_digest(a) != state_digest(b)
    c = _flat()
    c["optimizer.param_groups.0.lr"] = 0.2
    assert state_digest(c) != state_digest(a)
    d = _flat()
    d["model.bias"] = d["model.bias"].double()  # same values, another dtype
    assert state_digest(d) != state_digest(a)


def test_live_state_is_dirty_once_an_optimizer_step_began():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    live = LiveState(m, opt)
    assert live.report(0).step == NO_STATE  # nothing completed yet
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    live.mark(0, 1.5)
    r = live.report(0)
    assert r.holds and r.step == 0 and r.digest == live.digest()
    m(torch.randn(3, 4)).sum().backward()  # step 1 began: forward and backward change nothing
    assert live.report(0).holds
    opt.step()  # its optimizer step ran, but step 1 was never marked complete
    r = live.report(0)
    assert not r.holds and "optimizer step began after step 0" in r.why
    live.mark(1)
    assert live.report(0).holds
    live.close()
    opt.step()  # hooks gone: no more counting
    assert live.clean()


def test_generators_are_captured_and_put_back():
    np = pytest.importorskip("numpy")
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    snap = capture_rng()
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(100), random.random(), np.random.rand(7)  # move every generator on
    apply_rng(snap)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
    assert rng_digest(snap) != rng_digest(capture_rng())  # the generators moved since


def test_take_copies_the_kept_state_into_a_new_model():
    torch.manual_seed(0)
    old = torch.nn.Linear(4, 2)
    old_opt = torch.optim.SGD(old.parameters(), lr=0.1, momentum=0.9)
    old(torch.randn(3, 4)).sum().backward()
    old_opt.step()
    prev = LiveState(old, old_opt)
    prev.mark(0)
    torch.manual_seed(5)
    new = torch.nn.Linear(4, 2)
    new_opt = torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9)
    live = LiveState(new, new_opt)
    assert live.digest() != prev.digest()
    live.take(prev)
    assert live.digest() == prev.digest()

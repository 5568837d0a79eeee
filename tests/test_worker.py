"""The worker shim in one process: it never needs the bus to train, restarts ``train_fn`` in
process after a fault (here with the bus gone, on its own after the decision timeout), and in
observe mode lets the fault through untouched."""
from __future__ import annotations

import time

import pytest

import trainguard
from trainguard.rank.shim import WorkerConfig


def _cfg(**kw) -> WorkerConfig:
    base = dict(job="unit", node="n0", world_size=1, nats_url="nats://127.0.0.1:9",
                decision_timeout_s=0.2, heartbeat_interval_s=0.05)
    base.update(kw)
    return WorkerConfig(**base)


def test_trains_without_a_bus():
    seen = []

    def train(ctx):
        for step in range(5):
            ctx.progress(step, loss=1.0 / (step + 1))
            seen.append(step)
        return "done"

    t0 = time.perf_counter()
    assert trainguard.run(train, _cfg()) == "done"
    assert seen == [0, 1, 2, 3, 4]
    assert time.perf_counter() - t0 < 10  # a missing bus does not hold training up


def test_restarts_in_process_after_an_exception():
    calls = []

    def train(ctx):
        calls.append((ctx.generation, ctx.restarts))
        if len(calls) == 1:
            ctx.progress(0)
            raise RuntimeError("first attempt fails")
        ctx.progress(1)
        return ctx.generation

    assert trainguard.run(train, _cfg(mode="action")) == 1
    assert calls == [(0, 0), (1, 1)]  # same process, next generation


def test_observe_mode_lets_the_fault_through():
    def train(ctx):
        raise ValueError("user bug")

    with pytest.raises(ValueError, match="user bug"):
        trainguard.run(train, _cfg(mode="observe"))


def test_config_from_torchrun_environment():
    cfg = WorkerConfig.from_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.1.1",
                                 "MASTER_PORT": "29500", "TG_JOB": "j"})
    assert (cfg.rank, cfg.local_rank, cfg.world_size, cfg.local_world_size) == (3, 1, 4, 2)
    assert cfg.rdzv_endpoint == "10.1.1.1:29500" and cfg.job == "j"

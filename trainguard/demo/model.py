"""The demo job's model and data: a small MLP on scikit-learn's bundled handwritten digits
(``sklearn.datasets.load_digits``: 1,797 8×8 images, shipped inside the package, nothing
downloaded).

The global batch of step ``s`` is a fixed function of (seed, s) and is split evenly across ranks,
so the averaged DDP gradient equals the single-process gradient of the same global batch: the
training math does not depend on the world size (1, 2, 3, 4 or 6 ranks with ``GLOBAL_BATCH`` 96),
and a fault-free single-process run with the same seed is the reference for accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GLOBAL_BATCH = 96


@dataclass
class Digits:
    x_train: torch.Tensor  # (N, 64) float32, scaled to [0, 1]
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor


def load(seed: int = 0, test_fraction: float = 0.25) -> Digits:
    """The digits split into train/test with a fixed permutation of ``seed``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.from_numpy(np.random.RandomState(seed).permutation(len(y)))
    n_test = int(len(y) * test_fraction)
    te, tr = perm[:n_test], perm[n_test:]
    return Digits(x[tr], y[tr], x[te], y[te])


def build(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """The MLP, initialised from ``seed`` (which also seeds torch's global generator: every rank
    draws the same dropout masks). ``dropout`` > 0 adds a dropout layer, whose masks come from
    that generator: a run is then only reproduced when the generator's state is too."""
    torch.manual_seed(seed)
    drop = [nn.Dropout(dropout)] if dropout > 0 else []
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *drop, nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(data: Digits, seed: int, step: int, rank: int, world_size: int):
    """This rank's share of the global batch of ``step`` (``GLOBAL_BATCH // world_size`` rows)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randperm(len(data.y_train), generator=g)[:GLOBAL_BATCH]
    mine = idx[rank::world_size]
    return data.x_train[mine], data.y_train[mine]


@torch.no_grad()
def accuracy(model: nn.Module, data: Digits) -> float:
    model.eval()
    pred = model(data.x_test).argmax(dim=1)
    model.train()
    return float((pred == data.y_test).float().mean())


def train_reference(steps: int, seed: int = 0) -> float:
    """Fault-free single-process training with the same math; returns test accuracy."""
    data = load(seed)
    model = build(seed)
    opt = optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = batch(data, seed, step, 0, 1)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return accuracy(model, data)

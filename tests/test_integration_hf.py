"""The Hugging Face integration with a real ``transformers.Trainer`` on a tiny BERT built in
code (no downloads): what the callback reports through ``trainguard.rank.hooks``, and
``resume_from_checkpoint`` skipping incomplete or damaged ``checkpoint-N`` directories.

The end-to-end test (a 2-rank ``Trainer.train`` under ``trainguard launch``, rank 1 killed) is
in ``test_integration_e2e.py``."""
from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trainguard.rank import hooks  # noqa: E402
from trainguard.integrations.huggingface import (TrainguardCallback,  # noqa: E402
                                                 checkpoint_complete, resume_from_checkpoint)


class Recorder:
    def __init__(self):
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.phases: list[str] = []

    def report(self, step=None, loss=None):
        if step is not None:
            self.steps.append(step)
        if loss is not None:
            self.losses.append(loss)


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(hooks, "active", lambda: True)
    monkeypatch.setattr(hooks, "report", r.report)
    monkeypatch.setattr(hooks, "phase", lambda name: r.phases.append(name))
    r.restored = []
    monkeypatch.setattr(hooks, "restored", r.restored.append)
    return r


class Data(torch.utils.data.Dataset):
    """Sequences whose label is whether token 1 occurs in them; made in code."""

    def __init__(self, n=64, length=12, vocab=50):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(2, vocab, (n, length), generator=g)
        self.x[::2, 3] = 1
        self.y = (self.x == 1).any(dim=1).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]),
                "labels": self.y[i]}


def _model():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def _trainer(out, max_steps, cb=None, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_steps=1, save_steps=2, report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=0, **kw)
    return transformers.Trainer(model=_model(), args=args, train_dataset=Data(),
                                callbacks=[cb] if cb else [])


def test_callback_reports_steps_losses_and_the_checkpoint_phase(rec, tmp_path):
    cb = TrainguardCallback()
    t = _trainer(tmp_path / "out", 6, cb)
    t.train()
    assert rec.steps == [0, 1, 2, 3, 4, 5]
    logged = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert len(logged) == 6 and rec.losses == pytest.approx(logged)
    assert rec.phases[0] == "startup"
    assert rec.phases.count("checkpoint") == 3  # saves at steps 2, 4, 6
    assert cb.resumed_step == 0


def test_callback_does_nothing_outside_trainguard(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(hooks, "report", lambda *a, **k: calls.append(a))
    assert not hooks.active()
    _trainer(tmp_path / "out", 2, TrainguardCallback(), save_strategy="no").train()
    assert calls == []


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 6 steps with checkpoints at steps 2, 4 and 6 (copied per test)."""
    out = tmp_path_factory.mktemp("hf") / "out"
    _trainer(out, 6).train()
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return out


@pytest.fixture
def out(trained, tmp_path):
    d = tmp_path / "out"
    shutil.copytree(trained, d)
    return d


def _flip(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_resume_takes_the_newest_complete_checkpoint(out, capsys):
    assert resume_from_checkpoint(str(out)) == str(out / "checkpoint-6")
    assert checkpoint_complete(str(out / "checkpoint-6")) == (True, "")
    # a save killed before the Trainer wrote trainer_state.json
    os.remove(out / "checkpoint-6" / "trainer_state.json")
    assert resume_from_checkpoint(str(out)) == str(out / "checkpoint-4")
    assert "checkpoint-6: no trainer_state.json" in capsys.readouterr().err
    # a truncated optimizer state
    p = out / "checkpoint-4" / "optimizer.pt"
    os.truncate(p, os.path.getsize(p) // 2)
    assert resume_from_checkpoint(str(out)) == str(out / "checkpoint-2")
    # a flipped byte in the optimizer state (CRC-32), then a truncated weights file
    _flip(out / "checkpoint-2" / "optimizer.pt")
    ok, why = checkpoint_complete(str(out / "checkpoint-2"))
    assert not ok and "optimizer.pt" in why
    assert resume_from_checkpoint(str(out)) is None
    assert resume_from_checkpoint(str(out / "nothing-here")) is None


def test_truncated_weights_and_missing_rng_are_told_apart(out):
    p = out / "checkpoint-6" / "model.safetensors"
    os.truncate(p, os.path.getsize(p) - 8)
    ok, why = checkpoint_complete(str(out / "checkpoint-6"))
    assert not ok and "model.safetensors" in why and "truncated" in why
    # the Trainer itself tolerates a missing RNG file: so does the check
    os.remove(out / "checkpoint-4" / "rng_state.pth")
    assert checkpoint_complete(str(out / "checkpoint-4")) == (True, "")


def test_trainer_resumes_from_the_helpers_choice(rec, out):
    os.remove(out / "checkpoint-6" / "trainer_state.json")
    cb = TrainguardCallback()
    t = _trainer(out, 8, cb)
    t.train(resume_from_checkpoint=resume_from_checkpoint(str(out)))
    assert cb.resumed_step == 4
    assert rec.restored == [3]  # the checkpoint of 4 completed steps: 0-3
    assert rec.steps == [4, 5, 6, 7]
    assert t.state.global_step == 8
    assert checkpoint_complete(str(out / "checkpoint-6"))[0]  # written again, whole this time

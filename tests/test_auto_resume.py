"""``trainguard.rank.auto_resume`` and ``trainguard.rank.framework_checkpoints`` with real Lightning
and Hugging Face Trainers in this process (one device, no launcher): in a restart generation a
``fit``/``train`` given no checkpoint resumes from the newest complete one, skipping incomplete
ones (zero-byte, truncated) with a line that says why; not on a first start, not when turned
off, not when the script chose its own. The 2-rank end-to-end course is in
``test_framework_restart_e2e.py``."""
from __future__ import annotations

import os
import shutil

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from trainguard.rank import auto_resume  # noqa: E402
from trainguard.rank.framework_checkpoints import (checkpoint_complete,  # noqa: E402
                                                 newest_hf_checkpoint,
                                                 newest_lightning_checkpoint)


@pytest.fixture(autouse=True)
def restart_env(monkeypatch):
    """A rank of restart 1; the wrappers installed and ready for their first call."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("TG_AUTO_RESUME", raising=False)
    monkeypatch.delenv("TG_GENERATION", raising=False)
    auto_resume.install()
    auto_resume._done.clear()
    yield
    auto_resume._done.clear()


# ---- Lightning --------------------------------------------------------------------------------
class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.start_step: int | None = None

    def training_step(self, batch, _i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self):
        self.start_step = int(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=8)


def _lightning(root, max_steps, dirpath=True):
    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt") if dirpath else None,
                                       every_n_train_steps=2, save_top_k=-1, save_last=True)
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root), callbacks=[ckpt],
                     max_steps=max_steps)


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    """Lightning's own checkpoints (no trainguard plugin) of steps 2, 4, 6 and ``last.ckpt``."""
    root = tmp_path_factory.mktemp("pl")
    os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    _lightning(root, 6).fit(Tiny(), _data())
    assert (root / "ckpt" / "last.ckpt").exists()
    return root


@pytest.fixture
def pl_root(lightning_run, tmp_path):
    shutil.copytree(lightning_run / "ckpt", tmp_path / "ckpt")
    return tmp_path


def test_newest_complete_lightning_checkpoint_skips_empty_and_truncated_files(pl_root, capsys):
    d = pl_root / "ckpt"
    (d / "epoch=0-step=8.ckpt").write_bytes(b"")  # killed before its first write
    data = (d / "epoch=0-step=6.ckpt").read_bytes()
    (d / "epoch=0-step=10.ckpt").write_bytes(data[: len(data) // 2])  # killed half-way
    path, step = newest_lightning_checkpoint([str(d)])
    assert step == 6 and os.path.basename(path) in ("last.ckpt", "epoch=0-step=6.ckpt")
    err = capsys.readouterr().err
    assert "epoch=0-step=8.ckpt: empty (0 bytes)" in err
    assert "epoch=0-step=10.ckpt: not a whole torch file" in err
    assert newest_lightning_checkpoint([str(pl_root / "none")]) == (None, None)


def test_a_restarted_fit_without_ckpt_path_resumes_and_says_so(pl_root, capsys):
    (pl_root / "ckpt" / "epoch=0-step=8.ckpt").write_bytes(b"")
    model = Tiny()
    _lightning(pl_root, 8).fit(model, _data())
    assert model.start_step == 6
    err = capsys.readouterr().err
    assert "trainguard: resuming from" in err and "(step 6)" in err
    # a second fit of the same script is its own: it is not redirected again
    model2 = Tiny()
    _lightning(pl_root, 2).fit(model2, _data())
    assert model2.start_step == 0


@pytest.mark.parametrize("env", [{"TG_AUTO_RESUME": "0"}, {"TORCHELASTIC_RESTART_COUNT": "0"}],
                         ids=["turned-off", "first-start"])
def test_no_resume_when_turned_off_or_on_a_first_start(pl_root, monkeypatch, env, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = Tiny()
    _lightning(pl_root, 2).fit(model, _data())
    assert model.start_step == 0
    assert "resuming from" not in capsys.readouterr().err


def test_the_scripts_own_ckpt_path_is_left_alone(pl_root):
    model = Tiny()
    _lightning(pl_root, 6).fit(model, _data(), ckpt_path=str(pl_root / "ckpt" /
                                                              "epoch=0-step=2.ckpt"))
    assert model.start_step == 2


def test_where_lightning_puts_checkpoints_without_a_dirpath(tmp_path):
    t = _lightning(tmp_path, 2, dirpath=False)
    assert auto_resume.lightning_dirs(t) == [str(tmp_path / "checkpoints")]


# ---- Hugging Face -----------------------------------------------------------------------------
class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(2, 50, (64, 12), generator=g)
        self.y = (self.x == 3).any(dim=1).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones_like(self.x[i]),
                "labels": self.y[i]}


class StartStep(transformers.TrainerCallback):
    def __init__(self):
        self.step: int | None = None

    def on_train_begin(self, args, state, control, **kw):
        self.step = int(state.global_step)


def _hf(out, max_steps, cb=None):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32, num_labels=2)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8,
        learning_rate=1e-3, save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
        seed=0, dataloader_num_workers=0, logging_strategy="no")
    return transformers.Trainer(model=transformers.BertForSequenceClassification(cfg),
                                args=args, train_dataset=Data(),
                                callbacks=[cb] if cb else [])


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "out"
    os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    _hf(out, 4).train()
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    return out


def test_a_zero_byte_shard_makes_a_checkpoint_incomplete(hf_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(hf_run, out)
    (out / "checkpoint-4" / "scheduler.pt").write_bytes(b"")
    ok, why = checkpoint_complete(str(out / "checkpoint-4"))
    assert not ok and "scheduler.pt" in why and "0 bytes" in why
    assert newest_hf_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_a_restarted_train_without_a_checkpoint_resumes_from_the_newest_complete(
        hf_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(hf_run, out)
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"")
    cb = StartStep()
    _hf(out, 6, cb).train()
    assert cb.step == 2
    err = capsys.readouterr().err
    assert f"not resuming from {out / 'checkpoint-4'}: empty files" in err
    assert f"resuming from {out / 'checkpoint-2'} (step 2)" in err


def test_a_train_turned_off_starts_from_step_0(hf_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(hf_run, out)
    monkeypatch.setenv("TG_AUTO_RESUME", "0")
    cb = StartStep()
    _hf(out, 2, cb).train()
    assert cb.step == 0

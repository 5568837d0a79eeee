"""The Lightning integration with a real ``lightning.pytorch.Trainer``: what the callback
reports through ``trainguard.rank.hooks``, and ``TrainguardCheckpointIO`` (staged async saves,
checksum verification, fallback past a damaged file).

The end-to-end test (a 2-rank DDP ``Trainer.fit`` under ``trainguard launch``, rank 1 killed)
is in ``test_integration_e2e.py``."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning.pytorch")

from trainguard.rank import hooks  # noqa: E402
from trainguard.rank import verified_file as _verified  # noqa: E402
from trainguard.integrations.lightning import (CorruptCheckpointError,  # noqa: E402
                                               TrainguardCallback, TrainguardCheckpointIO,
                                               newest_checkpoint)


class Recorder:
    def __init__(self):
        self.reports: list[tuple] = []
        self.phases: list[str] = []


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(hooks, "active", lambda: True)
    monkeypatch.setattr(hooks, "report", lambda step=None, loss=None: r.reports.append((step, loss)))
    monkeypatch.setattr(hooks, "phase", lambda name: r.phases.append(name))
    r.restored = []
    monkeypatch.setattr(hooks, "restored", r.restored.append)
    return r


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n=64, width=8, batch=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def _trainer(root, **kw):
    kw.setdefault("callbacks", [])
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=str(root), **kw)


def test_callback_reports_each_optimizer_step_with_its_loss(rec, tmp_path):
    cb = TrainguardCallback()
    model = Tiny()
    _trainer(tmp_path, max_steps=6, callbacks=[cb], enable_checkpointing=False).fit(model, _data())
    assert [s for s, _ in rec.reports] == [0, 1, 2, 3, 4, 5]
    assert [pytest.approx(x) for _, x in rec.reports] == model.losses
    assert rec.phases[0] == "startup"
    assert cb.resumed_step == 0


def test_callback_with_gradient_accumulation_reports_optimizer_steps(rec, tmp_path):
    model = Tiny()
    _trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, callbacks=[TrainguardCallback()],
             enable_checkpointing=False).fit(model, _data())
    assert len(model.losses) == 6
    assert [s for s, _ in rec.reports] == [0, 1, 2]
    # the loss of the micro-batch that completed each optimizer step
    assert [pytest.approx(x) for _, x in rec.reports] == model.losses[1::2]


def test_callback_does_nothing_outside_trainguard(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(hooks, "report", lambda *a, **k: calls.append(a))
    assert not hooks.active()
    _trainer(tmp_path, max_steps=2, callbacks=[TrainguardCallback()],
             enable_checkpointing=False).fit(Tiny(), _data())
    assert calls == []


def _ckpt_trainer(tmp_path, max_steps, cb=None, io=None, **mc):
    mc.setdefault("every_n_train_steps", 2)
    mc.setdefault("save_top_k", -1)
    mc.setdefault("save_last", True)
    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), **mc)
    io = io or TrainguardCheckpointIO()
    cbs = [ckpt] + ([cb] if cb else [])
    return _trainer(tmp_path, max_steps=max_steps, callbacks=cbs, plugins=[io]), io


def test_fit_saves_verified_checkpoints_and_resumes_from_last(rec, tmp_path):
    t, io = _ckpt_trainer(tmp_path, 6, TrainguardCallback())
    model = Tiny()
    t.fit(model, _data())
    d = tmp_path / "ckpt"
    names = sorted(os.listdir(d))
    ckpts = [n for n in names if n.endswith(".ckpt")]
    assert set(ckpts) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt",
                          "last.ckpt"}, names
    assert {n for n in names if not n.endswith(".ckpt")} == {c + ".tgsum" for c in ckpts}
    for c in ckpts:
        ok, why, side = _verified.verify(str(d / c))
        assert ok, why
    assert _verified.read_sidecar(str(d / "last.ckpt"))["meta"]["global_step"] == 6
    assert newest_checkpoint(d) in (str(d / "last.ckpt"), str(d / "epoch=0-step=6.ckpt"))
    assert len(io.saver.saves) == 6 and not io.saver.errors
    assert "checkpoint" in rec.phases

    # a new Trainer resumes from last.ckpt: at step 6, with the saved weights
    cb = TrainguardCallback()
    t2, io2 = _ckpt_trainer(tmp_path, 8, cb)
    model2 = Tiny()
    t2.fit(model2, _data(), ckpt_path="last")
    assert cb.resumed_step == 6
    assert rec.restored == [-1, 5]  # fresh, then the checkpoint of 6 completed steps (0-5)
    assert io2.loaded_path == str(d / "last.ckpt")
    assert len(model2.losses) == 2 and t2.global_step == 8
    assert "recovery" in rec.phases


def test_save_is_a_point_in_time_copy(tmp_path):
    """The file holds the values at the moment save_checkpoint returned, even when training
    changes the tensors in place while the background write runs."""
    io = TrainguardCheckpointIO()
    w = torch.arange(2_000_000, dtype=torch.float32)
    state = {"state_dict": {"w": w}, "global_step": 3, "epoch": 0, "nested": [{"t": w[:10]}]}
    p = str(tmp_path / "a.ckpt")
    io.save_checkpoint(state, p)
    w.mul_(-1)  # in place, right away
    io.teardown()
    got = io.load_checkpoint(p)
    assert torch.equal(got["state_dict"]["w"], torch.arange(2_000_000, dtype=torch.float32))
    assert torch.equal(got["nested"][0]["t"], torch.arange(10, dtype=torch.float32))
    assert got["global_step"] == 3
    # the next save reuses the staging buffers and writes the new values
    io.save_checkpoint(state, p)
    io.teardown()
    assert torch.equal(io.load_checkpoint(p)["state_dict"]["w"], w)
    assert io.saver.stager.held_bytes() == (2_000_000 + 10) * 4  # w and its slice: no growth


def _three(tmp_path):
    io = TrainguardCheckpointIO()
    d = tmp_path / "ck"
    for step in (2, 4, 6):
        io.save_checkpoint({"state_dict": {"w": torch.full((1000,), float(step))},
                            "global_step": step, "epoch": 0}, str(d / f"step={step}.ckpt"))
    io.teardown()
    return io, d


def _flip(path, at=None):
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(size // 2 if at is None else at)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_load_refuses_a_flipped_byte_and_falls_back(tmp_path, capsys):
    io, d = _three(tmp_path)
    _flip(d / "step=6.ckpt")
    ok, why, _ = _verified.verify(str(d / "step=6.ckpt"))
    assert not ok and "checksum" in why
    got = io.load_checkpoint(str(d / "step=6.ckpt"))
    assert got["global_step"] == 4 and io.loaded_path == str(d / "step=4.ckpt")
    assert "not loading" in capsys.readouterr().err
    assert newest_checkpoint(d) == str(d / "step=4.ckpt")


def test_load_refuses_a_truncated_file_and_falls_back(tmp_path):
    io, d = _three(tmp_path)
    p = d / "step=6.ckpt"
    os.truncate(p, os.path.getsize(p) - 100)
    ok, why, _ = _verified.verify(str(p))
    assert not ok and "truncated" in why
    assert io.load_checkpoint(str(p))["global_step"] == 4


def test_fallback_never_goes_past_the_rejected_step(tmp_path):
    io, d = _three(tmp_path)
    _flip(d / "step=4.ckpt")
    # step=6 is valid but newer than the one asked for: the fallback is step=2
    assert io.load_checkpoint(str(d / "step=4.ckpt"))["global_step"] == 2


def test_no_valid_checkpoint_left_raises(tmp_path):
    io, d = _three(tmp_path)
    for s in (2, 4, 6):
        _flip(d / f"step={s}.ckpt", at=10)
    with pytest.raises(CorruptCheckpointError, match="refusing to load"):
        io.load_checkpoint(str(d / "step=6.ckpt"))
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(str(d / "nope.ckpt"))


def test_file_without_sidecar_is_not_trusted(tmp_path):
    io, d = _three(tmp_path)
    torch.save({"global_step": 99}, d / "foreign.ckpt")  # e.g. Lightning's default writer
    assert io.load_checkpoint(str(d / "foreign.ckpt"))["global_step"] == 6
    os.remove(d / "step=6.ckpt.tgsum")  # a save killed before its commit record
    assert io.load_checkpoint(str(d / "step=6.ckpt"))["global_step"] == 4


def test_interrupted_overwrite_keeps_the_previous_version(tmp_path):
    """A crash between the data rename and the sidecar rename of an in-place overwrite
    (last.ckpt) leaves last.ckpt.tg-prev, and a load takes it."""
    io = TrainguardCheckpointIO()
    p = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, p)
    io.teardown()
    # what _write does before the crash: link the old version aside, replace the data
    os.link(p, p + _verified.PREV)
    with open(p + _verified.PREV + _verified.SIDECAR, "wb") as fh:
        fh.write(open(p + _verified.SIDECAR, "rb").read())
    os.remove(p)
    torch.save({"global_step": 2, "w": torch.zeros(10)}, p)
    got = io.load_checkpoint(p)
    assert got["global_step"] == 1 and io.loaded_path == p + _verified.PREV
    # a completed overwrite drops the .tg-prev link
    io.save_checkpoint({"global_step": 3, "w": torch.ones(10)}, p)
    io.teardown()
    io.save_checkpoint({"global_step": 4, "w": torch.ones(10)}, p)
    io.teardown()
    assert not os.path.exists(p + _verified.PREV)
    assert io.load_checkpoint(p)["global_step"] == 4


def test_fit_resumes_past_a_corrupt_last_ckpt(rec, tmp_path):
    t, _ = _ckpt_trainer(tmp_path, 6)
    t.fit(Tiny(), _data())
    d = tmp_path / "ckpt"
    os.truncate(d / "last.ckpt", 1000)
    os.remove(d / "epoch=0-step=6.ckpt")
    cb = TrainguardCallback()
    t2, io2 = _ckpt_trainer(tmp_path, 8, cb)
    t2.fit(Tiny(), _data(), ckpt_path="last")
    assert io2.loaded_path == str(d / "epoch=0-step=4.ckpt")
    assert cb.resumed_step == 4 and t2.global_step == 8


def test_top_k_retention_removes_files_with_their_sidecars(tmp_path):
    t, io = _ckpt_trainer(tmp_path, 8, save_top_k=1, monitor="train_loss", save_last=False)
    t.fit(Tiny(), _data())
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(names) == 2 and names[1] == names[0] + ".tgsum", names
    assert _verified.verify(str(tmp_path / "ckpt" / names[0]))[0]


def test_failed_write_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path, capsys):
    io = TrainguardCheckpointIO()
    p = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 1, "w": torch.ones(10)}, p)
    io.teardown()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    # deepcopy of the object works, pickling it in the writer fails
    class Odd(Unpicklable):
        def __deepcopy__(self, memo):
            return self

    io.save_checkpoint({"global_step": 2, "bad": Odd()}, p)
    io.teardown()
    assert io.saver.errors and "boom" in io.saver.errors[0][1]
    assert "failed" in capsys.readouterr().err
    assert io.load_checkpoint(p)["global_step"] == 1
    assert [n for n in os.listdir(tmp_path) if _verified.TMP in n] == []


def test_pytorch_lightning_package_name(monkeypatch, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from trainguard.integrations import pytorch_lightning as tgpl

    seen = []
    monkeypatch.setattr(hooks, "active", lambda: True)
    monkeypatch.setattr(hooks, "report", lambda step=None, loss=None: seen.append(step))

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def training_step(self, batch, i):
            return torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=1)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
               enable_progress_bar=False, enable_model_summary=False,
               callbacks=[tgpl.TrainguardCallback(), ck],
               plugins=[tgpl.TrainguardCheckpointIO()]).fit(M(), _data())
    assert seen == [0, 1, 2]
    assert tgpl.newest_checkpoint(tmp_path / "c").endswith("step=3.ckpt")

"""Checkpointer on one rank: real files, a real writer process, the validator's real check."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import format as fmt
from trainguard.checkpoint.staging import template
from trainguard.checkpoint.verify import validate_checkpoint

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return m, torch.optim.Adam(m.parameters(), lr=0.01)


def _train(m, opt, steps: int, start: int = 0) -> float:
    loss = torch.tensor(0.0)
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _equal_state(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if any(not torch.equal(v, mb.state_dict()[k]) for k, v in ma.state_dict().items()):
        return False
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k])
                                          for i in sa for k in sa[i])


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "ckpt")


def _ckpt(m, o, root, job, resources=None, **kw):
    return Checkpointer(m, o, config=CheckpointConfig(root=root, **kw), job=job, rank=0,
                        world_size=1, resources=resources)


def test_template_matches_torch_save():
    import io

    for t in (torch.randn(30, 20), torch.arange(7), torch.tensor(2.5), torch.zeros(0, 3),
              torch.randn(4).to(torch.bfloat16)):
        pre, suf = template(t.dtype, tuple(t.shape))
        blob = pre + t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() + suf
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)


def test_retention_plan_keeps_newest_valid():
    rows = [("a", 1, 0, "valid"), ("b", 2, 0, "invalid"), ("c", 3, 0, "valid"),
            ("d", 4, 0, "pending"), ("e", 5, 0, "valid")]
    assert fmt.plan_retention(rows, 2) == ["b", "a"]
    assert fmt.plan_retention(rows, 3) == []
    # nothing valid: nothing deleted
    assert fmt.plan_retention([("x", 1, 0, "invalid"), ("y", 2, 0, "pending")], 1) == []
    # the newest valid is never deleted even with keep=1 and newer invalid ones
    assert fmt.plan_retention([("v", 1, 0, "valid"), ("i", 2, 0, "invalid")], 1) == []


def test_save_restore_plain_dcp_and_shm(root):
    m, o = _model()
    loss = _train(m, o, 3)
    c = _ckpt(m, o, root, "t-basic")
    assert c.restore() == 0 and c.restore_source == "none"
    assert c.save(2, loss=loss)
    assert c.wait(30) and c.stats["committed"] == 1, c.stats
    path = os.path.join(root, fmt.checkpoint_name(2, 0))
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "manifest.json"]
    rep = validate_checkpoint(path)
    assert rep.ok, rep.reasons
    man = fmt.read_manifest(path)
    assert man["step"] == 2 and man["world_size"] == 1 and man["loss"] == pytest.approx(loss)
    assert man["keys"]["model.0.weight"] == {"shape": [16, 8], "dtype": "float32"}
    # plain DCP loads it into a plain model state dict
    import torch.distributed.checkpoint as dcp

    m2, _ = _model(seed=1)
    sd = {"model": m2.state_dict()}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in m.state_dict().items())
    # restore from disk into a fresh model and optimizer
    m3, o3 = _model(seed=2)
    c3 = _ckpt(m3, o3, root, "t-basic-other", restore_from_shm=False)
    assert c3.restore() == 3
    assert c3.restore_source == "disk" and c3.restored_step == 2
    assert c3.restored_loss == pytest.approx(loss)
    assert _equal_state((m, o), (m3, o3))
    # the same job's staged copy in /dev/shm is byte-identical: restore from it (with the
    # first one's resources, as the Checkpointer of the next generation gets them)
    m4, o4 = _model(seed=3)
    c4 = _ckpt(m4, o4, root, "t-basic", resources=c.resources)
    assert c4.restore() == 3 and c4.restore_source == "shm"
    assert _equal_state((m, o), (m4, o4))
    # post-recovery check material
    assert c4.recovery_check(loss)["ok"] is True
    assert c4.recovery_check(float("nan"))["ok"] is False
    c4.finalize()
    assert not os.path.exists(f"/dev/shm/trainguard-t-basic-r0.stage")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def test_flipped_byte_falls_back_to_older_valid(root):
    m, o = _model()
    c = _ckpt(m, o, root, "t-flip", restore_from_shm=False)
    _train(m, o, 2)
    c.save(1)
    c.wait(30)
    ref = [v.clone() for v in m.state_dict().values()]
    _train(m, o, 2, start=2)
    c.save(3)
    c.wait(30)
    newest = os.path.join(root, fmt.checkpoint_name(3, 0))
    man = fmt.read_manifest(newest)
    item = next(i for i in man["items"] if i["key"] == "model.0.weight")
    _flip(os.path.join(newest, item["file"]), item["data_offset"] + 5)
    rep = validate_checkpoint(newest)
    assert not rep.ok and any("checksum" in r for r in rep.reasons)
    m2, o2 = _model(seed=5)
    c2 = _ckpt(m2, o2, root, "t-flip-r", restore_from_shm=False)
    assert c2.restore() == 2 and c2.restored_step == 1
    assert "step_0000000003_g0000" in c2.restore_reason and "checksum" in c2.restore_reason
    assert all(torch.equal(a, b) for a, b in zip(ref, m2.state_dict().values()))
    c.finalize()


def test_nan_in_optimizer_state_is_invalid(root):
    m, o = _model()
    _train(m, o, 2)
    c = _ckpt(m, o, root, "t-nan")
    c.save(1)
    c.wait(30)
    o.state[next(iter(m.parameters()))]["exp_avg_sq"][0, 0] = float("nan")
    c.save(2)
    c.wait(30)
    bad = validate_checkpoint(os.path.join(root, fmt.checkpoint_name(2, 0)))
    assert not bad.ok and any("NaN/Inf" in r and "optimizer" in r for r in bad.reasons)
    m2, o2 = _model(seed=4)
    c2 = _ckpt(m2, o2, root, "t-nan-r")
    assert c2.restore() == 2 and c2.restored_step == 1 and "NaN" in c2.restore_reason
    assert all(torch.isfinite(t).all() for s in o2.state.values() for t in s.values())
    c.finalize()


def test_partial_checkpoints_are_never_restored(root):
    m, o = _model()
    c = _ckpt(m, o, root, "t-partial", restore_from_shm=False)
    c.save(1)
    c.wait(30)
    good = os.path.join(root, fmt.checkpoint_name(1, 0))
    # a later save whose commit never happened: a final name without manifest, and a tmp dir
    shutil.copytree(good, os.path.join(root, fmt.checkpoint_name(5, 0)))
    os.unlink(os.path.join(root, fmt.checkpoint_name(5, 0), fmt.MANIFEST))
    shutil.copytree(good, os.path.join(root, ".tmp-" + fmt.checkpoint_name(7, 0) + "-1"))
    # and one whose shard file was truncated after the commit
    shutil.copytree(good, os.path.join(root, fmt.checkpoint_name(6, 0)))
    with open(os.path.join(root, fmt.checkpoint_name(6, 0), "__0_0.distcp"), "r+b") as fh:
        fh.truncate(100)
    m2, o2 = _model(seed=9)
    c2 = _ckpt(m2, o2, root, "t-partial-r")
    assert c2.restore() == 2 and c2.restored_step == 1
    assert "not committed" in c2.restore_reason and "truncated" in c2.restore_reason
    c.finalize()


def test_retention_keeps_k_valid(root):
    m, o = _model()
    c = _ckpt(m, o, root, "t-keep", keep=2)
    for s in range(5):
        _train(m, o, 1, start=s)
        c.save(s)
        c.wait(30)
    c.finalize()  # the writer has handled the last prune when it exits
    steps = sorted(e.step for e in fmt.list_checkpoints(root))
    assert steps == [3, 4], steps


def test_retention_deletes_nothing_while_the_state_store_does_not_answer(root):
    """A job with a state store that does not answer (a rank cut off from the control plane,
    perhaps excluded and training on until its lease runs out): every checkpoint stays, for
    the live run to resume from; without a state store at all the writers' verdicts decide."""
    m, o = _model()
    c = Checkpointer(m, o, config=CheckpointConfig(root=root, keep=2, state_timeout_s=0.2),
                     job="t-keep-cut", rank=0, world_size=1, redis_url="redis://127.0.0.1:1/0")
    for s in range(4):
        _train(m, o, 1, start=s)
        c.save(s)
        c.wait(30)
    c.finalize()
    assert sorted(e.step for e in fmt.list_checkpoints(root)) == [0, 1, 2, 3]


def test_retention_counts_nan_checkpoints_as_invalid(root):
    """No state store: the writers' NaN count is the verdict. Steps 3 and 4 hold NaN, so the
    newest two valid ones (1, 2) stay, with everything newer; 0 goes."""
    m, o = _model()
    c = _ckpt(m, o, root, "t-keep-nan", keep=2)
    for s in range(5):
        _train(m, o, 1, start=s)
        if s == 3:
            with torch.no_grad():
                m[0].weight[0, :3] = float("nan")
        c.save(s)
        c.wait(30)
    c.finalize()
    steps = sorted(e.step for e in fmt.list_checkpoints(root))
    assert steps == [1, 2, 3, 4], steps
    nan_path = os.path.join(root, fmt.checkpoint_name(4, 0))
    assert c._verdicts[nan_path] == "invalid"
    assert not validate_checkpoint(nan_path).ok  # the validator agrees


def test_retention_treats_an_earlier_process_checkpoints_as_pending(root):
    m, o = _model()

    def train() -> None:  # the state changes between saves (an unchanged one is stale)
        with torch.no_grad():
            next(m.parameters()).add_(1.0)

    first = _ckpt(m, o, root, "t-keep-old", keep=5)
    for s in range(2):
        train()
        first.save(s)
        first.wait(30)
    first.finalize()
    second = _ckpt(m, o, root, "t-keep-new", keep=2)
    train()
    second.save(2)
    second.wait(30)
    # one valid checkpoint known: the earlier ones (unknown verdict) are not deleted yet
    assert sorted(e.step for e in fmt.list_checkpoints(root)) == [0, 1, 2]
    for s in (3, 4):
        train()
        second.save(s)
        second.wait(30)
    second.finalize()
    assert sorted(e.step for e in fmt.list_checkpoints(root)) == [3, 4]


@pytest.mark.parametrize("dtype", sorted(fmt.NONFINITE_BITS))
def test_count_nonfinite_agrees_with_torch(dtype):
    tdt = getattr(torch, dtype, None)
    if tdt is None:
        pytest.skip(f"torch has no {dtype}")
    vals = torch.tensor([1.0, -2.0, float("nan"), float("inf"), -float("inf"), 0.5, 0.0] * 3)
    try:
        t = vals.to(tdt)
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"cannot make {dtype} here: {exc}")
    real = torch.view_as_real(t).flatten() if t.is_complex() else t
    want = int((~torch.isfinite(real.to(torch.float64))).sum())
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()

    def count(dt: str, chunk: int = 8) -> int:  # chunks as the writer feeds them
        c = fmt.NonfiniteCounter(dt)
        for o in range(0, len(raw), chunk):
            c.update(raw[o:o + chunk])
        return c.count

    assert count(dtype) == want
    assert count("int64") == 0


def test_missing_directory_reports_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    m, o = _model()
    c = _ckpt(m, o, str(blocker / "ckpt"), "t-enotdir")
    assert c.save(1)  # returns at once: the failure comes from the writer
    c.wait(30)
    assert c.stats["failed"] == 1 and c.stats["committed"] == 0
    assert "cannot write checkpoint" in c.stats["last_error"]
    _train(m, o, 1)  # training goes on
    c.finalize()


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_save_failed_last_valid_stays(small_tmpfs):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)  # 16.6 KB of weights, 50 KB with Adam state
    o = torch.optim.Adam(m.parameters())
    _train_lin = lambda: (o.zero_grad(), m(torch.randn(2, 64)).sum().backward(), o.step())
    _train_lin()
    c = _ckpt(m, o, small_tmpfs, "t-full", keep=5)
    c.save(1)
    c.wait(30)
    assert c.stats["committed"] == 1
    with open(os.path.join(small_tmpfs, "filler"), "wb") as fh:  # leave ≈ 20 KB free
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        fh.write(b"\0" * max(0, free - 20_000))
    _train_lin()
    c.save(2)
    c.wait(30)
    assert c.stats["failed"] == 1, c.stats
    assert "disk is full" in c.stats["last_error"]
    assert [e.step for e in fmt.list_checkpoints(small_tmpfs)] == [1]
    assert not any(n.startswith(".tmp-") for n in os.listdir(small_tmpfs))
    m2 = torch.nn.Linear(64, 64)
    c2 = Checkpointer(m2, torch.optim.Adam(m2.parameters()),
                      config=CheckpointConfig(root=small_tmpfs), job="t-full-r", rank=0,
                      world_size=1)
    assert c2.restore() == 2
    c.finalize()


def test_manifest_tampering_is_caught(root):
    m, o = _model()
    c = _ckpt(m, o, root, "t-man")
    c.save(1)
    c.wait(30)
    path = os.path.join(root, fmt.checkpoint_name(1, 0))
    man = json.loads(open(os.path.join(path, fmt.MANIFEST)).read())
    man["keys"]["model.0.weight"]["shape"] = [16, 9]
    with open(os.path.join(path, fmt.MANIFEST), "w") as fh:
        json.dump(man, fh)
    rep = validate_checkpoint(path)
    assert not rep.ok and any("manifest checksum" in r for r in rep.reasons)
    # a manifest that is self-consistent but disagrees with DCP's .metadata is caught too
    man["manifest_checksum"] = fmt.manifest_body_checksum(man)
    with open(os.path.join(path, fmt.MANIFEST), "w") as fh:
        json.dump(man, fh)
    rep = validate_checkpoint(path)
    assert not rep.ok and any("model.0.weight" in r and ".metadata" in r for r in rep.reasons)
    c.finalize()


def test_abandoned_inflight_save_is_cancelled_not_committed(root):
    """A save of an ended generation waits for a shard that will never come (world of 2, rank 1
    gone): abandoning it frees the coordinator at once instead of after the commit timeout."""
    import time

    m, o = _model()
    c = Checkpointer(m, o, config=CheckpointConfig(root=root, commit_timeout_s=300), job="t-ab",
                     rank=0, world_size=2)
    assert c.save(3)
    assert not c.wait(1.0)  # rank 1's shard never comes: the commit waits
    t0 = time.monotonic()
    assert c.abandon_inflight() is True
    assert c.wait(10.0), "the cancelled save did not finish"
    assert time.monotonic() - t0 < 10.0
    assert c.stats["failed"] == 1 and "cancelled" in c.stats["last_error"]
    assert fmt.list_checkpoints(root) == []
    assert not [n for n in os.listdir(root) if n.startswith(fmt.TMP_PREFIX)]
    assert c.abandon_inflight() is False  # nothing in flight any more
    c.finalize()

"""checkpoint_validator as a service on a real NATS and Valkey, fed by a real Checkpointer."""
from __future__ import annotations

import asyncio
import shutil
import os

import pytest
import torch

from trainguard import schemas
from trainguard.checkpoint_validator.service import CheckpointValidator
from trainguard.checkpoint_validator.validate import validate_checkpoint
from trainguard.schemas import subjects
from trainguard.clients.bus import Bus
from trainguard.clients.threaded_bus import ThreadedBus
from trainguard.checkpoint import CheckpointConfig, Checkpointer
from trainguard.checkpoint import format as fmt
from trainguard.services.base import ServiceConfig
from trainguard.clients.store import StateStore

pytestmark = pytest.mark.timeout(120)


async def _wait_for(events: list, n: int, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(events) < n and loop.time() < end:
        await asyncio.sleep(0.02)
    assert len(events) >= n, events


async def _answering(bus: Bus) -> None:
    """Return once the validator answers its health request: it is subscribed by then."""
    for _ in range(100):
        try:
            await bus.request("tg.svc.checkpoint_validator.health", b"", timeout=0.2)
            return
        except Exception:  # noqa: BLE001
            await asyncio.sleep(0.05)


async def test_saved_validated_marked_and_restored(servers, redis_db, tmp_path):
    job = "vsvc"
    svc = CheckpointValidator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db))
    task = asyncio.create_task(svc.run())
    watcher = await Bus(servers.nats_url, "test-watch").connect()
    verdicts: list[schemas.Event] = []
    await watcher.subscribe(subjects.job(job, "ckpt"),
                            lambda s, e: verdicts.append(e) if e.SCHEMA in (
                                "ckpt.validated", "ckpt.invalid") else None)
    await watcher.flush()
    await _answering(watcher)
    tbus = ThreadedBus(servers.nats_url, "test-rank").start()
    assert tbus.wait_connected(5)
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(4, 16)).sum().backward()
    o.step()
    c = Checkpointer(m, o, config=CheckpointConfig(root=root), job=job, rank=0, world_size=1,
                     bus=tbus, redis_url=redis_db)
    await asyncio.to_thread(lambda: (c.save(10, loss=0.25), c.wait(30)))
    await _wait_for(verdicts, 1)
    assert verdicts[0].SCHEMA == "ckpt.validated" and verdicts[0].step == 10
    # step 20: one flipped byte in the shard → invalid, with the reason
    w10 = m.weight.detach().clone()
    m.weight.data.add_(1.0)
    await asyncio.to_thread(lambda: (c.save(20, loss=0.2), c.wait(30)))
    # the validator may race us; flip before it reads by checking the verdict afterwards:
    await _wait_for(verdicts, 2)
    path20 = os.path.join(root, fmt.checkpoint_name(20, 0))
    assert verdicts[1].SCHEMA == "ckpt.validated"
    store = StateStore(redis_db)
    idx = {r["path"]: r for r in await store.checkpoints(job)}
    assert idx[path20]["status"] == "valid"
    # damage after validation: restore re-checks checksums and falls back to step 10
    man = fmt.read_manifest(path20)
    f = os.path.join(path20, man["items"][0]["file"])
    with open(f, "r+b") as fh:
        fh.seek(man["items"][0]["data_offset"])
        b = fh.read(1)
        fh.seek(man["items"][0]["data_offset"])
        fh.write(bytes([b[0] ^ 0x80]))
    # and a re-announcement makes the validator mark it invalid
    tbus.publish(subjects.job(job, "ckpt"), schemas.CheckpointSaved(
        job=job, path=path20, step=20, world_size=1))
    await _wait_for(verdicts, 3)
    assert verdicts[2].SCHEMA == "ckpt.invalid" and "checksum" in " ".join(verdicts[2].reasons)
    idx = {r["path"]: r for r in await store.checkpoints(job)}
    assert idx[path20]["status"] == "invalid"
    m2 = torch.nn.Linear(16, 8)
    c2 = Checkpointer(m2, torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9),
                      config=CheckpointConfig(root=root, restore_from_shm=False), job=job,
                      rank=0, world_size=1, redis_url=redis_db)
    nxt = await asyncio.to_thread(c2.restore)
    assert nxt == 11 and c2.restored_loss == pytest.approx(0.25)
    assert "marked invalid by the validator" in c2.restore_reason
    assert torch.equal(m2.weight.detach(), w10)
    # the state store gone (wrong port): restore verifies manifests itself, same answer
    c3 = Checkpointer(m2, None, config=CheckpointConfig(root=root, restore_from_shm=False,
                                                        state_timeout_s=0.5),
                      job=job, rank=0, world_size=1, redis_url="redis://127.0.0.1:1/0")
    assert await asyncio.to_thread(c3.restore) == 11 and "checksum" in c3.restore_reason
    await asyncio.to_thread(c.finalize)
    tbus.close()
    await store.close()
    await watcher.close()
    svc.stop()
    await asyncio.wait_for(task, 10)
    assert svc.counts["validated"] == 2 and svc.counts["invalid"] == 1


async def test_bad_message_does_not_kill_validator(servers, redis_db, tmp_path):
    svc = CheckpointValidator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db))
    task = asyncio.create_task(svc.run())
    b = await Bus(servers.nats_url, "test-bad").connect()
    await _answering(b)
    got: list = []
    await b.subscribe(subjects.job("bad", "ckpt"),
                      lambda s, e: got.append(e) if e.SCHEMA == "ckpt.invalid" else None)
    await b.publish_raw(subjects.job("bad", "ckpt"), b"\xc1garbage")
    await b.publish(subjects.job("bad", "ckpt"), schemas.CheckpointSaved(
        job="bad", path=str(tmp_path / "nowhere"), step=1, world_size=1))
    await _wait_for(got, 1)
    assert "does not exist" in got[0].reasons[0]
    assert svc.bus.stats.bad["malformed"] == 1
    await b.close()
    svc.stop()
    await asyncio.wait_for(task, 10)


def test_retention_waits_for_the_validator(servers, redis_db, tmp_path):
    """With a state store, checkpoints the validator has not judged are pending: retention
    deletes none of them (seen in CI: deleting them early made a lagging validator find them
    gone and mark them invalid, the restored one included)."""
    root = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    c = Checkpointer(m, None, config=CheckpointConfig(root=root, keep=2), job="vsvc-keep",
                     rank=0, world_size=1, redis_url=redis_db)  # no validator running
    for step in range(1, 5):
        c.save(step)
        c.wait(30)
    c.finalize()
    assert sorted(e.step for e in fmt.list_checkpoints(root)) == [1, 2, 3, 4]


def test_validating_a_deleted_checkpoint_reports_instead_of_raising(tmp_path):
    root = str(tmp_path / "ckpt")
    m = torch.nn.Linear(4, 4)
    c = Checkpointer(m, None, config=CheckpointConfig(root=root), job="vsvc-gone", rank=0,
                     world_size=1)
    c.save(1)
    c.wait(30)
    c.finalize()
    path = fmt.list_checkpoints(root)[0].path
    os.unlink(os.path.join(path, "__0_0.distcp"))
    rep = validate_checkpoint(path)
    assert not rep.ok and any("__0_0.distcp" in r for r in rep.reasons), rep.reasons
    shutil.rmtree(path)
    rep = validate_checkpoint(path)
    assert not rep.ok and "does not exist" in rep.reasons[0]


async def test_a_failed_loss_check_after_a_restore_marks_that_checkpoint_invalid(servers,
                                                                                 redis_db):
    """recovery.verified not ok → the checkpoint at its restored step is invalid (reason: the
    losses), ckpt.invalid published; an ok check or another step changes nothing."""
    job = "vloss"
    store = StateStore(redis_db)
    for step in (10, 20):
        await store.mark_checkpoint(job, f"/ck/step-{step}", step, valid=True)
    svc = CheckpointValidator(ServiceConfig(nats_url=servers.nats_url, redis_url=redis_db))
    task = asyncio.create_task(svc.run())
    watcher = await Bus(servers.nats_url, "test-watch").connect()
    invalid: list[schemas.Event] = []
    await watcher.subscribe(subjects.job(job, "ckpt"), lambda s, e: invalid.append(e)
                            if e.SCHEMA == "ckpt.invalid" else None)
    await watcher.flush()
    await _answering(watcher)
    for ok, loss in ((True, 0.3), (False, 9.5)):
        await watcher.publish(subjects.job(job, "recovery"), schemas.RecoveryVerified(
            job=job, rank=1, generation=2, restored_step=20, loss_at_save=0.31,
            loss_after=loss, tolerance=0.5, ok=ok))
    await _wait_for(invalid, 1)
    idx = {c["step"]: c for c in await store.checkpoints(job)}
    assert idx[20]["status"] == "invalid" and idx[10]["status"] == "valid"
    assert "loss check failed on rank 1" in idx[20]["reasons"][0]
    assert "9.5" in idx[20]["reasons"][0] and invalid[0].step == 20
    await watcher.close()
    await store.close()
    svc.stop()
    await asyncio.wait_for(task, 10)

"""The seams of the checkpointer's parts: the save plan's checks, the restorer's choice, the
resources the runtime owns and abandons through, the one loss tolerance, and the layering
(the rank side imports nothing of the validator service). Real tensors, real files, real
writer processes; no mocks."""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import os
import time

import pytest
import torch

import trainguard
from trainguard.checkpoint import CheckpointConfig, Checkpointer, CheckpointResources
from trainguard.checkpoint import format as fmt
from trainguard.checkpoint.config import DEFAULT_LOSS_TOLERANCE
from trainguard.checkpoint.plan import (PlanError, ShardLayout, StagedItem, make_plan,
                                        new_plan_id)
from trainguard.checkpoint.restorer import Restorer, choose_checkpoint, loss_matches
from trainguard.checkpoint.statedict import get_state
from trainguard.rank.shim import WorkerConfig

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(seed: int = 0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    m(torch.randn(3, 8)).sum().backward()
    o.step()  # optimizer state exists (tensors) beside param_groups' numbers (byte items)
    return m, o


def _plan(m, o):
    return make_plan(get_state(m, o), 0, new_plan_id(1), lambda obj: [obj])


# ---- save plan ------------------------------------------------------------------------------------
def test_save_plan_of_a_real_model_is_whole():
    m, o = _model()
    plan = _plan(m, o)
    tensor_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    # parameters plus Adam's exp_avg and exp_avg_sq, each aligned in the buffer
    assert plan.staging_size >= 3 * tensor_bytes
    assert plan.keys["model.0.weight"] == {"shape": [16, 8], "dtype": "float32"}
    assert len(plan.layouts) == 1 and plan.layouts[0].byte_items  # lr, betas, …
    kinds = [w["kind"] for w in plan.writer_items]
    assert kinds.count("tensor") == len(plan.layouts[0].tensors)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rank = 1  # type: ignore[misc]
    lens = [[len(b) for b in plan.byte_blobs(get_state(m, o))]]
    assert plan.metadata_bytes(lens) is plan.metadata_bytes(lens)  # cached per sizes


def test_save_plan_rejects_broken_layouts():
    m, o = _model()
    plan = _plan(m, o)
    staged = sorted(plan.staged.items(), key=lambda kv: kv[1].offset)
    (k0, s0), (k1, s1) = staged[0], staged[1]
    lay = plan.layouts[0]
    t0 = lay.tensors[0]
    broken = {
        "plan id": dict(plan_id=0),
        "rank without a layout": dict(rank=1),
        "buffer too small": dict(staging_size=plan.staging_size - 64),
        "overlapping staged items": dict(staged={**plan.staged, k1: StagedItem(
            s0.offset + 64, s1.nbytes, s1.dtype, s1.shape)}),
        "misaligned staged item": dict(staged={**plan.staged, k0: StagedItem(
            s0.offset + 1, s0.nbytes, s0.dtype, s0.shape)}),
        "tensor blob mis-sized": dict(layouts=(ShardLayout(
            (dataclasses.replace(t0, length=t0.length + 1),) + lay.tensors[1:],
            lay.byte_items, lay.tensor_end + 1),)),
        "layout end wrong": dict(layouts=(ShardLayout(lay.tensors, lay.byte_items,
                                                      lay.tensor_end + 8),)),
        "writer item missing": dict(writer_items=plan.writer_items[1:]),
        "writer item elsewhere": dict(writer_items=(
            {**plan.writer_items[0], "shm_offset": plan.writer_items[0]["shm_offset"] + 64},)
            + plan.writer_items[1:]),
    }
    for what, change in broken.items():
        with pytest.raises(PlanError):
            dataclasses.replace(plan, **change)
            pytest.fail(f"accepted: {what}")
    assert dataclasses.replace(plan, plan_id=plan.plan_id + 1).plan_id == plan.plan_id + 1


# ---- restorer -------------------------------------------------------------------------------------
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def test_restorer_passes_over_what_a_generation_wrote_after_it_ended(tmp_path, redis_db):
    """A cut-off node trains on alone until its lease runs out: its checkpoints of generation
    0 written after the exclusion (which ended generation 0) are passed over, valid as they
    are; the end comes from the job record (``bump_generation``, a real Valkey)."""
    from trainguard.checkpoint.index import fetch_generation_ends
    from trainguard.clients.store import StateStore

    root = os.path.abspath(str(tmp_path / "ckpt"))
    m, o = _model()
    c = Checkpointer(m, o, config=CheckpointConfig(root=root, restore_from_shm=False),
                     job="seam-fence", rank=0, world_size=1)
    try:
        assert c.save(5, loss=0.75) and c.wait(30)

        async def _end():
            st = StateStore(redis_db)
            try:
                assert await st.bump_generation("seam-fence", 0, "d1") == 1
                assert await st.bump_generation("seam-fence", 0, "d2") == 1  # lost the race
                return await st.generation_ends("seam-fence")
            finally:
                await st.close()
        ends = asyncio.run(_end())
        assert list(ends) == [0] and abs(ends[0] - time.time_ns()) < 5 * 10**9, ends
        assert fetch_generation_ends(redis_db, "seam-fence", 5.0) == ends
        time.sleep(0.01)
        with torch.no_grad():
            m[0].weight.add_(1.0)
        assert c.save(10, loss=0.5) and c.wait(30)  # generation 0 still: the fenced remnant
    finally:
        c.finalize()
    late = fmt.checkpoint_name(10, 0)
    ch = choose_checkpoint(root, lambda: None, ended=lambda: ends)
    assert ch.step == 5 and ch.reasons[0].startswith(f"{late}: written by generation 0 "), ch
    assert "after that generation ended" in ch.reasons[0]
    assert choose_checkpoint(root, lambda: None, ended=lambda: None).step == 10  # no store
    assert choose_checkpoint(root, lambda: None).step == 10
    assert fetch_generation_ends("redis://127.0.0.1:1/0", "seam-fence", 0.5) is None


def test_restorer_chooses_the_newest_valid_over_a_corrupt_newer_one(tmp_path):
    root = str(tmp_path / "ckpt")
    m, o = _model()
    c = Checkpointer(m, o, config=CheckpointConfig(root=root, restore_from_shm=False),
                     job="seam-choose", rank=0, world_size=1)
    try:
        assert c.save(1, loss=0.75) and c.wait(30)
        want = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.no_grad():
            m[0].weight.add_(1.0)
        assert c.save(3, loss=0.5) and c.wait(30)
        assert c.stats["committed"] == 2, c.stats
    finally:
        c.finalize()
    newest = os.path.join(root, fmt.checkpoint_name(3, 0))
    item = next(i for i in fmt.read_manifest(newest)["items"] if i["key"] == "model.0.weight")
    _flip(os.path.join(newest, item["file"]), item["data_offset"] + 3)
    # a newer directory that was never committed is passed over too
    os.makedirs(os.path.join(root, fmt.checkpoint_name(5, 0)))

    no_store = choose_checkpoint(os.path.abspath(root), lambda: None)
    assert no_store.path == os.path.join(os.path.abspath(root), fmt.checkpoint_name(1, 0))
    assert (no_store.step, no_store.loss, no_store.world_size) == (1, 0.75, 1)
    assert [r.split(":")[0] for r in no_store.reasons] == [fmt.checkpoint_name(5, 0),
                                                           fmt.checkpoint_name(3, 0)]
    assert "not committed" in no_store.reasons[0] and "checksum" in no_store.reasons[1]
    # the validator marked the newer one valid before the damage: the quick re-check finds it
    marked = {os.path.abspath(newest): {"status": "valid"}}
    assert choose_checkpoint(os.path.abspath(root), lambda: marked).step == 1
    # ... unless asked not to re-check what the validator marked valid
    assert choose_checkpoint(os.path.abspath(root), lambda: marked, reverify_valid=False).step \
        == 3
    # every one marked invalid: nothing to restore, each named with the validator's reason
    bad = {e.path: {"status": "invalid", "reasons": ["NaN"]}
           for e in fmt.list_checkpoints(os.path.abspath(root))}
    none = choose_checkpoint(os.path.abspath(root), lambda: bad)
    assert none.path is None and sum("marked invalid" in r for r in none.reasons) == 2

    m2, o2 = _model(seed=7)
    r = Restorer(m2, o2, config=CheckpointConfig(root=root, restore_from_shm=False),
                 job="seam-choose-r", rank=0, world_size=1, group=None,
                 index=lambda: None).restore()
    assert (r.step, r.next_step, r.source, r.loss) == (1, 2, "disk", 0.75)
    assert fmt.checkpoint_name(3, 0) in r.reason
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())


# ---- resources: owned by the runtime, abandoned through it --------------------------------------
def test_the_runtime_abandons_the_inflight_save_through_its_resources(tmp_path):
    """Generation 0 starts a save that waits for a shard that never comes (rank 0 of a world
    of 2 whose rank 1 is gone), then faults: ``trainguard.run`` abandons the save through the
    resources it handed to its Checkpointer, long before the 30 s commit timeout, and the
    Checkpointer of generation 1 gets the same resources (writer and staging reused)."""
    root = str(tmp_path / "ckpt")
    seen: dict = {}

    def train(ctx):
        m, o = _model()
        ck = ctx.checkpointer(m, o, root=root, commit_timeout_s=30)
        if ctx.generation == 0:
            seen["owned_by_runtime"] = ck.resources is ctx._rt.ckpt_resources
            ck.world_size = 2  # torch.distributed is not initialised: planning stays local
            seen["started"] = ck.save(3)
            seen["waiting"] = not ck.wait(0.5)  # the coordinator waits for rank 1's shard
            seen["first"], seen["t_fault"] = ck, time.monotonic()
            raise RuntimeError("rank 1 died")
        try:  # any error here ends the run (a fault would restart it again and again)
            first = seen["first"]
            seen["finished"] = first.wait(10)
            seen["abandon_s"] = time.monotonic() - seen["t_fault"]
            seen["first_error"] = first.stats["last_error"]
            seen["same_resources"] = ck.resources is first.resources
            seen["writer_reused"] = ck.resources.writer is not None and \
                not ck.resources.writer.dead
            if not seen["finished"]:
                return -1  # a save would wait for the stuck one (the commit timeout)
            seen["saved"] = ck.save(4) and ck.wait(30)
            seen["committed"] = ck.stats["committed"]
        except Exception as exc:  # noqa: BLE001 - reported by the asserts below
            seen["error"] = repr(exc)
        return ctx.generation

    cfg = WorkerConfig(job="seam-abandon", node="n0", world_size=1, mode="action",
                       nats_url="nats://127.0.0.1:9", decision_timeout_s=0.2,
                       heartbeat_interval_s=0.05)
    result = trainguard.run(train, cfg)
    assert "error" not in seen, seen
    assert seen["owned_by_runtime"] and seen["started"] and seen["waiting"], seen
    assert seen["finished"] and seen["abandon_s"] < 10.0, seen  # commit timeout: 30 s
    assert "cancelled" in seen["first_error"], seen
    assert seen["same_resources"] and seen["writer_reused"], seen
    assert seen["saved"] and seen["committed"] == 1 and result == 1, seen
    assert [e.step for e in fmt.list_checkpoints(root)] == [4]
    assert not [n for n in os.listdir(root) if n.startswith(fmt.TMP_PREFIX)]
    assert not os.path.exists("/dev/shm/trainguard-seam-abandon-r0.stage")  # released at the end


def test_resources_without_a_save_have_nothing_to_abandon():
    res = CheckpointResources()
    assert res.abandon_inflight() is False and not res.busy()
    res.release()  # nothing to release: no error
    assert res.next_seq() < res.next_seq()


# ---- one loss tolerance ---------------------------------------------------------------------------
def test_one_loss_tolerance_with_the_schema_default():
    from trainguard import schemas

    assert CheckpointConfig().loss_tolerance == DEFAULT_LOSS_TOLERANCE
    assert schemas.RecoveryVerified.model_fields["tolerance"].default == DEFAULT_LOSS_TOLERANCE
    assert loss_matches(1.0, 1.4) is True and loss_matches(1.0, 1.6) is False
    assert loss_matches(1.0, 1.05, tolerance=0.01) is False
    assert loss_matches(None, 1.0) is None and loss_matches(1.0, float("inf")) is False
    with pytest.raises(ValueError, match="loss_tolerance"):
        CheckpointConfig(loss_tolerance=-0.1)


async def test_the_shipped_recovery_check_uses_the_configured_tolerance(servers, tmp_path):
    """``trainguard.run`` publishes ``recovery.verified`` with the Checkpointer's
    ``loss_tolerance``: a loss 30 % off the saved one fails a 10 % tolerance (it passed the
    hard-coded 0.5 before)."""
    from trainguard.clients.bus import Bus
    from trainguard.schemas import subjects

    job, root = "seam-tol", str(tmp_path / "ckpt")
    watcher = await Bus(servers.nats_url, "seam-watch").connect()
    got: list = []
    await watcher.subscribe(subjects.job(job, "recovery"), lambda s, e: got.append(e)
                            if e.SCHEMA == "recovery.verified" else None)
    await watcher.flush()

    def train(ctx):
        if ctx.generation > 1:
            return -1  # the first generation's save did not commit: end, the asserts tell
        m, o = _model()
        ck = ctx.checkpointer(m, o, root=root, loss_tolerance=0.1)
        start = ck.restore()
        if ctx.generation == 0:
            if ck.save(0, loss=1.0):
                ck.wait(30)
            raise RuntimeError("fault after the save")
        ctx.progress(start, loss=1.3)
        return start

    cfg = WorkerConfig(job=job, node="n0", world_size=1, mode="action",
                       nats_url=servers.nats_url, decision_timeout_s=0.2,
                       heartbeat_interval_s=0.05)
    try:
        assert await asyncio.to_thread(trainguard.run, train, cfg) == 1
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got, "no recovery.verified"
        ev = got[0]
        assert (ev.restored_step, ev.loss_at_save, ev.loss_after) == (0, 1.0, 1.3)
        assert ev.tolerance == pytest.approx(0.1) and ev.ok is False
    finally:
        await watcher.close()


# ---- layering --------------------------------------------------------------------------------------
def test_the_rank_side_imports_nothing_of_the_validator_service():
    """``trainguard/checkpoint/*`` is the rank-side library: it may be imported by the validator
    service (``verify``, ``format``), never the other way round."""
    pkg = os.path.join(ROOT, "trainguard", "checkpoint")
    offenders = []
    for name in sorted(os.listdir(pkg)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(pkg, name)).read())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{name}: {m}" for m in mods if "checkpoint_validator" in m]
    assert not offenders, offenders
    with open(os.path.join(ROOT, "checkpoint_validator", "service.py")) as fh:
        assert "from trainguard.checkpoint.verify import validate_checkpoint" in fh.read()


def test_no_module_of_the_checkpoint_package_is_over_400_lines():
    pkg = os.path.join(ROOT, "trainguard", "checkpoint")
    sizes = {n: sum(1 for _ in open(os.path.join(pkg, n))) for n in os.listdir(pkg)
             if n.endswith(".py")}
    assert max(sizes.values()) <= 400, sizes


def test_the_coordinator_rereads_a_result_note_still_being_written(tmp_path):
    """Result notes are written in place (no rename): the coordinator that finds a note without
    its last bytes reads it again, and commits once every note is whole."""
    import json
    import socket
    import threading

    from trainguard.checkpoint import format as fmt
    from trainguard.checkpoint.serve import WriterConnection

    root = tmp_path / "ck"
    tmp = root / ".tmp-step_0000000007_g0000-1"
    tmp.mkdir(parents=True)
    notes = {}
    for r in range(2):
        data = f"rank {r}".encode() * 100
        (tmp / fmt.shard_file(r)).write_bytes(data)
        notes[r] = json.dumps({"rank": r, "file": fmt.shard_file(r), "bytes": len(data),
                               "checksum": "0" * 16, "items": [], "nonfinite": []}).encode()
    (tmp / fmt.result_file(0)).write_bytes(notes[0])
    partial = tmp / fmt.result_file(1)
    partial.write_bytes(notes[1][:-5])  # rank 1's writer is still writing its note
    finish = threading.Timer(0.3, lambda: partial.write_bytes(notes[1]))
    ours, theirs = socket.socketpair()
    finish.start()
    try:
        total, bad = WriterConnection(theirs)._commit({
            "id": 1, "tmp_dir": str(tmp), "final_dir": str(root / fmt.checkpoint_name(7, 0)),
            "world_size": 2, "commit_timeout_s": 30, "metadata": b"meta", "fsync": True,
            "manifest": {"job": "j", "step": 7, "generation": 0}})
    finally:
        finish.cancel()
        ours.close()
        theirs.close()
    final = root / fmt.checkpoint_name(7, 0)
    m = fmt.read_manifest(str(final))
    assert [f["rank"] for f in m["files"]] == [0, 1, None]
    assert total == sum(f["bytes"] for f in m["files"]) and bad == []
    assert not tmp.exists() and not list(final.glob("*.result.json"))
    assert (final / fmt.METADATA).read_bytes() == b"meta"

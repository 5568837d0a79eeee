"""Runs of a job in the state store (``StateStore.begin_run``): a launch while the job's
launchers hold leases joins that run; a launch after they are gone is a new run, at a generation
past every one used before (the old run's rendezvous keys stay in the store). Real Valkey."""
from __future__ import annotations

import asyncio
import time

from trainguard.schemas import JobSettings
from trainguard.clients.store import StateStore
from trainguard.clients.store_runs import LauncherConflict, RankConflict


def _run(coro):
    return asyncio.run(coro)


async def _scenario(url: str):
    st = StateStore(url)
    try:
        await st.register_settings("j", JobSettings(mode="observe", hang_timeout_s=30.0))
        first = [await st.begin_run("j", "n0", 10.0, JobSettings(mode="observe")),
                 await st.begin_run("j", "n1", 10.0, JobSettings(mode="observe"))]
        await st.add_members("j", [{"rank": 0, "node": "n0", "local_rank": 0}])
        # the run goes on: decisions move it to generation 4, spend retries, then it finishes
        await st.update_job("j", generation=4, retries_used=3, status="finished")
        await st.end_launcher("j", "n0")
        await st.end_launcher("j", "n1")
        second = [await st.begin_run("j", "n0", 10.0, JobSettings(mode="action")),
                  await st.begin_run("j", "n1", 10.0, JobSettings(mode="action"))]
        job = await st.job("j")
        # a second launcher on a node whose launcher holds a live lease is refused
        await st.begin_run("k", "n0", 0.5)
        try:
            await st.begin_run("k", "n0", 10.0)
            conflict = None
        except LauncherConflict as exc:
            conflict = exc
        # a launcher that died without ending its lease: the lease runs out
        time.sleep(0.6)
        k_again = await st.begin_run("k", "n0", 10.0)
        return first, second, job, k_again, conflict
    finally:
        await st.close()


def test_a_launch_after_the_last_launcher_left_is_a_new_run(redis_db):
    first, second, job, k_again, conflict = _run(_scenario(redis_db))
    assert first == [(0, False), (0, False)]  # the first run: generation 0, both join it
    assert second == [(5, True), (5, False)]  # past generation 4; the second launcher joins
    assert job.generation == 5 and job.status == "running"
    assert job.retries_used == 0 and job.mode == "action"
    assert job.hang_timeout_s == 0.0  # the new run's settings replace the old run's
    assert job.members == []  # the new run's launchers register their ranks again
    # the old run's generation ended when the new run began (the fence of its checkpoints)
    assert list(job.generation_ends) == ["4"] and job.generation_ends["4"].isdigit(), job
    assert k_again == (1, True)
    assert conflict is not None and (conflict.job, conflict.node) == ("k", "n0")
    assert 0 < conflict.remaining_s <= 0.5 and "live launcher on node 'n0'" in str(conflict)


async def _mutators(url: str):
    st = StateStore(url)
    try:
        await asyncio.gather(*(st.add_spare("m", f"s{i}") for i in (2, 1, 2)))
        await st.set_group_attempt("m", 3, 2)
        await st.end_run("m", "finished")
        after_end = (await st.job("m")).status
        await st.commit_decision("m", retries_used=1, last_decision={"id": "d"}, stopped=True,
                                 pending_decision={"event_id": "e"})
        await st.end_run("m", "failed")  # a stopped job stays stopped
        stopped = await st.job("m")
        await st.clear_pending("m")
        await st.update_job("m", retry_budget=None, hang_timeout_s=4.5)
        return after_end, stopped, await st.job("m")
    finally:
        await st.close()


def test_the_narrow_mutators(redis_db):
    after_end, stopped, last = _run(_mutators(redis_db))
    assert after_end == "finished"
    assert stopped.spare_nodes == ["s1", "s2"] and stopped.group_attempt == "3:2"
    assert (stopped.status, stopped.retries_used, stopped.last_decision) == (
        "stopped", 1, {"id": "d"})
    assert stopped.pending_decision == {"event_id": "e"}
    assert last.pending_decision is None and last.retry_budget is None
    assert last.hang_timeout_s == 4.5


async def _requeued(url: str):
    st = StateStore(url)
    try:
        # a Slurm job on n0 and n1 at generation 2; n1 is cut off: its lease is still live
        first = [await st.begin_run("r", n, 10.0, run_id="7.0") for n in ("n0", "n1")]
        await st.update_job("r", generation=2)
        await st.end_launcher("r", "n0")  # n0's launcher was ended by the requeue
        # the requeued job (same id, restart 1) on n0 and n2: a new run, not n1's old one
        second = [await st.begin_run("r", n, 10.0, run_id="7.1") for n in ("n0", "n2")]
        # a launcher of the old allocation still on n0 when the new run starts there: no wait
        await st.begin_run("q", "n0", 10.0, run_id="8.0")
        third = await st.begin_run("q", "n0", 10.0, run_id="8.1")
        return first, second, await st.job("r"), third
    finally:
        await st.close()


def test_a_requeued_slurm_job_is_a_new_run_whatever_leases_its_old_run_holds(redis_db):
    first, second, job, third = _run(_requeued(redis_db))
    assert first == [(0, False), (0, False)]
    assert second == [(3, True), (3, False)]  # past generation 2; the second one joins
    assert job.run_id == "7.1" and job.status == "running"
    assert third == (1, True)  # no LauncherConflict: the lease was the old run's


def test_the_run_id_of_a_launch():
    from trainguard.launch.lease import run_id

    assert run_id({}) == ""
    assert run_id({"SLURM_JOB_ID": "41"}) == "41.0"
    assert run_id({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}) == "41.2"


async def _outboxes(url: str):
    import redis.asyncio as aioredis

    from trainguard.clients.store_scripts import OUTBOX_INDEX
    raw = aioredis.Redis.from_url(url, decode_responses=True)
    await raw.sadd("tg:jobs", "a", "b")
    st = StateStore(url)
    try:
        first = await st.outbox()                          # nothing kept yet
        await st.outbox_put("a", {"event_id": "d1", "ts": 3})
        await st.commit_decision("b", retries_used=1, last_decision={"id": "d2"},
                                 outbox={"event_id": "d2", "ts": 2})
        await st.outbox_put("a", {"event_id": "d3", "ts": 4})
        indexed = sorted(await raw.smembers(OUTBOX_INDEX))
        swept = await st.outbox()
        named = await st.outbox(["b", "c"])               # the jobs asked for, those with one
        await st.outbox_done("a", "d1")                    # a keeps d3: stays indexed
        await st.outbox_done("b", "d2")
        after = sorted(await raw.smembers(OUTBOX_INDEX)), await st.outbox()
        return first, indexed, swept, named, after
    finally:
        await st.close()
        await raw.aclose()


def test_the_outbox_index_names_exactly_the_jobs_with_a_decision_kept(redis_db):
    first, indexed, swept, named, (left, last) = _run(_outboxes(redis_db))
    assert first == {}
    assert indexed == ["a", "b"]
    assert {j: [d["event_id"] for d in ds] for j, ds in swept.items()} == {
        "a": ["d1", "d3"], "b": ["d2"]}
    assert {j: [d["event_id"] for d in ds] for j, ds in named.items()} == {"b": ["d2"]}
    assert left == ["a"] and [d["event_id"] for d in last["a"]] == ["d3"] and set(last) == {"a"}


async def _records(url: str):
    st = StateStore(url)
    try:
        await st.register_settings("r", JobSettings(mode="observe", hang_timeout_s=30.0))
        await st.r.hset("tg:job:bad", "generation", "not-a-number")
        a = await st.job_records(["r", "bad", "unknown"])
        b = await st.job_records(["r"])
        await st.update_job("r", hang_timeout_s=4.5)
        c = await st.job_records(["r"])
        return a, b, c
    finally:
        await st.close()


def test_job_records_reads_many_in_one_call_and_decodes_a_changed_hash_only(redis_db):
    a, b, c = _run(_records(redis_db))
    assert a["r"].hang_timeout_s == 30.0 and a["unknown"].generation == 0
    assert a["bad"].startswith("JobRecordError: ") and "generation" in a["bad"]
    assert b["r"] is a["r"]                      # the same hash: the record decoded before
    assert c["r"] is not a["r"] and c["r"].hang_timeout_s == 4.5


def test_fault_history_reads_the_nodes_and_the_signature_in_one_call_as_one_by_one(redis_db):
    """``fault_history`` (the attributor's one round trip) answers what ``node_history`` per
    node and ``signature_history`` answer; the in-memory store of a replay does the same."""
    from trainguard.tools.memstore import MemoryStore

    async def scenario():
        st = StateStore(redis_db)
        mem = MemoryStore()
        try:
            for s in (st, mem):
                for node, job, ts in (("n1", "a", 10), ("n1", "b", 20), ("n2", "b", 30)):
                    res = s.record_fault(node, job, "sig", {"fault_class": "crash"}, ts_ns=ts)
                    if asyncio.iscoroutine(res):
                        await res
            records, pairs = await st.fault_history(("n1", "n2", "n9"), "sig", 15)
            assert records == {n: await st.node_history(n, 15) for n in ("n1", "n2", "n9")}
            assert [r["job"] for r in records["n1"]] == ["b"] and records["n9"] == []
            assert pairs == await st.signature_history("sig", 15) == [("b", "n1"), ("b", "n2")]
            assert mem.fault_history(("n1", "n2", "n9"), "sig", 15) == (records, pairs)
            assert await st.fault_history((), "none", 0) == ({}, [])
        finally:
            await st.close()

    _run(scenario())


async def _second_copy(url: str):
    st = StateStore(url)
    try:
        await st.begin_run("dup", "vm", 10.0)
        await st.add_members("dup", [{"rank": r, "node": "vm", "local_rank": r}
                                     for r in range(2)])
        # a second launch of the running job under another --node, node rank 0 again
        await st.begin_run("dup", "fake", 10.0)
        try:
            await st.add_members("dup", [{"rank": r, "node": "fake", "local_rank": r}
                                         for r in range(2)])
            refused = None
        except RankConflict as exc:
            refused = exc
        members_after_refusal = (await st.job("dup")).members
        # another node rank joins; a node whose holder's lease ran out takes its ranks
        await st.add_members("dup", [{"rank": 2, "node": "fake", "local_rank": 0}])
        await st.end_launcher("dup", "vm")
        taken = await st.add_members("dup", [{"rank": 0, "node": "fake", "local_rank": 0}])
        return refused, members_after_refusal, taken
    finally:
        await st.close()


def test_a_second_launch_under_another_node_name_cannot_take_running_ranks(redis_db):
    """The second launch of a running job with another --node and the same node rank was
    accepted: it replaced the running ranks' entries in ``members`` and started a second copy
    of them, which met the running job's rendezvous (found by a new user's trial)."""
    refused, members, taken = _run(_second_copy(redis_db))
    assert isinstance(refused, RankConflict) and isinstance(refused, LauncherConflict)
    assert (refused.rank, refused.node) == (0, "vm") and 0 < refused.remaining_s <= 10
    assert "--node-rank" in str(refused) and "--spare-node" in str(refused)
    assert [(m["rank"], m["node"]) for m in members] == [(0, "vm"), (1, "vm")]
    assert [(m["rank"], m["node"]) for m in taken] == [(0, "fake"), (1, "vm"), (2, "fake")]

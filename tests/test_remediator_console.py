"""The console as a real process over a real Valkey: job list, job detail with the remediator's
audit trail and checkpoints, the node table and the incidents of the audit trail (without NATS),
the HTML pages, 404, health."""
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from trainguard.stack.process import free_port
from trainguard.clients.store import StateStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_console(redis_db):
    async def seed():
        st = StateStore(redis_db)
        await st.register_job("cj", mode="action", generation=2, world_size=4, retry_budget=5)
        await st.audit("cj", {"type": "decision", "action": "restart_workers", "generation": 2})
        await st.add_checkpoint("cj", "/ck/step-10", 10)
        await st.mark_checkpoint("cj", "/ck/step-10", 10, valid=True)
        await st.add_members("cj", [{"rank": 0, "node": "n0", "local_rank": 0},
                                    {"rank": 1, "node": "n1", "local_rank": 0}])
        await st.set_node("n1", "excluded", "cj: GPU XID 79 on n1:0")
        now = time.time_ns()
        await st.record_fault("n0", "other-job", "gpu_xid|xid|xid=48",
                              {"layer": "hardware", "fault_class": "gpu_xid"}, now)
        await st.audit("cj", {"type": "decision", "action": "exclude_node_and_requeue",
                              "generation": 3, "decision": {
                                  "event_id": "d1", "action": "exclude_node_and_requeue",
                                  "generation": 3, "execute": True, "mode": "action",
                                  "fault_class": "gpu_xid", "ranks": [1], "nodes": ["n1"],
                                  "reason": "GPU <fell> off the bus", "fault_ts": now - 2 * 10**9,
                                  "detected_ts": now - 19 * 10**8, "ts": now - 18 * 10**8}})
        await st.close()
    asyncio.run(seed())
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.tools.console", "--redis-url", redis_db,
                             "--port", str(port)], env={**os.environ, "PYTHONPATH": ROOT},
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                if get(base + "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        status, body = get(base + "/jobs")
        assert status == 200
        assert json.loads(body) == [{"job": "cj", "mode": "action", "generation": 2,
                                     "world_size": 4, "status": "", "retries_used": 0,
                                     "retry_budget": 5}]
        status, body = get(base + "/jobs/cj")
        detail = json.loads(body)
        assert detail["state"]["generation"] == 2
        assert detail["audit"][0] == {"type": "decision", "action": "restart_workers",
                                      "generation": 2}
        assert detail["checkpoints"][0]["status"] == "valid"
        assert get(base + "/jobs/nope")[0] == 404
        nodes = {n["node"]: n for n in json.loads(get(base + "/api/nodes")[1])}
        assert nodes["n1"]["state"] == "excluded" and "XID 79" in nodes["n1"]["reason"]
        assert nodes["n0"]["state"] == "suspect" and nodes["n0"]["fault_jobs"] == ["other-job"]
        assert nodes["n0"]["ranks"] == {"cj": [0]} and not nodes["n0"]["repeat_offender"]
        inc = json.loads(get(base + "/api/jobs/cj/incidents")[1])
        assert inc["source"].startswith("the audit trail")
        (only,) = [i for i in inc["incidents"] if i["action"] == "exclude_node_and_requeue"]
        assert only["seconds_from_fault"] == {"detected": 0.1, "decided": 0.2, "resumed": None}
        assert only["decision"]["nodes"] == ["n1"]
        status, page = get(base + "/")
        assert status == 200 and b'href="job/cj"' in page and b"excluded" in page
        status, page = get(base + "/job/cj")
        assert status == 200 and b"exclude_node_and_requeue" in page
        assert b"GPU &lt;fell&gt; off the bus" in page and b"+0.200 s" in page
        assert get(base + "/job/nope")[0] == 404
    finally:
        proc.terminate()
        proc.wait(10)

"""The console as a real process over a real Valkey: job list, job detail with the remediator's
audit trail and checkpoints, 404, health."""
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from trainguard.embedded import free_port
from trainguard.state import StateStore

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
        await st.close()
    asyncio.run(seed())
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.console", "--redis-url", redis_db,
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
        assert detail["audit"] == [{"type": "decision", "action": "restart_workers",
                                    "generation": 2}]
        assert detail["checkpoints"][0]["status"] == "valid"
        assert get(base + "/jobs/nope")[0] == 404
        assert b"trainguard" in get(base + "/")[1]
    finally:
        proc.terminate()
        proc.wait(10)

"""The fleet breaker through the console (a real process over a real Valkey) and the
``trainguard breaker`` command: status, a refused reset without a reason, a reset with who
and why in the breaker's trail, the front page's line."""
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from trainguard.stack.process import free_port
from trainguard.schemas import BreakerState
from trainguard.clients.store import StateStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIPPED = BreakerState(status="tripped", tripped_ts=time.time_ns(), held=3,
                       trip_reason="33 node(s) taken out within 300 s, past the limit of 32",
                       taken=tuple({"node": f"n{i}", "job": "j", "decision_id": f"d{i}",
                                    "action": "exclude_node_and_requeue",
                                    "ts": time.time_ns()} for i in range(32)))


def call(url, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def seed(redis_url, state):
    async def run():
        st = StateStore(redis_url)
        await st.put_breaker(state, (await st.breaker()).version)
        await st.close()
    asyncio.run(run())


def cli(redis_url, *args):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "breaker", *args],
                          env={**os.environ, "PYTHONPATH": ROOT, "REDIS_URL": redis_url,
                               "NATS_URL": ""},
                          capture_output=True, text=True, timeout=60)


def test_breaker_through_the_console_and_the_command(redis_db):
    seed(redis_db, TRIPPED)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.tools.console", "--redis-url", redis_db,
                             "--port", str(port)], env={**os.environ, "PYTHONPATH": ROOT},
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                if call(base + "/healthz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        code, body = call(base + "/api/breaker")
        b = json.loads(body)
        assert code == 200 and b["status"] == "tripped" and b["taken"] == 32 and b["held"] == 3
        code, page = call(base + "/")
        assert code == 200 and b"fleet breaker" in page and b"tripped" in page
        code, body = call(base + "/api/breaker/reset", {"by": "ops"})
        assert code == 400 and b"--reason" in body
        code, body = call(base + "/api/breaker/reset", {"by": "ops@site", "reason": "rolled back"})
        assert code == 200 and json.loads(body)["status"] == "closed"
        assert json.loads(body)["last_reset"]["by"] == "ops@site"
    finally:
        proc.terminate()
        proc.wait(10)

    # the command: exit 3 while tripped, a reset needs --reason, who/why in the trail
    seed(redis_db, TRIPPED)
    out = cli(redis_db, "status")
    assert out.returncode == 3 and "TRIPPED" in out.stdout and "reset --reason" in out.stdout
    assert cli(redis_db, "reset").returncode == 2
    out = cli(redis_db, "reset", "--reason", "bad health rule fixed", "--by", "alice")
    assert out.returncode == 0 and "closed" in out.stdout
    out = cli(redis_db, "status", "--json")
    s = json.loads(out.stdout)
    assert out.returncode == 0 and s["status"] == "closed" and s["taken"] == 0
    assert [(t["type"], t.get("by")) for t in s["trail"]] == [("reset", "ops@site"),
                                                            ("reset", "alice")]
    assert s["trail"][-1]["reason"] == "bad health rule fixed"
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "status"],
                         env={**os.environ, "PYTHONPATH": ROOT, "REDIS_URL": redis_db},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "fleet breaker: CLOSED" in out.stdout

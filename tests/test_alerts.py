"""The alert webhook: the pure step as a table, and the service against a real local HTTP
server, with decisions published on a real bus."""
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainguard import schemas
from trainguard.services.alerts import AlertState, Alerts, Webhook, WebhookError, payload, step
from trainguard.clients.bus import Bus
from trainguard.core.reducer import Call, Received, Reply, run_offline
from trainguard.schemas import subjects
from trainguard.services.base import ServiceConfig


def dec(action, key="j:g1", execute=True, nodes=("node1",)):
    return schemas.Decision(job="j", action=action, idempotency_key=key, execute=execute,
                            mode="action" if execute else "observe", generation=2,
                            nodes=list(nodes), ranks=[2, 3], fault_class="node_lost",
                            reason="the node is gone")


@pytest.mark.parametrize("action,alerts", [
    ("stop_job_notify_user", True), ("exclude_node_and_requeue", True),
    ("restart_workers", False), ("restart_in_process", False), ("none", False)])
def test_which_decisions_alert(action, alerts):
    _, eff = run_offline(step, AlertState(), [(0.0, Received("tg.job.j.decision", dec(action)))])
    assert bool(eff) is alerts
    if alerts:
        (c,) = eff
        assert isinstance(c, Call) and c.target == "webhook" and not c.wait
        assert c.args[0]["trainguard"]["action"] == action


def test_a_decision_delivered_twice_alerts_once_and_a_failed_post_is_logged():
    d = dec("stop_job_notify_user")
    inputs = [(0.0, Received("tg.job.j.decision", d)), (0.1, Received("tg.job.j.decision", d))]

    def fail(call):
        raise WebhookError("POST http://x: connection refused")
    state, eff = run_offline(step, AlertState(), inputs, fail)
    calls = [e for e in eff if isinstance(e, Call)]
    assert len(calls) == 1 and state.failed == 1 and state.posted == 0
    assert any("not delivered" in getattr(e, "message", "") for e in eff)
    state, _ = step(state, Reply(("alert", "j"), 200), 1.0)
    assert state.posted == 1


def test_payload_is_slack_shaped():
    p = payload(dec("exclude_node_and_requeue", execute=False))
    assert p["text"].startswith("trainguard: job j node excluded")
    assert "observe mode: not executed" in p["text"]
    assert p["blocks"][0]["type"] == "section"
    with pytest.raises(ValueError):
        Webhook("ftp://nope")


class _Hook(BaseHTTPRequestHandler):
    got: list = []
    status = 200

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.got.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(_Hook.status)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


async def test_service_posts_to_a_real_http_server(servers):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/hook"
    svc = Alerts(ServiceConfig(nats_url=servers.nats_url, redis_url=""), webhook=url)
    task = asyncio.create_task(svc.run())
    pub = await Bus(servers.nats_url, "alerts-pub").connect()
    try:
        for _ in range(100):
            if svc.bus.nc is not None and svc.bus.nc.is_connected:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        await pub.publish(subjects.job("j", "decision"), dec("restart_workers", key="j:g0"))
        await pub.publish(subjects.job("j", "decision"), dec("stop_job_notify_user"))
        await pub.publish(subjects.job("j", "decision"), dec("stop_job_notify_user"))  # again
        await pub.flush()
        for _ in range(100):
            if svc.model.posted:
                break
            await asyncio.sleep(0.05)
        _Hook.status = 500
        await pub.publish(subjects.job("j", "decision"), dec("exclude_node_and_requeue",
                                                             key="j:g2"))
        await pub.flush()
        for _ in range(100):
            if len(_Hook.got) >= 2 and svc.model.failed + svc.model.posted >= 2:
                break
            await asyncio.sleep(0.05)
        assert [g[1]["trainguard"]["action"] for g in _Hook.got] == [
            "stop_job_notify_user", "exclude_node_and_requeue"]
        assert _Hook.got[0][0] == "application/json"
        assert "STOPPED" in _Hook.got[0][1]["text"]
        assert svc.model.posted == 1 and svc.model.failed == 1  # the 500 is a failed post
    finally:
        svc.stop()
        await task
        await pub.close()
        srv.shutdown()

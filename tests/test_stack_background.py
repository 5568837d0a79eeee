"""A launch's embedded stack starts its services when asked (``Stack.start(defer_services=True)``
and ``start_services``): it returns once NATS, Valkey, the streams and the rendezvous store
answer, and the services' health arrives later — or their failure is said, never raised into
the job."""
from __future__ import annotations

import socket
import time

from trainguard.stack.local import Stack


def _answers(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5):
        return True


def test_returns_with_the_store_up_and_the_services_become_healthy():
    stack = Stack(services=("detector", "remediator"), agent_nodes=("n0",), rendezvous=True)
    try:
        stack.start(timeout=120, defer_services=True)
        assert _answers(stack.rdzv_endpoint)
        stack.start_services(timeout=90)
        assert stack.services_ready.wait(90), stack.services_error
        assert stack.services_error == ""
        assert stack.health("remediator")["ok"] is True
    finally:
        stack.stop()


def test_a_service_that_cannot_start_is_said_not_raised(capfd):
    # the remediator refuses a decision timeout that is not a number and exits at start
    stack = Stack(services=("remediator",), agent_nodes=("n0",), rendezvous=False,
                  env={"TG_DECISION_TIMEOUT_S": "soon"})
    try:
        stack.start(timeout=60, defer_services=True)
        stack.start_services(timeout=60)  # does not raise
        deadline = time.monotonic() + 70
        while not stack.services_error and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "remediator" in stack.services_error and not stack.services_ready.is_set()
        assert "did not come up" in capfd.readouterr().err
        assert stack.keep_logs  # its log stays to be read
    finally:
        stack.stop()


def test_deferred_services_start_when_asked_once_and_never_after_stop():
    """``start(defer_services=True)`` (a launch's embedded stack: the services wait until its
    ranks train): nothing but the servers and the store until ``start_services``; a second call
    starts nothing more, and a call after ``stop`` starts nothing."""
    stack = Stack(services=("detector", "remediator"), agent_nodes=("n0",), rendezvous=True)
    try:
        stack.start(timeout=120, defer_services=True)
        assert _answers(stack.rdzv_endpoint)
        assert set(stack.procs) == {"rendezvous"}
        assert not stack.services_ready.wait(1.0)
        stack.start_services(timeout=90)
        pids = {n: p.pid for n, p in stack.procs.items()}
        assert {"detector", "remediator"} <= set(pids)
        stack.start_services(timeout=90)
        assert {n: p.pid for n, p in stack.procs.items()} == pids
        assert stack.services_ready.wait(90), stack.services_error
        assert stack.health("detector")["ok"] is True
    finally:
        stack.stop()
    stack.start_services()
    assert all(p.poll() is not None for p in stack.procs.values())

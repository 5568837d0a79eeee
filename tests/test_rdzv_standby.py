"""A rendezvous store with a standby: the endpoint list, and the relay that moves every new
connection to the standby once the primary stops answering — real store processes
(``python -m trainguard.rendezvous.store``), real TCPStore clients, a real SIGKILL."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard.rendezvous.endpoint import parse_endpoint, split_endpoints
from trainguard.rendezvous.gate import Relay, relay_for


@pytest.mark.parametrize("text, want", [
    ("a:1", ["a:1"]),
    ("a:1,b:2", ["a:1", "b:2"]),
    (" a:1 , b:2 ,", ["a:1", "b:2"]),
    ("tls://a:1,tls://b:2", ["tls://a:1", "tls://b:2"]),
])
def test_split_endpoints(text, want):
    assert split_endpoints(text) == want


@pytest.mark.parametrize("text, says", [
    ("", "names no store"),
    (",", "names no store"),
    ("a:1,b", "must be host:port"),
    ("tls://a:1,b:2", "mixes tls:// and plain"),
])
def test_split_endpoints_refuses(text, says):
    with pytest.raises(ValueError, match=says):
        split_endpoints(text)


def test_one_endpoint_is_expected_where_a_list_is_given():
    with pytest.raises(ValueError, match="several stores"):
        parse_endpoint("a:1,b:2")


def _store(port: int = 0, token: str = "") -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k != "TG_RDZV_TOKEN"}
    if token:
        env["TG_RDZV_TOKEN"] = token
    p = subprocess.Popen([sys.executable, "-m", "trainguard.rendezvous.store", "--port",
                          str(port)], stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    assert line.startswith("ready "), line
    return p, line.split()[1]


def _client(endpoint: str):
    import torch.distributed as dist

    host, port = parse_endpoint(endpoint)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait(10)


@pytest.mark.parametrize("token", ["", "s3cret-token"])
def test_the_relay_moves_to_the_standby_and_stays_there(token):
    primary, a = _store(token=token)
    standby, b = _store(token=token)
    restarted = None
    relay = Relay(f"{a},{b}", token).start()
    try:
        c = _client(relay.endpoint)
        c.set("job/g0/arrived", "1")
        assert relay.remote == parse_endpoint(a) and relay.failovers == 0
        _kill(primary)
        # the connection of the dead store is gone: its next request fails …
        with pytest.raises(Exception):
            c.get("job/g0/arrived")
        # … and a new one reaches the standby, where the next generation meets
        c2 = _client(relay.endpoint)
        c2.set("job/g1/arrived", "2")
        assert relay.failovers == 1 and relay.remote == parse_endpoint(b)
        assert _client(b if not token else relay.endpoint).get("job/g1/arrived") == b"2"
        # the primary started again, empty, on its port: the relay stays on the standby, which
        # holds the keys (a relay that went back would split the job's rendezvous)
        restarted, a2 = _store(parse_endpoint(a)[1], token)
        assert a2 == a
        assert _client(relay.endpoint).get("job/g1/arrived") == b"2"
        assert relay.failovers == 1
        # the standby dies too: the relay goes round to the primary
        _kill(standby)
        _client(relay.endpoint).set("job/g2/arrived", "3")
        assert relay.failovers == 2 and relay.remote == parse_endpoint(a)
    finally:
        relay.stop()
        for p in (primary, standby, restarted):
            if p is not None:
                _kill(p)


def test_relay_for_a_list_without_a_token_is_a_relay_and_one_store_is_itself(monkeypatch):
    monkeypatch.delenv("TG_RDZV_TOKEN", raising=False)
    assert relay_for("127.0.0.1:1") == "127.0.0.1:1"
    got = relay_for("127.0.0.1:1,127.0.0.1:2")
    assert got.startswith("127.0.0.1:") and got not in ("127.0.0.1:1", "127.0.0.1:2")
    with pytest.raises(ValueError, match="mixes"):
        relay_for("127.0.0.1:1,tls://127.0.0.1:2")


def test_no_store_answering_closes_the_client_as_an_unreachable_store():
    primary, a = _store()
    standby, b = _store()
    _kill(primary)
    _kill(standby)
    relay = Relay(f"{a},{b}", "").start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception):
            import torch.distributed as dist

            host, port = parse_endpoint(relay.endpoint)
            dist.TCPStore(host, port, is_master=False,
                          timeout=datetime.timedelta(seconds=2)).get("x")
        assert time.monotonic() - t0 < 15
        assert relay.failovers == 0
    finally:
        relay.stop()

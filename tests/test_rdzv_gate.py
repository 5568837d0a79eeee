"""The token in front of the rendezvous store (``trainguard.rendezvous.gate``), against a real
``python -m trainguard.rendezvous.store`` and real torch ``TCPStore`` clients."""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import pytest

from trainguard.rendezvous import store as rendezvous
from trainguard.rendezvous.endpoint import is_tls
from trainguard.rendezvous.gate import PREAMBLE, TOKEN_ENV, Gate, Relay, preamble, relay_for

TOKEN = "t0ken-for-tests_0123456789abcdef"


@pytest.fixture()
def gated_store():
    env = {**os.environ, TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.rendezvous.store", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert "(token required)" in line, line + proc.stderr.read()
    yield line.split()[1], proc
    proc.terminate()
    proc.wait(10)


def _bare_client(endpoint: str):
    import torch.distributed as dist

    host, port = rendezvous.parse_endpoint(endpoint)
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=3))


def test_only_clients_with_the_token_reach_the_store(gated_store, monkeypatch):
    endpoint, proc = gated_store
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    store = rendezvous.connect_store(endpoint, timeout_s=10)  # through this process's relay
    store.set("job/g1/rank0", "4242")
    assert store.get("job/g1/rank0") == b"4242"
    assert relay_for(endpoint) != endpoint and relay_for(endpoint).startswith("127.0.0.1:")
    # torch's own client without the preamble: closed before the store sees a byte
    with pytest.raises(Exception):
        _bare_client(endpoint).get("job/g1/rank0")
    # a wrong token, and garbage: closed too
    host, port = rendezvous.parse_endpoint(endpoint)
    for first in (preamble("not-the-token"), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(first + b"\x00" * 16)
            s.settimeout(5)
            assert s.recv(100) == b""  # closed by the gate
    proc.terminate()
    _out, err = proc.communicate(timeout=10)
    assert "refused a connection from 127.0.0.1" in err, err


def test_gate_counts_refusals_not_port_probes_and_passes_pipelined_bytes():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    seen: list[str] = []
    gate = Gate("127.0.0.1", 0, master.port, TOKEN, on_refused=lambda p, why: seen.append(why))
    gate.start()
    try:
        socket.create_connection(("127.0.0.1", gate.port), timeout=5).close()  # a probe
        with socket.create_connection(("127.0.0.1", gate.port), timeout=5) as s:
            s.sendall(PREAMBLE + b"wrong\n")
            assert s.recv(10) == b""
        relay = Relay(gate.endpoint, TOKEN).start()
        try:
            client = dist.TCPStore("127.0.0.1", relay.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=10))
            client.set("k", "v" * 100_000)  # larger than one read: relayed whole
            assert master.get("k") == b"v" * 100_000
            assert client.add("n", 3) == 3 and master.add("n", 1) == 4
        finally:
            relay.stop()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == ["a wrong token"] and gate.refused == 1 and gate.admitted >= 1
    finally:
        gate.stop()


def test_a_token_must_be_one_word():
    for bad in ("", "two words", "tab\tin"):
        with pytest.raises(ValueError):
            preamble(bad)


def test_ranks_get_the_relay_and_never_the_token(monkeypatch):
    from trainguard.launch.config import LaunchConfig
    from trainguard.launch.pool import ProcessPool

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = LaunchConfig(script="train.py", job="j", rdzv_endpoint="10.0.0.5:29400",
                       nats_url="nats://x:4222", redis_url="redis://x:6379")
    pool = ProcessPool(cfg, bus=None, post=lambda ev: None)
    pool.rdzv_relay = "127.0.0.1:40123"
    env = pool.base_env()
    assert TOKEN_ENV not in env
    assert env["TG_RDZV_ENDPOINT"] == "127.0.0.1:40123"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "40123")


@pytest.fixture()
def tls_gated_store(tmp_path):
    """``python -m trainguard.rendezvous.store`` with a token and the stack's kind of certificate
    (``trainguard.security.tls.ensure``): the gate serves TLS only."""
    from trainguard.security import tls

    files = tls.ensure(tmp_path / "tls", ["127.0.0.1", "localhost"])
    env = {**os.environ, TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.rendezvous.store", "--port", "0",
                             "--tls-cert", str(files.cert), "--tls-key", str(files.key)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert line.startswith("ready tls://127.0.0.1:"), line + proc.stderr.read()
    yield line.split()[1], files, proc
    proc.terminate()
    proc.wait(10)


def test_a_tls_gate_carries_the_token_only_inside_tls(tls_gated_store, tmp_path, monkeypatch):
    """With TLS the relay verifies the gate against the CA and sends the token inside TLS: a
    client with the token reaches the store; the token sent in clear, torch's own client, and
    a relay trusting another CA never do (the gate answers nothing but a TLS handshake)."""
    from trainguard.security import tls

    endpoint, files, _proc = tls_gated_store
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(tls.CA_ENV, str(files.ca))
    store = rendezvous.connect_store(endpoint, timeout_s=10)
    store.set("job/g1/rank0", "7")
    assert store.get("job/g1/rank0") == b"7"
    host, port = rendezvous.parse_endpoint(endpoint)
    assert endpoint == f"tls://{host}:{port}"
    with socket.create_connection((host, port), timeout=5) as s:  # the right token, in clear
        s.sendall(preamble(TOKEN) + b"\x00" * 16)
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(100):
                got += chunk
        except ConnectionError:
            pass
        # closed, at most after a TLS alert record (content type 21): never a store's answer
        assert got == b"" or got[0] == 0x15, got
    with pytest.raises(Exception):
        _bare_client(endpoint).get("job/g1/rank0")
    other = tls.ensure(tmp_path / "other", ["127.0.0.1"])
    wrong = Relay(endpoint, TOKEN, ca=str(other.ca)).start()
    try:
        import torch.distributed as dist

        with pytest.raises(Exception):
            dist.TCPStore("127.0.0.1", wrong.port, is_master=False,
                          timeout=datetime.timedelta(seconds=3)).get("job/g1/rank0")
    finally:
        wrong.stop()


def test_a_tls_endpoint_needs_the_token():
    with pytest.raises(ValueError, match="TG_RDZV_TOKEN"):
        relay_for("tls://127.0.0.1:29400", token="")
    assert rendezvous.parse_endpoint("tls://h.example:29400") == ("h.example", 29400)
    assert is_tls("tls://h:1") and not is_tls("h:1")
    with pytest.raises(SystemExit):
        rendezvous.main(["--port", "0", "--tls-cert", "c.pem"])  # the key is missing


def _listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (``/proc/net/tcp{,6}``)."""
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


def test_the_store_behind_the_gate_listens_on_loopback_only(gated_store):
    """TCPStore's own listener binds every interface whatever host it is given: the store a
    gate fronts must not, or a client without the token reaches it on the host's other
    addresses. Only the gate's port is on the listen address; the store's is 127.0.0.1."""
    import psutil

    endpoint, proc = gated_store
    _, gate_port = rendezvous.parse_endpoint(endpoint)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ports = _listening_ports(proc.pid)
        if len(ports) >= 2:
            break
        time.sleep(0.1)
    store = [(ip, port) for ip, port in ports if port != gate_port]
    assert store and all(ip == "127.0.0.1" for ip, _ in store), ports
    assert psutil.Process(proc.pid).is_running()

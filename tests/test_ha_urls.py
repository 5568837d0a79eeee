"""The replicated control plane's URL forms and stream copies, offline: the sentinel URL, the NATS
server list and the stream replica counts (the servers themselves: ``test_ha_e2e.py``)."""
from __future__ import annotations

import pytest

from trainguard.security.credentials import redact
from trainguard.clients.nats_url import server_options
from trainguard.clients.streams import STREAMS, stream_replicas
from trainguard.stack.ha import SENTINEL_READ_RULES, sentinel_config
from trainguard.clients.store_sentinel import SentinelURL, is_sentinel_url, parse


@pytest.mark.parametrize("url, want", [
    ("redis+sentinel://worker:pw@127.0.0.1:26379,127.0.0.1:26380,h3:26381/trainguard/0",
     SentinelURL((("127.0.0.1", 26379), ("127.0.0.1", 26380), ("h3", 26381)), "trainguard", 0,
                 "worker", "pw", False)),
    ("redis+sentinel://s1:1/m", SentinelURL((("s1", 1),), "m")),
    ("rediss+sentinel://u:p%40ss@[::1]:5/m/3",
     SentinelURL((("::1", 5),), "m", 3, "u", "p@ss", True)),
])
def test_a_sentinel_url_names_the_sentinels_master_db_and_user(url, want):
    assert is_sentinel_url(url)
    assert parse(url) == want


@pytest.mark.parametrize("url", [
    "redis+sentinel://h:1",            # no master name
    "redis+sentinel://h/m",            # no port
    "redis+sentinel://h:x/m",          # port not a number
    "redis+sentinel://h:1,/m",         # empty host
    "redis+sentinel://h:1/m/db",       # db not a number
])
def test_a_bad_sentinel_url_says_the_form(url):
    with pytest.raises(ValueError):
        parse(url)


def test_plain_urls_are_not_sentinel_urls():
    assert not is_sentinel_url("redis://u:p@h:6379/0")
    assert not is_sentinel_url("rediss://h:6379")


def test_a_server_list_connects_to_each_with_the_first_credentials():
    opts = server_options("nats://u:p@h1:1, nats://u:p@h2:2,nats://u:p@h3:3")
    assert opts == {"servers": ["nats://u:p@h1:1", "nats://u:p@h2:2", "nats://u:p@h3:3"],
                    "user": "u", "password": "p"}
    assert server_options("nats://u:p@h1:1") == {"servers": "nats://u:p@h1:1"}
    with pytest.raises(ValueError):
        server_options(" , ")


def test_every_password_of_a_list_is_redacted():
    assert redact("tls://a:s1@h:1,tls://a:s2@h:2") == "tls://a:***@h:1,tls://a:***@h:2"
    assert redact("redis+sentinel://w:s3@h:1,h:2/m/0") == "redis+sentinel://w:***@h:1,h:2/m/0"
    assert redact("redis://u:s4@h:1/0") == "redis://u:***@h:1/0"


def test_streams_get_three_copies_on_a_cluster_and_one_on_a_server():
    names = [n for n, _s, _a in STREAMS]
    assert {n: stream_replicas(n, 3) for n in names} == {n: 3 for n in names}
    assert {n: stream_replicas(n, 5) for n in names} == {n: 3 for n in names}
    assert {n: stream_replicas(n, 1) for n in names} == {n: 1 for n in names}
    assert stream_replicas("TG_EVENTS", 2) == 2


def test_sentinels_let_roles_find_the_primary_and_only_admin_change_it():
    from trainguard.security.credentials import Credentials

    class Creds(Credentials):
        def __init__(self):
            pass

        def users(self):
            return [("admin", "pa", None), ("worker", "pw", None)]

        def password(self, role):
            return {"admin": "pa", "worker": "pw"}[role]

    text = sentinel_config("127.0.0.1", 26379, "/tmp/x", "tg", ("127.0.0.1", 6379), 2, 1000,
                           2000, Creds())
    lines = text.splitlines()
    assert "sentinel monitor tg 127.0.0.1 6379 2" in lines
    assert "sentinel down-after-milliseconds tg 1000" in lines
    assert "user default off" in lines
    assert "user admin on >pa ~* &* +@all" in lines
    assert f"user worker on >pw {SENTINEL_READ_RULES}" in lines
    assert "+sentinel|failover" not in SENTINEL_READ_RULES and "+@all" not in SENTINEL_READ_RULES

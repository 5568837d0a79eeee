"""A rendezvous store's endpoint as trainguard hands it out: ``host:port``, or
``tls://host:port`` for a store behind a TLS gate (``trainguard.rendezvous.gate``); several,
comma-separated, for a store with standbys (``host:port,host2:port2``: the first the primary,
the others taken over in order by the clients' relay when it stops answering). Pure."""
from __future__ import annotations

__all__ = ["TLS_SCHEME", "is_tls", "parse_endpoint", "split_endpoints"]

#: Scheme of an endpoint whose gate serves TLS (``trainguard up`` with TLS prints
#: ``TG_RDZV_ENDPOINT=tls://host:port``): its clients reach it through a relay
#: (``rdzv_gate.relay_for``), which needs the store's token and verifies the gate's certificate
#: against ``TG_TLS_CA``.
TLS_SCHEME = "tls://"


def is_tls(endpoint: str) -> bool:
    """True for an endpoint whose gate serves TLS (``tls://host:port``; of a list, its first)."""
    return endpoint.strip().startswith(TLS_SCHEME)


def split_endpoints(endpoint: str) -> list[str]:
    """``"a:1,b:2"`` → ``["a:1", "b:2"]`` (the primary first, then its standbys), each checked
    with ``parse_endpoint``. Raises ValueError for an empty list, a malformed entry, or a list
    mixing ``tls://`` and plain stores (a relay speaks one or the other to all of them)."""
    out = [e.strip() for e in endpoint.split(",") if e.strip()]
    if not out:
        raise ValueError(f"rendezvous endpoint {endpoint!r} names no store (host:port)")
    for e in out:
        parse_endpoint(e)
    if len({is_tls(e) for e in out}) > 1:
        raise ValueError(f"rendezvous endpoint {endpoint!r} mixes tls:// and plain stores")
    return out


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"tls://host:port"`` → (host, port); raises ValueError saying the
    expected form (a list of several is ``split_endpoints``'s)."""
    if "," in endpoint:
        raise ValueError(f"rendezvous endpoint {endpoint!r} names several stores where one "
                         f"host:port is expected")
    if is_tls(endpoint):
        endpoint = endpoint[len(TLS_SCHEME):]
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rendezvous endpoint {endpoint!r} must be host:port")
    return host or "127.0.0.1", int(port)

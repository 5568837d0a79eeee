"""A rendezvous store's endpoint as trainguard hands it out: ``host:port``, or
``tls://host:port`` for a store behind a TLS gate (``trainguard.rendezvous.gate``). Pure."""
from __future__ import annotations

__all__ = ["TLS_SCHEME", "is_tls", "parse_endpoint"]

#: Scheme of an endpoint whose gate serves TLS (``trainguard up`` with TLS prints
#: ``TG_RDZV_ENDPOINT=tls://host:port``): its clients reach it through a relay
#: (``rdzv_gate.relay_for``), which needs the store's token and verifies the gate's certificate
#: against ``TG_TLS_CA``.
TLS_SCHEME = "tls://"


def is_tls(endpoint: str) -> bool:
    """True for an endpoint whose gate serves TLS (``tls://host:port``)."""
    return endpoint.startswith(TLS_SCHEME)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"tls://host:port"`` → (host, port); raises ValueError saying the
    expected form."""
    if is_tls(endpoint):
        endpoint = endpoint[len(TLS_SCHEME):]
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rendezvous endpoint {endpoint!r} must be host:port")
    return host or "127.0.0.1", int(port)

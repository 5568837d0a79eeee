"""What a NATS URL means to trainguard's bus client: the servers and credentials nats-py
connects with, the TLS context, and the inbox prefix replies come under.

A URL is one server or a comma-separated list of the servers of one cluster
(``nats://u:p@h1:4222,nats://u:p@h2:4222``); ``tls://`` asks for TLS.
"""
from __future__ import annotations

import logging
import ssl
from typing import Any
from urllib.parse import urlsplit

from trainguard.security.roles import inbox_of
from trainguard.security.tls import ca_file, client_context


class _QuietTLSClose(logging.Filter):
    """Drops asyncio's ``returning true from eof_received() has no effect when using ssl``:
    nats-py's protocol asks to keep a half-closed connection open, which asyncio cannot do over
    TLS and says on every TLS connection that closes (a client revoked and reconnecting said it
    10 times a second); nothing is wrong and nothing else is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_QuietTLSClose())


def tls_context(url: str, ca: str | None = None) -> ssl.SSLContext | None:
    """The client TLS context for NATS ``url`` (a comma-separated list): one verifying against
    ``ca_file(ca)`` when a server is ``tls://`` or a CA file is given (``ca`` or env
    ``TG_TLS_CA``: a ``nats://`` server that requires TLS then works too), else None (nats-py
    upgrades to TLS with the system's trust store if the server requires it)."""
    if ca_file(ca) or any(u.strip().startswith("tls://") for u in url.split(",")):
        return client_context(ca)
    return None


def server_options(url: str) -> dict[str, Any]:
    """nats-py's ``connect`` options for NATS ``url``, one URL or a comma-separated list of the
    servers of one cluster (``nats://u:p@h1:4222,nats://u:p@h2:4222``): ``servers`` (a list when
    there are several: the client connects to one and, when it goes, to another, as it does to
    the servers the cluster announces), and ``user``/``password`` of the first URL that has them,
    so that an announced server (named without credentials) is logged into as the same user.
    Raises ValueError for an empty ``url``."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError("empty NATS URL")
    opts: dict[str, Any] = {"servers": urls if len(urls) > 1 else urls[0]}
    if len(urls) > 1:
        for u in urls:
            try:
                parts_ = urlsplit(u)
            except ValueError:
                continue
            if parts_.username and parts_.password:
                opts["user"], opts["password"] = parts_.username, parts_.password
                break
    return opts


def user_inbox(url: str) -> str:
    """The inbox prefix of the user in NATS URL ``url`` (``auth.inbox_of``: ``_INBOX.<user>``),
    or ``_INBOX`` for a URL without a user. ``trainguard.security.roles`` lets each role and
    per-job user subscribe to its own prefix only, so no client reads the replies to another's
    requests (a JetStream answer carries stored events)."""
    try:
        user = urlsplit(url.split(",", 1)[0]).username
    except ValueError:
        user = None
    return inbox_of(user) if user else "_INBOX"

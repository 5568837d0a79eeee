"""Errors shared by trainguard's clients of its servers (the bus and the state store)."""
from __future__ import annotations


class ServerUnreachable(ConnectionError):
    """NATS or Redis/Valkey did not answer. ``what`` ("NATS" or "Redis/Valkey"), ``url``,
    ``reason`` (the client's own last error); ``str()`` adds what to do next: start one with
    ``trainguard up`` or point ``env`` (the URL's environment variable) at a running server.
    A caller for whom that advice is wrong (``trainguard up`` itself) words its own from the
    attributes."""

    def __init__(self, what: str, url: str, reason: str, env: str):
        self.what, self.url, self.reason, self.env = what, url, reason, env
        if "CERTIFICATE_VERIFY_FAILED" in reason or "TLS Required" in reason:
            hint = ("the server speaks TLS with a certificate this client does not trust: set "
                    "TG_TLS_CA to the CA file `trainguard up` printed (<data dir>/tls/ca.pem)")
        else:
            hint = f"start one with `trainguard up` or set {env} to a running server"
        super().__init__(f"cannot reach {what} at {url} ({reason}): {hint}")

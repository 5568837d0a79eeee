"""Errors shared by trainguard's clients of its servers (the bus and the state store)."""
from __future__ import annotations


class ServerUnreachable(ConnectionError):
    """NATS or Redis/Valkey did not answer. ``what`` ("NATS" or "Redis/Valkey"), ``url``,
    ``reason`` (the client's own last error); ``str()`` adds what to do next: start one with
    ``trainguard up`` or point ``env`` (the URL's environment variable) at a running server.
    A caller for whom that advice is wrong (``trainguard up`` itself) words its own from the
    attributes."""

    #: what a server says when it refuses a client's user or password (NATS, Valkey/Redis)
    REFUSALS = ("Authorization Violation", "invalid username-password", "WRONGPASS",
                "Authentication Timeout")

    @classmethod
    def is_refusal(cls, text: str) -> bool:
        """Whether a client's error ``text`` is a server refusing its credentials."""
        return any(r.lower() in text.lower() for r in cls.REFUSALS)

    def __init__(self, what: str, url: str, reason: str, env: str):
        self.what, self.url, self.reason, self.env = what, url, reason, env
        #: the server answered and refused the credentials: trying again will not help
        self.refused = self.is_refusal(reason)
        if self.refused:
            hint = ("the server refused these credentials: check the user and password in the "
                    "URL (the export line or env/<role>.env that `trainguard up` or `trainguard "
                    "credentials issue` printed; a revoked or rotated user needs the new one)")
        elif "is unusable" in reason and "CA file" in reason:
            hint = "point TG_TLS_CA at the CA file `trainguard up` printed (<data dir>/tls/ca.pem)"
        elif "CERTIFICATE_VERIFY_FAILED" in reason or "TLS Required" in reason:
            hint = ("the server speaks TLS with a certificate this client does not trust: set "
                    "TG_TLS_CA to the CA file `trainguard up` printed (<data dir>/tls/ca.pem)")
        else:
            hint = f"start one with `trainguard up` or set {env} to a running server"
        super().__init__(f"cannot reach {what} at {url} ({reason}): {hint}")

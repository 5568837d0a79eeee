"""The servers' configuration that enforces the roles (``trainguard.security.roles.ROLES``):
the nats-server configuration with one user per role, per-job worker and per-node agent and
their subject permissions, and the Valkey ACL file (``default`` disabled, passwords as SHA-256),
with the rules an older Valkey or Redis does not know left out (``rules_for_version``).
"""
from __future__ import annotations

import hashlib
import json

from trainguard.security.credentials import Credentials
from trainguard.security.roles import Role

def nats_permissions(role: Role) -> dict:
    """The ``permissions`` block of ``role`` in a nats-server configuration."""
    perms: dict = {"publish": {"allow": list(role.publish)},
                   "subscribe": {"allow": list(role.subscribe)}}
    if role.responses:
        perms["allow_responses"] = True
    return perms



#: nats-server payload limit: the largest message any client may publish (bytes). The largest
#: legitimate events (a verdict with its evidence, a telemetry sample of 8 GPUs) are a few KiB;
#: the shim keeps the last 4000 characters of a traceback; a longer launcher log line is dropped
#: and counted by the publisher.
MAX_PAYLOAD = 1024 * 1024


def nats_config(creds: Credentials | None, host: str, port: int, store_dir: str,
                log_file: str | None, max_file_store: int, max_payload: int = MAX_PAYLOAD,
                http_port: int | None = None, tls: tuple[str, str] | None = None,
                pid_file: str | None = None) -> str:
    """The nats-server configuration (JSON, which nats-server reads as its config format):
    listen address, payload limit, JetStream store and its size cap (``max_file_store`` bytes),
    and one user per role and per job given its own workers, with their permissions (none when
    ``creds`` is None); ``log_file`` None: the log goes to stderr; ``http_port``: the
    monitoring port (health); ``tls``: ``(cert_file, key_file)`` — every client must speak TLS
    (a plaintext one is refused: ``Secure Connection - TLS Required``); ``pid_file``: where the
    server writes its pid (``reload_nats`` signals it)."""
    cfg: dict = {"server_name": "trainguard", "host": host, "port": port,
                 "max_payload": max_payload,
                 "jetstream": {"store_dir": store_dir, "max_file_store": max_file_store,
                               "max_memory_store": 64 * 1024 * 1024}}
    if log_file:
        cfg["log_file"] = log_file
    if pid_file:
        cfg["pid_file"] = pid_file
    if http_port:
        cfg["http_port"] = http_port
    if tls is not None:
        cfg["tls"] = {"cert_file": tls[0], "key_file": tls[1], "timeout": 5}
    if creds is not None:
        cfg["authorization"] = nats_users(creds)
    return json.dumps(cfg, indent=1) + "\n"


def nats_users(creds: Credentials) -> dict:
    """The ``authorization`` block of the nats-server configuration: every user of
    ``creds.users()`` with its permissions."""
    return {"users": [{"user": name, "password": pw, "permissions": nats_permissions(role)}
                      for name, pw, role in creds.users()]}


#: The oldest server the roles' rules work on (``(major, minor)``): ACL selectors
#: (``_JOBS_ADD``) came in Redis 7.0; Valkey's first release was 7.2.
VALKEY_MIN_VERSION = (7, 0)

#: ACL rules naming a command a server gained after ``VALKEY_MIN_VERSION``, with the release
#: that brought it: an older server refuses an ACL file or ``ACL SETUSER`` naming a command it
#: does not know, so ``rules_for_version`` leaves the rule out there. ``CLIENT SETINFO`` came in
#: Redis 7.2 (redis-py sends it on connect and ignores its refusal).
VALKEY_RULE_SINCE: dict[str, tuple[int, int]] = {"+client|setinfo": (7, 2)}


def rules_for_version(rules: str, version: tuple[int, int] | None) -> str:
    """``rules`` (space-separated ACL rules) without those ``VALKEY_RULE_SINCE`` says a server
    of ``version`` (``(major, minor)``, as ``redis_version`` reports it) does not know; all of
    them when ``version`` is None (a current server)."""
    if version is None:
        return rules
    return " ".join(r for r in rules.split()
                    if version >= VALKEY_RULE_SINCE.get(r.lower(), (0, 0)))


def valkey_user_rules(password: str, role: Role,
                      version: tuple[int, int] | None = None) -> str:
    """One Valkey ACL user's rules after its name: ``on``, the SHA-256 of ``password``, the
    role's key patterns and commands (``rules_for_version`` of a server of ``version``)."""
    return (f"on #{hashlib.sha256(password.encode()).hexdigest()} "
            f"{rules_for_version(role.valkey, version)}")


def _default_user_rules(version: tuple[int, int] | None) -> str:
    """What the ``default`` user (always ``off``: no connection can authenticate as it, so an
    unauthenticated client is answered NOAUTH) may run. Nothing, on a current server. Redis 7.0
    replays a MULTI/EXEC from its append-only file as ``default`` and checks that user's ACL
    there: with ``-@all`` every transaction of the AOF was refused at start ("ACLs rules changed
    between the moment the transaction was accumulated and the EXEC call", seen with Debian 12's
    7.0.15) and the job records were lost across a restart; 7.2 and Valkey skip the check for
    the AOF. So on a server before 7.2 the disabled ``default`` keeps every command."""
    if version is not None and version < (7, 2):
        return "~* &* +@all"
    return "-@all"


def valkey_acl(creds: Credentials, version: tuple[int, int] | None = None) -> str:
    """The Valkey ACL file: ``default`` disabled, one user per role and per job given its own
    workers, passwords as SHA-256; for a server of ``version`` (``rules_for_version``)."""
    lines = [f"user default off resetkeys {_default_user_rules(version)}"]
    for name, pw, role in creds.users():
        lines.append(f"user {name} {valkey_user_rules(pw, role, version)}")
    return "\n".join(lines) + "\n"

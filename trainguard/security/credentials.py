"""The passwords of the roles (``trainguard.security.roles``) and of the per-job and per-node
users, kept in the local stack's data directory; the rendezvous store's token; URLs with their
password hidden.

``Credentials`` generates one random password per role (``secrets.token_urlsafe``) into
``credentials.json`` (mode 0600) in the stack's data directory and reads it back on the next
start, so URLs stay valid across a stop/start. Deleting the file (or ``trainguard up
--rotate-credentials``) rotates every password at the next start. A per-job user's password
(``trainguard credentials issue --job NAME``) is kept there under ``jobs``, a per-node agent's
under ``nodes``; a rotation renews them too, ``Credentials.remove_job`` (``trainguard
credentials revoke``) takes one away.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

from trainguard.security.private_file import write_private
from trainguard.security.roles import (JOB_USER_PREFIX, NODE_USER_PREFIX, ROLES, Role, job_role,
                                       job_user, node_role, node_user)

@dataclass
class Credentials:
    """One password per role of ``ROLES``, one per job given its own workers (``jobs``: job
    name → password), one per node given its own agent (``nodes``: node name → password);
    ``path`` is where they are kept (None: in memory)."""

    passwords: dict[str, str]
    path: Path | None = None
    jobs: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def generate(cls, roles: Iterable[str] = ROLES) -> "Credentials":
        return cls({r: secrets.token_urlsafe(24) for r in roles})

    def users(self) -> list[tuple[str, str, Role]]:
        """``(user, password, role)`` of every role, then of every job's workers and every
        node's agent given their own user."""
        return ([(n, self.passwords[n], r) for n, r in ROLES.items()]
                + [(job_user(j), pw, job_role(j)) for j, pw in sorted(self.jobs.items())]
                + [(node_user(n), pw, node_role(n)) for n, pw in sorted(self.nodes.items())])

    def password(self, user: str) -> str:
        """The password of role, per-job or per-node user ``user``. Raises ``KeyError``."""
        if user in self.passwords:
            return self.passwords[user]
        for prefix, table in ((JOB_USER_PREFIX, self.jobs), (NODE_USER_PREFIX, self.nodes)):
            if user.startswith(prefix) and user[len(prefix):] in table:
                return table[user[len(prefix):]]
        raise KeyError(user)

    def save(self) -> None:
        """Write them to ``path`` (0600, atomically)."""
        if self.path is None:
            raise ValueError("these credentials have no file")
        write_private(self.path, json.dumps({"version": 1, "passwords": self.passwords,
                                             "jobs": self.jobs, "nodes": self.nodes},
                                            indent=1) + "\n")

    def _add(self, table: dict[str, str], name: str, rotate: bool) -> None:
        if rotate or name not in table:
            table[name] = secrets.token_urlsafe(24)
            if self.path is not None:
                self.save()

    def _remove(self, table: dict[str, str], name: str) -> bool:
        if table.pop(name, None) is None:
            return False
        if self.path is not None:
            self.save()
        return True

    def add_job(self, job: str, rotate: bool = False) -> str:
        """Give ``job``'s workers a password (a new one when ``rotate``), saved when the
        credentials have a file; returns the user name. Raises ``ValueError`` (``job_user``)."""
        user = job_user(job)
        self._add(self.jobs, job, rotate)
        return user

    def remove_job(self, job: str) -> bool:
        """Take ``job``'s workers' user away (saved when the credentials have a file); returns
        whether it had one."""
        return self._remove(self.jobs, job)

    def add_node(self, node: str, rotate: bool = False) -> str:
        """Give ``node``'s agent a password, as ``add_job``; returns the user name. Raises
        ``ValueError`` (``node_user``)."""
        user = node_user(node)
        self._add(self.nodes, node, rotate)
        return user

    def remove_node(self, node: str) -> bool:
        """Take ``node``'s agent's user away, as ``remove_job``."""
        return self._remove(self.nodes, node)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike, rotate: bool = False) -> "Credentials":
        """The credentials kept in ``path`` (a JSON file, mode 0600), created with fresh
        passwords when missing or when ``rotate``; a role added to ``ROLES`` since gets one.
        Raises ``ValueError`` for a file that is not the stack's credentials."""
        path = Path(path)
        kept: dict[str, str] = {}
        jobs: dict[str, str] = {}
        nodes: dict[str, str] = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
                kept = dict(data["passwords"])
                jobs = dict(data.get("jobs") or {})
                nodes = dict(data.get("nodes") or {})
            except (ValueError, KeyError, TypeError) as exc:
                if not rotate:  # a rotation replaces it whole
                    raise ValueError(f"{path} is not a trainguard credentials file ({exc}): "
                                     f"move it away and start again for new credentials") from None
        if rotate:  # every password anew; the jobs and nodes given their own keep one each
            kept, jobs = {}, {j: secrets.token_urlsafe(24) for j in jobs}
            nodes = {n: secrets.token_urlsafe(24) for n in nodes}
        fresh = cls.generate()
        creds = cls({r: kept.get(r) or fresh.passwords[r] for r in ROLES}, path, jobs, nodes)
        if creds.passwords != kept or rotate:
            creds.save()
        return creds

    def nats_url(self, role: str, host: str, port: int, tls: bool = False) -> str:
        """``nats://`` (``tls://`` when ``tls``) URL of role or per-job user ``role``."""
        return f"{'tls' if tls else 'nats'}://{role}:{self.password(role)}@{host}:{port}"

    def redis_url(self, role: str, host: str, port: int, db: int = 0, tls: bool = False) -> str:
        """``redis://`` (``rediss://`` when ``tls``) URL of role or per-job user ``role``."""
        return f"{'rediss' if tls else 'redis'}://{role}:{self.password(role)}@{host}:{port}/{db}"


#: Environment variable carrying the rendezvous store's token (``trainguard.rendezvous.gate``).
RDZV_TOKEN_ENV = "TG_RDZV_TOKEN"


def rdzv_token() -> str:
    """A new rendezvous store token (``trainguard.rendezvous.gate``): 32 URL-safe characters,
    192 bits from ``secrets``."""
    return secrets.token_urlsafe(24)


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs); every password of
    a comma-separated list (a NATS cluster's URLs, a sentinel URL's hosts) too."""
    if "," in url:
        return ",".join(re.sub(r"^([a-z+]+://[^:/@]*):[^@/]*@", r"\1:***@", part)
                        for part in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))

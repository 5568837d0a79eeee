"""Per-job and per-node users on a stack's state directory (``trainguard credentials issue`` /
``revoke``, ``Stack.issue_job``).

A new user is added to ``credentials.json``, to NATS by rewriting its users and a configuration
reload (``nats_server.reload_nats``), and to Valkey by ``ACL SETUSER`` + ``ACL SAVE`` as
``admin`` (``valkey_server.update_valkey_user``), without a restart; a stopped stack gets it at
its next start. Revoking takes it away the same way (``ACL DELUSER``); both servers close its
connections.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from trainguard.security.credentials import Credentials

from trainguard.security.roles import job_user, node_user
from trainguard.stack.nats_server import reload_nats
from trainguard.stack.valkey_server import update_valkey_user


def issue_job(data_dir: str | os.PathLike, job: str,
              rotate: bool = False) -> tuple[Credentials, bool]:
    """Give ``job``'s workers their own user (``trainguard.security.roles.job_role``) in the stack whose
    state is ``data_dir``: saved in its credentials file and, when the stack runs, added to NATS
    (``reload_nats``) and Valkey (``update_valkey_user``) at once; ``rotate``: a new password
    for a job that has one. Returns the credentials and whether running servers took the user
    at once (False: none runs there; the next start does). Raises ``FileNotFoundError`` when
    ``data_dir`` holds no stack's credentials, ``ValueError`` for a job name that cannot be
    one, ``ServerStartError`` when NATS refused the reload."""
    return _issue_user(data_dir, job_user(job), lambda creds: creds.add_job(job, rotate))


def issue_node(data_dir: str | os.PathLike, node: str,
               rotate: bool = False) -> tuple[Credentials, bool]:
    """Give ``node``'s agent its own user (``trainguard.security.roles.node_role``: that node's subjects
    only), as ``issue_job`` does a job's workers. Raises as ``issue_job``."""
    return _issue_user(data_dir, node_user(node), lambda creds: creds.add_node(node, rotate))


def revoke_job(data_dir: str | os.PathLike, job: str) -> tuple[bool, bool]:
    """Take ``job``'s workers' own user away on the stack whose state is ``data_dir``: removed
    from its credentials file and, when the stack runs, from NATS (``reload_nats``: the server
    closes the user's connections as it reloads) and Valkey (``ACL DELUSER``, which closes its
    connections); the user's ``env/job-<job>.env`` is deleted. A new connection with the old
    password is refused at once. Returns ``(had_user, live)``. Raises ``FileNotFoundError`` when
    ``data_dir`` holds no stack's credentials, ``ValueError`` for a job name that cannot be one,
    ``ServerStartError`` when NATS refused the reload."""
    return _revoke_user(data_dir, job_user(job), lambda creds: creds.remove_job(job))


def revoke_node(data_dir: str | os.PathLike, node: str) -> tuple[bool, bool]:
    """Take ``node``'s agent's own user away, as ``revoke_job`` does a job's. Returns
    ``(had_user, live)``; raises as ``revoke_job``."""
    return _revoke_user(data_dir, node_user(node), lambda creds: creds.remove_node(node))


def _issue_user(data_dir: str | os.PathLike, user: str,
                add: Callable[[Credentials], object]) -> tuple[Credentials, bool]:
    """``issue_job`` and ``issue_node``: ``add`` gives ``user`` a password (a new one when
    rotating)."""
    d = Path(data_dir)
    path = d / "credentials.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: start `trainguard up` (with this "
                                f"--data-dir) once first")
    creds = Credentials.load_or_create(path)
    try:
        before: str | None = creds.password(user)
    except KeyError:
        before = None
    add(creds)
    # a new password for a user that had one (``--rotate``): NATS closes the user's connections
    # as it reloads (their CONNECT no longer authenticates); Valkey keeps a connection that
    # authenticated once, so its sessions are closed too, or a leaked old password's open
    # session would outlive the rotation
    rotated = before is not None and before != creds.password(user)
    live = reload_nats(d / "nats", creds)  # idempotent: the servers may already have it
    live = update_valkey_user(d, creds, user, drop_sessions=rotated) or live
    return creds, live


def _revoke_user(data_dir: str | os.PathLike, user: str,
                 remove: Callable[[Credentials], bool]) -> tuple[bool, bool]:
    """``revoke_job`` and ``revoke_node``: ``remove`` takes the user from the credentials."""
    d = Path(data_dir)
    path = d / "credentials.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no stack keeps its state there")
    creds = Credentials.load_or_create(path)
    had = remove(creds)
    live = reload_nats(d / "nats", creds)
    live = update_valkey_user(d, creds, user) or live
    (d / "env" / f"{user}.env").unlink(missing_ok=True)
    return had, live

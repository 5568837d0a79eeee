"""The state directory of a stack: where ``trainguard up`` keeps credentials, TLS files, the
JetStream store and Valkey's append-only file across starts, locked so that two stacks never
share one; or a temporary directory removed when the stack stops.

Layout (``trainguard.stack.embedded.EmbeddedServers``; the replicated set has one folder per
server instead)::

    credentials.json   one password per role and per job given its own workers (0600)
    ports.json         the host and ports of the last start, tried first at the next one
    tls/               ca.pem, ca.key, server.pem, server.key (``trainguard.security.tls``; keys 0600)
    nats/nats.conf     generated config (0600; it holds the passwords)   nats/js/  the JetStream store
    nats/nats.pid      the running server's pid (for config reloads)
    valkey/users.acl   generated ACL (SHA-256 of the passwords)   valkey/appendonlydir/  the AOF
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from trainguard.stack.process import ServerStartError


def default_data_dir() -> Path:
    """Where ``trainguard up`` keeps its state: ``$XDG_STATE_HOME/trainguard``, else
    ``~/.local/state/trainguard``."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(base) / "trainguard"


def open_state_dir(data_dir: Path | None, prefix: str) -> tuple[Path, int | None, bool]:
    """The directory a stack keeps its state in: ``data_dir`` (created 0700 and locked, so two
    stacks never share it: ``lock_dir``), else a new temporary one named ``prefix…``. Returns
    ``(directory, lock fd or None, whether it is temporary)``; ``close_state_dir`` undoes it.
    Raises ServerStartError as ``lock_dir``."""
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(data_dir, 0o700)
        return data_dir, lock_dir(data_dir), False
    return Path(tempfile.mkdtemp(prefix=prefix)), None, True


def close_state_dir(directory: Path | None, lock: int | None, owned: bool) -> None:
    """Remove a temporary state directory (``owned``) and release a kept one's lock."""
    if owned and directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    if lock is not None:
        os.close(lock)  # releases the flock


def lock_dir(path: Path) -> int:
    """Hold an exclusive lock on ``path/lock`` (released when the returned fd is closed): two
    stacks on one data directory would share a JetStream store and an AOF. Raises
    ServerStartError when another process holds it."""
    import fcntl

    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ServerStartError(f"another trainguard stack uses the data directory {path}: stop "
                               f"it, or give this one its own --data-dir (or --ephemeral)")
    return fd

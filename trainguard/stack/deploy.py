"""The servers' files for docker compose and Kubernetes: ``python -m trainguard.stack.deploy``.

``compose-env`` prints the ``.env`` of passwords (one per role of
``trainguard.security.roles.ROLES``) and the rendezvous token; ``server-config DIR`` writes the
servers' files from it (``trainguard.security.server_config``), with a CA and server certificate
(``trainguard.security.tls``) in ``DIR/tls`` or, ``--tls-from``, those of a mounted Secret;
``tls-secret DIR`` makes that Secret's files once (every Kubernetes pod then agrees on the CA).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainguard.security import tls
from trainguard.security.credentials import RDZV_TOKEN_ENV, Credentials, rdzv_token
from trainguard.security.private_file import write_private
from trainguard.security.roles import ROLES
from trainguard.security.server_config import nats_config, valkey_acl


def _env_name(role: str) -> str:
    return f"TG_{role.upper()}_PASSWORD"


def compose_env() -> list[str]:
    """Fresh ``.env`` lines for docker compose (and the Kubernetes Secret
    ``trainguard-credentials``): ``TG_<ROLE>_PASSWORD=…`` per role, then
    ``TG_RDZV_TOKEN=…``, the rendezvous store's token (``rdzv_token``, as ``trainguard
    up`` makes it)."""
    return ([f"{_env_name(role)}={pw}" for role, pw in Credentials.generate().passwords.items()]
            + [f"{RDZV_TOKEN_ENV}={rdzv_token()}"])


def _server_tls(args, out: Path):
    """The TLS files ``server-config`` gives nats.conf: those of ``--tls-from`` (a mounted
    Secret, used as they are), else ``trainguard.security.tls.ensure`` in ``DIR/tls`` (the CA
    kept when present) made readable by the servers (``share_with_servers``), the CA copied to
    ``--ca-dir``. Raises ``FileNotFoundError`` for a ``--tls-from`` without the files,
    ``PermissionError`` for a ``--key-group`` this user may not give."""
    if args.tls_from:
        src = Path(args.tls_from).absolute()
        files = tls.TLSFiles(src / "ca.pem", src / "server.pem", src / "server.key")
        missing = [str(p) for p in (files.cert, files.key) if not p.exists()]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} missing: create the Secret with "
                                    f"`python -m trainguard.stack.deploy tls-secret DIR` "
                                    f"(deploy/README.md)")
        return files
    files = tls.ensure(out / "tls", [*tls.SERVICE_NAMES, *args.tls_san])
    tls.share_with_servers(files, args.key_group)
    if args.ca_dir:
        ca_dir = Path(args.ca_dir)
        ca_dir.mkdir(parents=True, exist_ok=True)
        write_private(ca_dir / "ca.pem", files.ca.read_text())
        os.chmod(ca_dir / "ca.pem", 0o644)  # a certificate: every client reads it
    return files


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.stack.deploy compose-env`` prints a fresh ``.env`` (``compose_env``);
    ``server-config DIR`` writes ``DIR/nats.conf`` (TLS required unless ``--no-tls``) and
    ``DIR/users.acl`` for the compose and Kubernetes servers from those variables, and the TLS
    files (``_server_tls``); ``tls-secret DIR`` writes a CA and a server certificate into DIR
    for the Kubernetes Secret ``trainguard-tls``. Exit status 2 for missing variables or
    files."""
    p = argparse.ArgumentParser(prog="python -m trainguard.stack.deploy")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("compose-env", help="print a password per role and the rendezvous token, "
                                       "as .env lines")
    sc = sub.add_parser("server-config", help="write nats.conf and users.acl from TG_*_PASSWORD, "
                                              "and the TLS CA and server certificate")
    sc.add_argument("dir")
    sc.add_argument("--store-dir", default="/data")
    sc.add_argument("--max-file-store", type=int, default=2 * 1024 ** 3)
    sc.add_argument("--no-tls", action="store_true", help="plaintext NATS, no certificates")
    sc.add_argument("--tls-san", action="append", default=[], metavar="NAME",
                    help="one more name the server certificate covers (repeatable)")
    sc.add_argument("--tls-from", metavar="SRC", help="use SRC/server.pem and SRC/server.key "
                    "(a mounted Secret) instead of generating DIR/tls")
    sc.add_argument("--ca-dir", help="also write the CA certificate to CA_DIR/ca.pem (0644), a "
                    "directory the clients mount without the servers' secrets")
    sc.add_argument("--key-group", type=int, metavar="GID", help="group id that may read the "
                    "server key (0640; default: 0600, this user only)")
    ts = sub.add_parser("tls-secret", help="write ca.pem, ca.key, server.pem, server.key into DIR "
                                           "for `kubectl create secret generic trainguard-tls`")
    ts.add_argument("dir")
    ts.add_argument("--tls-san", action="append", default=[], metavar="NAME")
    args = p.parse_args(argv)
    if args.cmd == "compose-env":
        print("\n".join(compose_env()))
        return 0
    if args.cmd == "tls-secret":
        files = tls.ensure(args.dir, [*tls.SERVICE_NAMES, *args.tls_san])
        print(f"trainguard.stack.deploy: {files.ca}, {files.cert}, {files.key} (keep "
              f"{args.dir}/ca.key private: a rerun signs a new server certificate with it). Then:\n"
              f"  kubectl -n trainguard create secret generic trainguard-tls "
              f"--from-file={files.ca} --from-file={files.cert} --from-file={files.key}\n"
              f"  kubectl -n trainguard create configmap trainguard-ca --from-file={files.ca}\n"
              f"  kubectl -n train create configmap trainguard-ca --from-file={files.ca}",
              file=sys.stderr)
        return 0
    missing = [_env_name(r) for r in ROLES if not os.environ.get(_env_name(r))]
    if missing:
        print(f"trainguard.stack.deploy: {', '.join(missing)} not set: create them with "
              f"`python -m trainguard.stack.deploy compose-env > .env` beside "
              f"docker-compose.yml", file=sys.stderr)
        return 2
    creds = Credentials({r: os.environ[_env_name(r)] for r in ROLES})
    out = Path(args.dir).absolute()  # nats.conf names its TLS files: from anywhere
    out.mkdir(parents=True, exist_ok=True)
    files = None
    if not args.no_tls:
        try:
            files = _server_tls(args, out)
        except (FileNotFoundError, PermissionError) as exc:  # no Secret; --key-group not ours
            print(f"trainguard.stack.deploy: {exc}", file=sys.stderr)
            return 2
    pair = (str(files.cert), str(files.key)) if files else None
    for name, text in (("nats.conf", nats_config(creds, "0.0.0.0", 4222, args.store_dir, None,
                                                 args.max_file_store, http_port=8222,
                                                 tls=pair)),
                       ("users.acl", valkey_acl(creds))):
        write_private(out / name, text)
    # users.acl holds SHA-256 hashes only and Valkey reads it as its own user (uid 999 in the
    # valkey image); nats.conf holds every role's password in clear and stays 0600 (NATS runs
    # as root in its image, as this one-shot does)
    os.chmod(out / "users.acl", 0o644)
    print(f"trainguard.stack.deploy: wrote {out}/nats.conf and {out}/users.acl"
          + (f", TLS from {files.cert.parent}" if files else " (no TLS)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The servers' files for docker compose and Kubernetes: ``python -m trainguard.stack.deploy``.

``compose-env`` prints the ``.env`` of passwords (one per role of
``trainguard.security.roles.ROLES``) and the rendezvous token; ``server-config DIR`` writes the
servers' files from it (``trainguard.security.server_config``), with a CA and server certificate
(``trainguard.security.tls``) in ``DIR/tls`` or, ``--tls-from``, those of a mounted Secret;
``tls-secret DIR`` makes that Secret's files once (every Kubernetes pod then agrees on the CA).
With ``--cluster`` and ``--sentinel-primary`` it writes the replicated servers' files too
(``trainguard.stack.cluster_config``): docker compose's profile ``ha`` and the Kubernetes overlay
``deploy/kubernetes/ha``.
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
from trainguard.stack import cluster_config as cc


def _env_name(role: str) -> str:
    return f"TG_{role.upper()}_PASSWORD"


#: ``.env`` lines of ``compose-env --ha``: docker compose runs the profile ``ha`` and none of
#: the single servers and services (their ``scale`` is ``TG_SINGLE_SCALE``; services without a
#: profile always run otherwise).
HA_ENV = ("COMPOSE_PROFILES=ha", "TG_SINGLE_SCALE=0")


def compose_env(ha: bool = False) -> list[str]:
    """Fresh ``.env`` lines for docker compose (and the Kubernetes Secret
    ``trainguard-credentials``): ``TG_<ROLE>_PASSWORD=…`` per role, then
    ``TG_RDZV_TOKEN=…``, the rendezvous store's token (``rdzv_token``, as ``trainguard
    up`` makes it); ``ha``: then ``HA_ENV``."""
    return ([f"{_env_name(role)}={pw}" for role, pw in Credentials.generate().passwords.items()]
            + [f"{RDZV_TOKEN_ENV}={rdzv_token()}"] + (list(HA_ENV) if ha else []))


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


def _write_replicated(args, creds: Credentials, files, out: Path, nats_text: str) -> list[str]:
    """The replicated servers' files of ``server-config`` (``trainguard.stack.cluster_config``),
    in ``out``; returns their names. ``--cluster``: ``<host>.conf`` per peer, or with
    ``--cluster-self NAME`` that peer's as ``nats.conf``; ``--sentinel-primary HOST``:
    ``valkey.conf`` (holds ``admin``'s password: 0640, of ``--key-group`` when given),
    ``sentinel.conf`` (0600), ``valkey-start.sh`` and ``sentinel-start.sh``. Raises ValueError for a bad peer list, a
    ``--cluster-self`` that is none of them, or Valkey files asked for without TLS."""
    written = []
    triple = (str(files.cert), str(files.key), str(files.ca)) if files else None
    if args.cluster:
        peers = cc.parse_peers(args.cluster)
        mine = [cc.peer_named(peers, args.cluster_self)] if args.cluster_self else peers
        for me in mine:
            name = "nats.conf" if args.cluster_self else f"{me.host}.conf"
            write_private(out / name, cc.nats_cluster_config(
                nats_text, me, peers, creds.password("admin"), args.port, triple))
            written.append(name)
    if args.sentinel_primary:
        if triple is None:
            raise ValueError("--sentinel-primary: the replicated Valkey serves TLS only "
                             "(leave out --no-tls)")
        sentinels = [h.strip() for h in args.sentinels.split(",") if h.strip()]
        if len(sentinels) < 3:
            raise ValueError(f"--sentinels: 3 or more host names, not {args.sentinels!r}")
        write_private(out / "valkey.conf",
                      cc.valkey_node_config(creds, str(out / "users.acl"), triple,
                                            args.store_dir))
        if args.key_group is not None:
            os.chown(out / "valkey.conf", -1, args.key_group)
        os.chmod(out / "valkey.conf", 0o640)  # valkey-server runs as the valkey user
        write_private(out / "sentinel.conf",
                      cc.ha_sentinel_config(creds, args.sentinel_primary, triple,
                                            quorum=len(sentinels) // 2 + 1,
                                            data_dir=args.store_dir))
        (out / "valkey-start.sh").write_text(cc.valkey_start_script(
            str(out / "valkey.conf"), sentinels, args.sentinel_primary, str(files.ca)))
        (out / "sentinel-start.sh").write_text(cc.sentinel_start_script(
            str(out / "sentinel.conf"), args.store_dir))
        for script in ("valkey-start.sh", "sentinel-start.sh"):
            os.chmod(out / script, 0o755)
        written += ["valkey.conf", "sentinel.conf", "valkey-start.sh", "sentinel-start.sh"]
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.stack.deploy compose-env`` prints a fresh ``.env`` (``compose_env``);
    ``server-config DIR`` writes ``DIR/nats.conf`` (TLS required unless ``--no-tls``) and
    ``DIR/users.acl`` for the compose and Kubernetes servers from those variables, and the TLS
    files (``_server_tls``); ``tls-secret DIR`` writes a CA and a server certificate into DIR
    for the Kubernetes Secret ``trainguard-tls``. Exit status 2 for missing variables or
    files."""
    p = argparse.ArgumentParser(prog="python -m trainguard.stack.deploy")
    sub = p.add_subparsers(dest="cmd", required=True)
    ce = sub.add_parser("compose-env", help="print a password per role and the rendezvous "
                                            "token, as .env lines")
    ce.add_argument("--ha", action="store_true", help="and select the profile ha: "
                    "the replicated servers and services, none of the single ones")
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
    sc.add_argument("--port", type=int, default=4222, help="NATS client port")
    sc.add_argument("--cluster", metavar="HOST[:PORT],…", help="the NATS cluster's servers and "
                    "route ports (default 6222): write <HOST>.conf for each")
    sc.add_argument("--cluster-self", metavar="NAME", help="with --cluster: write only this "
                    "server's, as nats.conf (NAME: its host or the host's first label)")
    sc.add_argument("--sentinel-primary", metavar="HOST", help="write valkey.conf, sentinel.conf, "
                    "valkey-start.sh and sentinel-start.sh for a Valkey primary HOST, its replicas and sentinels")
    sc.add_argument("--sentinels", default="sentinel-0,sentinel-1,sentinel-2", metavar="HOST,…",
                    help="the sentinels' host names (valkey-start.sh asks them for the primary)")
    ts = sub.add_parser("tls-secret", help="write ca.pem, ca.key, server.pem, server.key into DIR "
                                           "for `kubectl create secret generic trainguard-tls`")
    ts.add_argument("dir")
    ts.add_argument("--tls-san", action="append", default=[], metavar="NAME")
    args = p.parse_args(argv)
    if args.cmd == "compose-env":
        print("\n".join(compose_env(args.ha)))
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
    nats_text = nats_config(creds, "0.0.0.0", args.port, args.store_dir, None,
                            args.max_file_store, http_port=8222, tls=pair)
    for name, text in (("nats.conf", nats_text), ("users.acl", valkey_acl(creds))):
        write_private(out / name, text)
    try:
        more = _write_replicated(args, creds, files, out, nats_text)
    except ValueError as exc:
        print(f"trainguard.stack.deploy: {exc}", file=sys.stderr)
        return 2
    # users.acl holds SHA-256 hashes only and Valkey reads it as its own user (uid 999 in the
    # valkey image); nats.conf holds every role's password in clear and stays 0600 (NATS runs
    # as root in its image, as this one-shot does)
    os.chmod(out / "users.acl", 0o644)
    print(f"trainguard.stack.deploy: wrote {out}/nats.conf and {out}/users.acl"
          + "".join(f", {out}/{n}" for n in more)
          + (f", TLS from {files.cert.parent}" if files else " (no TLS)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

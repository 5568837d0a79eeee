"""``trainguard credentials issue --job NAME``: one job's workers get their own user.

The user ``job-<NAME>`` (``trainguard.security.roles.job_role``) may publish only that job's subjects
(rank heartbeats, worker, log, ckpt, recovery, action) plus node heartbeats and health
requests, listen only to that job's decisions and control requests, and write only that job's
Valkey keys. It is saved in ``DATA_DIR/credentials.json`` and, when ``trainguard up`` runs on
that data directory, added to NATS (config reload) and Valkey (``ACL SETUSER``) at once; a
stopped stack gets it at its next start. Prints the job's ``export NATS_URL=… REDIS_URL=…``
line (plus ``TG_TLS_CA``) on stdout and writes it to ``DATA_DIR/env/job-<NAME>.env`` (0600).
``--rotate``: a new password for that job (its launchers then need the new line).

``trainguard credentials revoke --job NAME`` takes the user away: removed from the credentials
file and its env file, from NATS by a configuration reload and from Valkey by ``ACL DELUSER``;
both servers close its open connections at once, so the job's launchers and ranks lose the bus
and the state store (training goes on stepping; they stop at the end of their lease).

``--node NAME`` instead of ``--job``: the node's agent gets (or loses) its own user ``node-<NAME>``
(``trainguard.security.roles.node_role``), which may publish only that node's telemetry, heartbeat, XID
and kernel subjects (the shared ``agent`` role may publish any node's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainguard.security.private_file import write_private

from trainguard.security.roles import job_user, node_user
from trainguard.stack.process import ServerStartError
from trainguard.stack.statedir import default_data_dir
from trainguard.stack.users import issue_job, issue_node, revoke_job, revoke_node


def exports(data_dir: Path, user: str) -> str:
    """The ``export`` line of ``user`` on the stack of ``data_dir`` (its last host and ports)."""
    from trainguard.security.credentials import Credentials

    creds = Credentials.load_or_create(data_dir / "credentials.json")
    ports = json.loads((data_dir / "ports.json").read_text())
    tls = ports.get("tls") or {}
    host = ports.get("host") or "127.0.0.1"
    line = (f"export NATS_URL={creds.nats_url(user, host, ports['nats'], tls=tls.get('nats'))} "
            f"REDIS_URL={creds.redis_url(user, host, ports['valkey'], tls=tls.get('valkey'))}")
    env = data_dir / "env" / "worker.env"
    if env.exists():  # the rendezvous endpoint of the running stack, as its worker line says
        for kv in env.read_text().split()[1:]:
            if kv.startswith(("TG_RDZV_ENDPOINT=", "TG_RDZV_TOKEN=")):
                line += f" {kv}"
    if tls.get("nats") or tls.get("valkey"):
        line += f" TG_TLS_CA={data_dir / 'tls' / 'ca.pem'}"
    return line


def main(argv: list[str] | None = None) -> int:
    """Returns 0 on success, 2 for a bad name or a data directory without a stack, 1 when a
    running server refused the new user."""
    p = argparse.ArgumentParser(prog="trainguard credentials", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    iss = sub.add_parser("issue", help="give a job's workers (or a node's agent) their own user")
    rev = sub.add_parser("revoke", help="take a job's (or a node's) own user away (its "
                         "connections close)")
    for sp in (iss, rev):
        who = sp.add_mutually_exclusive_group(required=True)
        who.add_argument("--job", help="job name (as `trainguard launch --job`)")
        who.add_argument("--node", help="node name (as `python -m trainguard.agents --node`)")
        sp.add_argument("--data-dir", default=None,
                        help=f"the stack's data directory (default {default_data_dir()})")
    iss.add_argument("--rotate", action="store_true", help="a new password for this job or node")
    args = p.parse_args(argv)
    data_dir = Path(args.data_dir or default_data_dir()).expanduser()
    kind, name = ("job", args.job) if args.job is not None else ("node", args.node)
    if args.cmd == "revoke":
        return _revoke(data_dir, kind, name)
    got = _change(issue_job if kind == "job" else issue_node, data_dir, name, args.rotate)
    if isinstance(got, int):
        return got
    _, live = got
    user = job_user(name) if kind == "job" else node_user(name)
    line = exports(data_dir, user)
    write_private(data_dir / "env" / f"{user}.env", line + "\n")
    print(line, flush=True)
    when = "now" if live else "at the next `trainguard up` (none runs on this data directory)"
    print(f"trainguard credentials: {user} may publish and write only {kind} {name!r}'s "
          f"subjects and keys, from {when}; also in {data_dir / 'env' / (user + '.env')}",
          file=sys.stderr)
    return 0


def _change(change, *args):
    """``change(*args)`` (``issue_job``, ``revoke_job`` or their node forms), or the exit status of its error,
    said on stderr: 2 for a bad name or a data directory without a stack, 1 when a running
    server refused the change."""
    try:
        return change(*args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"trainguard credentials: {exc}", file=sys.stderr)
        return 2
    except ServerStartError as exc:
        print(f"trainguard credentials: {exc}", file=sys.stderr)
        return 1


def _revoke(data_dir: Path, kind: str, name: str) -> int:
    got = _change(revoke_job if kind == "job" else revoke_node, data_dir, name)
    if isinstance(got, int):
        return got
    had, live = got
    user = job_user(name) if kind == "job" else node_user(name)
    if not had:
        print(f"trainguard credentials: {user} had no credentials here (nothing to revoke)",
              file=sys.stderr)
        return 0
    when = ("now: its open connections were closed" if live else
            "at the next `trainguard up` (none runs on this data directory)")
    print(f"trainguard credentials: {user} revoked, {when}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

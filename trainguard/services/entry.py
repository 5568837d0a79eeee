"""The command-line entry of a service: ``python -m trainguard.detector --nats-url …
--redis-url …`` (or env ``NATS_URL``, ``REDIS_URL``), which is what docker-compose and
Kubernetes run. It stops the service cleanly on SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Callable

from trainguard.schemas import subjects
from trainguard.services.base import Service, ServiceConfig


def main(factory: Callable[[ServiceConfig], Service], argv: list[str] | None = None) -> None:
    """Command-line entry of a service: parse the flags (``argv``; default ``sys.argv``), build
    ``factory(ServiceConfig)`` and run it until SIGTERM or SIGINT. Raises SystemExit with the
    reason when NATS or Valkey cannot be reached."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    prog = (f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None
            else None)  # `python -m trainguard.detector`, not `__main__.py`
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""))
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--node", default=subjects.default_node())
    p.add_argument("--replica", default=os.environ.get("TG_REPLICA", ""),
                   help="this replica's name among the service's replicas; a replica "
                        "restarted under the same name handles what arrived while it was down "
                        "(default: <host>-<pid>)")
    p.add_argument("--log-level", default=os.environ.get("TG_LOG_LEVEL", "INFO"))
    p.add_argument("--metrics-port", default=None,
                   help="serve Prometheus /metrics on this port (0: ephemeral; env "
                        "TG_METRICS_PORT; default off)")
    args, _ = p.parse_known_args(argv)
    if args.metrics_port is not None:
        os.environ["TG_METRICS_PORT"] = args.metrics_port
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServiceConfig(nats_url=args.nats_url, redis_url=args.redis_url, node=args.node,
                        **({"replica": args.replica} if args.replica else {}))
    svc = factory(cfg)

    async def _amain() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, svc.stop)
        await svc.run()

    try:
        asyncio.run(_amain())
    except ConnectionError as exc:  # NATS or Valkey unreachable: say so, no traceback
        raise SystemExit(f"{svc.name}: {exc}") from None

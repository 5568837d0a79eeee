"""Base of the trainguard services (agent, detector, attributor, remediator,
checkpoint_validator): bus + state connection, subscriptions, a periodic tick, a health
responder, and clean shutdown on SIGTERM/SIGINT.

A service is thin: ``handle`` parses (the bus already decoded and validated the event), calls a
pure decide function, and publishes what it returns. Each service also answers NATS requests on
``tg.svc.<name>.health`` with a JSON object ``{"ok": true, "name": …, "stats": {…}}``, which is
what ``trainguard up`` waits for. With ``TG_METRICS_PORT`` (or ``--metrics-port``) set, it also
serves Prometheus ``/metrics`` (``trainguard.metrics``; the port is in the health reply).

Run one alone with ``python -m <service> --nats-url URL --redis-url URL`` (or env ``NATS_URL``,
``REDIS_URL``), which is what docker-compose and Kubernetes do.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

from trainguard.schemas import subjects

from . import metrics, tracing
from .auth import redact
from .bus import Bus, Handler
from .state import StateStore

log = logging.getLogger("trainguard.service")


def health_subject(name: str) -> str:
    return f"tg.svc.{name}.health"


@dataclass
class ServiceConfig:
    """Connection settings shared by all services.

    ``nats_url``/``redis_url`` — required (env ``NATS_URL``/``REDIS_URL``); there is no default
    so a service never talks to a server by accident. ``node`` — this host's node name
    (env ``TG_NODE``, default the hostname). ``tick_s`` — period of ``tick()`` in seconds.
    ``queue`` — NATS queue group for running several replicas ("" = every replica sees all).
    """

    nats_url: str = field(default_factory=lambda: os.environ.get("NATS_URL", ""))
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", ""))
    node: str = field(default_factory=subjects.default_node)
    tick_s: float = 0.05
    queue: str = ""


class Service:
    """Subclass and set ``name``; override ``subscriptions``, ``setup``, ``tick``, ``health``."""

    name = "service"
    uses_state = True

    def __init__(self, config: ServiceConfig | None = None):
        self.config = config or ServiceConfig()
        if not self.config.nats_url:
            raise SystemExit(f"{self.name}: no NATS URL: pass --nats-url or set NATS_URL "
                             f"(`trainguard up` starts a local stack)")
        if self.uses_state and not self.config.redis_url:
            raise SystemExit(f"{self.name}: no Redis URL: pass --redis-url or set REDIS_URL")
        self.bus = Bus(self.config.nats_url, self.name)
        self.state: StateStore | None = None
        self.metrics: Any = None  # trainguard.metrics.Metrics when TG_METRICS_PORT is set
        self._stop = asyncio.Event()

    # ---- to override ------------------------------------------------------------------------
    def subscriptions(self) -> list[tuple[str, Handler]]:
        return []

    async def setup(self) -> None:
        """Called once connected, before subscribing."""

    async def tick(self) -> None:
        """Called every ``config.tick_s`` seconds."""

    def health(self) -> dict[str, Any]:
        return {}

    def extra_stats(self) -> dict[str, Any]:
        """Counters of the service base class, added to the health reply's ``stats``."""
        return {}

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await self.bus.connect(timeout=10.0)
        if self.uses_state:
            self.state = StateStore(self.config.redis_url)
            await self.state.ping()
        await self.setup()
        tracing.configure_from_env(self.name)
        self.metrics = metrics.mount(self)  # /metrics when TG_METRICS_PORT is set
        for subject, handler in self.subscriptions():
            await self.bus.subscribe(subject, tracing.traced(self.name, handler),
                                     queue=self.config.queue)
        await self.bus.nc.subscribe(health_subject(self.name), cb=self._health)
        await self.bus.flush()
        log.info("%s ready (nats=%s)", self.name, redact(self.config.nats_url))

    async def _health(self, msg: Any) -> None:
        s = self.bus.stats
        body = {"ok": True, "name": self.name, "pid": os.getpid(),
                "stats": {"received": s.received, "published": s.published,
                          "dropped": s.dropped, "handler_errors": s.handler_errors,
                          "bad": dict(s.bad), **self.extra_stats()},
                "metrics_port": self.metrics.port if self.metrics else None, **self.health()}
        await msg.respond(json.dumps(body).encode())

    async def run(self) -> None:
        """Start, tick until ``stop()``, then close connections."""
        await self.start()
        try:
            while not self._stop.is_set():
                try:
                    await self.tick()
                except Exception:  # noqa: BLE001 - a tick error never kills the service
                    log.exception("%s tick failed", self.name)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.config.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.close()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        await self.bus.close()
        if self.state is not None:
            await self.state.close()


def main(factory: Callable[[ServiceConfig], Service], argv: list[str] | None = None) -> None:
    """Command-line entry of a service: ``python -m trainguard.detector --nats-url … --redis-url …``."""
    p = argparse.ArgumentParser()
    p.add_argument("--nats-url", default=os.environ.get("NATS_URL", ""))
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--node", default=subjects.default_node())
    p.add_argument("--queue", default=os.environ.get("TG_QUEUE", ""))
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
                        queue=args.queue)
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

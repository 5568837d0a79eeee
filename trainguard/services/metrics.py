"""Prometheus metrics of a trainguard process: a ``/metrics`` endpoint (``prometheus-client``).

Off unless asked for: ``TG_METRICS_PORT`` (or a service's ``--metrics-port``) names the port;
``0`` takes an ephemeral one; ``TG_METRICS_HOST`` the address it listens on (default every
interface, ``0.0.0.0``: a Prometheus elsewhere scrapes it). ``trainguard up`` gives every service
a port of its own on the stack's address and prints the URLs (``trainguard.stack.endpoints``). The port
in use is in the service's health reply (``metrics_port``), so a tool finds it with
``tg.svc.<name>.health``.

What is exported (every name is in ``METRIC_NAMES``; ``deploy/grafana/trainguard.json``
queries only these, a test checks it):

* per service (``service`` label), read from the bus client and the reducer base at scrape time:
  ``tg_events_handled_total`` (messages received), ``tg_events_dead_lettered_total`` (messages
  that did not decode, republished on ``tg.dlq.<service>``), ``tg_handler_errors_total``,
  ``tg_events_published_total``, ``tg_reducer_effects_total``,
  ``tg_reducer_effect_errors_total``;
* from what a service publishes (event timestamps, Unix ns): ``tg_anomalies_total{fault_class,
  kind}`` and the histogram ``tg_fault_to_anomaly_seconds{fault_class}`` (``ts - first_ts``)
  of the detector's anomalies (a hang's ``first_ts`` is the rank's last progress: the silence
  before detection counts); ``tg_decisions_total{fault_class, action}`` and
  ``tg_fault_to_decision_seconds{fault_class, action}`` (``ts - fault_ts``) of the remediator's
  decisions; the node agent's telemetry as gauges ``tg_node_cpu_percent``,
  ``tg_node_memory_used_bytes``, ``tg_node_load1`` (``node``) and ``tg_gpu_utilization_percent``,
  ``tg_gpu_memory_used_bytes``, ``tg_gpu_temperature_celsius``, ``tg_gpu_power_watts``
  (``node``, ``gpu`` index);
* per job, from the goodput ledger (``trainguard.core.goodput``), where a process has jobs' events
  (the console): ``tg_job_training_goodput{job}`` and ``tg_job_gpu_seconds_lost{job, phase}``.

The publishes are observed by wrapping the service's ``Bus.publish`` (``mount``); nothing in a
reducer changes. Histogram buckets (seconds): from the measured recoveries of README (detection
0.05–3 s, decisions within a second, worker restarts 1–10 s) up to the 60 s watchdog.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable

from trainguard import schemas

log = logging.getLogger("trainguard.services.metrics")

#: Latency buckets in seconds (see the module docstring).
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)

SERVICE_COUNTERS = {
    "tg_events_handled_total": "messages the service received from the bus",
    "tg_events_dead_lettered_total": "messages that did not decode (sent to tg.dlq.<service>)",
    "tg_handler_errors_total": "messages whose handler raised",
    "tg_events_published_total": "events the service published",
    "tg_reducer_effects_total": "effects the service's reducer returned and were carried out",
    "tg_reducer_effect_errors_total": "effects (calls) that failed",
}
NODE_GAUGES = {"tg_node_cpu_percent": "cpu_percent", "tg_node_memory_used_bytes":
               "mem_used_bytes", "tg_node_load1": "load1"}
GPU_GAUGES = {"tg_gpu_utilization_percent": "util_percent", "tg_gpu_memory_used_bytes":
              "mem_used_bytes", "tg_gpu_temperature_celsius": "temperature_c",
              "tg_gpu_power_watts": "power_w"}
JOB_GAUGES = ("tg_job_training_goodput", "tg_job_gpu_seconds_lost")
EVENT_METRICS = ("tg_anomalies_total", "tg_fault_to_anomaly_seconds", "tg_decisions_total",
                 "tg_fault_to_decision_seconds")
#: Every metric name a trainguard process can export.
METRIC_NAMES = (tuple(SERVICE_COUNTERS) + EVENT_METRICS + tuple(NODE_GAUGES)
                + tuple(GPU_GAUGES) + JOB_GAUGES)


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start (``prometheus-client`` missing, port taken)."""


def port_from_env(value: str | None = None) -> int | None:
    """The port ``TG_METRICS_PORT`` (or ``value``) asks for: None when unset or empty (off),
    0 for an ephemeral port. Raises ``MetricsError`` for a value that is not a port."""
    raw = os.environ.get("TG_METRICS_PORT", "") if value is None else value
    if raw.strip() == "":
        return None
    try:
        port = int(raw)
    except ValueError:
        raise MetricsError(f"TG_METRICS_PORT={raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise MetricsError(f"TG_METRICS_PORT={raw!r} is not a port number (0..65535)")
    return port


class Metrics:
    """The metrics of one process: a registry, the event metrics, the scrape-time collectors
    (``add_collector``) and the HTTP server (``serve``)."""

    def __init__(self) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise MetricsError("metrics need prometheus-client: pip install "
                               "'trainguard[services]'") from None
        self.pc = pc
        self.registry = pc.CollectorRegistry()
        self.anomalies = pc.Counter("tg_anomalies", "anomalies published",
                                    ["fault_class", "kind"], registry=self.registry)
        self.fault_to_anomaly = pc.Histogram(
            "tg_fault_to_anomaly_seconds", "first evidence of a fault to its anomaly (s)",
            ["fault_class"], buckets=BUCKETS, registry=self.registry)
        self.decisions = pc.Counter("tg_decisions", "decisions published",
                                    ["fault_class", "action"], registry=self.registry)
        self.fault_to_decision = pc.Histogram(
            "tg_fault_to_decision_seconds", "fault to decision (s)", ["fault_class", "action"],
            buckets=BUCKETS, registry=self.registry)
        self.gauges: dict[str, Any] = {}
        for name in NODE_GAUGES:
            self.gauges[name] = pc.Gauge(name, "node agent telemetry", ["node"],
                                         registry=self.registry)
        for name in GPU_GAUGES:
            self.gauges[name] = pc.Gauge(name, "GPU telemetry (NVML)", ["node", "gpu"],
                                         registry=self.registry)
        self.server: Any = None
        self.port: int | None = None

    # ---- what a process publishes ------------------------------------------------------------
    def observe(self, ev: schemas.Event) -> None:
        """Count ``ev`` (an event this process published) into the event metrics."""
        if isinstance(ev, schemas.Anomaly):
            self.anomalies.labels(ev.fault_class, ev.kind).inc()
            if ev.first_ts and ev.ts >= ev.first_ts:
                self.fault_to_anomaly.labels(ev.fault_class).observe((ev.ts - ev.first_ts) / 1e9)
        elif isinstance(ev, schemas.Decision):
            self.decisions.labels(ev.fault_class, ev.action).inc()
            if ev.fault_ts and ev.ts >= ev.fault_ts:
                self.fault_to_decision.labels(ev.fault_class, ev.action).observe(
                    (ev.ts - ev.fault_ts) / 1e9)
        elif isinstance(ev, schemas.NodeTelemetry):
            node = ev.node or ""
            for name, attr in NODE_GAUGES.items():
                self.gauges[name].labels(node).set(float(getattr(ev, attr) or 0.0))
            for g in ev.gpus:
                for name, attr in GPU_GAUGES.items():
                    v = getattr(g, attr)
                    if v is not None:
                        self.gauges[name].labels(node, str(g.index)).set(float(v))

    def add_collector(self, collect: Callable[[], Iterable[Any]]) -> None:
        """Register ``collect()`` (yields metric families) to run at every scrape."""

        class _C:
            def collect(self_inner):  # noqa: N805 - prometheus calls collect()
                return collect()

        self.registry.register(_C())

    def service_collector(self, service: Any) -> None:
        """The per-service counters of ``SERVICE_COUNTERS``, read from ``service`` (its
        ``bus.stats``, and ``effects_run``/``effect_errors`` of a reducer service)."""
        from prometheus_client.core import CounterMetricFamily

        def collect() -> Iterable[Any]:
            s = service.bus.stats
            values = {"tg_events_handled_total": s.received,
                      "tg_events_dead_lettered_total": sum(s.bad.values()),
                      "tg_handler_errors_total": s.handler_errors,
                      "tg_events_published_total": s.published,
                      "tg_reducer_effects_total": getattr(service, "effects_run", 0),
                      "tg_reducer_effect_errors_total": getattr(service, "effect_errors", 0)}
            for name, doc in SERVICE_COUNTERS.items():
                fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["service"])
                fam.add_metric([service.name], values[name])
                yield fam

        self.add_collector(collect)

    # ---- the endpoint ------------------------------------------------------------------------
    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (0: ephemeral) in a thread; returns the port.
        Raises ``MetricsError`` when the port cannot be bound."""
        try:
            res = self.pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise MetricsError(f"metrics port {port}: {exc}") from None
        self.server = res[0] if isinstance(res, tuple) else res
        self.port = int(self.server.server_port)
        return self.port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def text(self) -> bytes:
        """The exposition text (what ``/metrics`` answers)."""
        return self.pc.generate_latest(self.registry)


def mount(service: Any, port: int | None = None) -> Metrics | None:
    """The hook of ``trainguard.services.base.Service.start``: when ``port`` (default
    ``TG_METRICS_PORT``) is set, serve the service's metrics and observe what it publishes;
    returns the ``Metrics`` (None when off). A port that cannot be served is logged, and the
    service runs on without metrics (metrics never stop a service)."""
    try:
        port = port_from_env() if port is None else port
        if port is None:
            return None
        m = Metrics()
        m.service_collector(service)
        extra = getattr(service, "metric_families", None)
        if callable(extra):  # a service's own gauges (the remediator's fleet breaker)
            m.add_collector(extra)
        m.serve(port, os.environ.get("TG_METRICS_HOST") or "0.0.0.0")
    except MetricsError as exc:
        log.error("%s: no metrics: %s", service.name, exc)
        return None
    publish, publish_stored = service.bus.publish, service.bus.publish_stored

    def _observe(event: schemas.Event) -> None:
        try:
            m.observe(event)
        except Exception as exc:  # noqa: BLE001 - a metric never fails a publish
            log.debug("metrics: %s", exc)

    async def observed(subject: str, event: schemas.Event, **kw: Any) -> None:
        await publish(subject, event, **kw)
        _observe(event)

    async def observed_stored(subject: str, event: schemas.Event, **kw: Any) -> int:
        seq = await publish_stored(subject, event, **kw)  # decisions: with a JetStream ack
        _observe(event)
        return seq

    service.bus.publish = observed
    service.bus.publish_stored = observed_stored
    log.info("%s: metrics on port %d (/metrics)", service.name, m.port)
    return m


def job_collector(m: Metrics, ledgers: Callable[[], Iterable[Any]]) -> None:
    """Per-job goodput gauges from ``ledgers()`` (``trainguard.core.goodput.Ledger`` objects), read
    at every scrape."""
    from prometheus_client.core import GaugeMetricFamily

    def collect() -> Iterable[Any]:
        good = GaugeMetricFamily("tg_job_training_goodput",
                                 "useful steps × fault-free step time / wall time", labels=["job"])
        lost = GaugeMetricFamily("tg_job_gpu_seconds_lost", "GPU-seconds lost to incidents, "
                                 "by phase", labels=["job", "phase"])
        for led in ledgers():
            if led.training_goodput is not None:
                good.add_metric([led.job], led.training_goodput)
            for phase, v in led.gpu_s_lost.items():
                lost.add_metric([led.job, phase], v)
        yield good
        yield lost

    m.add_collector(collect)

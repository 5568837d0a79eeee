"""A service's handling of an event becomes an OpenTelemetry span in the event's trace."""
import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from trainguard import schemas
from trainguard.services import tracing
from trainguard.clients.bus import Bus
from trainguard.services.base import Service, ServiceConfig


class _Echo(Service):
    name = "echo"
    uses_state = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.got = []

    def subscriptions(self):
        return [("tg.job.trace.log", self.on_log)]

    async def on_log(self, subject, ev):
        self.got.append(ev)


async def test_span_joins_the_event_trace(servers):
    exporter = InMemorySpanExporter()
    tracing.configure(exporter, service="test")
    try:
        svc = _Echo(ServiceConfig(nats_url=servers.nats_url))
        task = asyncio.create_task(svc.run())
        for _ in range(100):
            if svc.bus.connected:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        pub = await Bus(servers.nats_url, "pub").connect()
        ev = schemas.LogLine(job="trace", line="x")
        await pub.publish("tg.job.trace.log", ev)
        await pub.flush()
        for _ in range(100):
            if svc.got:
                break
            await asyncio.sleep(0.02)
        svc.stop()
        await task
        await pub.close()
        (span,) = exporter.get_finished_spans()
        assert span.name == "echo log.line"
        assert format(span.context.trace_id, "032x") == ev.trace_id
        assert span.attributes["trainguard.job"] == "trace"
    finally:
        tracing._provider = None

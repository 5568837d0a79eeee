"""What the demo sees of a job: its events from the bus, and the latest heartbeat of each rank."""
from __future__ import annotations

import threading
from typing import Any

from trainguard import schemas


class Recorder:
    """Collects the job's events from the bus (a ``ThreadedBus`` subscription to
    ``tg.job.<job>.>``) with the latest heartbeat of each rank."""

    def __init__(self, nats_url: str, job: str):
        from trainguard.clients.threaded_bus import ThreadedBus

        self.job = job
        self.lock = threading.Lock()
        self.events: list[schemas.Event] = []
        self.hb: dict[int, schemas.RankHeartbeat] = {}
        self.bus = ThreadedBus(nats_url, f"demo-recorder-{job}")
        self.bus.subscribe(f"tg.job.{job}.>", self._on)
        self.bus.start()
        self.bus.wait_connected(10)

    def _on(self, subject: str, ev: schemas.Event) -> None:
        with self.lock:
            if isinstance(ev, schemas.RankHeartbeat):
                if ev.rank is not None:
                    prev = self.hb.get(ev.rank)
                    if prev is None or ev.ts >= prev.ts:
                        self.hb[ev.rank] = ev
            else:
                self.events.append(ev)

    def of(self, cls: type, since_ns: int = 0) -> list[Any]:
        with self.lock:
            return [e for e in self.events if isinstance(e, cls) and e.ts >= since_ns]

    def heartbeat(self, rank: int) -> schemas.RankHeartbeat | None:
        return self.hb.get(rank)  # one dict read: atomic under the GIL

    def close(self) -> None:
        self.bus.close(timeout=1.0)

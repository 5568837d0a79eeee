"""The JetStream streams of trainguard: which subjects each keeps, for how long, in how many
bytes and how many copies, and the stream configurations ``Bus.ensure_streams`` applies.

Pure definitions: nothing here talks to a server.
"""
from __future__ import annotations

from dataclasses import dataclass

from nats.js.api import (DiscardPolicy, RetentionPolicy, StorageType, StreamConfig,
                         SubjectTransform)

from trainguard.core import partitions as parts

#: JetStream streams that keep event history for audit and replay.
#: (name, subjects, max_age seconds). Telemetry and heartbeats are kept briefly: the node
#: agents' (``tg.node.<node>.heartbeat``) and the launchers' (``tg.node.<node>.launcher.<job>``)
#: alike. An existing stream is given this configuration at the next ``ensure_streams``.
STREAMS: tuple[tuple[str, list[str], float], ...] = (
    ("TG_EVENTS", ["tg.job.*.log", "tg.job.*.worker", "tg.job.*.anomaly", "tg.job.*.verdict",
                   "tg.job.*.decision", "tg.job.*.ckpt", "tg.job.*.action", "tg.job.*.recovery",
                   "tg.node.*.xid", "tg.node.*.kernel", "tg.node.*.anomaly", "tg.node.*.slurm",
                   "tg.job.*.slurm"], 7 * 86400.0),
    ("TG_TELEMETRY", ["tg.node.*.telemetry", "tg.node.*.heartbeat", "tg.node.*.launcher.*",
                      "tg.job.*.rank.*.hb"], 3600.0),
    ("TG_DLQ", ["tg.dlq.>"], 7 * 86400.0),
)
#: The streams that keep job subjects, stored by partition (``trainguard.core.partitions``): a
#: replica of a partitioned service consumes only its partitions of them.
PARTITIONED_STREAMS = ("TG_EVENTS", "TG_TELEMETRY")

MiB = 1024 * 1024


@dataclass(frozen=True)
class StreamLimits:
    """Size bounds of one stream (bytes); the oldest messages go first when ``max_bytes`` is
    reached (discard old), so a flood costs history, never the disk."""

    max_bytes: int
    max_msg_size: int
    reason: str


#: Bounds of each stream of ``STREAMS`` (its age limit is there). A stream over its bound drops
#: its oldest messages; the JetStream store of the embedded NATS is capped at their sum plus a
#: margin (``streams_max_bytes``).
STREAM_LIMITS: dict[str, StreamLimits] = {
    "TG_EVENTS": StreamLimits(1024 * MiB, 1 * MiB,
                              "a week of faults, decisions and logs of a busy cluster is tens of "
                              "MiB; a message is at most the server's payload limit"),
    "TG_TELEMETRY": StreamLimits(256 * MiB, 256 * 1024,
                                 "an hour of heartbeats and telemetry of ~1,000 ranks and ~100 "
                                 "nodes; a telemetry sample is a few KiB"),
    "TG_DLQ": StreamLimits(64 * MiB, 16 * 1024,
                           "dead letters keep the reason headers and a 1 KiB prefix "
                           "(``dead_letters.DLQ_PREFIX_BYTES``): enough to see what was sent, "
                           "never a copy"),
}

#: Copies of each stream of ``STREAMS`` in a NATS cluster (capped at its size,
#: ``stream_replicas``): a stream acknowledges a message once a majority of its copies stored
#: it, so with 3 copies the loss of any one server loses no acknowledged decision, verdict,
#: action or dead letter (the design card: "JetStream R3 for decisions, outbox, audit and
#: verdicts"; the outbox and the audit trail themselves live in Valkey). Telemetry gets 3 too,
#: though it is re-sent every few seconds: the detector reads heartbeats through the stream
#: (``trainguard.services.durable``), so a one-copy telemetry stream on the server that died is
#: silence from every rank and node at once — ``bench/ha.py`` saw that become a node declared
#: lost and the job stopped.
STREAM_REPLICAS: dict[str, int] = {"TG_EVENTS": 3, "TG_TELEMETRY": 3, "TG_DLQ": 3}


def stream_replicas(name: str, cluster_size: int) -> int:
    """Copies stream ``name`` gets on a cluster of ``cluster_size`` servers (1 for a single
    server): ``STREAM_REPLICAS`` capped at the cluster size (JetStream refuses more copies than
    servers)."""
    return max(1, min(STREAM_REPLICAS.get(name, 1), cluster_size))


def streams_max_bytes(limits: dict[str, StreamLimits] | None = None) -> int:
    """Sum of the streams' ``max_bytes`` (bytes): what the JetStream store may hold."""
    return sum(lim.max_bytes for lim in (limits or STREAM_LIMITS).values())


def stream_configs(limits: dict[str, StreamLimits] | None = None, partitions: int = 0,
                   cluster_size: int = 1) -> list[StreamConfig]:
    """The configuration of each stream of ``STREAMS``: its age limit, the size bounds of
    ``limits`` (default ``STREAM_LIMITS``; KeyError for a stream it lacks), job subjects of
    ``PARTITIONED_STREAMS`` stored in ``partitions`` partitions (0: as published),
    ``stream_replicas(name, cluster_size)`` copies, direct gets allowed (``Bus.last_stored``:
    a get per subject) and the oldest messages discarded first."""
    limits = limits or STREAM_LIMITS
    out = []
    for name, subs, max_age in STREAMS:
        lim = limits[name]
        tr = None
        if partitions and name in PARTITIONED_STREAMS:
            src, dest = parts.transform(partitions)
            tr = SubjectTransform(src=src, dest=dest)
        out.append(StreamConfig(name=name, subjects=subs, max_age=max_age,
                                max_bytes=lim.max_bytes, max_msg_size=lim.max_msg_size,
                                discard=DiscardPolicy.OLD, subject_transform=tr,
                                allow_direct=True, retention=RetentionPolicy.LIMITS,
                                storage=StorageType.FILE,
                                num_replicas=stream_replicas(name, cluster_size)))
    return out

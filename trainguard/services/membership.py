"""Which replica of a service serves which job: leases in Valkey and rendezvous hashing.

Every replica of a service (``detector``, ``attributor``, ``remediator``,
``checkpoint_validator``) holds a lease in ``tg:members:<service>`` (``StateStore.renew_member``)
and renews it every ``MembershipConfig.renew_s``; a replica whose lease ran out (killed, hung,
cut off from Valkey) is no longer a member. A partition key — a job name, or ``node:<node>``
for what belongs to a node alone — is served by exactly one live member: the one with the
highest ``score(member, key)`` (rendezvous, or highest-random-weight, hashing). When a member
leaves only the keys it served move, each to the member that scored second for it; when one
joins it takes about 1/N of the keys from the others. Every replica computes the same owner
from the same member list, with no coordination beyond the list.

When the streams are partitioned (``trainguard.core.partitions``: the server stores a job's subjects
in partition ``partition(job, N)``), what is assigned to the members is the partition, not the
job: a replica owns whole partitions, so its durable consumers can filter on them and it
receives only its own jobs' messages. Plain rendezvous over 32 keys is uneven (6/9/17 of 32 for
three members seen), so partitions are assigned with bounded loads (``assign_partitions``):
each partition in turn goes to the member of highest weight for it that holds fewer than
⌈N / members⌉; a member leaving moves its own partitions and, at most, one or two of the
others'. ``job_owner`` is that rule, pure.

The pure parts (``score``, ``owner``, ``job_owner``, ``partition_key``) are what tests and the
bench drive; the ``Membership`` object is the service side (one lease, the member list, a cache
of decisions).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Iterable

from trainguard.core.partitions import partition
from trainguard.schemas.subjects import untoken

log = logging.getLogger("trainguard.services.membership")


@dataclass
class MembershipConfig:
    """Lease timing, seconds.

    * ``renew_s`` — period of the lease renewal and of the member-list read (1 s);
    * ``lease_s`` — how long a lease lasts unrenewed (3 s: three renewals may be missed —
      a Valkey round trip stalled by a busy host — before the replica's jobs move; a dead
      replica's jobs move within ``lease_s + renew_s``).
    """

    renew_s: float = 1.0
    lease_s: float = field(default_factory=lambda: float(os.environ.get("TG_LEASE_S", "3")))


def default_replica() -> str:
    """A replica name unique to this process (``<host>-<pid>``): a replica started without
    ``--replica`` gets fresh durable consumers, so only a named replica resumes its own."""
    return f"{socket.gethostname()}-{os.getpid()}"


def score(member: str, key: str) -> int:
    """The rendezvous weight of ``member`` for ``key``: the first 8 bytes of
    blake2b(member NUL key), as an unsigned integer (stable across processes and hosts)."""
    h = hashlib.blake2b(f"{member}\0{key}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def owner(key: str, members: Iterable[str]) -> str | None:
    """The member that serves ``key`` (None when there is no member). Ties — impossible in
    practice with 64-bit weights — go to the smaller name."""
    best: tuple[int, str] | None = None
    for m in members:
        s = score(m, key)
        if best is None or s > best[0] or (s == best[0] and m < best[1]):
            best = (s, m)
    return None if best is None else best[1]


@functools.lru_cache(maxsize=64)
def _assign(n: int, members: tuple[str, ...]) -> tuple[str, ...]:
    cap = math.ceil(n / len(members))
    load = dict.fromkeys(members, 0)
    out = []
    for p in range(n):
        key = f"partition:{p}"
        best = min((m for m in members if load[m] < cap), key=lambda m: (-score(m, key), m))
        load[best] += 1
        out.append(best)
    return tuple(out)


def assign_partitions(n: int, members: Iterable[str]) -> tuple[str, ...]:
    """The member serving each of ``n`` partitions (index = partition; empty without
    members): partitions 0 … n-1 in turn, each to the member with the highest ``score(member,
    "partition:<p>")`` among those holding fewer than ⌈n / members⌉ so far (rendezvous with
    bounded loads: every member holds ⌊n/m⌋ or ⌈n/m⌉)."""
    ms = tuple(sorted(set(members)))
    return _assign(n, ms) if ms and n > 0 else ()


def job_owner(key: str, members: Iterable[str], partitions: int = 0) -> str | None:
    """The member that serves partition key ``key`` (a job, or ``node:<node>``) when the job
    streams have ``partitions`` partitions: the owner of the job's partition
    (``assign_partitions``); a node key, or any key with 0 partitions, is hashed itself."""
    if partitions and not key.startswith("node:"):
        owners = assign_partitions(partitions, members)
        return owners[partition(key, partitions)] if owners else None
    return owner(key, members)


def partition_key(subject: str) -> str | None:
    """The partition key of a bus subject: the job of ``tg.job.<job>.…``, ``node:<node>`` of
    ``tg.node.<node>.…``, by name (a token's ``%2E`` read back as ``.``: the key a reducer
    asks ``serves`` about, so a dotted node name such as a Kubernetes node's
    ``ip-10-0-1-5.ec2.internal`` hashes to one owner whichever side asks); None for anything
    else (served by every replica)."""
    parts = subject.split(".", 3)
    if len(parts) >= 3 and parts[0] == "tg":
        if parts[1] == "job":
            return untoken(parts[2])
        if parts[1] == "node":
            return f"node:{untoken(parts[2])}"
    return None


class Membership:
    """One replica's view of its service's members.

    ``members`` is the last list read (this replica alone until the first renewal);
    ``epoch`` grows each time it changes. ``partitions`` — the job streams' partition count
    (0: not partitioned, jobs hashed one by one; ``set_partitions``). ``owns(key)`` is cached per
    epoch while there are other members."""

    def __init__(self, service: str, replica: str, config: MembershipConfig | None = None):
        self.service, self.replica = service, replica
        self.config = config or MembershipConfig()
        self.members: tuple[str, ...] = (replica,)
        self.epoch = 0
        self.partitions = 0
        self._cache: dict[str, bool] = {}
        self._owned: frozenset[int] | None = None

    def set_partitions(self, n: int) -> None:
        """Own by partition of ``n`` (0: by job)."""
        if n != self.partitions:
            self.partitions = n
            self._cache.clear()
            self._owned = None

    def owned_partitions(self) -> frozenset[int]:
        """The partitions this replica serves (empty when not partitioned)."""
        if self._owned is None:
            self._owned = frozenset(
                p for p, m in enumerate(assign_partitions(self.partitions, self.members))
                if m == self.replica)
        return self._owned

    def owns(self, key: str | None) -> bool:
        """Whether this replica serves partition ``key`` (None: everyone does). A replica alone
        serves every key, and caches none: the cache would keep every job and node name a
        hostile sender makes up (one per message of bench/fuzz.py's fresh tokens)."""
        if key is None or len(self.members) == 1:
            return True
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 200_000:
                self._cache.clear()
            got = self._cache[key] = \
                job_owner(key, self.members, self.partitions) == self.replica
        return got

    def update(self, members: Iterable[str]) -> bool:
        """Take a new member list (this replica is always in it: it serves while it runs);
        True when it changed."""
        new = tuple(sorted(set(members) | {self.replica}))
        if new == self.members:
            return False
        log.info("%s/%s: members %s -> %s", self.service, self.replica,
                 ",".join(self.members), ",".join(new))
        self.members = new
        self.epoch += 1
        self._cache.clear()
        self._owned = None
        return True

    async def renew(self, state) -> bool:
        """Renew this replica's lease in ``state`` (a ``StateStore``) and take the member list;
        True when it changed. Raises what the store raises (the caller retries next period)."""
        return self.update(await state.renew_member(self.service, self.replica,
                                                    self.config.lease_s))

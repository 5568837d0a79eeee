"""Who may do what on the bus and in the state store: roles as data, the credentials the local
stack generates for them, and the server configuration that enforces them.

Every process of the stack connects as one **role**; the role's password is in its URL
(``nats://<role>:<password>@host:port``, ``redis://<role>:<password>@host:port/0``), so no
launcher, shim or service needs an option of its own. ``ROLES`` is the one table: for each role
the NATS subjects it may publish and subscribe, the Valkey ACL rules it gets, and why. The
servers refuse everything else: NATS answers a publish outside the role's list with a
``Permissions Violation`` (the message is dropped, nobody receives it) and refuses a client
without a user (``Authorization Violation``); Valkey answers ``NOPERM`` for a key or command the
role lacks, and its ``default`` user is disabled.

The two decisions that matter most are single-writer:

* only the ``remediator`` may publish ``tg.job.<job>.decision`` (what launchers and shims carry
  out);
* only the ``checkpoint_validator`` may write ``tg:ckpt:*`` (whether a checkpoint may be resumed
  from; every other role reads it).

``Credentials`` generates one random password per role (``secrets.token_urlsafe``) into
``credentials.json`` (mode 0600) in the stack's data directory and reads it back on the next
start, so URLs stay valid across a stop/start. Deleting the file (or ``trainguard up
--rotate-credentials``) rotates every password at the next start.

**Per-job workers.** ``trainguard credentials issue --job NAME`` adds a user ``job-<NAME>``
(``job_role``): the ``worker`` row with every ``tg.job.*`` subject narrowed to that job's
(``tg.job.<NAME>.…``), the launcher's beat to its job's (``tg.node.*.launcher.<NAME>``), without
the node agent's heartbeat subject (health subjects stay as the worker's) and, in
Valkey, writes to that job's keys only (``tg:jobs``, ``tg:job:<NAME>``,
``tg:job:<NAME>:launchers``) and reads only that job's record, run and checkpoints; its replies
come to its own inbox prefix (``inbox_of``) and it reads only its job's stored decision. Its
password is kept in ``credentials.json`` under ``jobs``; a rotation renews it too,
``Credentials.remove_job`` (``trainguard credentials revoke``) takes it away. The shared
``worker`` role stays for launches without one.

**Compose and Kubernetes** (``main``): ``compose-env`` prints the ``.env`` of passwords and the
rendezvous token; ``server-config DIR`` writes the servers' files from it, with a CA and server
certificate (``trainguard.security.tls``) in ``DIR/tls`` or, ``--tls-from``, those of a mounted Secret;
``tls-secret DIR`` makes that Secret's files once (every Kubernetes pod then agrees on the CA).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

from trainguard.security.private_file import write_private  # noqa: F401 - credentials and server configs use it

#: What a role may run in Valkey besides its keys: reads, writes, Lua (the atomic mutators of
#: ``trainguard.clients.store``), MULTI/EXEC, connection upkeep; never FLUSHALL, KEYS, CONFIG, DEBUG,
#: ACL, SHUTDOWN and the rest of ``@dangerous``. ``client|setinfo``: redis-py sends it on connect.
_SERVICE_CMDS = "-@all +@read +@write +@scripting +@transaction +@connection -@dangerous " \
                "+client|setinfo +client|setname"
_READ_CMDS = "-@all +@read +@connection -@dangerous +client|setinfo +client|setname"
#: A worker's commands: a service's, less listing the keyspace (SCAN, RANDOMKEY, DBSIZE: every
#: job's key names, which a job's user must not learn) and managing server-side scripts (SCRIPT,
#: FUNCTION: a flush is everybody's); EVAL, which its atomic mutators use, stays.
_WORKER_CMDS = _SERVICE_CMDS + " -scan -randomkey -dbsize -script -function"
#: What a worker may do to ``tg:jobs`` (the set of job names every launcher adds its job to): add
#: a name, nothing else — not remove another job's, delete the set or list it (only services
#: read it). A Valkey ACL selector (Valkey / Redis ≥ 7.0): its key pattern and commands are
#: checked apart from the user's own, so SREM or DEL of the key answers NOPERM.
_JOBS_ADD = "(~tg:jobs +sadd)"

#: JetStream API subjects a reader of the stored history needs (``trainguard replay
#: history``: ephemeral pull consumers; ``Bus.last_stored``: one stored message). Creating,
#: changing or deleting streams and deleting consumers are left to ``admin``.
_JS_READ = ("$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
            "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>",
            "$JS.API.CONSUMER.CREATE.>",
            "$JS.API.CONSUMER.INFO.*.*", "$JS.API.CONSUMER.MSG.NEXT.*.*", "$JS.ACK.>")


def inbox_of(user: str) -> str:
    """The inbox prefix of NATS user ``user`` (``trainguard.clients.bus.Bus`` uses it by default):
    ``_INBOX.<user>`` with each ``.`` written ``%2E`` (one subject token, so one user's prefix is
    never a prefix of another's: ``job-a.b`` → ``_INBOX.job-a%2Eb``)."""
    return "_INBOX." + user.replace(".", "%2E")


def _inbox(user: str) -> str:
    """What ``user`` subscribes to for the replies to its own requests: its prefix only."""
    return inbox_of(user) + ".>"


#: A worker reads one kind of stored message: its job's last decision (``Bus.last_stored``, a
#: rank that starts late), with a direct get whose API subject names the subject read, stored
#: partitioned (``tg.p.<p>.job.…``) or as published; and the stream's configuration (its
#: partition transform, ``allow_direct``).
_DECISION_GET = ("$JS.API.STREAM.INFO.TG_EVENTS",
                 "$JS.API.DIRECT.GET.TG_EVENTS.tg.p.*.job.*.decision",
                 "$JS.API.DIRECT.GET.TG_EVENTS.tg.job.*.decision")


def _consumer(service: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a partitioned service needs to consume the streams durably
    (``trainguard.services.durable``): publish — find a stream, create or look up its durable push
    consumers and the short-lived replay consumers, pull the replay, ack what it handled;
    the streams' info (their partition count, ``consume.stream_partitions``); subscribe — its
    consumers' delivery subjects ``tg.deliver.<service>.>``, the replies to its
    own requests (its inbox prefix ``_INBOX.<service>``: JetStream API answers and publish
    acks), its per-replica health subject, which it also asks itself to learn whether the bus
    answers (``ReducerService``'s bus probe)."""
    return (("$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.*",
             "$JS.API.CONSUMER.INFO.*.*",
             "$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.DURABLE.CREATE.*.*",
             "$JS.API.CONSUMER.MSG.NEXT.*.*", "$JS.ACK.TG_EVENTS.>",
             "$JS.ACK.TG_TELEMETRY.>", f"tg.svc.{service}.health.*"),
            (f"tg.deliver.{service}.>", f"_INBOX.{service}.>", f"tg.svc.{service}.health.*"))


def _dlq(service: str) -> str:
    """Where ``service`` dead-letters what it cannot decode (``subjects.dead_letter``): each
    service role under its own name only, so that no client forges another's dead letters
    (what an operator reads, and the services' health counts, as that service's refusals)."""
    return f"tg.dlq.{service}"


#: Where a job's ranks and launchers dead-letter (``subjects.job_dead_letter``:
#: ``tg.dlq.job.<job>.<client>``); ``job_role`` narrows it to the job's own. The agent and the
#: Slurm watcher subscribe to nothing an event is decoded from, so they have no dead letters.
_JOB_DLQ = "tg.dlq.job.*.>"
#: A launcher's node heartbeat, ``tg.node.<node>.launcher.<job>`` (``subjects.launcher``): the
#: job's token last, so that ``job_role`` narrows it to the job's own launchers (the node is not
#: known when a job's user is issued: any node).
_LAUNCHER_BEAT = "tg.node.*.launcher.*"
#: The detector deletes a consumer of the heartbeat and telemetry stream made with another ack
#: policy (an earlier release's explicit acks; ``consume.ACKS``), which the server cannot change
#: in place: ``consume.durable_subscribe`` creates it anew. The stream holds seconds-relevant
#: messages only, and consumer names are one token, so the right is the stream's, not a prefix.
_TELEMETRY_CONSUMER_DELETE = "$JS.API.CONSUMER.DELETE.TG_TELEMETRY.*"
#: The Kubernetes drain handshake (``trainguard.scheduler.k8s.drain``, one replica, remediator role): its
#: health subjects, its bus probe (a request to itself) and the replies to it.
_DRAIN = (("tg.svc.k8s-drain.health.*",),
          ("tg.svc.k8s-drain.health", "tg.svc.k8s-drain.health.*", "_INBOX.k8s-drain.>"))


@dataclass(frozen=True)
class Role:
    """One row of the permission table.

    ``publish``/``subscribe`` — NATS subjects (wildcards allowed) the role may publish to and
    subscribe to; ``responses`` — it may answer requests it received (the services' health
    replies) without a publish right on ``_INBOX``; ``valkey`` — the rules of its Valkey ACL user
    after ``on``/password (key patterns ``~`` read-write, ``%R~`` read-only, then commands);
    ``reason`` — why the role needs what it has.
    """

    name: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    valkey: str
    reason: str
    responses: bool = False


ROLES: dict[str, Role] = {r.name: r for r in (
    Role("admin", (">",), (">",), "~* &* +@all",
         "`trainguard up` itself and operators: creates the JetStream streams, asks every service "
         "for its health, runs the demo harness and the tests' fixtures, replays recordings "
         "(`trainguard replay play`)."),
    Role("agent",
         ("tg.node.*.telemetry", "tg.node.*.heartbeat", "tg.node.*.xid", "tg.node.*.kernel"),
         ("tg.svc.*.health",),
         "resetkeys %R~tg:node:* " + _READ_CMDS,
         "the node agent reports what the node itself sees: metrics, node heartbeat, XID and "
         "kernel-log lines; it keeps no state (it may read a node's status). Its health subject "
         "carries the node name (`tg.svc.agent-<node>.health`), hence the wildcard.",
         responses=True),
    Role("worker",
         ("tg.job.*.rank.*.hb", "tg.job.*.worker", "tg.job.*.log", "tg.job.*.ckpt",
          "tg.job.*.recovery", "tg.job.*.action", _LAUNCHER_BEAT,
          "tg.svc.*.health", "$JS.API.STREAM.NAMES") + _DECISION_GET + (_JOB_DLQ,),
         ("tg.job.*.decision", "tg.job.*.control", _inbox("worker")),
         "resetkeys ~tg:job:* %R~tg:ckpt:* " + _WORKER_CMDS + " " + _JOBS_ADD,
         "what ranks (the shim, the hooks of an unmodified script, the checkpointer) and "
         "launchers publish: rank heartbeats, worker started/exited, log lines, checkpoint "
         "saved/failed, recovery, action results, the launcher's node heartbeat "
         "(`tg.node.<node>.launcher.<job>`: never the node agent's `tg.node.*.heartbeat`, which "
         "would let a worker keep a lost node looking alive; the per-job user has no other "
         "job's launcher subject either); they listen to "
         "their job's decisions and control requests (a checkpoint request before a node drain), "
         "and a late rank reads the last stored decision from TG_EVENTS (`Bus.last_stored`: "
         "decisions only); replies come to its own inbox prefix only. In Valkey a launcher "
         "registers the job and its run (`tg:job:<job>` and its lease set) and adds its name to "
         "`tg:jobs` (SADD only: it cannot remove or read another job's name); "
         "checkpoint validity (`tg:ckpt:*`, what restore trusts) is read-only; node status, "
         "reputation, fault history, idempotency keys and service leases it cannot read. Never "
         "a decision, an anomaly or a verdict."),
    Role("detector",
         ("tg.job.*.anomaly", "tg.node.*.anomaly", _dlq("detector"), _TELEMETRY_CONSUMER_DELETE)
         + _consumer("detector")[0],
         ("tg.job.*.rank.*.hb", "tg.job.*.worker", "tg.job.*.log", "tg.job.*.ckpt",
          "tg.job.*.recovery", "tg.node.*.heartbeat", _LAUNCHER_BEAT, "tg.node.*.xid",
          "tg.node.*.telemetry", "tg.node.*.kernel", "tg.node.*.slurm", "tg.job.*.slurm",
          "tg.svc.detector.health")
         + _consumer("detector")[1],
         "resetkeys ~tg:members:detector %R~tg:* " + _SERVICE_CMDS,
         "turns raw signals into anomalies; reads job records (learned timeouts, members); "
         "holds its replica's lease (`tg:members:detector`); consumes the streams durably "
         "(and replaces its heartbeat consumers of an earlier ack policy).",
         responses=True),
    Role("attributor",
         ("tg.job.*.verdict", _dlq("attributor")) + _consumer("attributor")[0],
         ("tg.job.*.anomaly", "tg.node.*.anomaly", "tg.node.*.telemetry",
          "tg.svc.attributor.health")
         + _consumer("attributor")[1],
         "resetkeys ~tg:hist:* ~tg:nodeattrs:* ~tg:members:attributor %R~tg:* " + _SERVICE_CMDS,
         "turns anomalies into verdicts; writes the cross-job fault history (`tg:hist:*`), the "
         "nodes' attributes from their telemetry (`tg:nodeattrs:*`: a shared cause names what "
         "its nodes have in common) and its replica's lease; consumes the streams durably.",
         responses=True),
    Role("remediator",
         ("tg.job.*.decision", "tg.job.*.control", "tg.job.*.action", "tg.fleet.breaker",
          _dlq("remediator"))
         + _consumer("remediator")[0] + _DRAIN[0],
         ("tg.job.*.verdict", "tg.job.*.action", "tg.job.*.recovery",
          "tg.svc.remediator.health") + _consumer("remediator")[1] + _DRAIN[1],
         "resetkeys ~tg:jobs ~tg:job:* ~tg:outboxes ~tg:outbox:* ~tg:audit:* ~tg:idem:* "
         "~tg:node:* ~tg:rep:* ~tg:breaker ~tg:breaker:* "
         "~tg:members:remediator %R~tg:* "
         + _SERVICE_CMDS,
         "the only chooser of actions: the only role that may publish decisions (with a "
         "JetStream ack, from its outbox `tg:outbox:<job>`, the jobs with one in `tg:outboxes`) and control "
         "requests to the "
         "ranks (a checkpoint before a Kubernetes node drain); publishes the result of the "
         "actions it carries out itself (node exclusion); writes the job record, the audit "
         "trail (`tg:audit:<job>`), idempotency keys, node status (exclusion), the fleet breaker "
         "(`tg:breaker`, its trail; its transitions on `tg.fleet.breaker`) and its replica's lease. The "
         "Kubernetes drain handshake runs as this role too (its own health subjects).",
         responses=True),
    Role("checkpoint_validator",
         ("tg.job.*.ckpt", _dlq("checkpoint_validator")) + _consumer("checkpoint_validator")[0],
         ("tg.job.*.ckpt", "tg.job.*.recovery", "tg.svc.checkpoint_validator.health")
         + _consumer("checkpoint_validator")[1],
         "resetkeys ~tg:ckpt:* ~tg:members:checkpoint_validator %R~tg:* " + _SERVICE_CMDS,
         "the only writer of checkpoint validity (`tg:ckpt:*`); publishes its verdict on "
         "`tg.job.<job>.ckpt`, which ranks also publish `ckpt.saved` on: on the bus that verdict "
         "is information only, the state store is what restore trusts.",
         responses=True),
    Role("slurm_watch",
         ("tg.node.*.slurm", "tg.job.*.slurm", "tg.svc.slurm_watch.health.*"),
         ("tg.svc.slurm_watch.health", "tg.svc.slurm_watch.health.*", "_INBOX.slurm_watch.>"),
         "resetkeys ~tg:jobs ~tg:job:* %R~tg:* " + _SERVICE_CMDS,
         "the Slurm watcher: publishes what squeue and sinfo say of the jobs that opted in and "
         "their nodes (`slurm.job`, `slurm.node`) and writes the scheduler part of their job "
         "records (`tg:jobs`, `tg:job:<job>`); it consumes nothing, and asks its own health "
         "subject whether the bus answers (the bus probe).",
         responses=True),
    Role("reader",
         ("tg.svc.*.health",) + _JS_READ,
         ("tg.job.>", "tg.node.>", "tg.dlq.>", _inbox("reader")),
         "resetkeys %R~tg:* " + _READ_CMDS,
         "the console, `trainguard replay record/history`, dashboards: watch every event and "
         "read the stored history and the state store; publish nothing an event consumer acts "
         "on."),
)}


#: Prefix of a per-job worker's user name (``job-<job>``); no role name starts with it.
JOB_USER_PREFIX = "job-"


def job_user(job: str) -> str:
    """The user name of ``job``'s workers: ``job-<job>``. Raises ``ValueError`` for a name that
    is no subject token (``trainguard.schemas.subjects.token``) or holds a ``:`` (a URL's user
    name ends at the first ``:``)."""
    from trainguard.schemas import subjects

    subjects.job_name(job)  # no ':' either, which would also end the user name in a URL
    return JOB_USER_PREFIX + job


#: Prefix of a per-node agent's user name (``node-<node>``); no role name starts with it.
NODE_USER_PREFIX = "node-"


def node_user(node: str) -> str:
    """The user name of ``node``'s agent: ``node-<node>``. Raises ``ValueError`` for a name
    that is no subject token or holds a ``:`` (as ``job_user``)."""
    from trainguard.schemas import subjects

    subjects.job_name(node)  # the same rules: a subject token, no ':'
    return NODE_USER_PREFIX + node


def node_role(node: str) -> Role:
    """The ``agent`` row narrowed to ``node``: each ``tg.node.*.`` subject becomes
    ``tg.node.<token>.``, so an agent given this user publishes its own node's telemetry, node
    heartbeat, XID and kernel lines and no other node's (the shared ``agent`` role may publish
    any node's: one agent could blame another node for an XID, or keep a lost one alive); its
    health requests and its read-only view of node status stay. Raises ``ValueError`` as
    ``node_user``."""
    from trainguard.schemas import subjects

    user = node_user(node)
    tok = subjects.token(node)
    agent = ROLES["agent"]
    return Role(user, tuple(s.replace("tg.node.*.", f"tg.node.{tok}.", 1)
                            for s in agent.publish),
                agent.subscribe, agent.valkey,
                f"the node agent of {node!r} only: the agent's rights on that node's subjects, "
                f"none on another node's.", responses=agent.responses)


def scoped_role(user: str) -> Role:
    """The role of a per-job (``job-<job>``) or per-node (``node-<node>``) user. Raises
    ``KeyError`` for any other name, ``ValueError`` for a name no such user can have."""
    if user.startswith(JOB_USER_PREFIX):
        return job_role(user[len(JOB_USER_PREFIX):])
    if user.startswith(NODE_USER_PREFIX):
        return node_role(user[len(NODE_USER_PREFIX):])
    raise KeyError(user)


def job_role(job: str) -> Role:
    """The ``worker`` row narrowed to ``job``: each ``tg.job.*.`` subject becomes
    ``tg.job.<token>.`` (the stored form ``tg.p.*.job.*.`` of the decision get likewise), the
    launcher's beat ``tg.node.*.launcher.<token>`` (its own launchers', on any node), the inbox
    the user's own (``inbox_of``); its dead letters go under its job only (``tg.dlq.job.<token>.>``); the
    rest (health requests, the stream's configuration) stays; in Valkey it may add to ``tg:jobs`` (the
    job names; ``_JOBS_ADD``), write ``tg:job:<job>`` and ``tg:job:<job>:launchers`` and read
    that job's keys and checkpoints only. Raises ``ValueError`` as ``job_user``."""
    from trainguard.schemas import subjects

    user = job_user(job)
    tok = subjects.token(job)
    worker = ROLES["worker"]

    def narrow(subs: tuple[str, ...]) -> tuple[str, ...]:
        # ``tg.job.*.`` as published, ``.job.*.`` in a stored (partitioned) form and in the
        # dead letters (``tg.dlq.job.*.>``), the inbox, the launcher's beat to its job's
        return tuple(_inbox(user) if s == _inbox("worker") else
                     _LAUNCHER_BEAT[:-1] + tok if s == _LAUNCHER_BEAT else
                     s.replace("tg.job.*.", f"tg.job.{tok}.", 1).replace(".job.*.",
                                                                         f".job.{tok}.", 1)
                     for s in subs)
    return Role(user, narrow(worker.publish), narrow(worker.subscribe),
                f"resetkeys ~tg:job:{job} ~tg:job:{job}:launchers %R~tg:job:{job}:* "
                f"%R~tg:ckpt:{job} %R~tg:ckpt:{job}:* " + _WORKER_CMDS + " " + _JOBS_ADD,
                f"the launchers and ranks of job {job!r} only: the worker's rights on that job's "
                f"subjects and keys, none on another job's: it reads that job's record, run, "
                f"checkpoints and stored decision, and the replies to its own requests, no "
                f"other job's.")


def nats_permissions(role: Role) -> dict:
    """The ``permissions`` block of ``role`` in a nats-server configuration."""
    perms: dict = {"publish": {"allow": list(role.publish)},
                   "subscribe": {"allow": list(role.subscribe)}}
    if role.responses:
        perms["allow_responses"] = True
    return perms


# ---- credentials -----------------------------------------------------------------------------
@dataclass
class Credentials:
    """One password per role of ``ROLES``, one per job given its own workers (``jobs``: job
    name → password), one per node given its own agent (``nodes``: node name → password);
    ``path`` is where they are kept (None: in memory)."""

    passwords: dict[str, str]
    path: Path | None = None
    jobs: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def generate(cls, roles: Iterable[str] = ROLES) -> "Credentials":
        return cls({r: secrets.token_urlsafe(24) for r in roles})

    def users(self) -> list[tuple[str, str, Role]]:
        """``(user, password, role)`` of every role, then of every job's workers and every
        node's agent given their own user."""
        return ([(n, self.passwords[n], r) for n, r in ROLES.items()]
                + [(job_user(j), pw, job_role(j)) for j, pw in sorted(self.jobs.items())]
                + [(node_user(n), pw, node_role(n)) for n, pw in sorted(self.nodes.items())])

    def password(self, user: str) -> str:
        """The password of role, per-job or per-node user ``user``. Raises ``KeyError``."""
        if user in self.passwords:
            return self.passwords[user]
        for prefix, table in ((JOB_USER_PREFIX, self.jobs), (NODE_USER_PREFIX, self.nodes)):
            if user.startswith(prefix) and user[len(prefix):] in table:
                return table[user[len(prefix):]]
        raise KeyError(user)

    def save(self) -> None:
        """Write them to ``path`` (0600, atomically)."""
        if self.path is None:
            raise ValueError("these credentials have no file")
        write_private(self.path, json.dumps({"version": 1, "passwords": self.passwords,
                                             "jobs": self.jobs, "nodes": self.nodes},
                                            indent=1) + "\n")

    def _add(self, table: dict[str, str], name: str, rotate: bool) -> None:
        if rotate or name not in table:
            table[name] = secrets.token_urlsafe(24)
            if self.path is not None:
                self.save()

    def _remove(self, table: dict[str, str], name: str) -> bool:
        if table.pop(name, None) is None:
            return False
        if self.path is not None:
            self.save()
        return True

    def add_job(self, job: str, rotate: bool = False) -> str:
        """Give ``job``'s workers a password (a new one when ``rotate``), saved when the
        credentials have a file; returns the user name. Raises ``ValueError`` (``job_user``)."""
        user = job_user(job)
        self._add(self.jobs, job, rotate)
        return user

    def remove_job(self, job: str) -> bool:
        """Take ``job``'s workers' user away (saved when the credentials have a file); returns
        whether it had one."""
        return self._remove(self.jobs, job)

    def add_node(self, node: str, rotate: bool = False) -> str:
        """Give ``node``'s agent a password, as ``add_job``; returns the user name. Raises
        ``ValueError`` (``node_user``)."""
        user = node_user(node)
        self._add(self.nodes, node, rotate)
        return user

    def remove_node(self, node: str) -> bool:
        """Take ``node``'s agent's user away, as ``remove_job``."""
        return self._remove(self.nodes, node)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike, rotate: bool = False) -> "Credentials":
        """The credentials kept in ``path`` (a JSON file, mode 0600), created with fresh
        passwords when missing or when ``rotate``; a role added to ``ROLES`` since gets one.
        Raises ``ValueError`` for a file that is not the stack's credentials."""
        path = Path(path)
        kept: dict[str, str] = {}
        jobs: dict[str, str] = {}
        nodes: dict[str, str] = {}
        if path.exists():
            try:
                data = json.loads(path.read_text())
                kept = dict(data["passwords"])
                jobs = dict(data.get("jobs") or {})
                nodes = dict(data.get("nodes") or {})
            except (ValueError, KeyError, TypeError) as exc:
                if not rotate:  # a rotation replaces it whole
                    raise ValueError(f"{path} is not a trainguard credentials file ({exc}): "
                                     f"move it away and start again for new credentials") from None
        if rotate:  # every password anew; the jobs and nodes given their own keep one each
            kept, jobs = {}, {j: secrets.token_urlsafe(24) for j in jobs}
            nodes = {n: secrets.token_urlsafe(24) for n in nodes}
        fresh = cls.generate()
        creds = cls({r: kept.get(r) or fresh.passwords[r] for r in ROLES}, path, jobs, nodes)
        if creds.passwords != kept or rotate:
            creds.save()
        return creds

    def nats_url(self, role: str, host: str, port: int, tls: bool = False) -> str:
        """``nats://`` (``tls://`` when ``tls``) URL of role or per-job user ``role``."""
        return f"{'tls' if tls else 'nats'}://{role}:{self.password(role)}@{host}:{port}"

    def redis_url(self, role: str, host: str, port: int, db: int = 0, tls: bool = False) -> str:
        """``redis://`` (``rediss://`` when ``tls``) URL of role or per-job user ``role``."""
        return f"{'rediss' if tls else 'redis'}://{role}:{self.password(role)}@{host}:{port}/{db}"


#: Environment variable carrying the rendezvous store's token (``trainguard.rendezvous.gate``).
RDZV_TOKEN_ENV = "TG_RDZV_TOKEN"


def rdzv_token() -> str:
    """A new rendezvous store token (``trainguard.rendezvous.gate``): 32 URL-safe characters,
    192 bits from ``secrets``."""
    return secrets.token_urlsafe(24)


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages and logs); every password of
    a comma-separated list (a NATS cluster's URLs, a sentinel URL's hosts) too."""
    if "," in url:
        return ",".join(re.sub(r"^([a-z+]+://[^:/@]*):[^@/]*@", r"\1:***@", part)
                        for part in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# ---- server configuration --------------------------------------------------------------------
#: nats-server payload limit: the largest message any client may publish (bytes). The largest
#: legitimate events (a verdict with its evidence, a telemetry sample of 8 GPUs) are a few KiB;
#: the shim keeps the last 4000 characters of a traceback; a longer launcher log line is dropped
#: and counted by the publisher.
MAX_PAYLOAD = 1024 * 1024


def nats_config(creds: Credentials | None, host: str, port: int, store_dir: str,
                log_file: str | None, max_file_store: int, max_payload: int = MAX_PAYLOAD,
                http_port: int | None = None, tls: tuple[str, str] | None = None,
                pid_file: str | None = None) -> str:
    """The nats-server configuration (JSON, which nats-server reads as its config format):
    listen address, payload limit, JetStream store and its size cap (``max_file_store`` bytes),
    and one user per role and per job given its own workers, with their permissions (none when
    ``creds`` is None); ``log_file`` None: the log goes to stderr; ``http_port``: the
    monitoring port (health); ``tls``: ``(cert_file, key_file)`` — every client must speak TLS
    (a plaintext one is refused: ``Secure Connection - TLS Required``); ``pid_file``: where the
    server writes its pid (``reload_nats`` signals it)."""
    cfg: dict = {"server_name": "trainguard", "host": host, "port": port,
                 "max_payload": max_payload,
                 "jetstream": {"store_dir": store_dir, "max_file_store": max_file_store,
                               "max_memory_store": 64 * 1024 * 1024}}
    if log_file:
        cfg["log_file"] = log_file
    if pid_file:
        cfg["pid_file"] = pid_file
    if http_port:
        cfg["http_port"] = http_port
    if tls is not None:
        cfg["tls"] = {"cert_file": tls[0], "key_file": tls[1], "timeout": 5}
    if creds is not None:
        cfg["authorization"] = nats_users(creds)
    return json.dumps(cfg, indent=1) + "\n"


def nats_users(creds: Credentials) -> dict:
    """The ``authorization`` block of the nats-server configuration: every user of
    ``creds.users()`` with its permissions."""
    return {"users": [{"user": name, "password": pw, "permissions": nats_permissions(role)}
                      for name, pw, role in creds.users()]}


#: The oldest server the roles' rules work on (``(major, minor)``): ACL selectors
#: (``_JOBS_ADD``) came in Redis 7.0; Valkey's first release was 7.2.
VALKEY_MIN_VERSION = (7, 0)

#: ACL rules naming a command a server gained after ``VALKEY_MIN_VERSION``, with the release
#: that brought it: an older server refuses an ACL file or ``ACL SETUSER`` naming a command it
#: does not know, so ``rules_for_version`` leaves the rule out there. ``CLIENT SETINFO`` came in
#: Redis 7.2 (redis-py sends it on connect and ignores its refusal).
VALKEY_RULE_SINCE: dict[str, tuple[int, int]] = {"+client|setinfo": (7, 2)}


def rules_for_version(rules: str, version: tuple[int, int] | None) -> str:
    """``rules`` (space-separated ACL rules) without those ``VALKEY_RULE_SINCE`` says a server
    of ``version`` (``(major, minor)``, as ``redis_version`` reports it) does not know; all of
    them when ``version`` is None (a current server)."""
    if version is None:
        return rules
    return " ".join(r for r in rules.split()
                    if version >= VALKEY_RULE_SINCE.get(r.lower(), (0, 0)))


def valkey_user_rules(password: str, role: Role,
                      version: tuple[int, int] | None = None) -> str:
    """One Valkey ACL user's rules after its name: ``on``, the SHA-256 of ``password``, the
    role's key patterns and commands (``rules_for_version`` of a server of ``version``)."""
    return (f"on #{hashlib.sha256(password.encode()).hexdigest()} "
            f"{rules_for_version(role.valkey, version)}")


def _default_user_rules(version: tuple[int, int] | None) -> str:
    """What the ``default`` user (always ``off``: no connection can authenticate as it, so an
    unauthenticated client is answered NOAUTH) may run. Nothing, on a current server. Redis 7.0
    replays a MULTI/EXEC from its append-only file as ``default`` and checks that user's ACL
    there: with ``-@all`` every transaction of the AOF was refused at start ("ACLs rules changed
    between the moment the transaction was accumulated and the EXEC call", seen with Debian 12's
    7.0.15) and the job records were lost across a restart; 7.2 and Valkey skip the check for
    the AOF. So on a server before 7.2 the disabled ``default`` keeps every command."""
    if version is not None and version < (7, 2):
        return "~* &* +@all"
    return "-@all"


def valkey_acl(creds: Credentials, version: tuple[int, int] | None = None) -> str:
    """The Valkey ACL file: ``default`` disabled, one user per role and per job given its own
    workers, passwords as SHA-256; for a server of ``version`` (``rules_for_version``)."""
    lines = [f"user default off resetkeys {_default_user_rules(version)}"]
    for name, pw, role in creds.users():
        lines.append(f"user {name} {valkey_user_rules(pw, role, version)}")
    return "\n".join(lines) + "\n"


# ---- docker compose and Kubernetes ---------------------------------------------------------------
def _env_name(role: str) -> str:
    return f"TG_{role.upper()}_PASSWORD"


def compose_env() -> list[str]:
    """Fresh ``.env`` lines for docker compose (and the Kubernetes Secret
    ``trainguard-credentials``): ``TG_<ROLE>_PASSWORD=…`` per role, then
    ``TG_RDZV_TOKEN=…``, the rendezvous store's token (``rdzv_token``, as ``trainguard
    up`` makes it)."""
    return ([f"{_env_name(role)}={pw}" for role, pw in Credentials.generate().passwords.items()]
            + [f"{RDZV_TOKEN_ENV}={rdzv_token()}"])


def _server_tls(args, out: Path):
    """The TLS files ``server-config`` gives nats.conf: those of ``--tls-from`` (a mounted
    Secret, used as they are), else ``trainguard.security.tls.ensure`` in ``DIR/tls`` (the CA kept when
    present) made readable by the servers (``share_with_servers``), the CA copied to
    ``--ca-dir``. Raises ``FileNotFoundError`` for a ``--tls-from`` without the files,
    ``PermissionError`` for a ``--key-group`` this user may not give."""
    from trainguard.security import tls

    if args.tls_from:
        src = Path(args.tls_from).absolute()
        files = tls.TLSFiles(src / "ca.pem", src / "server.pem", src / "server.key")
        missing = [str(p) for p in (files.cert, files.key) if not p.exists()]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} missing: create the Secret with "
                                    f"`python -m trainguard.security.auth tls-secret DIR` "
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


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.security.auth compose-env`` prints a fresh ``.env`` (``compose_env``);
    ``server-config DIR`` writes ``DIR/nats.conf`` (TLS required unless ``--no-tls``) and
    ``DIR/users.acl`` for the compose and Kubernetes servers from those variables, and the TLS
    files (``_server_tls``); ``tls-secret DIR`` writes a CA and a server certificate into DIR
    for the Kubernetes Secret ``trainguard-tls``. Exit status 2 for missing variables or
    files."""
    import argparse
    import sys

    from trainguard.security import tls

    p = argparse.ArgumentParser(prog="python -m trainguard.security.auth")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("compose-env", help="print a password per role and the rendezvous token, "
                                       "as .env lines")
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
    ts = sub.add_parser("tls-secret", help="write ca.pem, ca.key, server.pem, server.key into DIR "
                                           "for `kubectl create secret generic trainguard-tls`")
    ts.add_argument("dir")
    ts.add_argument("--tls-san", action="append", default=[], metavar="NAME")
    args = p.parse_args(argv)
    if args.cmd == "compose-env":
        print("\n".join(compose_env()))
        return 0
    if args.cmd == "tls-secret":
        files = tls.ensure(args.dir, [*tls.SERVICE_NAMES, *args.tls_san])
        print(f"trainguard.security.auth: {files.ca}, {files.cert}, {files.key} (keep {args.dir}/ca.key "
              f"private: a rerun signs a new server certificate with it). Then:\n"
              f"  kubectl -n trainguard create secret generic trainguard-tls "
              f"--from-file={files.ca} --from-file={files.cert} --from-file={files.key}\n"
              f"  kubectl -n trainguard create configmap trainguard-ca --from-file={files.ca}\n"
              f"  kubectl -n train create configmap trainguard-ca --from-file={files.ca}",
              file=sys.stderr)
        return 0
    missing = [_env_name(r) for r in ROLES if not os.environ.get(_env_name(r))]
    if missing:
        print(f"trainguard.security.auth: {', '.join(missing)} not set: create them with `python -m "
              f"trainguard.security.auth compose-env > .env` beside docker-compose.yml", file=sys.stderr)
        return 2
    creds = Credentials({r: os.environ[_env_name(r)] for r in ROLES})
    out = Path(args.dir).absolute()  # nats.conf names its TLS files: from anywhere
    out.mkdir(parents=True, exist_ok=True)
    files = None
    if not args.no_tls:
        try:
            files = _server_tls(args, out)
        except (FileNotFoundError, PermissionError) as exc:  # no Secret; --key-group not ours
            print(f"trainguard.security.auth: {exc}", file=sys.stderr)
            return 2
    pair = (str(files.cert), str(files.key)) if files else None
    for name, text in (("nats.conf", nats_config(creds, "0.0.0.0", 4222, args.store_dir, None,
                                                 args.max_file_store, http_port=8222,
                                                 tls=pair)),
                       ("users.acl", valkey_acl(creds))):
        write_private(out / name, text)
    # users.acl holds SHA-256 hashes only and Valkey reads it as its own user (uid 999 in the
    # valkey image); nats.conf holds every role's password in clear and stays 0600 (NATS runs
    # as root in its image, as this one-shot does)
    os.chmod(out / "users.acl", 0o644)
    print(f"trainguard.security.auth: wrote {out}/nats.conf and {out}/users.acl"
          + (f", TLS from {files.cert.parent}" if files else " (no TLS)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

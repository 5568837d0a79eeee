"""Who may do what on the bus and in the state store: the roles as data.

Every process of the stack connects as one **role**; the role's password is in its URL
(``nats://<role>:<password>@host:port``, ``redis://<role>:<password>@host:port/0``), so no
launcher, shim or service needs an option of its own. ``ROLES`` is the one table: for each role
the NATS subjects it may publish and subscribe, the Valkey ACL rules it gets, and why. The
servers refuse everything else (``trainguard.security.server_config`` writes their
configuration from this table): NATS answers a publish outside the role's list with a
``Permissions Violation`` (the message is dropped, nobody receives it) and refuses a client
without a user (``Authorization Violation``); Valkey answers ``NOPERM`` for a key or command the
role lacks, and its ``default`` user is disabled.

The two decisions that matter most are single-writer:

* only the ``remediator`` may publish ``tg.job.<job>.decision`` (what launchers and shims carry
  out);
* only the ``checkpoint_validator`` may write ``tg:ckpt:*`` (whether a checkpoint may be resumed
  from; every other role reads it).

Only the node agent (``agent``, or one node's ``node-<NAME>``: ``node_role``) may publish a
node's heartbeat ``tg.node.<node>.heartbeat``; a launcher beats on its own subject
``tg.node.<node>.launcher.<job>``.

**Per-job workers.** ``trainguard credentials issue --job NAME`` adds a user ``job-<NAME>``
(``job_role``): the ``worker`` row with every ``tg.job.*`` subject narrowed to that job's
(``tg.job.<NAME>.…``), the launcher's beat to its job's (``tg.node.*.launcher.<NAME>``) and, in
Valkey, writes to that job's keys only (``tg:jobs``, ``tg:job:<NAME>``,
``tg:job:<NAME>:launchers``) and reads only that job's record, run and checkpoints; its replies
come to its own inbox prefix (``inbox_of``) and it reads only its job's stored decision. Its
password is kept with the others (``trainguard.security.credentials``). The shared ``worker``
role stays for launches without one.
"""
from __future__ import annotations

from dataclasses import dataclass

#: What a role may run in Valkey besides its keys: reads, writes, Lua (the atomic mutators of
#: ``trainguard.clients.store``), MULTI/EXEC, connection upkeep; never FLUSHALL, KEYS, CONFIG,
#: DEBUG, ACL, SHUTDOWN and the rest of ``@dangerous``. ``client|setinfo``: redis-py sends it on
#: connect.
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
#: The Kubernetes drain handshake (``trainguard.scheduler.k8s.drain``, one replica, remediator
#: role): its health subjects, its bus probe (a request to itself) and the replies to it.
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
         ("tg.job.*.anomaly", "tg.node.*.anomaly", _dlq("detector"))
         + _consumer("detector")[0],
         ("tg.job.*.rank.*.hb", "tg.job.*.worker", "tg.job.*.log", "tg.job.*.ckpt",
          "tg.job.*.recovery", "tg.node.*.heartbeat", _LAUNCHER_BEAT, "tg.node.*.xid",
          "tg.node.*.telemetry", "tg.node.*.kernel", "tg.node.*.slurm", "tg.job.*.slurm",
          "tg.svc.detector.health")
         + _consumer("detector")[1],
         "resetkeys ~tg:members:detector %R~tg:* " + _SERVICE_CMDS,
         "turns raw signals into anomalies; reads job records (learned timeouts, members); "
         "holds its replica's lease (`tg:members:detector`); consumes the streams durably.",
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
         "JetStream ack, from its outbox `tg:outbox:<job>`, the jobs with one in `tg:outboxes`) "
         "and control requests to the ranks (a checkpoint before a Kubernetes node drain); publishes the result of the "
         "actions it carries out itself (node exclusion); writes the job record, the audit "
         "trail (`tg:audit:<job>`), idempotency keys, node status (exclusion), the fleet breaker "
         "(`tg:breaker`, its trail; its transitions on `tg.fleet.breaker`) and its replica's "
         "lease. The Kubernetes drain handshake runs as this role too (its own health subjects).",
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
    the user's own (``inbox_of``); its dead letters go under its job only
    (``tg.dlq.job.<token>.>``); the rest (health requests, the stream's configuration) stays; in
    Valkey it may add to ``tg:jobs`` (the job names; ``_JOBS_ADD``), write ``tg:job:<job>`` and
    ``tg:job:<job>:launchers`` and read that job's keys and checkpoints only. Raises ``ValueError`` as ``job_user``."""
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

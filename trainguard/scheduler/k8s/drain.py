"""The checkpoint-aware drain handshake: a node is drained only after the jobs on it have
checkpointed.

1. An operator or a node-maintenance tool annotates the node ``trainguard.io/drain-requested``
   (any value; ``kubectl annotate node N trainguard.io/drain-requested=upgrade``).
2. ``DrainService`` sees it (it lists the nodes every ``poll_s``), finds the jobs with ranks on
   that node (their job records' ``members``) and publishes a ``CheckpointRequest`` to each
   (``tg.job.<job>.control``, ``hold_s``: the ranks wait at the saved step), re-sent every
   ``resend_s`` until answered; the node's ``trainguard.io/drain-status`` says
   ``checkpointing``.
3. Each job's rank 0 answers ``CheckpointRequestDone`` once the save is committed; with
   ``require_valid`` the service then waits for the checkpoint validator's verdict in the state
   store (``valid``). A failed or invalid save is asked for again, ``attempts`` times in all.
4. When every job is checkpointed (or ``deadline_s`` has passed: the drain is never blocked for
   ever, the status says what was missing), the node gets ``trainguard.io/drain-ready`` (value:
   ``<job>@<step>`` per job) and, with ``evict``, is cordoned and its trainguard pods evicted
   through the Eviction API (disruption budgets honoured, ``trainguard.scheduler.k8s.api``). The outcome
   is published as an ``ActionResult`` per job (``executor: controller:kubernetes-drain``).

The logic is the pure ``step`` (table-tested with ``run_offline``); ``DrainCluster`` is the one
call target (``"cluster"``), holding the Kubernetes and state-store calls. Run with
``python -m trainguard.scheduler.k8s drain`` under the remediator role (``NATS_URL``/``REDIS_URL``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard import schemas
from trainguard.core.reducer import Call, Effect, Input, Log, Publish, Received, Reply, Tick
from trainguard.services.live_reducer import ReducerService
from trainguard.schemas import subjects

from trainguard.scheduler.k8s.api import DRAIN_READY, DRAIN_REQUESTED, DRAIN_STATUS, Kube, KubeConfig
from trainguard.scheduler.k8s.controller import KubernetesNodeController

log = logging.getLogger("trainguard.scheduler.k8s.drain")


@dataclass(frozen=True)
class DrainConfig:
    """Settings (seconds). ``poll_s`` [1]: node listing period. ``hold_s`` [120]: how long
    ranks wait at the saved step for the eviction (the detector allows 600 s in phase
    ``checkpoint``). ``lookahead_s`` [2]: see ``CheckpointRequest`` (a rank's bus thread starved
for more than this on an overloaded host makes the ranks skip, and the request is repeated). ``resend_s`` [5]: re-send
    an unanswered request (a rank that subscribed late). ``attempts`` [3]: requests per job.
    ``deadline_s`` [300]: drain-ready at the latest this long after the annotation.
    ``require_valid`` [True]: wait for the validator's verdict. ``evict`` [True]: cordon and
    evict after drain-ready (False: only annotate; the operator drains)."""

    poll_s: float = 1.0
    hold_s: float = 120.0
    lookahead_s: float = 2.0
    resend_s: float = 5.0
    attempts: int = 3
    deadline_s: float = 300.0
    require_valid: bool = True
    evict: bool = True


@dataclass(frozen=True)
class JobDrain:
    """One job's part of a node's drain. ``status``: requested | committed | valid | failed."""

    request_id: str
    sent: float
    attempt: int = 1
    status: str = "requested"
    step: int = -1
    path: str = ""
    detail: str = ""


@dataclass(frozen=True)
class NodeDrain:
    """One node's drain. ``phase``: jobs | checkpointing | ready | done."""

    node: str
    started: float
    phase: str = "jobs"
    jobs: dict[str, JobDrain] = field(default_factory=dict)
    last_check: float = 0.0


@dataclass(frozen=True)
class DrainState:
    config: DrainConfig = DrainConfig()
    nodes: dict[str, NodeDrain] = field(default_factory=dict)
    last_scan: float = -1e18
    seq: int = 0


def _request(job: str, node: str, jd: JobDrain, cfg: DrainConfig) -> Publish:
    return Publish(subjects.job(job, "control"), schemas.CheckpointRequest(
        job=job, node=node, request_id=jd.request_id, reason=f"drain of node {node}",
        hold_s=cfg.hold_s, lookahead_s=cfg.lookahead_s))


def _status(node: str, text: str) -> Call:
    return Call("cluster", "annotate", (node, {DRAIN_STATUS: text[:250]}))


def step(st: DrainState, inp: Input, now: float) -> tuple[DrainState, list[Effect]]:
    """The handshake's reducer (see the module docstring)."""
    cfg = st.config
    if isinstance(inp, Tick):
        fx: list[Effect] = []
        if now - st.last_scan >= cfg.poll_s:
            st = replace(st, last_scan=now)
            fx.append(Call("cluster", "drain_requested", reply=("scan",)))
        nodes = dict(st.nodes)
        for name, nd in st.nodes.items():
            if nd.phase != "checkpointing":
                continue
            jobs, checked = dict(nd.jobs), False
            for job, jd in nd.jobs.items():
                if jd.status == "requested" and now - jd.sent >= cfg.resend_s:
                    jobs[job] = replace(jd, sent=now)
                    fx.append(_request(job, name, jobs[job], cfg))
                elif jd.status == "committed" and now - nd.last_check >= cfg.poll_s:
                    checked = True
                    fx.append(Call("cluster", "checkpoint_status", (job, jd.path),
                                   reply=("valid", name, job)))
            nd = replace(nd, jobs=jobs, last_check=now if checked else nd.last_check)
            if now - nd.started >= cfg.deadline_s:
                late = {j: (replace(d, status="failed", detail=d.detail or "deadline passed")
                            if d.status not in ("valid", "failed") else d)
                        for j, d in jobs.items()}
                nd = replace(nd, jobs=late)
            nodes[name] = nd
        st = replace(st, nodes=nodes)
        return _advance(st, fx, now)
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple):
        kind = inp.tag[0]
        if kind == "scan":
            if inp.error:
                return st, [Log(logging.WARNING, f"listing nodes failed: {inp.error}")]
            wanted = set(inp.value or ())
            nodes = {n: d for n, d in st.nodes.items() if n in wanted}
            fx = []
            for n in sorted(wanted - set(nodes)):
                nodes[n] = NodeDrain(n, now)
                fx += [Log(logging.INFO, f"drain requested for node {n}"),
                       Call("cluster", "jobs_on_node", (n,), reply=("jobs", n))]
            return replace(st, nodes=nodes), fx
        nd = st.nodes.get(inp.tag[1]) if len(inp.tag) > 1 else None
        if nd is None:
            return st, []
        if kind == "jobs":
            if inp.error:  # the state store did not answer: list again at the next scan
                nodes = {n: d for n, d in st.nodes.items() if n != nd.node}
                return replace(st, nodes=nodes), [Log(logging.WARNING, inp.error)]
            jobs, fx, seq = {}, [], st.seq
            for job in sorted(inp.value or ()):
                seq += 1
                jd = JobDrain(f"drain-{inp.wall_ns:x}-{seq}", now)
                jobs[job] = jd
                fx.append(_request(job, nd.node, jd, cfg))
            nd = replace(nd, phase="checkpointing", jobs=jobs)
            fx.insert(0, _status(nd.node, f"checkpointing {', '.join(jobs) or 'no job'}"))
            st = replace(st, seq=seq, nodes={**st.nodes, nd.node: nd})
            return _advance(st, fx, now)
        if kind == "valid":
            job = inp.tag[2]
            jd = nd.jobs.get(job)
            if jd is None or jd.status != "committed":
                return st, []
            if inp.value == "valid":
                jd = replace(jd, status="valid")
            elif inp.value == "invalid":
                return _again(st, nd, job, jd, now, "the validator found it invalid")
            nd = replace(nd, jobs={**nd.jobs, job: jd})
            return _advance(replace(st, nodes={**st.nodes, nd.node: nd}), [], now)
        if kind == "evicted":
            res = inp.value
            ok = bool(res and res.ok) and not inp.error
            detail = inp.error or (res.detail if res else "no result")
            fx = [Log(logging.INFO if ok else logging.WARNING,
                      f"drain of {nd.node}: {detail}")]
            for job, jd in nd.jobs.items():
                fx.append(Publish(subjects.job(job, "action"), schemas.ActionResult(
                    job=job, node=nd.node, decision_id=jd.request_id,
                    idempotency_key=f"{jd.request_id}:drain", executor="controller:kubernetes-drain",
                    action="drain_node", ok=ok, detail=f"checkpoint {jd.status} at step "
                    f"{jd.step}; {detail}"[:1000])))
            nd = replace(nd, phase="done")
            return replace(st, nodes={**st.nodes, nd.node: nd}), fx
        return st, []
    if isinstance(inp, Received) and isinstance(inp.event, schemas.CheckpointRequestDone):
        ev = inp.event
        for nd in st.nodes.values():
            for job, jd in nd.jobs.items():
                if jd.request_id != ev.request_id or jd.status != "requested":
                    continue
                if not ev.ok:
                    return _again(st, nd, job, jd, now, ev.detail or "the save failed")
                jd = replace(jd, status="committed" if cfg.require_valid else "valid",
                             step=ev.step, path=ev.path)
                nd = replace(nd, jobs={**nd.jobs, job: jd}, last_check=-1e18)
                return _advance(replace(st, nodes={**st.nodes, nd.node: nd}),
                                [Log(logging.INFO, f"{job} checkpointed step {ev.step} for "
                                                   f"the drain of {nd.node}")], now)
    return st, []


def _again(st: DrainState, nd: NodeDrain, job: str, jd: JobDrain, now: float,
           why: str) -> tuple[DrainState, list[Effect]]:
    """Ask ``job`` again under a new request id, or give up after ``attempts``."""
    fx: list[Effect] = [Log(logging.WARNING, f"drain of {nd.node}: {job}: {why}")]
    if jd.attempt >= st.config.attempts:
        jd = replace(jd, status="failed", detail=why)
    else:
        jd = JobDrain(f"{jd.request_id.rsplit('.', 1)[0]}.{jd.attempt + 1}", now,
                      attempt=jd.attempt + 1)
        fx.append(_request(job, nd.node, jd, st.config))
    nd = replace(nd, jobs={**nd.jobs, job: jd})
    return _advance(replace(st, nodes={**st.nodes, nd.node: nd}), fx, now)


def _advance(st: DrainState, fx: list[Effect], now: float) -> tuple[DrainState, list[Effect]]:
    """Nodes whose every job is valid or failed become ready: annotate, then evict."""
    nodes = dict(st.nodes)
    for name, nd in st.nodes.items():
        if nd.phase != "checkpointing" or any(
                j.status not in ("valid", "failed") for j in nd.jobs.values()):
            continue
        summary = ",".join(f"{j}@{d.step}" if d.status == "valid" else f"{j}:none"
                           for j, d in sorted(nd.jobs.items())) or "no-jobs"
        failed = [f"{j}: {d.detail}" for j, d in nd.jobs.items() if d.status == "failed"]
        fx.append(Call("cluster", "annotate", (name, {
            DRAIN_READY: summary[:250],
            DRAIN_STATUS: ("ready" if not failed else "ready without a checkpoint for "
                           + "; ".join(failed))[:250]})))
        nd = replace(nd, phase="ready")
        if st.config.evict:
            fx.append(Call("cluster", "evict_node", (name,), reply=("evicted", name),
                           wait=False))
        else:
            nd = replace(nd, phase="done")
        nodes[name] = nd
    return replace(st, nodes=nodes), fx


class DrainCluster:
    """The calls of the handshake: Kubernetes (``Kube``) and the state store."""

    def __init__(self, kube: Kube, state: Any):
        self.kube, self.state = kube, state
        self.controller = KubernetesNodeController(state, kube=kube)

    async def drain_requested(self) -> list[str]:
        """Nodes annotated ``drain-requested`` and not yet ``drain-ready``."""
        out = []
        for n in await self.kube.nodes():
            ann = (n.get("metadata") or {}).get("annotations") or {}
            if DRAIN_REQUESTED in ann and DRAIN_READY not in ann:
                out.append(n["metadata"]["name"])
        return out

    async def jobs_on_node(self, node: str) -> list[str]:
        """Running jobs with a member rank on ``node`` (job records)."""
        out = []
        for job in await self.state.jobs():
            rec = await self.state.job(job)
            if rec.status == "running" and any(m.get("node") == node for m in rec.members or ()):
                out.append(job)
        return out

    async def checkpoint_status(self, job: str, path: str) -> str:
        """``valid`` | ``invalid`` | ``pending``: the validator's verdict on ``path``."""
        for c in await self.state.checkpoints(job):
            if c["path"] == path:
                return c["status"]
        return "pending"

    async def annotate(self, node: str, annotations: dict[str, str | None]) -> None:
        await self.kube.label_node(node, {}, annotations)

    async def evict_node(self, node: str) -> Any:
        """Cordon ``node`` and evict its trainguard pods (``ControllerResult``)."""
        await self.kube.cordon(node)
        failed, n = [], 0
        for p in await self.kube.managed_pods(node):
            n += 1
            res = await self.kube.evict(p["metadata"].get("namespace", ""), p["metadata"]["name"])
            if not res.ok:
                failed.append(f"{res.namespace}/{res.name}: {res.detail}")
        from trainguard.scheduler.base import ControllerResult

        return ControllerResult(not failed, f"cordoned {node}, evicted {n - len(failed)} of {n} "
                                            f"pod(s)" + (f"; {'; '.join(failed)}" if failed else ""))


class DrainService(ReducerService[DrainState]):
    """The handshake as a service (remediator role): consumes ``tg.job.*.action``."""

    name = "k8s-drain"
    topics = ("tg.job.*.action",)
    #: one replica watches the nodes: no job partitioning, no durable consumer (an answer
    #: missed while it was down is asked for again: the drain restarts from the annotation)
    partitioned = False

    def __init__(self, config=None, drain: DrainConfig | None = None,
                 kube: Kube | KubeConfig | None = None):
        self.drain_config = drain or DrainConfig()
        self.kube = kube if isinstance(kube, Kube) else Kube(kube)
        super().__init__(config)
        self.cluster: DrainCluster | None = None

    def initial_state(self) -> DrainState:
        return DrainState(config=self.drain_config)

    async def setup(self) -> None:
        # the base class's bus probe asks this replica's own health subject
        from trainguard.services.base import health_subject

        await self.bus.nc.subscribe(health_subject(self.name, self.config.replica),
                                    cb=self._health)

    def step(self, state: DrainState, event: Input, now: float):
        return step(state, event, now)

    def targets(self) -> dict[str, Any]:
        if self.cluster is None:
            self.cluster = DrainCluster(self.kube, self.state)
        return {"state": self.state, "cluster": self.cluster}

    def health(self) -> dict[str, Any]:
        return {"draining": {n: d.phase for n, d in self.model.nodes.items()}}

    async def close(self) -> None:
        await super().close()
        await self.kube.close()

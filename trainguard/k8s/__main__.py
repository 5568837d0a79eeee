"""``python -m trainguard.k8s drain [options]``: run the checkpoint-aware drain handshake
(``trainguard.k8s.drain``) as the remediator role (``NATS_URL``, ``REDIS_URL``; Kubernetes
credentials from the service account or ``KUBECONFIG``).

Options: ``--hold S`` (120) · ``--deadline S`` (300) · ``--poll S`` (1) · ``--no-evict`` (only
annotate ``trainguard.io/drain-ready``; the operator drains) · ``--no-validate`` (do not wait for
the validator's verdict) · ``--namespace NS`` (env ``TG_K8S_NAMESPACE``; default all).
"""
from __future__ import annotations

import argparse
import sys

from trainguard.service import ServiceConfig, main

from .api import KubeConfig
from .drain import DrainConfig, DrainService


def parse(argv: list[str]) -> tuple[DrainConfig, KubeConfig]:
    p = argparse.ArgumentParser(prog="python -m trainguard.k8s drain")
    p.add_argument("--hold", type=float, default=DrainConfig.hold_s)
    p.add_argument("--deadline", type=float, default=DrainConfig.deadline_s)
    p.add_argument("--poll", type=float, default=DrainConfig.poll_s)
    p.add_argument("--no-evict", action="store_true")
    p.add_argument("--no-validate", action="store_true")
    p.add_argument("--namespace", default=None)
    a, _ = p.parse_known_args(argv)
    if min(a.hold, a.deadline, a.poll) < 0 or a.poll == 0:
        p.error("--hold, --deadline must be >= 0 and --poll > 0 seconds")
    kube = KubeConfig() if a.namespace is None else KubeConfig(namespace=a.namespace)
    return DrainConfig(poll_s=a.poll, hold_s=a.hold, deadline_s=a.deadline,
                       evict=not a.no_evict, require_valid=not a.no_validate), kube


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "drain":
        raise SystemExit("usage: python -m trainguard.k8s drain [options] (see --help)")
    drain, kube = parse(argv[1:])

    def factory(cfg: ServiceConfig) -> DrainService:
        cfg.tick_s = 0.2
        return DrainService(cfg, drain, kube)

    main(factory, argv[1:])


if __name__ == "__main__":
    run()

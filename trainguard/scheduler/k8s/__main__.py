"""``python -m trainguard.scheduler.k8s drain [options]``: run the checkpoint-aware drain handshake
(``trainguard.scheduler.k8s.drain``) as the remediator role (``NATS_URL``, ``REDIS_URL``; Kubernetes
credentials from the service account or ``KUBECONFIG``).

Options: ``--hold S`` (120) · ``--deadline S`` (300) · ``--poll S`` (1) · ``--no-evict`` (only
annotate ``trainguard.io/drain-ready``; the operator drains) · ``--no-validate`` (do not wait for
the validator's verdict) · ``--namespace NS`` (env ``TG_K8S_NAMESPACE``; default all).

``python -m trainguard.scheduler.k8s readmit NODE [--canary-cmd CMD]``: give a suspect node back
(``KubernetesNodeController.readmit``): uncordon it and remove ``trainguard.io/suspect`` only
when the canary passes — the node is ``Ready`` with no drain requested and, with
``--canary-cmd``, the shell command ``CMD`` (env ``TG_NODE`` = the node; e.g. a health-check
Job pinned to the node, waited for with ``kubectl wait``) exits 0. With ``REDIS_URL`` set the
node's record in the state store becomes ``healthy``. Exit status 0 readmitted, 1 kept cordoned.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from trainguard.services.base import ServiceConfig
from trainguard.services.entry import main

from trainguard.scheduler.k8s.api import KubeConfig
from trainguard.scheduler.k8s.drain import DrainConfig, DrainService


def parse(argv: list[str]) -> tuple[DrainConfig, KubeConfig]:
    p = argparse.ArgumentParser(prog="python -m trainguard.scheduler.k8s drain")
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


async def command_canary(cmd: str, node: str, timeout_s: float) -> tuple[bool, str]:
    """Run ``cmd`` in a shell with ``TG_NODE=node``; passes on exit status 0 within
    ``timeout_s`` seconds (``controller_base.run_canary_command``, the one canary runner of
    every controller). The detail quotes the end of its output."""
    from trainguard.scheduler.base import run_canary_command

    ok, detail = await run_canary_command(["/bin/sh", "-c", cmd], node, timeout_s)
    return ok, f"canary {cmd!r}: {detail}"


async def readmit(argv: list[str]) -> int:
    """``readmit NODE [--canary-cmd CMD] [--canary-timeout S]``; returns the exit status."""
    from trainguard.clients.store import StateStore

    from trainguard.scheduler.k8s.controller import KubernetesNodeController

    p = argparse.ArgumentParser(prog="python -m trainguard.scheduler.k8s readmit")
    p.add_argument("node")
    p.add_argument("--canary-cmd", default="")
    p.add_argument("--canary-timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    state = StateStore(os.environ["REDIS_URL"]) if os.environ.get("REDIS_URL") else None
    ctl = KubernetesNodeController(state, KubeConfig())

    async def canary(node: str) -> tuple[bool, str]:
        ok, detail = await ctl.ready_canary(node)
        if not ok or not a.canary_cmd:
            return ok, detail
        ok, more = await command_canary(a.canary_cmd, node, a.canary_timeout)
        return ok, f"{detail}; {more}"

    try:
        res = await ctl.readmit(a.node, canary)
    finally:
        await ctl.kube.close()
        if state is not None:
            await state.close()
    print(res.detail)
    return 0 if res.ok else 1


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "readmit":
        raise SystemExit(asyncio.run(readmit(argv[1:])))
    usage = ("usage: python -m trainguard.scheduler.k8s drain [options] | readmit NODE "
             "[--canary-cmd CMD] [--canary-timeout S]\n\n"
             "  drain    the checkpoint-aware drain handshake (one replica; `drain --help`)\n"
             "  readmit  return a cordoned node to service after its canary (`readmit --help`)")
    if argv in (["-h"], ["--help"]):
        print(usage)
        raise SystemExit(0)
    if not argv or argv[0] != "drain":
        raise SystemExit(usage)
    drain, kube = parse(argv[1:])

    def factory(cfg: ServiceConfig) -> DrainService:
        cfg.tick_s = 0.2
        return DrainService(cfg, drain, kube)

    main(factory, argv[1:])


if __name__ == "__main__":
    run()

"""``python -m trainguard.agents --node NAME --nats-url URL [options]``: run the node agent.

Connection options (``--nats-url``, ``--redis-url``, ``--node``, ``--log-level`` and their
environment variables ``NATS_URL``, ``REDIS_URL``, ``TG_NODE``, ``TG_LOG_LEVEL``) behave as for
every trainguard service. The node name defaults to the short host name (the part before the
first dot) unless `TG_NODE` is set — on Kubernetes from the downward API (`spec.nodeName`), dots
included (subject tokens encode them). Agent options:

``--interval`` telemetry period, s (1.0) · ``--heartbeat-interval`` node heartbeat period, s
(0.5) · ``--kmsg auto|/dev/kmsg|journal|none|PATH`` kernel log source (auto; env
``TG_AGENT_KMSG``) · ``--kmsg-from-start`` also read what the log already holds ·
``--peers host:port,...`` latency probe targets (env ``TG_AGENT_PEERS``) · ``--probe-timeout``
s (0.5) · ``--no-nvml`` skip NVML · ``--nvml-module MOD[:FACTORY]`` use this module instead of
pynvml (env ``TG_AGENT_NVML_MODULE``; ``agents.nvml.load_module``: the demo's simulated GPUs are
``trainguard.demo.fake_pynvml:for_node``) · ``--memory-budget-file PATH`` this node is a share
of its host: memory of its own processes against the budget in PATH (env
``TG_AGENT_MEMORY_BUDGET_FILE``; ``{node}`` is replaced by the node name;
``agents.host.NodeMemory``).
"""
from __future__ import annotations

import argparse
import os
import sys

from trainguard.schemas import subjects
from trainguard.services.base import ServiceConfig
from trainguard.services.entry import main

from trainguard.agents.agent import AgentConfig, NodeAgent
from trainguard.agents.kernel_log import KernelLogConfig
from trainguard.agents.nvml import NvmlConfig


def parse_agent_args(argv: list[str]) -> tuple[AgentConfig, str]:
    """``(AgentConfig, node)`` from the agent's own options; unknown options are left for the
    common service parser. Exits with a usage message on a bad value."""
    p = argparse.ArgumentParser(prog="python -m trainguard.agents", description="trainguard node agent")
    p.add_argument("--node", default=subjects.default_node())
    p.add_argument("--interval", type=float, default=1.0, help="telemetry period, seconds")
    p.add_argument("--heartbeat-interval", type=float, default=0.5,
                   help="node heartbeat period, seconds")
    p.add_argument("--kmsg", default=os.environ.get("TG_AGENT_KMSG", "auto"),
                   help="kernel log: auto, /dev/kmsg, journal, none or a file path")
    p.add_argument("--kmsg-from-start", action="store_true",
                   help="also report what the kernel log already holds")
    p.add_argument("--peers", default=os.environ.get("TG_AGENT_PEERS", ""),
                   help="comma-separated host:port latency probe targets")
    p.add_argument("--probe-timeout", type=float, default=0.5, help="seconds")
    p.add_argument("--no-nvml", action="store_true", help="do not use NVML")
    p.add_argument("--nvml-module", default=os.environ.get("TG_AGENT_NVML_MODULE", ""),
                   help="MODULE or MODULE:FACTORY with pynvml's API to use instead of pynvml")
    p.add_argument("--memory-budget-file",
                   default=os.environ.get("TG_AGENT_MEMORY_BUDGET_FILE", ""),
                   help="the node is a share of the host: its memory budget in bytes is in "
                        "this file ({node}: the node name)")
    args, _ = p.parse_known_args(argv)
    cfg = AgentConfig(
        interval_s=args.interval, heartbeat_interval_s=args.heartbeat_interval,
        peers=tuple(x.strip() for x in args.peers.split(",") if x.strip()),
        probe_timeout_s=args.probe_timeout,
        kernel=KernelLogConfig(source=args.kmsg, from_start=args.kmsg_from_start),
        nvml=NvmlConfig(enabled=not args.no_nvml, module=args.nvml_module),
        memory_budget_file=args.memory_budget_file)
    try:
        cfg.validate()
    except ValueError as exc:
        p.error(str(exc))
    return cfg, args.node


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    agent_cfg, node = parse_agent_args(argv)
    if not any(a == "--node" or a.startswith("--node=") for a in argv):
        argv += ["--node", node]

    def factory(cfg: ServiceConfig) -> NodeAgent:
        cfg.tick_s = 1.0  # the agent's work runs in its own tasks, the base tick idles
        return NodeAgent(cfg, agent_cfg)

    main(factory, argv)


if __name__ == "__main__":
    run()

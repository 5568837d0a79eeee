"""trainguard node agent: host and GPU telemetry, node heartbeat, kernel-log and NVML XIDs.

Run one per node: ``python -m trainguard.agents --node NAME --nats-url URL``. See ``agents.agent`` for
what it publishes, ``agents.nvml``, ``agents.host`` and ``agents.kernel_log`` for the parts.
"""

from .agent import KERNEL_KIND, AgentConfig, NodeAgent
from .host import HostSampler, probe_latencies
from .kernel_log import KernelLogConfig, open_follower
from .nvml import NvmlConfig, NvmlSampler, decode_clock_event_reasons, normalise_pci

__all__ = ["NodeAgent", "AgentConfig", "KERNEL_KIND", "HostSampler", "probe_latencies",
           "KernelLogConfig", "open_follower", "NvmlConfig", "NvmlSampler",
           "decode_clock_event_reasons", "normalise_pci"]

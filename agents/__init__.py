"""trainguard node agent: host and GPU telemetry, node heartbeat, kernel-log and NVML XIDs.

Run one per node: ``python -m trainguard.agents --node NAME --nats-url URL``. See ``agents.agent`` for
what it publishes, ``agents.nvml``, ``agents.host`` and ``agents.kernel_log`` for the parts.
"""

from trainguard.agents.agent import KERNEL_KIND, AgentConfig, NodeAgent
from trainguard.agents.host import HostSampler, probe_latencies
from trainguard.agents.kernel_log import KernelLogConfig, open_follower
from trainguard.agents.nvml import NvmlConfig, NvmlSampler, decode_clock_event_reasons, normalise_pci

__all__ = ["NodeAgent", "AgentConfig", "KERNEL_KIND", "HostSampler", "probe_latencies",
           "KernelLogConfig", "open_follower", "NvmlConfig", "NvmlSampler",
           "decode_clock_event_reasons", "normalise_pci"]

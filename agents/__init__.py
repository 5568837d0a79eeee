"""trainguard node agent: host and GPU telemetry, node heartbeat, kernel-log and NVML XIDs.

Run one per node: ``python -m agents --node NAME --nats-url URL``. See ``agents.agent`` for
what it publishes, ``agents.nvml``, ``agents.host`` and ``agents.kernel_log`` for the parts.
"""
from trainguard.syspath import working_dir_off_path_under_m

working_dir_off_path_under_m()  # `python -m` here: a ./schemas folder must not shadow ours

from .agent import KERNEL_KIND, AgentConfig, NodeAgent  # noqa: E402
from .host import HostSampler, probe_latencies  # noqa: E402
from .kernel_log import KernelLogConfig, open_follower  # noqa: E402
from .nvml import NvmlConfig, NvmlSampler, decode_clock_event_reasons, normalise_pci  # noqa: E402

__all__ = ["NodeAgent", "AgentConfig", "KERNEL_KIND", "HostSampler", "probe_latencies",
           "KernelLogConfig", "open_follower", "NvmlConfig", "NvmlSampler",
           "decode_clock_event_reasons", "normalise_pci"]

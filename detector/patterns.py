"""Log patterns as data: what a line from a rank, a launcher, dmesg or the journal means.

``PATTERNS`` is an ordered table; ``match_line(line)`` returns the first row that matches (rows
are ordered most specific first, so "CUDA error: uncorrectable ECC error" is an ECC fault, not a
generic ``RuntimeError``). Each row carries:

* ``name`` — stable id, used in evidence and tests;
* ``regex`` — Python regex (case-insensitive unless the row says otherwise); named groups
  ``rank``, ``local_rank``, ``seq``, ``op``, ``peer``, ``peer_host``, ``pci``, ``gpu``, ``pid``,
  ``ready`` become facts in the match's ``groups``;
* ``fault_class`` / ``layer`` — the vocabulary (``schemas.vocabulary``) the line points at, the
  layer as a hint to the attributor (no action: only the remediator chooses one);
* ``symptom`` — True when the line is what a rank prints *because another fault happened*
  (a peer's connection reset after a death, a watchdog timeout while blocked on a hung peer);
* ``weight`` — 0..1, how specific the line is for its fault class (1 = unambiguous);
* ``why`` — the reasoning and, where there is one, the source.

The rows describe kinds of faults as the components that see them print them — PyTorch (c10d
store, rendezvous, ProcessGroupNCCL, torchrun, the allocators), NCCL and the IB verbs, aws-ofi-nccl
and libfabric's EFA provider, gloo, Horovod, the CUDA runtime and the NVIDIA driver, the Linux
kernel (OOM killer, memory cgroup, MCE/EDAC, hung tasks, NIC drivers, NFS/Lustre), systemd, Slurm,
the kubelet and kube-scheduler, cloud spot/preemption notices, Ray/Dask/YARN memory monitors,
DeepSpeed, fairseq, apex and Megatron loss scalers, safetensors/transformers/h5py loaders. They
are grouped by kind (one ``# ====`` block per kind) and written from those projects' message
formats (each ``why`` names the file or document), not from particular bug reports;
``tests/fixtures/log_kinds.jsonl`` holds logs of every kind, and benign noise that must match
nothing.

``match_line`` skips a row when none of the literal words its regex requires is in the line
(``_GATES``, derived from the regexes): the same result, several times faster on the lines of a
healthy job.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.schemas.vocabulary import FaultClass, Layer


@dataclass(frozen=True)
class LogPattern:
    name: str
    regex: re.Pattern
    fault_class: FaultClass
    layer: Layer
    symptom: bool = False
    weight: float = 0.7
    why: str = ""


@dataclass
class PatternMatch:
    """A matched line: the table row and the named groups it captured (non-empty only)."""

    pattern: LogPattern
    groups: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.pattern.name


def _p(name: str, regex: str, fault_class: str, layer: str, symptom: bool = False,
       weight: float = 0.7, why: str = "", flags: int = re.IGNORECASE) -> LogPattern:
    return LogPattern(name, re.compile(regex, flags), FaultClass(fault_class), Layer(layer),
                      symptom, weight, why)


_PCI = r"(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
#: a loss scale that has reached the floor of dynamic loss scaling: 0, 1, a fraction or 1e-N
_TINY = r"(?:0(?:\.\d+)?|1(?:\.0+)?|\d(?:\.\d+)?e-\d+)(?![\d.])"
#: an NCCL line at INFO level: the setup rows below ignore it (NCCL and aws-ofi-nccl print their
#: probing at INFO; old NCCL printed IB completion errors at INFO, so that row reads INFO too)
_NOT_INFO = r"^(?!.*\bNCCL INFO\b)"

# The table is grouped by fault *kind*; within a kind the rows cover the formats the kind is
# printed in by the components that see it (kernel, scheduler, container runtime, framework,
# communication library). ``why`` names the source of each format: the file that prints it or
# the documentation page that describes it. Order matters (first match wins): specific rows
# come before the generic ones at the end.
PATTERNS: tuple[LogPattern, ...] = (
    # ==== GPU hardware and driver ===============================================================
    _p("gpu_lost",
       r"GPU is lost|fallen off the bus|Unable to determine the device handle for GPU\s*" + _PCI
       + r"?|CUDA_ERROR_ECC_UNCORRECTABLE_DISABLED|RmInitAdapter failed",
       "gpu_xid", "hardware", weight=0.9,
       why="NVML/driver report the GPU gone from the PCIe bus (XID 79) or failing to initialise "
           "(NVRM: RmInitAdapter failed): reboot needed (NVIDIA XID catalog, "
           "docs.nvidia.com/deploy/xid-errors)"),
    _p("uncorrectable_ecc",
       r"uncorrectable ECC error|ECC error encountered|cudaErrorECCUncorrectable|"
       r"double bit (?:ECC )?error|DBE\)? has been detected",
       "ecc", "hardware", weight=0.9,
       why="CUDA runtime error 214 (cudaErrorECCUncorrectable, CUDA Runtime API 'Error "
           "Handling' docs): GPU memory fault"),
    _p("uncorrectable_nvlink",
       r"uncorrectable NVLink error|cudaErrorNvlinkUncorrectable|NVLink: fatal error",
       "nvlink", "hardware", weight=0.9,
       why="CUDA runtime error 220 (cudaErrorNvlinkUncorrectable, CUDA Runtime API 'Error "
           "Handling' docs)"),
    _p("gpu_thermal",
       r"(?:HW|SW) (?:Thermal )?Slowdown\s*:\s*Active|thermal (?:slowdown|throttl\w*)|"
       r"GPU (?:is )?(?:over ?heat\w*|running hot)|clocks? (?:are )?throttled.*therm",
       "thermal", "hardware", weight=0.8,
       why="NVML clock-event reasons SwThermalSlowdown / HwThermalSlowdown / HwSlowdown "
           "(NVML API nvmlClocksEventReasons; nvidia-smi -q 'HW Thermal Slowdown : Active')"),
    _p("cuda_unknown_error",
       r"CUDA error: unknown error|cudaErrorUnknown\b|CUDA_ERROR_UNKNOWN",
       "gpu_xid", "hardware", weight=0.5,
       why="CUDA runtime cudaErrorUnknown (999): the driver could not say what failed — on a "
           "training node it follows a GPU that fell off the bus or a driver fault (XID); "
           "low weight, an XID line or an OOM explains it better"),
    _p("cuda_driver_setup",
       r"CUDA driver version is insufficient|Driver/library version mismatch|"
       r"Found no NVIDIA driver on your system|no CUDA-capable device is detected|"
       r"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver|"
       r"CUDA-capable device\(s\) is/are busy or unavailable|cudaErrorDevicesUnavailable|"
       r"cudaErrorInsufficientDriver|cudaErrorNoDevice|CUDA error: initialization error|"
       r"CUDA_ERROR_NOT_INITIALIZED|no kernel image is available for execution on the device|"
       r"The NVIDIA driver on your system is too old|No CUDA GPUs are available|"
       r"Unexpected error from cudaGetDeviceCount|forward compatibility was attempted on non "
       r"supported HW|system not yet initialized|cudaErrorSystemNotReady|NVRM: API mismatch",
       "crash", "system_software", weight=0.8,
       why="the CUDA runtime cannot use the GPU for a reason of the node's software: driver "
           "older than the runtime (cudaErrorInsufficientDriver 35), driver upgraded without a "
           "reboot (NVML 'Driver/library version mismatch'), exclusive/prohibited compute mode "
           "(cudaErrorDevicesUnavailable 46, CUDA Runtime API docs), a build without the GPU's "
           "architecture (cudaErrorNoKernelImageForDevice 209), fabric manager not running on an "
           "NVSwitch system (cudaErrorSystemNotReady 802 'system not yet initialized'), a user-space "
           "driver newer than the kernel module ('NVRM: API mismatch'); torch wraps these as "
           "'Unexpected error from cudaGetDeviceCount()' (c10/cuda/CUDAFunctions.cpp)"),
    # ==== host hardware and kernel ==============================================================
    _p("host_machine_check",
       r"\[Hardware Error\]:.*(?:Uncorrected|fatal)|EDAC \S+: \d+ UE |"
       r"Machine check: Processor context corrupt|Kernel panic - not syncing: Fatal machine check|"
       r"AER: (?:Multiple )?Uncorrected \(Fatal\) error",
       "crash", "hardware", weight=0.8,
       why="the kernel's MCE/EDAC report of an uncorrected host memory or CPU error "
           "(linux arch/x86/kernel/cpu/mce, drivers/edac/edac_mc.c 'UE') or a fatal PCIe error "
           "(drivers/pci/pcie/aer.c 'AER: Uncorrected (Fatal) error received')"),
    _p("kernel_hung_task",
       r"blocked for more than \d+ seconds|soft lockup - CPU#\d+ stuck for|"
       r"rcu_sched detected stalls|INFO: task \S+ blocked",
       "hang", "system_software", weight=0.6,
       why="the kernel's hung-task / soft-lockup detectors (linux kernel/hung_task.c, "
           "kernel/watchdog.c): a process stuck in the kernel, usually on I/O"),
    # ==== memory: device ========================================================================
    _p("cuda_oom",
       r"CUDA out of memory|OutOfMemoryError: CUDA|cudaErrorMemoryAllocation|"
       r"CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|HIP out of memory|"
       r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)|"
       r"Cuda failure (?:\d+ )?'out of memory'|cudaMalloc\w* failed.{0,40}out of memory|"
       r"OOM when allocating tensor|RESOURCE_EXHAUSTED: Out of memory while trying to allocate|"
       r"NPU out of memory|MPS backend out of memory|XPU out of memory",
       "oom_gpu", "application", weight=0.95,
       why="device memory ran out: torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp "
           "'CUDA out of memory. Tried to allocate'), the CUDA runtime (cudaErrorMemoryAllocation "
           "2, 'out of memory'), NCCL's CUDACHECK (src/include/checks.h \"Cuda failure '%s'\"), "
           "cuBLAS/cuDNN allocation statuses, TensorFlow/XLA RESOURCE_EXHAUSTED: batch, model or "
           "activations too large for the GPU, or stray processes on it"),
    # ==== memory: host (kernel, cgroup, scheduler, container runtime, framework monitors) =======
    _p("host_oom_kill",
       r"Out of memory: Kill(?:ed)? process (?P<pid>\d+)|oom-kill:|invoked oom-killer|"
       r"Memory cgroup out of memory|oom_reaper: reaped process (?P<pid2>\d+)|"
       r"Task in \S+ killed as a result of limit of|memory: usage \d+kB, limit \d+kB, failcnt|"
       r"is killed by signal: Killed|has been killed by the OOM killer|"
       r"systemd-oomd\[\d+\]: Killed \S+ due to memory",
       "oom_host", "application", weight=0.95,
       why="the Linux OOM killer (mm/oom_kill.c: '%s invoked oom-killer', 'oom-kill:constraint="
           "…', 'Out of memory: Killed process %d', 'Memory cgroup out of memory: Killed process', "
           "'oom_reaper: reaped process'; mm/memcontrol.c: 'memory: usage %llukB, limit …') killed "
           "the process; torch's DataLoader reports a worker it killed ('is killed by signal: "
           "Killed', torch/utils/data/_utils/signal_handling.py); systemd's view of either "
           "(src/core/unit.c 'A process of this unit has been killed by the OOM killer.', "
           "systemd-oomd src/oom/oomd.c 'Killed %s due to memory pressure …')"),
    _p("slurm_oom",
       r"Detected \d+ oom[-_]kill event|task \d+: Out Of Memory|"
       r"\btasks? [\d,-]+: Out Of Memory|Exceeded (?:job|step) memory limit|"
       r"(?-i:\bOUT_OF_MEMORY\b)|JobState=OUT_OF_MEMORY|exceeded memory limit \(\d+ > \d+\), being killed",
       "oom_host", "application", weight=0.95,
       why="Slurm's cgroup plugin counted OOM kills of the step (src/plugins/task/cgroup/"
           "task_cgroup_memory.c 'Detected %lu oom_kill event(s) in %ps', older 'oom-kill "
           "event(s) in step … cgroup'), srun's task summary (src/srun/launch.c '%s: task %s: Out "
           "Of Memory'), jobacct_gather's 'Exceeded job memory limit', job state OUT_OF_MEMORY"),
    _p("slurm_memory_limit_hit",
       r"hit memory(?:\+swap)? limit at least once during execution|oom-kill event count: [1-9]",
       "oom_host", "application", symptom=True, weight=0.4,
       why="Slurm's task/cgroup saw the step reach its memory limit (src/plugins/task/cgroup/"
           "task_cgroup_memory.c '%ps hit memory limit at least once during execution. This may "
           "or may not result in some failure.'; cgroup v1 'oom-kill event count'): a hint — the "
           "'Detected … oom_kill event' line or the process's own fault decides"),
    _p("container_oom",
       r"OOMKilled|System OOM encountered|\bReason:\s*OOMKilling|container .{0,60}was OOM.?killed|"
       r"OOM killed process",
       "oom_host", "application", weight=0.95,
       why="the container runtime / kubelet saw its cgroup OOM killer fire: container status "
           "reason OOMKilled (kubernetes pkg/kubelet, container state), kubelet event SystemOOM "
           "'System OOM encountered, victim process: %v, pid: %v' (pkg/kubelet/oom)"),
    _p("framework_host_oom",
       r"killed due to the node running low on memory|ray\.exceptions\.OutOfMemoryError|"
       r"exceeds the memory usage threshold of|DefaultCPUAllocator: (?:can't|not enough memory)|"
       r"Torch: not enough memory: you tried to allocate|"
       r"exceeded \d+% memory budget|killed by YARN for exceeding memory limits|"
       r"is running beyond physical memory limits|Container killed due to memory usage|"
       r"session crashed after using all available RAM|"
       r"^(?!.*(?:ibv_|NET/IB|NET/OFI|NCCL)).*\[Errno 12\] Cannot allocate memory|"
       r"std::bad_alloc|^(?:\[[\w, ]+\](?:<std\w+>)?:\s*)?MemoryError\b",
       "oom_host", "application", weight=0.9,
       why="a framework ran out of host memory or its own memory monitor killed a worker: Ray's "
           "memory monitor ('Task was killed due to the node running low on memory … exceeds "
           "the memory usage threshold of', docs.ray.io 'Out-Of-Memory Prevention'), torch's CPU "
           "allocator (c10/core/impl/alloc_cpu.cpp 'DefaultCPUAllocator: can't allocate "
           "memory'), Dask's worker memory monitor (distributed/worker_memory.py 'exceeded 95% "
           "memory budget. Restarting'), YARN's container monitor ('is running beyond physical "
           "memory limits', 'Container killed by YARN for exceeding memory limits'), ECS/AWS Batch "
           "stop reason 'OutOfMemoryError: Container killed due to memory usage', Colab's 'Your "
           "session crashed after using all available RAM', ENOMEM from Python (errno 12), C++ "
           "std::bad_alloc, Python MemoryError"),
    _p("k8s_eviction_memory",
       r"The node was low on resource: memory|node had condition: \[MemoryPressure\]|"
       r"evict\w* .{0,80}\bmemory pressure",
       "oom_host", "infrastructure", weight=0.85,
       why="kubelet's node-pressure eviction for memory (pkg/kubelet/eviction/helpers.go "
           "'The node was low on resource: %v.'; kubernetes.io docs 'Node-pressure Eviction'): "
           "the node ran short of memory and the kubelet evicted the pod"),
    # ==== signals and exits =====================================================================
    _p("sigbus",
       r"Signal 7 \(SIGBUS\)|exit ?code\s*:\s*-7\b|Caught signal 7\b|\bBus error\b|"
       r"insufficient shared memory|/dev/shm.*(?:No space|too small|full)|return code = -7\b|"
       r"terminated with signal SIGBUS|<Signals\.SIGBUS: 7>",
       "crash", "infrastructure", weight=0.8,
       why="SIGBUS in a training process is nearly always a write past the end of a /dev/shm "
           "mapping (NCCL's intra-node buffers, DataLoader tensors): containers default to a "
           "64 MB /dev/shm — raise it (--shm-size / an emptyDir with medium Memory). Formats: "
           "torch/utils/data/_utils/signal_handling.py ('Unexpected bus error encountered in "
           "worker. This might be caused by insufficient shared memory (shm)'), torchelastic "
           "'Signal 7 (SIGBUS) received by PID'"),
    _p("sigsegv",
       r"Signal 11 \(SIGSEGV\)|exit ?code\s*:\s*-11\b|Caught signal 11\b|Segmentation fault|"
       r"SIGSEGV|segfault at [0-9a-f]+ ip |return code = -11\b|<Signals\.SIGSEGV: 11>",
       "crash", "unknown", weight=0.7,
       why="native crash in the process: extension, library, driver or memory (kernel: "
           "arch/x86/mm/fault.c 'segfault at %lx ip %px sp %px error %lx')"),
    _p("sigkill",
       r"Signal 9 \(SIGKILL\)|exit ?code\s*:\s*-9\b|exit(?:ed)? with (?:status|exit) code 137\b|"
       r"exit(?:ed)? with code 137\b|^(?:\[[\d,]+\]<std\w+>:)?Killed\s*$|"
       r"\btasks? [\d,-]+: Killed\b|exit code:? 137\b|return code = -9\b|"
       r"terminated with signal SIGKILL|Exited \(137\)|^zsh: killed\s|<Signals\.SIGKILL: 9>|"
       r"^(?:.*: line \d+: )?(?:\[\d+\]\+?\s+)?(?:\d+\s+)?Killed\s+\S*python",
       "oom_host", "application", weight=0.45,
       why="SIGKILL that the launcher did not send: the kernel OOM killer is its usual sender "
           "on a training host (check `dmesg | grep -i oom`); low weight because an operator or "
           "scheduler can send it too (srun: src/srun/launch.c '%s: task %s: %s' with the "
           "signal's name; DeepSpeed deepspeed/launcher/launch.py '%s exits with return code = "
           "%d'; torch/multiprocessing/spawn.py 'process %d terminated with signal %s'; "
           "Python's CalledProcessError 'died with <Signals.SIGKILL: 9>' (the old "
           "torch.distributed.launch); the shell's 'Killed' job report)"),
    _p("sigabrt",
       r"Signal 6 \(SIGABRT\)|exit ?code\s*:\s*-6\b|Aborted \(core dumped\)|"
       r"exit(?:ed)? with (?:status|exit) code 134\b|terminate called (?:after throwing|without)|"
       r"return code = -6\b|terminated with signal SIGABRT|<Signals\.SIGABRT: 6>",
       "crash", "unknown", symptom=True, weight=0.3,
       why="abort() after an uncaught C++ exception (libstdc++ 'terminate called after "
           "throwing an instance of'): the exception printed before it is the cause"),
    _p("agent_sigterm",
       r"Received Signals\.SIGTERM death signal|SignalException: Process \d+ got signal: 15\b",
       "crash", "infrastructure", symptom=True, weight=0.3,
       why="torchrun's agent itself got SIGTERM from outside (torch/distributed/elastic/"
           "multiprocessing/api.py 'Received %s death signal, shutting down workers'): the "
           "scheduler cancelled, preempted or timed out the job, or killed it after another "
           "node's task failed — a symptom; the scheduler's own line says which"),
    # ==== the cluster: preemption, eviction, node failure, time limit ===========================
    _p("scheduler_node_failure",
       r"CANCELLED AT \S+ DUE TO (?:NODE ?FAILURE|PREEMPTION)|Node failure on \S+|"
       r"(?-i:\bNODE_FAIL\b|\bPREEMPTED\b)|JobState=(?:NODE_FAIL|PREEMPTED)|"
       r"Reason=Node(?:Fail|Down)\b",
       "node_lost", "infrastructure", weight=0.85,
       why="Slurm ended the job because a node failed or the job was preempted "
           "(src/slurmd/slurmstepd/req.c '*** %s ON %s CANCELLED AT %s DUE TO PREEMPTION ***' / "
           "'DUE TO NODE FAILURE'; src/srun/allocate.c 'Node failure on %s'; job states "
           "NODE_FAIL, PREEMPTED): requeue elsewhere"),
    _p("scheduler_time_limit",
       r"CANCELLED AT \S+ DUE TO TIME LIMIT|JobState=TIMEOUT|\bDUE TO TIME LIMIT\b",
       "crash", "infrastructure", weight=0.6,
       why="Slurm killed the job at its wall-clock limit (src/slurmd/slurmstepd/req.c "
           "'DUE TO TIME LIMIT'): no fault of the program or the node — resume from the last "
           "checkpoint with a longer limit"),
    _p("k8s_eviction_storage",
       r"The node was low on resource: ephemeral-storage|"
       r"ephemeral local storage usage exceeds the total limit|"
       r"exceeded its local ephemeral storage limit|Usage of EmptyDir volume .{0,80}exceeds the limit|"
       r"node had condition: \[DiskPressure\]",
       "filesystem", "infrastructure", weight=0.85,
       why="kubelet evicted the pod for local disk (pkg/kubelet/eviction/helpers.go "
           "'The node was low on resource: ephemeral-storage', 'Pod ephemeral local storage usage "
           "exceeds the total limit of containers %s', 'Container %s exceeded its local "
           "ephemeral storage limit %q', 'Usage of EmptyDir volume %q exceeds the limit %q')"),
    _p("k8s_evicted",
       r"^\s*(?:Status:\s*Failed\s+)?Reason:\s*Evicted\s*$|\bWarning\s+Evicted\s*$|"
       r"\bpod .{0,80}\bevicted\b",
       "node_lost", "infrastructure", symptom=True, weight=0.5,
       why="a pod's status or event says only that it was evicted (kubernetes pod status "
           "reason Evicted): the message beside it (the resource the node was low on) says "
           "why; alone, the pod was taken away — a symptom-only verdict of node_lost"),
    _p("k8s_eviction",
       r"\bWarning\s+Evicted\s+.{0,80}\S|The node was low on resource|"
       r"terminated in response to imminent node shutdown|Preempted in order to admit critical pod|"
       r"TaintManagerEviction|Marking for deletion Pod|status is now: NodeNotReady|"
       r"\bNodeNotReady\b|Spot Instance interruption|instance-action.{0,40}terminate|"
       r"Instance was preempted|compute\.instances\.preempted|The node was drained|"
       r"Preempted to accommodate|\bnode (?:was|is being) preempted\b|Preempted by (?:a )?pod|"
       r"PreemptionByScheduler|DeletionByTaintManager|EvictionByEvictionAPI",
       "node_lost", "infrastructure", weight=0.8,
       why="the pod or the machine was taken away: kubelet eviction (pkg/kubelet/eviction, "
           "reason Evicted), graceful node shutdown (pkg/kubelet/nodeshutdown 'Pod was "
           "terminated in response to imminent node shutdown.'), kubelet preemption "
           "(pkg/kubelet/preemption 'Preempted in order to admit critical pod'), taint-based "
           "eviction (TaintManagerEviction), the node going NotReady, cloud spot/preemptible "
           "reclaim (AWS 'Spot Instance interruption notice', GCE compute.instances.preempted), "
           "kube-scheduler preemption (pkg/scheduler/framework/preemption 'Preempted by pod %v on "
           "node %v'), the DisruptionTarget condition's reasons (PreemptionByScheduler, "
           "DeletionByTaintManager, EvictionByEvictionAPI; kubernetes.io 'Pod disruption "
           "conditions')"),
    # ==== collectives: NCCL / gloo / Horovod ====================================================
    _p("nccl_watchdog_timeout",
       r"(?:\[Rank (?P<rank>\d+)\]\s*)?Watchdog caught collective operation timeout:\s*"
       r"Work\w*\(SeqNum=(?P<seq>\d+),\s*OpType=(?P<op>\w+)",
       "hang", "unknown", symptom=True, weight=0.6,
       why="ProcessGroupNCCL's watchdog: this rank waited past the collective timeout — it is "
           "blocked on a peer that is hung, dead or slow (the rank behind is the culprit)"),
    _p("collective_timeout",
       r"Timed out waiting \d+ ?ms for (?:recv|send) operation|Application timeout caused pair "
       r"closure|collective operation timeout|NCCL communicator was aborted.*timeout|"
       r"ProcessGroupGloo.*[Tt]imeout|Timeout at NCCL work: \d+|"
       r"Heartbeat monitor timed out|watchdog got stuck for \d+ seconds|"
       r"Some NCCL operations have failed or timed out",
       "hang", "unknown", symptom=True, weight=0.5,
       why="gloo/NCCL collective timeout (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: "
           "'Timeout at NCCL work', the heartbeat monitor, 'Some NCCL operations have failed or "
           "timed out'): blocked on a peer"),
    _p("remote_peer_closed",
       r"Connection closed by remote peer (?P<peer_host>[A-Za-z][\w.-]*)",
       "node_lost", "infrastructure", symptom=True, weight=0.5,
       why="NCCL's socket to a named remote host closed (src/misc/socket.cc 'socketProgress: "
           "Connection closed by remote peer %s'): that host's process or the host itself went "
           "away; when nothing else from that host explains it, the host is lost"),
    _p("nccl_remote_error",
       r"ncclRemoteError|remote process exited or there was a network error",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="ncclRemoteError (src/init.cc ncclGetErrorString): a remote peer exited or the "
           "network failed; a symptom of the peer's fault"),
    _p("ib_completion_error",
       r"NET/IB\w*\s*:\s*Got completion (?:from peer (?:(?P<peer>\d[\d.]*)\S*|\S+)\s*)?with "
       r"(?:error|status=)|IBV_WC_\w+_ERR|transport retry counter exceeded|RETRY_EXC_ERR|"
       r"ibv_poll_cq.*fail|NET/IB.*async fatal event|"
       r"NET/IB\s*:.{0,40}Got async event\s*:\s*[^(]{0,40}?(?:error|catastrophic)|"
       r"mlx5\w*:.*(?:CQE error|syndrome)",
       "network", "hardware", weight=0.8,
       why="RDMA work completion with an error status (NCCL src/transport/net_ib 'Got "
           "completion from peer %s with status=%s(%d) … vendor_err', 'async fatal event'; e.g. "
           "12 = IBV_WC_RETRY_EXC_ERR: the remote side stopped acknowledging) — a link, cable or "
           "HCA fault on that path, which stays broken until the node is serviced (a hardware "
           "layer: the policy's network/hardware row moves the job off the node); a non-fatal "
           "async event (NET/IB 'Got non-fatal async event'; before 2.19 every event was "
           "'Got async event : %s' — only ibv_event_type_str's error/catastrophic ones count, "
           "not 'GID table change' or 'port active') is no fault"),
    _p("ib_verbs_setup",
       _NOT_INFO + r".*(?:Call to ibv_\w+ failed.{0,40}(?:Cannot allocate memory|errno 12|"
       r"Operation not permitted)|ibv_reg_mr\w* failed|NET/IB\s*:\s*Unable to (?:open|query) "
       r"(?:device|port))",
       "network", "system_software", weight=0.7,
       why="an InfiniBand verbs call failed for a reason of the node's setup: locked-memory "
           "limit (ENOMEM from ibv_create_qp / ibv_reg_mr: ulimit -l, container memlock), no "
           "permission, device not openable (NCCL src/misc/ibvwrap.cc 'Call to %s failed with "
           "error %s', src/transport/net_ib/init.cc 'NET/IB : Unable to open device %s')"),
    _p("nic_kernel_error",
       r"mlx5_core .{0,80}(?:Cable unplugged|Cable error|health compromised|[Ff]atal error \d+ "
       r"detected|internal error)|NETDEV WATCHDOG: .{0,80}transmit queue \d+ timed out|"
       r"mlx5_core .{0,80}Link down|\bib\d+: .{0,40}lost carrier",
       "network", "hardware", weight=0.75,
       why="the kernel's NIC driver reports the port or the adapter failing (linux drivers/net/"
           "ethernet/mellanox/mlx5/core/events.c 'Port module event: module %u, Cable unplugged', "
           "health.c 'device's health compromised', net/sched/sch_generic.c 'NETDEV WATCHDOG: %s "
           "(%s): transmit queue %u timed out'): a link, cable or adapter fault on that node"),
    _p("ofi_completion_error",
       _NOT_INFO + r".*(?:NET/OFI .{0,80}completed with error|NET/OFI Unable to read from "
       r"fi_cq_readerr|NET/OFI .{0,40}\bfi_\w+(?:\(\))? failed(?!.*fi_getinfo)|"
       r"NET/OFI Unable to post|Unresponsive (?:receiver|remote)|Unreachable remote|"
       r"Failure posting handshake to peer|"
       r"prov_errno: ?\d+|libfabric:\d+:\d+:.{0,20}efa:.{0,80}<(?:warn|warning)>.{0,200}"
       r"(?:error|fail|unreachable|unresponsive))",
       "network", "infrastructure", weight=0.75,
       why="AWS EFA / libfabric completion or transfer error as the aws-ofi-nccl plugin prints "
           "it (aws/aws-ofi-nccl src/nccl_ofi_rdma.cpp, include/nccl_ofi_platform.h: 'NET/OFI "
           "Request %p (%s) completed with error: err … prov_errno … strerror', older 'completed "
           "with error. RC: %d. Error: %d (%s)'; 'Unable to read from fi_cq_readerr'; "
           "'fi_read failed') with libfabric's EFA status strings (ofiwg/libfabric "
           "prov/efa/src/efa_errno.h: 'Unresponsive receiver …', 'Unreachable remote - never "
           "received a response', 'Unresponsive remote')"),
    _p("ofi_setup_error",
       _NOT_INFO + r".*NET/OFI (?:OFI )?(?:fi_getinfo\(\) call failed|Couldn't open a fabric "
       r"provider|Unable to register memory|Unable to find a protocol that worked|"
       r"\S+ provider requires at least libfabric|Initializing plugin failed|"
       r"No eligible providers|Only EFA provider is supported|Couldn't open AV|"
       r"Creating new endpoint for domain .{0,40}failed|aws-ofi-nccl initialization failed)|"
       r"(?:NCCL WARN|\bWARN:).{0,120}NET/OFI ",
       "network", "system_software", weight=0.7,
       why="the aws-ofi-nccl plugin could not set up libfabric/EFA (src/nccl_ofi_net.cpp "
           "'Couldn't open a fabric provider', src/nccl_ofi_rdma.cpp 'OFI fi_getinfo() call "
           "failed', 'Unable to register memory', 'EFA provider requires at least libfabric "
           "version', ofiutils 'Couldn't open AV'; every NCCL_OFI_WARN is printed on a failing "
           "path, so any other WARN-level NET/OFI line counts too): drivers, libfabric version, "
           "FI_* settings, security group or device plugin"),
    _p("nccl_message_truncated",
       r"Message truncated : received \d+|message truncated\s*:\s*receiving \d+ bytes instead of|"
       r"Duplicate GPU detected|ncclInvalidUsage|invalid usage \(run with NCCL_DEBUG",
       "app_exception", "application", weight=0.8,
       why="NCCL saw peers disagree on a collective or the program misuse it (src/bootstrap.cc "
           "'Message truncated : received %d bytes instead of %d', NET/Socket 'message "
           "truncated'; ncclInvalidUsage 'invalid usage' e.g. 'Duplicate GPU detected' — two "
           "ranks on one GPU): a program or launch-configuration error on every rank"),
    _p("nccl_system_error",
       r"unhandled system error|ncclSystemError|Bootstrap : no socket interface found|"
       r"NET/Socket : No usable listening interface found|No valid <IPv4_or_hostname>:<port>|"
       r"internal error - please report this issue to the NCCL developers|ncclInternalError",
       "network", "system_software", weight=0.6,
       why="NCCL: a system call failed (socket, connect, shared memory) or it found no usable "
           "interface (src/init.cc ncclGetErrorString 'unhandled system error', 'internal error "
           "- please report…'; src/bootstrap.cc 'Bootstrap : no socket interface found') — "
           "interfaces, firewall, NCCL_SOCKET_IFNAME or /dev/shm"),
    _p("nccl_cuda_error",
       r"unhandled cuda error|ncclUnhandledCudaError",
       "crash", "system_software", symptom=True, weight=0.4,
       why="ncclUnhandledCudaError (src/init.cc): a CUDA call inside NCCL failed; the 'Last "
           "error: Cuda failure …' line or the GPU's XID names the cause (out of memory, "
           "illegal access, a lost GPU) — a symptom on its own"),
    _p("nccl_socket_error",
       r"NCCL WARN.*(?:Connection reset by peer|Connection refused|Broken pipe|"
       r"Connection timed out|No route to host)|socketProgress.*(?:reset|refused)",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="NCCL's bootstrap/proxy socket failed (NVIDIA/nccl src/misc/socket.cc, "
           "src/bootstrap.cc: strerror of connect/send/recv); either side can be the cause"),
    _p("gloo_peer_reset",
       r"(?:gloo|pair\.cc).*(?:Connection reset by peer|Connection closed by peer|Read error|"
       r"Write error|Broken pipe)|Connection closed by peer \[|Transport endpoint is not connected",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="gloo pair lost its peer (gloo/transport/tcp/pair.cc 'Read error', 'Connection "
           "closed by peer', 'Write error'): after a rank dies its ring neighbours see this "
           "within tens of ms (findings: 20–35 ms) — a symptom of the death"),
    _p("horovod_stall",
       r"Stalled ops:|\[ready ranks: (?P<ready>[\d, ]+)\]|One or more tensors were submitted to "
       r"be reduced, gathered or broadcasted by subset of ranks",
       "hang", "unknown", weight=0.6,
       why="Horovod's stall inspector (horovod/common/stall_inspector.cc: 'One or more tensors "
           "were submitted to be reduced, gathered or broadcasted by subset of ranks', '[ready "
           "ranks: …]') lists the ranks that are ready; the missing ones are hung"),
    _p("collective_mismatch",
       r"Detected mismatch between collectives|Expected to have finished reduction in the prior "
       r"iteration|Parameters which did not receive grad",
       "app_exception", "application", weight=0.9,
       why="ranks took different code paths (collective fingerprint or DDP unused parameters): "
           "a program error on every rank, restarting repeats it (torch/csrc/distributed/c10d/"
           "ProcessGroupWrapper.cpp 'Detected mismatch between collectives on ranks', reducer.cpp "
           "'Expected to have finished reduction in the prior iteration'; torch's warning that "
           "find_unused_parameters=True found none unused is no error: the Hugging Face Trainer "
           "sets it by default)"),
    # ==== CUDA application errors ===============================================================
    _p("cuda_illegal_access",
       r"an illegal memory access was encountered|cudaErrorIllegalAddress|"
       r"illegal instruction was encountered|misaligned address|CUDA_ERROR_ILLEGAL_ADDRESS|"
       r"CUDA error: unspecified launch failure|cudaErrorLaunchFailure|"
       r"Cuda failure (?:\d+ )?'unspecified launch failure'",
       "app_exception", "application", weight=0.7,
       why="a kernel touched memory it does not own or faulted (cudaErrorIllegalAddress 700, "
           "cudaErrorLaunchFailure 719 'an exception occurred on the device while executing a "
           "kernel', CUDA Runtime API docs; kernel log: XID 13/31/43); application bug unless it "
           "recurs on one GPU across processes"),
    _p("cuda_device_assert",
       r"device-side assert(?:ion)? triggered|Assertion `.*` failed\.?$",
       "app_exception", "application", weight=0.9,
       why="a device-side assert (cudaErrorAssert 710 'device-side assert triggered'; the "
           "kernel's own 'Assertion `…` failed.'): index out of range, bad label — a "
           "deterministic program error"),
    # ==== storage and checkpoints ===============================================================
    _p("disk_full",
       r"No space left on device|\bENOSPC\b|Disk quota exceeded|\bEDQUOT\b",
       "filesystem", "infrastructure", weight=0.95,
       why="the filesystem (or quota) is full (strerror of ENOSPC 28 'No space left on "
           "device', EDQUOT 122 'Disk quota exceeded')"),
    _p("checkpoint_write_failed",
       r"PytorchStreamWriter failed writing|file write failed|Read-only file system|"
       r"(?:failed|unable) to (?:save|write) (?:the )?checkpoint|"
       r"^(?!.*(?:NCCL|NET/|libfabric|ibv_|fi_cq)).*(?:Input/output error|\bEIO\b)|"
       r"Stale file handle|Buffer I/O error on dev|I/O error, dev \w+|File \S+ cannot be opened\.|"
       r"nfs: server \S+ not responding|LustreError|Lustre: .{0,80}(?:lost|evicted|timed out)",
       "filesystem", "infrastructure", weight=0.85,
       why="a write to the checkpoint/output filesystem failed (full, read-only, I/O error) or "
           "the shared filesystem stopped answering (kernel: block/blk-core.c 'I/O error, dev "
           "%s', fs/buffer.c 'Buffer I/O error on dev', fs/nfs 'nfs: server %s not responding', "
           "torch.save's writer caffe2/serialize/inline_container.cc 'File %s cannot be opened.', "
           "Lustre client 'LustreError')"),
    _p("weights_only_load",
       r"Weights only load failed|WeightsUnpickler error",
       "app_exception", "application", weight=0.8,
       why="torch.load with weights_only=True (the default since torch 2.6, torch/serialization.py "
           "'Weights only load failed') refused a pickled object: a program/version change, the "
           "checkpoint itself is readable — no corruption"),
    _p("checkpoint_corrupt",
       r"PytorchStreamReader failed|failed finding central directory|invalid load key|"
       r"UnpicklingError|Ran out of input|safetensors.*(?:invalid|incomplete|HeaderTooLarge)|"
       r"Error while deserializing header|MetadataIncompleteBuffer|HeaderTooSmall|"
       r"InvalidHeaderDeserialization|incomplete metadata, file not fully covered|"
       r"checkpoint (?:is )?(?:corrupt\w*|truncated)|CheckpointException|"
       r"unexpected EOF|checksum mismatch|BadZipFile|File is not a zip file|"
       r"Invalid magic number; corrupt file|truncated file: eof = \d+|file signature not found|"
       r"Unable to load weights from (?:pytorch )?checkpoint file|"
       r"(?:zero[- ]?(?:byte|size)|empty) (?:checkpoint|shard|file)|size (?:is )?0 bytes|"
       r"DataLossError|truncated record at|Error -3 while decompressing data|"
       r"storage has wrong size: expected \d+ got \d+|"
       r"CheckpointingException|\bDATA_LOSS: |Consistency check failed: file should be of size",
       "checkpoint_corrupt", "infrastructure", weight=0.9,
       why="a checkpoint file cannot be read back — zero-byte or truncated: torch.load's zip "
           "reader (caffe2/serialize/inline_container.cc 'PytorchStreamReader failed reading "
           "zip archive: failed finding central directory'), pickle ('Ran out of input', "
           "'invalid load key'), safetensors ('Error while deserializing header: "
           "HeaderTooSmall / MetadataIncompleteBuffer / HeaderTooLarge', safetensors/src/"
           "tensor.rs), h5py ('truncated file: eof = …'), transformers modeling_utils.py "
           "('Unable to load weights from pytorch checkpoint file'), torch.distributed.checkpoint "
           "CheckpointException, TensorFlow DataLossError ('Checksum does not match', 'truncated "
           "record at'), Megatron dist_checkpointing CheckpointingException, tensorstore "
           "DATA_LOSS, huggingface_hub 'Consistency check failed: file should be of size %d but "
           "has size %d' (a truncated download): written while the disk filled or the writer "
           "died; resume from "
           "the newest valid checkpoint"),
    # ==== rendezvous and the c10d store =========================================================
    _p("store_connect_timeout",
       r"The client socket has timed out after \S+ while trying to connect to|"
       r"connect\(\) timed out\. Original timeout was|"
       r"Timed out initializing process group in store based barrier|"
       r"The server socket has failed to (?:listen on any local network address|bind to)|"
       r"EADDRINUSE|DistNetworkError: .{0,80}(?:timed out|refused|Address already in use)|"
       r"^(?!.*\[W)(?!.*\bW\d{4} ).*(?:The client socket has failed to connect to any "
       r"network address of|network addresses of \(.{0,80}\) cannot be retrieved)",
       "rendezvous", "infrastructure", weight=0.85,
       why="the c10d TCPStore never connected or never filled: the client's connect timeout "
           "(torch/csrc/distributed/c10d/socket.cpp 'The client socket has timed out after %s "
           "while trying to connect to (%s, %d)', older 'connect() timed out'), the store-based "
           "barrier of init_process_group (torch/distributed/distributed_c10d.py 'Timed out "
           "initializing process group in store based barrier on rank'), or the server could "
           "not listen (socket.cpp 'The server socket has failed to listen on any local network "
           "address', EADDRINUSE: MASTER_PORT taken; 'The client socket has failed to connect to "
           "any network address of (%s, %d)', 'The IPv6 network addresses of (%s, %d) cannot be "
           "retrieved (gai error …)': MASTER_ADDR does not resolve) — a wrong MASTER_ADDR/port, a "
           "firewall, a missing node; the W-level per-attempt retries are no fault"),
    _p("store_unique_id",
       r"(?:retrieving|retreiving) ncclUniqueId from \[\d+\] via c10d key-value store",
       "rendezvous", "infrastructure", symptom=True, weight=0.55,
       why="a rank could not fetch NCCL's unique id from rank 0 through the c10d store "
           "(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp broadcastUniqueNCCLID: '[%d] is "
           "setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
           "store by key '%s', but store->get('%s') got error: …'; 'This may indicate a possible "
           "application crash on rank 0 or a network set up issue'): rank 0 never got there or "
           "the store is unreachable — a symptom when rank 0's own fault is in the log"),
    _p("store_socket_timeout",
       r"\bSocket Timeout\b|\bWait timeout\b.{0,40}keys?:",
       "rendezvous", "infrastructure", symptom=True, weight=0.5,
       why="a c10d store request timed out (torch/csrc/distributed/c10d/Utils.hpp recvBytes: "
           "'Socket Timeout' when the socket's receive timeout expires; TCPStore 'wait timeout "
           "after %dms, keys: …'): a rank waited for a key that a peer never wrote — the peer is "
           "missing or dead; a symptom when the peer's own fault is in the log"),
    _p("store_peer_closed",
       r"DistNetworkError: Failed to recv, got 0 bytes|"
       r"^(?!.*\[W)(?!.*\bW\d{4} ).*Failed to recv, got 0 bytes",
       "rendezvous", "infrastructure", symptom=True, weight=0.3,
       why="the TCPStore server (on rank 0 or the launcher) closed the connection "
           "(torch/csrc/distributed/c10d/Utils.hpp 'Failed to recv, got 0 bytes. Connection was "
           "likely closed. Did the remote server shutdown or crash?'): the host of the store "
           "died or exited first — a symptom; as a W-level line at shutdown it is no fault"),
    _p("rendezvous_timeout",
       r"RendezvousTimeoutError|RendezvousClosedError|RendezvousConnectionError|"
       r"RendezvousStateError|"
       r"rendezvous.{0,40}(?:timed? ?out|failed)|Timed out (?:after \d+ seconds )?waiting for "
       r"(?:clients|all \d* ?processes|workers)|DistStoreError|TCPStore.{0,40}(?:timed? ?out|"
       r"refused)|init_process_group.{0,40}timed? ?out|RendezvousError: rendezvous of generation|"
       r"The connection to the C10d store has failed",
       "rendezvous", "infrastructure", weight=0.85,
       why="the ranks never all met: a node missing, a wrong endpoint or run id "
           "(torch/distributed/elastic/rendezvous/api.py and c10d_rendezvous_backend.py, "
           "torch/distributed/distributed_c10d.py DistStoreError 'Timed out after %d seconds "
           "waiting for clients. %d/%d clients joined.')"),
    _p("rendezvous_config_hint",
       r"master_addr is only used for static rdzv_backend",
       "rendezvous", "infrastructure", symptom=True, weight=0.3,
       why="torchrun ignores MASTER_ADDR for a dynamic rendezvous backend (torch/distributed/"
           "run.py): nodes of one job may not meet where the user thinks. The launcher's "
           "'config has no run_id, generated a random run_id' (torch/distributed/launcher/api.py "
           "launch_agent) is printed by every launch without --rdzv-id and is no hint: as a "
           "rendezvous symptom it outranked the hang symptoms of a watchdog timeout"),
    _p("launcher_traceback",
       r'File ".*(?:/bin/torchrun|torch/distributed/run\.py|torch/distributed/launcher/api\.py)"',
       "rendezvous", "infrastructure", symptom=True, weight=0.2,
       why="the launcher itself raised (not a worker): before workers start, that is the "
           "rendezvous or the launch configuration"),
    # ==== numerics ==============================================================================
    _p("loss_scale_collapse",
       r"loss scale already at minimum|Minimum loss scale reached|loss[_ ]scale.{0,30}"
       r"(?:underflow|collapsed|below (?:the )?min)|"
       r"Attempted loss scale: \d+(?:\.\d+)?, reducing to " + _TINY + r"|"
       r"reducing loss scale to " + _TINY + r"|setting (?:loss )?scale to: " + _TINY + r"|"
       r"Reducing dynamic loss scale from \S+ to " + _TINY + r"|"
       r"\b(?:loss|grad)[_ ]scale\W{1,3}(?:0(?:\.0+)?|\d(?:\.\d+)?e-\d+)(?![\d.])|"
       r"loss scale: " + _TINY + r" \|.*skipped iterations:\s*[1-9]",
       "nan_loss", "application", weight=0.9,
       why="fp16 dynamic loss scaling kept halving on overflow until it reached its floor: "
           "gradients are Inf/NaN every step (DeepSpeed deepspeed/runtime/fp16/loss_scaler.py "
           "'Current loss scale already at minimum - cannot decrease scale anymore', "
           "'[deepspeed] OVERFLOW! … Attempted loss scale: %d, reducing to %d' at 1 or 0; "
           "fairseq optim/dynamic_loss_scaler.py 'Minimum loss scale reached'; apex amp "
           "'Gradient overflow. Skipping step, loss scaler %d reducing loss scale to %g'; "
           "Megatron's iteration line 'loss scale: 1.0 | … skipped iterations: N'; older "
           "DeepSpeed fused_optimizer 'Reducing dynamic loss scale from %s to %s'). Dynamic "
           "scaling starts near 2^16; a scale at or below 1 means even the unscaled gradients "
           "overflow fp16 — the floor; a halving from a large scale is routine and no fault"),
    _p("nan_loss",
       r"(?:loss|grad(?:ient)?[_ ]?norm|total_norm)\W(?:(?!\|).){0,60}?\b(?:nan|[+-]?inf)\b"
       r"(?! iterations)|found NaN|"
       r"NaN or Inf found|non-finite (?:loss|grad\w*)|Unexpected result nan|Detected (?:NaN|Inf)|"
       r"\bnan\b(?! iterations).{0,30}(?:loss|grad)|anomaly.*returned nan|"
       r"(?:loss|grad\w*) (?:is|became|= ?)\s*(?:not finite|non-finite)",
       "nan_loss", "application", weight=0.85,
       why="loss or gradient norm became NaN/Inf (Megatron training_log 'lm loss: nan', "
           "megatron-core 'found NaN in local grad norm', Lightning 'The loss returned in "
           "`training_step` is nan', torch.autograd anomaly mode \"Function '…' returned nan "
           "values\"): numerics or data; roll back to a checkpoint"),
    # ==== generic ===============================================================================
    _p("launcher_child_failed",
       r"ChildFailedError|elastic\.multiprocessing\.api:failed|Root Cause \(first observed",
       "crash", "unknown", symptom=True, weight=0.2,
       why="torchrun's summary of a failed worker (torch/distributed/elastic/multiprocessing/"
           "errors/__init__.py ChildFailedError, 'Root Cause (first observed failure)'): the "
           "worker's own lines say why"),
    _p("python_exception",
       r"^(?:\[[\w, ]+\](?:<std\w+>)?:\s*)?(?:[\w.]+\.)?(?P<exc>[A-Z]\w*(?:Error|Exception))"
       r"(?::\s|$)",
       "app_exception", "application", weight=0.5,
       why="an exception raised by the training program (the last line of a CPython "
           "traceback, '<Type>: <message>')", flags=0),
)

#: Lines that are never faults on their own (they would otherwise match a generic row).
IGNORE = re.compile(r"^\s*(?:Traceback \(most recent call last\)|File \"|frame #\d+|\^+$)")
#: trainguard's own reports of a failed or NaN checkpoint save, logged by the rank (anywhere in
#: the line: after a logging prefix). Their event (``ckpt.save_failed``, fault class
#: ``checkpoint_save``: flagged, training goes on) is what counts; read as a log line, "Read-only
#: file system" in it would make a ``filesystem`` fault that stops the job.
OWN_REPORTS = re.compile(r"checkpoint of step \d+ (?:failed|holds NaN)")

# Rank in a line's own prefix, in the forms launchers and PyTorch print.
_RANK_RE = (
    # torch >= 2.2 log prefix, also behind torchrun's --tee prefix ([default0]:) or Ray's
    # actor prefix ((WorkerDict pid=…))
    re.compile(r"^(?:\[[A-Za-z_]+\d+\]:|\([^)]*pid=\d+[^)]*\)\s*)?\[rank(?P<rank>\d+)\]:"),
    re.compile(r"\[Rank (?P<rank>\d+)\]"),                         # ProcessGroupNCCL
    re.compile(r"\[PG [^\]]*?\bRank (?P<rank>\d+)\]"),               # ProcessGroupNCCL, torch >= 2.3
    re.compile(r"^\[(?P<rank>\d+)\]<std(?:out|err)>:"),            # horovodrun / mpirun -tag
    re.compile(r"^\[\d+,(?P<rank>\d+)\]<std(?:out|err)>:"),        # Open MPI --tag-output
    re.compile(r"\d\[\d+,(?P<rank>\d+)\]<std(?:out|err)>:"),       # timestamped Open MPI
    re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank"),   # torchrun error summary
    re.compile(r"\bRank (?P<rank>\d+):"),                          # "Rank 3: found NaN …"
    re.compile(r"\bon rank (?P<rank>\d+)\b"),
)
_LOCAL_RANK_RE = re.compile(r"local_rank\s*[:=]\s*(?P<lr>\d+)")
_DEVICE_RE = re.compile(r"\b(?:cuda:|device |Device:? |GPU )(?P<dev>\d+)\b")


# ---- literal gates: skip a row whose regex cannot match (its required words are absent) ---------
try:  # Python >= 3.11
    from re import _constants as _sre_c, _parser as _sre_p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef]
    import sre_parse as _sre_p  # type: ignore[no-redef]

_MIN_GATE = 3


def _any_of(items) -> tuple[str, ...] | None:
    """Lower-case literals of which at least one occurs in any text the parsed sequence
    ``items`` matches; None when no such set is known (the row then always runs)."""
    best: tuple[str, ...] | None = None
    run: list[str] = []

    def consider(cand: tuple[str, ...] | None) -> None:
        nonlocal best
        if cand and min(map(len, cand)) >= _MIN_GATE and (
                best is None or min(map(len, cand)) > min(map(len, best))):
            best = cand

    for op, av in list(items) + [(None, None)]:
        if op is _sre_c.LITERAL:
            run.append(chr(av))
            continue
        consider(("".join(run).lower(),) if run else None)
        run = []
        if op is _sre_c.SUBPATTERN:
            consider(_any_of(av[-1]))
        elif op is _sre_c.BRANCH:
            alts = [_any_of(a) for a in av[1]]
            if all(alts):
                consider(tuple(x for a in alts for x in a))
        elif op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT) and av[0] >= 1:
            consider(_any_of(av[2]))
    return best


def _gate(rx: re.Pattern) -> tuple[str, ...] | None:
    try:
        return _any_of(_sre_p.parse(rx.pattern, rx.flags))
    except Exception:  # pragma: no cover - an unparsable pattern just runs ungated
        return None


#: Per row, lower-case words of which one must be in the line for the row to match (None: no
#: gate). Derived from each regex, so a necessary condition by construction; it spares most rows
#: the regex on most lines (``tests/test_log_kinds.py`` checks gated == ungated).
_GATES: tuple[tuple[LogPattern, tuple[str, ...] | None], ...] = tuple(
    (p, _gate(p.regex)) for p in PATTERNS)


def match_line(line: str, *, gated: bool = True) -> PatternMatch | None:
    """First row of ``PATTERNS`` that matches ``line`` (stripped), with its named groups;
    None for an uninteresting line. Never raises. ``gated=False`` runs every row's regex (the
    literal gates only skip rows that cannot match)."""
    s = line.strip()
    if not s or IGNORE.match(s) or OWN_REPORTS.search(s):
        return None
    low = s.lower() if gated else ""
    for p, gate in _GATES:
        if gated and gate is not None and not any(w in low for w in gate):
            continue
        m = p.regex.search(s)
        if m:
            return PatternMatch(p, {k: v for k, v in m.groupdict().items() if v})
    return None


def line_rank(line: str) -> int | None:
    """The global rank a line names in its prefix or text (``[rank3]:``, ``[Rank 3]``,
    ``[3]<stderr>:``, ``[1,3]<stderr>:``, ``rank : 3 (local_rank: …)``, ``Rank 3:``), else None."""
    for rx in _RANK_RE:
        m = rx.search(line)
        if m:
            return int(m.group("rank"))
    return None


def line_local_rank(line: str) -> int | None:
    """``local_rank: N`` / ``local_rank=N`` in a line, else None."""
    m = _LOCAL_RANK_RE.search(line)
    return int(m.group("lr")) if m else None


def line_device(line: str) -> int | None:
    """A GPU index the line names (``cuda:1``, ``Device: 3``, ``GPU 0``), else None."""
    m = _DEVICE_RE.search(line)
    return int(m.group("dev")) if m else None


# ---- step-time lines (offline straggler / throughput evidence) ---------------------------------
_STEP_TIME_RE = re.compile(
    r"(?P<v>\d+(?:\.\d+)?)\s*(?P<unit>s|sec|secs|seconds|ms)\s*/\s*(?:step|batch|it|iter)\b"
    r"|(?:step[_ ]time|time/step|iter(?:ation)?[_ ]time)\s*[:=]\s*(?P<v2>\d+(?:\.\d+)?)"
    r"\s*(?P<unit2>ms|s)?", re.IGNORECASE)
_RATE_RE = re.compile(
    r"(?P<v>\d+(?:\.\d+)?)\s*(?:examples|samples|images|tokens|it)\s*/\s*s(?:ec)?\b",
    re.IGNORECASE)
_STEP_RE = re.compile(r"\bstep\s*[:=]?\s*(?P<step>\d+)\b", re.IGNORECASE)


def step_time_of(line: str) -> float | None:
    """Seconds per step a progress line reports (``1.21 sec/step``, ``step_time: 350ms``);
    None when it reports none."""
    m = _STEP_TIME_RE.search(line)
    if not m:
        return None
    v = float(m.group("v") or m.group("v2"))
    unit = (m.group("unit") or m.group("unit2") or "s").lower()
    return v / 1000.0 if unit == "ms" else v


def rate_of(line: str) -> float | None:
    """Throughput a progress line reports (examples/s, samples/s, it/s), else None."""
    m = _RATE_RE.search(line)
    return float(m.group("v")) if m else None


def step_of(line: str) -> int | None:
    m = _STEP_RE.search(line)
    return int(m.group("step")) if m else None

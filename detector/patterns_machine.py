"""Log-pattern rows of the machines and their schedulers: GPU hardware and driver, host
hardware and kernel, device and host memory, signals and exits, and the cluster (preemption,
eviction, node failure, time limits). Part of the ordered table ``patterns.PATTERNS`` (these rows
come first); see ``trainguard.detector.patterns`` for the row fields and the sources."""
from __future__ import annotations

from trainguard.detector.pattern_types import _PCI, LogPattern
from trainguard.detector.pattern_types import row as _p

#: rows in table order (first match wins)
MACHINE_ROWS: tuple[LogPattern, ...] = (
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
       r"NPU out of memory|MPS backend out of memory|XPU out of memory|"
       r"Free memory on device .{0,40} on startup is less than desired GPU memory utilization|"
       r"No available memory for the cache blocks|"
       r"KV cache is needed, which is larger than the available KV cache memory",
       "oom_gpu", "application", weight=0.95,
       source=("https://github.com/ovg-project/kvcached/issues/110",
               "https://github.com/QwenLM/Qwen3/issues/12"),
       why="device memory ran out: torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp "
           "'CUDA out of memory. Tried to allocate'), the CUDA runtime (cudaErrorMemoryAllocation "
           "2, 'out of memory'), NCCL's CUDACHECK (src/include/checks.h \"Cuda failure '%s'\"), "
           "cuBLAS/cuDNN allocation statuses, TensorFlow/XLA RESOURCE_EXHAUSTED: batch, model or "
           "activations too large for the GPU, or stray processes on it; vLLM's start-up check "
           "(vllm/worker 'Free memory on device (%s/%s GiB) on startup is less than desired GPU "
           "memory utilization'): the memory budget does not fit what other processes left; its KV "
           "cache check after loading the weights (vllm/worker/worker.py "
           "raise_if_cache_size_invalid 'No available memory for the cache blocks. Try "
           "increasing `gpu_memory_utilization`', v1 vllm/v1/core/kv_cache_utils.py "
           "check_enough_kv_cache_memory '… KV cache is needed, which is larger than the "
           "available KV cache memory'): the model and its cache do not fit the GPU's budget"),
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
    _p("k8s_pod_table_oomkilled",
       r"^\s*(?:\S+\s+)?(?:pod/)?[\w.-]+\s+\d+/\d+\s+OOMKilled\s+\d+",
       "oom_host", "unknown", weight=0.85,
       source=("https://github.com/flyteorg/flyte/issues/3686",
               "https://github.com/open-edge-platform/geti_v2/issues/146",
               "https://github.com/hmcts/cnp-flux-config/pull/28772"),
       why="a row of `kubectl get pods` (NAME READY STATUS RESTARTS AGE) whose STATUS is "
           "OOMKilled: the container's cgroup memory limit was hit (kubernetes container state "
           "reason OOMKilled). The row says no more: neither how much the program asked for nor "
           "who set the limit — in the real threads the layer was undecided twice and once the "
           "deployment's limit (raised in the fix), never shown by the table — so the layer "
           "is unknown"),
    _p("container_oom",
       r"OOMKilled|System OOM encountered|\bReason:\s*OOMKilling|container .{0,60}was OOM.?killed|"
       r"OOM killed process",
       "oom_host", "application", weight=0.95,
       why="the container runtime / kubelet saw its cgroup OOM killer fire: container status "
           "reason OOMKilled (kubernetes pkg/kubelet, container state), kubelet event SystemOOM "
           "'System OOM encountered, victim process: %v, pid: %v' (pkg/kubelet/oom)"),
    _p("framework_host_oom",
       r"killed due to the node running low on memory|ray\.exceptions\.OutOfMemoryError|"
       r"Workers? \(tasks / actors\) killed due to memory pressure \(OOM\)|"
       r"exceeds the memory usage threshold of|DefaultCPUAllocator: (?:can't|not enough memory)|"
       r"Torch: not enough memory: you tried to allocate|"
       r"exceeded \d+% memory budget|killed by YARN for exceeding memory limits|"
       r"is running beyond physical memory limits|Container killed due to memory usage|"
       r"session crashed after using all available RAM|"
       r"^(?!.*(?:ibv_|NET/IB|NET/OFI|NCCL)).*\[Errno 12\] Cannot allocate memory|"
       r"std::bad_alloc|^(?:\[[\w, ]+\](?:<std\w+>)?:\s*)?MemoryError\b",
       "oom_host", "application", weight=0.9,
       source=("https://github.com/jchengai/planTF/issues/28", "https://github.com/flwrlabs/flower/issues/2157"),
       why="a framework ran out of host memory or its own memory monitor killed a worker: Ray's "
           "memory monitor ('Task was killed due to the node running low on memory … exceeds "
           "the memory usage threshold of', docs.ray.io 'Out-Of-Memory Prevention'), torch's CPU "
           "allocator (c10/core/impl/alloc_cpu.cpp 'DefaultCPUAllocator: can't allocate "
           "memory'), Dask's worker memory monitor (distributed/worker_memory.py 'exceeded 95% "
           "memory budget. Restarting'), YARN's container monitor ('is running beyond physical "
           "memory limits', 'Container killed by YARN for exceeding memory limits'), ECS/AWS Batch "
           "stop reason 'OutOfMemoryError: Container killed due to memory usage', Colab's 'Your "
           "session crashed after using all available RAM', ENOMEM from Python (errno 12), C++ "
           "std::bad_alloc, Python MemoryError; the raylet's periodic summary (src/ray/raylet/"
           "node_manager.cc '%d Workers (tasks / actors) killed due to memory pressure (OOM)')"),
    _p("k8s_eviction_memory",
       r"The node was low on resource: memory|node had condition: \[MemoryPressure\]|"
       r"evict\w* .{0,80}\bmemory pressure",
       "oom_host", "infrastructure", weight=0.85,
       why="kubelet's node-pressure eviction for memory (pkg/kubelet/eviction/helpers.go "
           "'The node was low on resource: %v.'; kubernetes.io docs 'Node-pressure Eviction'): "
           "the node ran short of memory and the kubelet evicted the pod"),
    # ==== signals and exits =====================================================================
    _p("torch_shm_segment",
       r"unable to write to file </torch_\w+>\s*:\s*No space left on device",
       "crash", "infrastructure", weight=0.85,
       source=("https://github.com/logicalclocks/hopsworks/issues/1557",
               "https://github.com/idiap/ESLAM/issues/20"),
       why="torch.multiprocessing could not grow a shared-memory segment of its own (the "
           "'</torch_<pid>_<n>>' names are the files it creates in /dev/shm for tensors passed "
           "between processes — DataLoader workers; c10 'unable to write to file <%s>: %s (%d)' "
           "with ENOSPC): /dev/shm is full, the container's 64 MB default — a crash of the "
           "container's configuration like a SIGBUS in a worker, not a full training disk"),
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
    _p("launcher_rank_exit",
       r"trainguard launch \[[^\]]*\]: rank \d+ \(pid (?P<pid>\d+)\) exited with "
       r"(?:signal \d+|status [1-9]\d*)",
       "crash", "unknown", weight=0.8,
       why="trainguard's own launcher saw the rank's process end (trainguard/launch/loop.py "
           "'rank %d (pid %d) exited with signal %d' / 'status %d', from waitpid): the same "
           "observation as its live worker.exited event, read the same way (crash, layer "
           "unknown: an exit status names no cause)"),
    _p("sigsegv",
       r"Signal 11 \(SIGSEGV\)|exit ?code\s*:\s*-11\b|Caught signal 11\b|Segmentation fault|"
       r"SIGSEGV|segfault at [0-9a-f]+ ip |return code = -11\b|<Signals\.SIGSEGV: 11>|"
       r"\bSignal \(11\) received\.",
       "crash", "unknown", weight=0.7,
       source=("https://github.com/triton-inference-server/server/issues/6506",
               "https://github.com/triton-inference-server/server/issues/3916",
               "https://github.com/triton-inference-server/server/issues/7400"),
       why="native crash in the process: extension, library, driver or memory (kernel: "
           "arch/x86/mm/fault.c 'segfault at %lx ip %px sp %px error %lx'; Triton Inference "
           "Server's own handler prints 'Signal (11) received.' and its backtrace — a serving "
           "engine's crash shows no CUDA line, and the frames of a backend library name the "
           "code, not the cause)"),
    _p("sigkill",
       r"Signal 9 \(SIGKILL\)|exit ?code\s*:\s*-9\b|exit(?:ed)? with (?:status|exit) code 137\b|"
       r"exit(?:ed)? with code 137\b|^(?:\[[\d,]+\]<std\w+>:)?Killed\s*$|"
       r"\btasks? [\d,-]+: Killed\b|exit code:? 137\b|return code = -9\b|"
       r"terminated with signal SIGKILL|Exited \(137\)|^zsh: killed\s|<Signals\.SIGKILL: 9>|"
       r"^(?:.*: line \d+: )?\s*(?:\[\d+\]\+?\s+)?(?:\d+\s+)?Killed\s+(?:\S+\s+){0,3}\S*python",
       "oom_host", "unknown", weight=0.45,
       source=("https://github.com/lmzpai/roboMamba/issues/10",
               "https://github.com/deepspeedai/DeepSpeed/issues/3232",
               "https://github.com/argoproj/argo-workflows/issues/8981"),
       why="SIGKILL that the launcher did not send: the kernel OOM killer is its usual sender "
           "on a training host (check `dmesg | grep -i oom`); low weight because an operator or "
           "scheduler can send it too (srun: src/srun/launch.c '%s: task %s: %s' with the "
           "signal's name; DeepSpeed deepspeed/launcher/launch.py '%s exits with return code = "
           "%d'; torch/multiprocessing/spawn.py 'process %d terminated with signal %s'; "
           "Python's CalledProcessError 'died with <Signals.SIGKILL: 9>' (the old "
           "torch.distributed.launch); the shell's 'Killed' job report, also behind a wrapper "
           "such as 'pyenv exec python'). Layer unknown: a bare SIGKILL does not say whether "
           "the program's memory, another process or an operator caused it — in the real "
           "threads the layer was undecided as often as it was the program's"),
    _p("sigabrt",
       r"Signal 6 \(SIGABRT\)|exit ?code\s*:\s*-6\b|Aborted \(core dumped\)|"
       r"exit(?:ed)? with (?:status|exit) code 134\b|terminate called (?:after throwing|without)|"
       r"return code = -6\b|terminated with signal SIGABRT|<Signals\.SIGABRT: 6>|"
       r"\bSignal \(6\) received\.|\*\*\* SIGABRT received by PID \d+",
       "crash", "unknown", symptom=True, weight=0.3,
       source=("https://github.com/clearml/clearml-serving/issues/36",
               "https://github.com/pytorch/xla/issues/6426"),
       why="abort() after an uncaught C++ exception (libstdc++ 'terminate called after "
           "throwing an instance of'; Triton Inference Server's handler 'Signal (6) "
           "received.'; absl's failure signal handler '*** SIGABRT received by PID %d (TID %d) "
           "… stack trace: ***'): the exception printed before it is the cause"),
    _p("agent_sigterm",
       r"Received Signals\.SIGTERM death signal|SignalException: Process \d+ got signal: 15\b",
       "crash", "infrastructure", symptom=True, weight=0.3,
       why="torchrun's agent itself got SIGTERM from outside (torch/distributed/elastic/"
           "multiprocessing/api.py 'Received %s death signal, shutting down workers'): the "
           "scheduler cancelled, preempted or timed out the job, or killed it after another "
           "node's task failed — a symptom; the scheduler's own line says which"),
    _p("rank_sigterm",
       r"^(?:\[[\d,]+\]<std\w+>:)?Terminated\s*$|\btasks? [\d,-]+: Terminated\b|"
       r"exit(?:ed)? with (?:status|exit) code 143\b|terminated with signal SIGTERM|"
       r"return code = -15\b|<Signals\.SIGTERM: 15>",
       "crash", "system_software", symptom=True, weight=0.3,
       why="a rank ended by SIGTERM: someone tore the job down — its launcher or process "
           "manager after another rank failed, the scheduler, an operator (bash's job report "
           "is strsignal(SIGTERM), 'Terminated'; srun src/srun/launch.c '%s: task %s: %s'; "
           "Python's CalledProcessError '<Signals.SIGTERM: 15>'; 128 + 15 = exit status "
           "143). A symptom; it also says that a SIGKILL of a peer came from the same hand, "
           "not from the OOM killer, which sends SIGKILL alone (attributor ``REREADINGS``). "
           "Not torchrun's own 'Sending process %s closing signal SIGTERM', its cleanup"),
    # ==== the cluster: preemption, eviction, node failure, time limit ===========================
    _p("scheduler_node_failure",
       r"CANCELLED AT \S+ DUE TO (?:NODE ?FAILURE|PREEMPTION)|Node failure on \S+|"
       r"(?-i:\bNODE_FAIL\b|\bPREEMPTED\b)|JobState=(?:NODE_FAIL|PREEMPTED)|"
       r"Reason=Node(?:Fail|Down)\b|^\s*\w+_node_fail\s+\S+\s+\d{4}-\d\d-\d\dT",
       "node_lost", "infrastructure", weight=0.85,
       source=("https://github.com/Azure/az-hop/issues/1210",),
       why="Slurm ended the job because a node failed or the job was preempted "
           "(src/slurmd/slurmstepd/req.c '*** %s ON %s CANCELLED AT %s DUE TO PREEMPTION ***' / "
           "'DUE TO NODE FAILURE'; src/srun/allocate.c 'Node failure on %s'; job states "
           "NODE_FAIL, PREEMPTED; `sinfo -R` rows whose REASON a cloud plugin sets, e.g. "
           "Azure CycleCloud's 'cyclecloud_node_fail'): requeue elsewhere"),
    _p("ray_node_dead",
       r"has been marked dead because the (?:detector|monitor) has missed too many heartbeats|"
       r"mistakenly been marked (?:as )?dead by the (?:GCS|monitor)|"
       r"health check failed due to missing too many heartbeats|\bNodeDiedError\b|"
       r"The actor died because its node has died|"
       r"Task failed because the node it was running on is dead or unavailable",
       "node_lost", "unknown", weight=0.75,
       source=("https://github.com/verl-project/verl/issues/1632",),
       why="Ray's control store (GCS) stopped hearing from a node's raylet and removed the node "
           "(src/ray/gcs/gcs_server/gcs_node_manager.cc / gcs_health_check_manager.cc 'The node "
           "with node id: %s and address: %s … has been marked dead because the detector has "
           "missed too many heartbeats from it', older 'The node with client ID %s has been "
           "marked dead because the monitor has missed too many heartbeats'; the raylet's own "
           "'Exiting because this node manager has mistakenly been marked dead by the GCS' "
           "(src/ray/raylet/node_manager.cc); the node's death as the driver sees it: "
           "python/ray/exceptions.py NodeDiedError, ActorDiedError 'The actor died because its "
           "node has died', the NODE_DIED task error 'Task failed because the node it was running "
           "on is dead or unavailable'): every actor and task on that node is gone — a lost node. "
           "Ray's own text names the causes it cannot tell apart (a raylet killed by the OOM "
           "killer, a preempted machine, heartbeats late on a slow network or an overloaded "
           "host), so the layer is unknown. Outranks the 'actor died' crash rows: the node's "
           "death explains its actors'"),
    _p("slurm_task_exec_failed",
       r"slurmstepd(?:-\S+)?: error: execve\(\): \S+: No such file or directory|"
       r"slurmstepd(?:-\S+)?: error: couldn't chdir to [`'].{0,200}No such file or directory",
       "filesystem", "infrastructure", weight=0.7,
       source=("https://github.com/ArjunaCluster/ArjunaUsers/issues/46",),
       why="slurmstepd could not start the task on the node because a path it needs is not "
           "there (src/slurmd/slurmstepd/exec_wait.c / mgr.c 'execve(): %s: %m' for the batch "
           "script in slurmd's spool, 'couldn't chdir to `%s': %m: going to /tmp instead' for "
           "the job's working directory): the node's local spool or its mount of the shared "
           "file system is missing — the cluster's storage, not the program (the real thread: "
           "the GPU nodes' /tmp spool was broken, fixed by rebooting them)"),
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
    _p("k8s_crash_loop",
       r"\bCrashLoopBackOff\b|Back-off restarting failed container",
       "crash", "unknown", symptom=True, weight=0.4,
       source=("https://github.com/NVIDIA/gpu-operator/issues/35",
               "https://github.com/NVIDIA/gpu-operator/issues/624",
               "https://github.com/NVIDIA/gpu-operator/issues/488"),
       why="the kubelet restarts a container that keeps exiting, with a growing delay (pod "
           "status waiting reason CrashLoopBackOff in `kubectl get pods`, event 'Back-off "
           "restarting failed container'; kubernetes.io 'Pod Lifecycle'): the container died "
           "again and again — a crash whose cause is in the container's own log (`kubectl logs "
           "--previous`), so a symptom; alone, a crash of unknown layer"),
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
)

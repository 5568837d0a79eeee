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

The rows describe kinds of faults as PyTorch, NCCL, gloo, the CUDA runtime, the Linux kernel,
torchrun and DeepSpeed/Megatron print them; they are written from those projects' message
formats, not from particular bug reports.
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

PATTERNS: tuple[LogPattern, ...] = (
    # ---- GPU hardware --------------------------------------------------------------------------
    _p("gpu_lost",
       r"GPU is lost|fallen off the bus|Unable to determine the device handle for GPU\s*" + _PCI
       + r"?|cudaErrorDevicesUnavailable|CUDA_ERROR_ECC_UNCORRECTABLE_DISABLED",
       "gpu_xid", "hardware", weight=0.9,
       why="NVML/driver report the GPU gone from the PCIe bus (XID 79): reboot needed"),
    _p("uncorrectable_ecc",
       r"uncorrectable ECC error|ECC error encountered|cudaErrorECCUncorrectable|"
       r"double bit (?:ECC )?error|DBE\)? has been detected",
       "ecc", "hardware", weight=0.9,
       why="CUDA runtime error 39/214 (cudaErrorECCUncorrectable): GPU memory fault"),
    _p("uncorrectable_nvlink",
       r"uncorrectable NVLink error|cudaErrorNvlinkUncorrectable|NVLink: fatal error",
       "nvlink", "hardware", weight=0.9,
       why="CUDA runtime error 220 (cudaErrorNvlinkUncorrectable)"),
    _p("gpu_thermal",
       r"(?:HW|SW) (?:Thermal )?Slowdown\s*:\s*Active|thermal (?:slowdown|throttl\w*)|"
       r"GPU (?:is )?(?:over ?heat\w*|running hot)|clocks? (?:are )?throttled.*therm",
       "thermal", "hardware", weight=0.8,
       why="NVML clock-event reasons SwThermalSlowdown / HwThermalSlowdown / HwSlowdown"),
    # ---- memory -------------------------------------------------------------------------------
    _p("cuda_oom",
       r"CUDA out of memory|OutOfMemoryError: CUDA|cudaErrorMemoryAllocation|"
       r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_WORKSPACE)|"
       r"NCCL WARN.*Cuda failure 'out of memory'",
       "oom_gpu", "application", weight=0.95,
       why="the caching allocator could not get device memory: batch size, model or activation "
           "memory too large for the GPU, or stray processes on it"),
    _p("host_oom_kill",
       r"Out of memory: Kill(?:ed)? process (?P<pid>\d+)|oom-kill:|invoked oom-killer|"
       r"Memory cgroup out of memory|oom_reaper: reaped process (?P<pid2>\d+)|OOMKilled|"
       r"is killed by signal: Killed",
       "oom_host", "application", weight=0.95,
       why="the Linux OOM killer killed the process (kernel log) or the container (OOMKilled)"),
    # ---- signals --------------------------------------------------------------------------------
    _p("sigbus",
       r"Signal 7 \(SIGBUS\)|exit ?code\s*:\s*-7\b|Caught signal 7\b|\bBus error\b|"
       r"insufficient shared memory|/dev/shm.*(?:No space|too small|full)",
       "crash", "infrastructure", weight=0.8,
       why="SIGBUS in a training process is nearly always a write past the end of a /dev/shm "
           "mapping (NCCL's intra-node buffers, DataLoader tensors): containers default to a "
           "64 MB /dev/shm — raise it (--shm-size / an emptyDir with medium Memory)"),
    _p("sigsegv",
       r"Signal 11 \(SIGSEGV\)|exit ?code\s*:\s*-11\b|Caught signal 11\b|Segmentation fault|"
       r"SIGSEGV",
       "crash", "unknown", weight=0.7,
       why="native crash in the process: extension, library, driver or memory"),
    _p("sigkill",
       r"Signal 9 \(SIGKILL\)|exit ?code\s*:\s*-9\b|exit(?:ed)? with (?:status|exit) code 137\b|"
       r"exit(?:ed)? with code 137\b|^(?:\[[\d,]+\]<std\w+>:)?Killed\s*$",
       "oom_host", "application", weight=0.45,
       why="SIGKILL that the launcher did not send: the kernel OOM killer is its usual sender "
           "on a training host (check `dmesg | grep -i oom`); low weight because an operator or "
           "scheduler can send it too"),
    _p("sigabrt",
       r"Signal 6 \(SIGABRT\)|exit ?code\s*:\s*-6\b|Aborted \(core dumped\)|"
       r"exit(?:ed)? with (?:status|exit) code 134\b|terminate called (?:after throwing|without)",
       "crash", "unknown", symptom=True, weight=0.3,
       why="abort() after an uncaught C++ exception: the exception printed before it is the cause"),
    # ---- collectives: NCCL / gloo ---------------------------------------------------------------
    _p("nccl_watchdog_timeout",
       r"(?:\[Rank (?P<rank>\d+)\]\s*)?Watchdog caught collective operation timeout:\s*"
       r"Work\w*\(SeqNum=(?P<seq>\d+),\s*OpType=(?P<op>\w+)",
       "hang", "unknown", symptom=True, weight=0.6,
       why="ProcessGroupNCCL's watchdog: this rank waited past the collective timeout — it is "
           "blocked on a peer that is hung, dead or slow (the rank behind is the culprit)"),
    _p("collective_timeout",
       r"Timed out waiting \d+ ?ms for (?:recv|send) operation|Application timeout caused pair "
       r"closure|collective operation timeout|NCCL communicator was aborted.*timeout|"
       r"Socket Timeout|ProcessGroupGloo.*[Tt]imeout",
       "hang", "unknown", symptom=True, weight=0.5,
       why="gloo/NCCL collective timeout: blocked on a peer"),
    _p("remote_peer_closed",
       r"Connection closed by remote peer (?P<peer_host>[A-Za-z][\w.-]*)",
       "node_lost", "infrastructure", symptom=True, weight=0.5,
       why="NCCL's socket to a named remote host closed: that host's process or the host itself "
           "went away; when nothing else from that host explains it, the host is lost"),
    _p("nccl_remote_error",
       r"ncclRemoteError|remote process exited or there was a network error",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="NCCL: a remote peer exited or the network failed; a symptom of the peer's fault"),
    _p("ib_completion_error",
       r"NET/IB\s*:\s*Got completion (?:from peer (?P<peer>[\d.]+)\S*\s*)?with (?:error|status=)|"
       r"IBV_WC_\w+_ERR|transport retry counter exceeded|RETRY_EXC_ERR|ibv_poll_cq.*fail|"
       r"NET/IB.*(?:async|fatal) event|mlx5\w*:.*(?:CQE error|syndrome)",
       "network", "hardware", weight=0.8,
       why="RDMA work completion with an error status (e.g. 12 = IBV_WC_RETRY_EXC_ERR: the "
           "remote side stopped acknowledging) — a link, cable or HCA fault on that path, "
           "which stays broken until the node is serviced (a hardware layer: the policy's "
           "network/hardware row moves the job off the node)"),
    _p("nccl_system_error",
       r"unhandled system error|ncclSystemError",
       "network", "system_software", weight=0.6,
       why="NCCL: a system call failed (socket, connect, shared memory) — interfaces, "
           "firewall, NCCL_SOCKET_IFNAME or /dev/shm"),
    _p("nccl_socket_error",
       r"NCCL WARN.*(?:Connection reset by peer|Connection refused|Broken pipe|"
       r"Connection timed out|No route to host)|socketProgress.*(?:reset|refused)",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="NCCL's bootstrap/proxy socket failed; either side can be the cause"),
    _p("gloo_peer_reset",
       r"(?:gloo|pair\.cc).*(?:Connection reset by peer|Connection closed by peer|Read error|"
       r"Write error|Broken pipe)|Connection closed by peer \[|Transport endpoint is not connected",
       "network", "infrastructure", symptom=True, weight=0.5,
       why="gloo pair lost its peer: after a rank dies its ring neighbours see this within "
           "tens of ms (findings: 20–35 ms) — a symptom of the death"),
    _p("horovod_stall",
       r"Stalled ops:|\[ready ranks: (?P<ready>[\d, ]+)\]|One or more tensors were submitted to "
       r"be reduced, gathered or broadcasted by subset of ranks",
       "hang", "unknown", weight=0.6,
       why="Horovod's stall inspector lists the ranks that are ready; the missing ones are hung"),
    _p("collective_mismatch",
       r"Detected mismatch between collectives|Expected to have finished reduction in the prior "
       r"iteration|Parameters which did not receive grad",
       "app_exception", "application", weight=0.9,
       why="ranks took different code paths (collective fingerprint or DDP unused parameters): "
           "a program error on every rank, restarting repeats it (torch's warning that "
           "find_unused_parameters=True found none unused is no error: the Hugging Face Trainer "
           "sets it by default)"),
    # ---- CUDA application errors --------------------------------------------------------------
    _p("cuda_illegal_access",
       r"an illegal memory access was encountered|cudaErrorIllegalAddress|"
       r"illegal instruction was encountered|misaligned address|CUDA_ERROR_ILLEGAL_ADDRESS",
       "app_exception", "application", weight=0.7,
       why="a kernel touched memory it does not own (kernel log: XID 13/31); application bug "
           "unless it recurs on one GPU across processes"),
    _p("cuda_device_assert",
       r"device-side assert(?:ion)? triggered|Assertion `.*` failed\.?$",
       "app_exception", "application", weight=0.9,
       why="a device-side assert (index out of range, bad label): deterministic program error"),
    # ---- storage and checkpoints ----------------------------------------------------------------
    _p("disk_full",
       r"No space left on device|\bENOSPC\b|Disk quota exceeded|\bEDQUOT\b",
       "filesystem", "infrastructure", weight=0.95,
       why="the filesystem (or quota) is full"),
    _p("checkpoint_write_failed",
       r"PytorchStreamWriter failed writing|file write failed|Read-only file system|"
       r"(?:failed|unable) to (?:save|write) (?:the )?checkpoint|Input/output error|\bEIO\b|"
       r"Stale file handle",
       "filesystem", "infrastructure", weight=0.85,
       why="a write to the checkpoint/output filesystem failed (full, read-only, I/O error)"),
    _p("checkpoint_corrupt",
       r"PytorchStreamReader failed|failed finding central directory|invalid load key|"
       r"UnpicklingError|Ran out of input|safetensors.*(?:invalid|incomplete|HeaderTooLarge)|"
       r"checkpoint (?:is )?(?:corrupt\w*|truncated)|CheckpointException|"
       r"unexpected EOF|checksum mismatch",
       "checkpoint_corrupt", "infrastructure", weight=0.9,
       why="a checkpoint file cannot be read back (truncated zip, bad pickle): written while the "
           "disk filled or the writer died; resume from the newest valid checkpoint"),
    # ---- rendezvous ---------------------------------------------------------------------------
    _p("rendezvous_timeout",
       r"RendezvousTimeoutError|RendezvousClosedError|RendezvousConnectionError|"
       r"rendezvous.{0,40}(?:timed? ?out|failed)|Timed out (?:after \d+ seconds )?waiting for "
       r"(?:clients|all \d* ?processes|workers)|DistStoreError|TCPStore.{0,40}(?:timed? ?out|"
       r"refused)|init_process_group.{0,40}timed? ?out|RendezvousError: rendezvous of generation",
       "rendezvous", "infrastructure", weight=0.85,
       why="the ranks never all met: a node missing, a wrong endpoint or run id"),
    _p("rendezvous_config_hint",
       r"master_addr is only used for static rdzv_backend|generated a random run_id",
       "rendezvous", "infrastructure", symptom=True, weight=0.3,
       why="torchrun ignores MASTER_ADDR for a dynamic rendezvous backend and each node "
           "generates its own run id: nodes of one job may not join the same rendezvous"),
    _p("launcher_traceback",
       r'File ".*(?:/bin/torchrun|torch/distributed/run\.py|torch/distributed/launcher/api\.py)"',
       "rendezvous", "infrastructure", symptom=True, weight=0.2,
       why="the launcher itself raised (not a worker): before workers start, that is the "
           "rendezvous or the launch configuration"),
    # ---- numerics -----------------------------------------------------------------------------
    _p("loss_scale_collapse",
       r"loss scale already at minimum|Minimum loss scale reached|loss[_ ]scale.{0,30}"
       r"(?:underflow|collapsed|below (?:the )?min)",
       "nan_loss", "application", weight=0.9,
       why="fp16 dynamic loss scaling kept halving on overflow: gradients are Inf/NaN every step"),
    _p("nan_loss",
       r"(?:loss|grad(?:ient)?[_ ]?norm|total_norm)\W.{0,60}?\b(?:nan|[+-]?inf)\b|found NaN|"
       r"NaN or Inf found|non-finite (?:loss|grad\w*)|Unexpected result nan|Detected (?:NaN|Inf)|"
       r"\bnan\b.{0,30}(?:loss|grad)|anomaly.*returned nan",
       "nan_loss", "application", weight=0.85,
       why="loss or gradient norm became NaN/Inf: numerics or data; roll back to a checkpoint"),
    # ---- generic ------------------------------------------------------------------------------
    _p("launcher_child_failed",
       r"ChildFailedError|elastic\.multiprocessing\.api:failed|Root Cause \(first observed",
       "crash", "unknown", symptom=True, weight=0.2,
       why="torchrun's summary of a failed worker: the worker's own lines say why"),
    _p("python_exception",
       r"^(?:\[[\w, ]+\](?:<std\w+>)?:\s*)?(?:[\w.]+\.)?(?P<exc>[A-Z]\w*(?:Error|Exception))"
       r"(?::\s|$)",
       "app_exception", "application", weight=0.5,
       why="an exception raised by the training program", flags=0),
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
    re.compile(r"^\[rank(?P<rank>\d+)\]:"),                      # torch >= 2.2 log prefix
    re.compile(r"\[Rank (?P<rank>\d+)\]"),                         # ProcessGroupNCCL
    re.compile(r"^\[(?P<rank>\d+)\]<std(?:out|err)>:"),            # horovodrun / mpirun -tag
    re.compile(r"^\[\d+,(?P<rank>\d+)\]<std(?:out|err)>:"),        # Open MPI --tag-output
    re.compile(r"\d\[\d+,(?P<rank>\d+)\]<std(?:out|err)>:"),       # timestamped Open MPI
    re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank"),   # torchrun error summary
    re.compile(r"\bRank (?P<rank>\d+):"),                          # "Rank 3: found NaN …"
    re.compile(r"\bon rank (?P<rank>\d+)\b"),
)
_LOCAL_RANK_RE = re.compile(r"local_rank\s*[:=]\s*(?P<lr>\d+)")
_DEVICE_RE = re.compile(r"\b(?:cuda:|device |Device:? |GPU )(?P<dev>\d+)\b")


def match_line(line: str) -> PatternMatch | None:
    """First row of ``PATTERNS`` that matches ``line`` (stripped), with its named groups;
    None for an uninteresting line. Never raises."""
    s = line.strip()
    if not s or IGNORE.match(s) or OWN_REPORTS.search(s):
        return None
    for p in PATTERNS:
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

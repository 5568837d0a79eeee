"""Log-pattern rows of the software stack: collectives (NCCL, gloo, Horovod, IB verbs, EFA),
CUDA application errors, storage and checkpoints, rendezvous and the c10d store, numerics, and
the generic rows last. Part of the ordered table ``patterns.PATTERNS`` (after
``patterns_machine.MACHINE_ROWS``); see ``trainguard.detector.patterns`` for the row fields."""
from __future__ import annotations

from trainguard.core import cuda_errors
from trainguard.detector.pattern_types import _NOT_INFO, _TINY, LogPattern
from trainguard.detector.pattern_types import row as _p

#: rows in table order (first match wins; the generic rows are last)
SOFTWARE_ROWS: tuple[LogPattern, ...] = (
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
    _p("ib_qp_async_error",
       r"NET/IB\w*\s*:.{0,40}Got async event\s*:\s*(?:local access violation work queue|"
       r"invalid request local work queue|local work queue catastrophic) error",
       "network", "unknown", weight=0.5,
       source=("https://github.com/NVIDIA/nccl/issues/1710",),
       why="an InfiniBand async event of one queue pair (ibv_event_type_str of "
           "IBV_EVENT_QP_ACCESS_ERR 'local access violation work queue error', "
           "IBV_EVENT_QP_REQ_ERR 'invalid request local work queue error', IBV_EVENT_QP_FATAL "
           "'local work queue catastrophic error', as NCCL's net_ib prints it): the local side "
           "used the queue pair or its memory registration wrongly — the net plugin, the "
           "driver or the HCA; unlike a port error it names no link, and the real thread "
           "(a NET plugin swap changed it) did not decide the layer: unknown, at a low weight"),
    _p("ib_completion_error",
       r"NET/IB\w*\s*:\s*Got completion (?:from peer (?:(?P<peer>\d[\d.]*)\S*|\S+)\s*)?with "
       r"(?:error|status=)|IBV_WC_\w+_ERR|transport retry counter exceeded|RETRY_EXC_ERR|"
       r"ibv_poll_cq.*fail|NET/IB.*async fatal event|"
       r"NET/IB\s*:.{0,40}Got async event\s*:\s*[^(]{0,40}?(?:error|catastrophic)|"
       r"mlx5\w*:.*(?:CQE error|syndrome)",
       "network", "infrastructure", weight=0.6,
       source=("https://github.com/NVIDIA/nccl-tests/issues/24", "https://github.com/NVIDIA/nccl/issues/905",
               "https://github.com/NVIDIA/nccl/issues/1710"),
       why="RDMA work completion with an error status (NCCL src/transport/net_ib 'Got "
           "completion from peer %s with status=%s(%d) … vendor_err', 'async fatal event'; e.g. "
           "12 = IBV_WC_RETRY_EXC_ERR: the remote side stopped acknowledging) — a link, cable, "
           "switch port or HCA on that path, or the fabric's configuration (RoCE lossless "
           "settings, GPUDirect RDMA): the line names no node, and the maintainers' reading in "
           "the real threads was the fabric (a flapping link, 'sanitize your IB fabric'), so the "
           "layer is the infrastructure's, at a medium weight; a node's own HCA shows up as "
           "repeated errors from that node (the history rule); a non-fatal "
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
    _p("nccl_shm_segment",
       r"Error while creating shared memory segment|"
       r"shm\.h:\d+ NCCL WARN Call to posix_fallocate failed|"
       r"NCCL WARN Call to posix_fallocate failed\s*:\s*No space left on device|"
       r"in ncclShmOpen\(",
       "crash", "infrastructure", weight=0.85,
       source=("https://github.com/NVIDIA/nccl/issues/342", "https://github.com/NVIDIA/nccl/issues/290",
               "https://github.com/fal-ai-community/video-diffusion-speedrun/issues/2",
               "https://github.com/NVIDIA/JAX-Toolbox/issues/183"),
       why="NCCL could not create or grow its intra-node shared-memory segment in /dev/shm "
           "(src/misc/shmutils.cc 'Error while creating shared memory segment %s (size %zu)', "
           "older include/shm.h 'Call to posix_fallocate failed : No space left on device'; a "
           "SIGBUS inside ncclShmOpen): the container's /dev/shm is too small (docker's 64 MB "
           "default) — a crash of the container's configuration, not a network or disk fault"),
    _p("nccl_no_interface",
       r"Bootstrap : no socket interface found|NET/Socket : No usable listening interface found|"
       r"No valid <IPv4_or_hostname>:<port>|ncclSocketInit: connecting to address .{0,40}"
       r"is neither AF_INET|Socket creation failed : Address family not supported",
       "network", "infrastructure", weight=0.8,
       source=("https://github.com/marin-community/marin/issues/6940", "https://github.com/NVIDIA/nccl/issues/1837",
               "https://github.com/NVIDIA/nccl/issues/210"),
       why="NCCL found no usable IP interface for its bootstrap (src/bootstrap.cc 'Bootstrap : "
           "no socket interface found'; src/misc/socket.cc ncclSocketInit '… is neither "
           "AF_INET(2) nor AF_INET6(10)' when NCCL_SOCKET_IFNAME matches nothing; old "
           "include/socket.h 'Socket creation failed'): the node's interfaces or the job's "
           "NCCL_SOCKET_IFNAME — the cluster's network configuration"),
    _p("nccl_system_error",
       r"unhandled system error|ncclSystemError|"
       r"internal error - please report this issue to the NCCL developers|ncclInternalError",
       "network", "infrastructure", symptom=True, weight=0.5,
       source=("https://github.com/NVIDIA/nccl/issues/207", "https://github.com/NVIDIA/nccl/issues/375",
               "https://github.com/NVIDIA/nccl/issues/286"),
       why="NCCL: a system call failed (socket, connect, shared memory) or it found no usable "
           "interface (src/init.cc ncclGetErrorString 'unhandled system error', 'internal error "
           "- please report…') — interfaces, firewall, NCCL_SOCKET_IFNAME or /dev/shm. A "
           "wrapper: NCCL's 'Last error:' line (a socket, shm or IB row) names the cause, so "
           "the row is a symptom; alone it is read as the cluster's network configuration (the "
           "real threads: nodes that could not reach each other, a firewall, the wrong "
           "interface), at a low weight"),
    _p("nccl_cuda_error",
       r"unhandled cuda error|ncclUnhandledCudaError",
       "crash", "system_software", symptom=True, weight=0.4,
       why="ncclUnhandledCudaError (src/init.cc): a CUDA call inside NCCL failed; the 'Last "
           "error: Cuda failure …' line or the GPU's XID names the cause (out of memory, "
           "illegal access, a lost GPU) — a symptom on its own"),
    _p("nccl_connect_aborted",
       r"NCCL WARN.*Connect to \S+ failed\s*:\s*Software caused connection abort",
       "network", "infrastructure", weight=0.6,
       source=("https://github.com/NVIDIA/nccl-tests/issues/166",),
       why="NCCL's connect to a peer's socket was aborted on this host (src/misc/socket.cc "
           "'socketStartConnect: Connect to %s failed : %s' with ECONNABORTED, 'Software caused "
           "connection abort'): not a refusal by a dead peer (ECONNREFUSED) but the local stack "
           "dropping the attempt — a firewall rule, an interface that went down, the wrong "
           "NCCL_SOCKET_IFNAME: the path between the hosts, a root cause; the peer's 'Connection "
           "closed by remote peer' that follows is its symptom"),
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
    _p("stack_in_collective",
       r"^\s*(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|"
       r"monitored_barrier|all_to_all\w*|reduce|gather|scatter|send|recv|"
       r"destroy_process_group)\s+\((?:\S*/)?torch/distributed/distributed_c10d\.py:\d+\)\s*$",
       "hang", "unknown", symptom=True, weight=0.45,
       source=("https://github.com/pytorch/pytorch/issues/135703",),
       why="a frame of a py-spy dump ('    <function> (<file>:<line>)', benfred/py-spy's dump "
           "format) inside a torch.distributed collective or teardown: the process was dumped "
           "because it stopped making progress, and it is parked in the collective — a hang "
           "seen from a blocked rank, with no watchdog line (the watchdog fires only after its "
           "timeout, or never when the rank sits in teardown); a symptom: which rank is "
           "behind, and why, the stack does not say"),
    _p("collective_mismatch",
       r"Detected mismatch between collectives|Expected to have finished reduction in the prior "
       r"iteration|Parameters which did not receive grad|"
       r"Expected to mark a variable ready only once",
       "app_exception", "application", weight=0.9,
       source=("https://github.com/pytorch/pytorch/issues/43259",),
       why="ranks took different code paths (collective fingerprint or DDP unused parameters): "
           "a program error on every rank, restarting repeats it (torch/csrc/distributed/c10d/"
           "ProcessGroupWrapper.cpp 'Detected mismatch between collectives on ranks', reducer.cpp "
           "'Expected to have finished reduction in the prior iteration'; torch's warning that "
           "find_unused_parameters=True found none unused is no error: the Hugging Face Trainer "
           "sets it by default)"),
    # ==== CUDA application errors ===============================================================
    _p("cuda_illegal_access",  # the sticky errors' own strings (trainguard.core.cuda_errors)
       cuda_errors.texts("cudaErrorIllegalAddress", "cudaErrorIllegalInstruction",
                         "cudaErrorMisalignedAddress", "cudaErrorLaunchFailure"),
       "crash", "unknown", weight=0.7,
       source=("https://github.com/RVC-Boss/GPT-SoVITS/issues/1341",
               "https://github.com/tensorflow/tensorflow/issues/25866",
               "https://github.com/skhu101/GauHuman/issues/21"),
       why="a kernel touched memory it does not own or faulted (cudaErrorIllegalAddress 700, "
           "cudaErrorLaunchFailure 719 'an exception occurred on the device while executing a "
           "kernel', CUDA Runtime API docs; kernel log: XID 13/31/43). The CUDA context is "
           "corrupt and the process is lost (no in-process recovery), so a crash; its layer "
           "is unknown from the line: a kernel bug of the program or its framework, the CUDA "
           "toolkit (GauHuman: fixed by a newer CUDA) or the GPU when it recurs on one GPU "
           "across processes"),
    _p("cuda_device_assert",
       cuda_errors.texts("cudaErrorAssert") + r"|Assertion `.*` failed\.?$",
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
       r"unexpected EOF, expected \d+ more bytes|The file might be corrupted|"
       r"checksum mismatch|BadZipFile|File is not a zip file|"
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
    _p("store_barrier_timeout",
       r"Timed out initializing process group in store based barrier"
       r"(?:.*?world_size=(?P<world>\d+), (?:worker_count|num_workers_joined)=(?P<joined>\d+))?",
       "rendezvous", "unknown", weight=0.5,
       source=("https://github.com/tczhangzhi/pytorch-distributed/issues/18",
               "https://github.com/SpongebBob/Finetune-ChatGLM2-6B/issues/6"),
       why="init_process_group's store-based barrier timed out (torch/distributed/"
           "distributed_c10d.py 'Timed out initializing process group in store based barrier on "
           "rank %d, for key … (world_size=%d, worker_count=%d, timeout=…)'): the store was "
           "reached, but not every rank arrived in time — a rank still busy (data preparation "
           "before init) or a launch that started a different number of workers than the world "
           "size (worker_count > world_size), or a node whose ranks never started "
           "(worker_count < world_size) — the line cannot tell the program from the cluster, "
           "so the layer is unknown, at a low weight; except when more workers joined than the "
           "world size (worker_count > world_size, the groups ``joined`` > ``world``): the "
           "launch started more processes than it declared (srun -n2 with mp.spawn of 2 each, "
           "pytorch-distributed#18) — the launch configuration's, the program's layer "
           "(``signals.log_rule``)"),
    _p("store_unique_id",
       r"(?:retrieving|retreiving) ncclUniqueId from \[\d+\] via c10d key-value store",
       "rendezvous", "application", symptom=True, weight=0.55,
       source=("https://github.com/pytorch/pytorch/issues/107177", "https://github.com/bytedance/HLLM/issues/20"),
       why="a rank could not fetch NCCL's unique id from rank 0 through the c10d store "
           "(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp broadcastUniqueNCCLID: '[%d] is "
           "setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value "
           "store by key '%s', but store->get('%s') got error: …'; 'This may indicate a possible "
           "application crash on rank 0 or a network set up issue'): rank 0 never got there or "
           "the store is unreachable — a symptom when rank 0's own fault is in the log; alone, "
           "the store answered (the key was missing, not the store), so rank 0 was late: in the "
           "real threads a straggling rank 0 (data set construction before its first "
           "collective) — the program's"),
    _p("store_socket_timeout",
       r"\bSocket Timeout\b|\bWait timeout\b.{0,40}keys?:",
       "rendezvous", "unknown", symptom=True, weight=0.5,
       source=("https://github.com/alibaba/Pai-Megatron-Patch/issues/468",),
       why="a c10d store request timed out (torch/csrc/distributed/c10d/Utils.hpp recvBytes: "
           "'Socket Timeout' when the socket's receive timeout expires; TCPStore 'wait timeout "
           "after %dms, keys: …'): a rank waited for a key that a peer never wrote — the peer is "
           "missing, dead or late; a symptom when the peer's own fault is in the log, and of an "
           "unknown layer alone (the line cannot tell a late rank from a lost node)"),
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
    # ==== the node's own network access (downloads at start-up) =================================
    _p("download_unreachable",
       r"^(?!.*(?:WARNING|Retrying in|thrown while requesting|\[W\S* |\bW\d{4} ))"
       r".*(?:We couldn't connect to '?https?://|"
       r"Max retries exceeded with url|Failed to establish a new connection|"
       r"\[Errno 101\] Network is unreachable|Temporary failure in name resolution|"
       r"\[Errno -[23]\] Name or service not known|Connection to \S+ timed out\. \(connect timeout)",
       "network", "infrastructure", weight=0.6,
       source=("https://github.com/sktsherlock/TAG-Benchmark/issues/8",
               "https://github.com/BaranziniLab/KG_RAG/issues/46"),
       why="a process could not reach a server over the network at all — the final error of "
           "a download, not a retry warning: transformers' hub loader (src/transformers/utils/"
           "hub.py \"We couldn't connect to '%s' to load this file\"), urllib3/requests "
           "('Max retries exceeded with url', 'Failed to establish a new connection', 'Connection "
           "to %s timed out. (connect timeout=%s)'), and the resolver or the kernel under them "
           "(EAI_AGAIN 'Temporary failure in name resolution', EAI_NONAME 'Name or service not "
           "known', ENETUNREACH 101 'Network is unreachable'): the node's internet access, proxy, "
           "DNS or firewall — the cluster's network, not the program. Lines with a retry or a "
           "W-level prefix are no fault (huggingface_hub retries, c10d's per-attempt warnings)"),
    # ==== worker processes of Ray and serving engines ==========================================
    _p("ray_actor_died",
       r"ActorDiedError|RayActorError: The actor died|The actor died unexpectedly before "
       r"finishing this task|The actor is dead because its worker process has died|"
       r"WorkerCrashedError: The worker died unexpectedly",
       "crash", "unknown", weight=0.6,
       source=("https://github.com/Simple-Efficient/RL-Factory/issues/8",
               "https://github.com/hkust-nlp/simpleRL-reason/issues/25", "https://github.com/verl-project/verl/issues/383",
               "https://github.com/OpenRLHF/OpenRLHF/issues/265"),
       why="Ray reports that an actor's or task's worker process died (python/ray/exceptions.py "
           "ActorDiedError / RayActorError 'The actor died unexpectedly before finishing this "
           "task', WorkerCrashedError 'The worker died unexpectedly while executing this task'; "
           "the raylet's 'The actor is dead because its worker process has died. Worker exit "
           "type: SYSTEM_ERROR …'): a process crash seen from the driver, not an exception of the "
           "program; the cause (OOM killer, segfault, ray stop) is not in the line, and Ray's own "
           "list of 'potential root causes' is no evidence of any of them"),
    _p("engine_core_died",
       r"EngineCore encountered a fatal error|Engine core proc \S+ died unexpectedly|"
       r"EngineDeadError",
       "crash", "unknown", weight=0.6,
       source=("https://github.com/NovaSky-AI/SkyRL/issues/797",),
       why="vLLM's engine-core process died (vllm/v1/engine/core.py 'EngineCore encountered a "
           "fatal error.', core_client.py 'Engine core proc %s died unexpectedly', "
           "EngineDeadError): the process that runs the model is gone; the error above it, when "
           "the log holds it, names the cause"),
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

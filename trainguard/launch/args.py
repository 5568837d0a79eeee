"""``trainguard launch``'s command line: torchrun's, flag for flag, plus trainguard's own.

A script started as ``torchrun ARGS train.py`` starts as ``trainguard launch ARGS train.py``:
every torchrun flag of torch 2.13 (``torch/distributed/run.py``) is accepted in both spellings
(``--nproc-per-node`` / ``--nproc_per_node``), and those that cannot mean here what they mean
under torchrun are refused with the reason (``UNSUPPORTED``), never ignored.

How torchrun's flags map onto trainguard:

* ``--standalone``: one node; without ``NATS_URL``/``REDIS_URL``/``TG_RDZV_ENDPOINT`` (or the
  flags) the launcher starts an embedded stack for the job, as the demo does.
* ``--rdzv-endpoint``, or ``--master-addr``/``--master-port``: the rendezvous store
  (``trainguard.rendezvous.store``); the launcher hosts it there when it is on this machine and
  nothing answers yet (torchrun's c10d backend does the same on its host).
  ``--rdzv-backend``: ``c10d`` and ``static`` (both meet at that store); ``--rdzv-id``: the job
  name unless ``--job`` is given; ``--rdzv-conf join_timeout=S``: the start-up allowance.
* ``--nnodes MIN:MAX``: MAX nodes start the job; it may shrink to MIN nodes
  (``min_world_size = MIN × nproc``) when nodes are excluded. A plain ``--nnodes N`` keeps
  ``--min-world-size`` (default 1).
* ``--nproc-per-node``: a number, ``cpu`` (the CPU count), ``gpu`` (the GPU count, NVML) or
  ``auto`` (GPUs when there are any, else CPUs), as torchrun.
* ``--max-restarts N``: in action mode the retry budget; in observe mode the number of times the
  launcher restarts the whole worker group after a failure, as torchrun does.
* ``--log-dir``, ``--redirects``, ``--tee``, ``--local-ranks-filter``: the same per-rank files
  (``<log-dir>/<job>/attempt_<n>/<local rank>/{stdout,stderr}.log``) and console filtering.
* ``--no-python``: the program is started as it is (no warm spare, no hooks).
* ``--run-path``, ``--start-method``, ``--monitor-interval``, ``--local-addr``: accepted; ranks
  always start from warm spare processes that run the script with ``runpy`` (a fresh
  interpreter per rank, as with ``spawn``); the monitor interval is how often the launcher
  wakes when nothing happens.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from trainguard.launch.config import StdSpec

from trainguard.schemas import subjects

#: torchrun flags refused, with the reason (a flag that cannot mean what it means under torchrun
#: is an error, never silently ignored).
UNSUPPORTED: dict[str, str] = {
    "--logs-specs": "custom LogsSpecs classes are torchrun plug-ins; use --log-dir/--redirects/"
                    "--tee",
    "--event-log-handler": "torchrun's event handlers are plug-ins; trainguard publishes every "
                           "lifecycle event on NATS (tg.job.<job>.worker)",
    "--numa-binding": "NUMA binding is not implemented; bind with numactl inside the script",
    "--duplicate-stdout-filters": "not implemented; use --tee and grep the per-rank files",
    "--duplicate-stderr-filters": "not implemented; use --tee and grep the per-rank files",
    "--signals-to-handle": "the launcher handles SIGTERM and SIGINT (stop) and nothing else",
    "--virtual-local-rank": "not implemented: LOCAL_RANK is the rank's local index",
    "--shutdown-timeout": "ranks are stopped with SIGKILL at once (their staged checkpoints "
                          "survive that)",
}

#: ``--rdzv-conf`` keys that are accepted (torch's c10d/static backends): ``join_timeout``
#: sets the start-up allowance; the others tune torch's own store, which is not used here.
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "read_timeout",
                  "timeout", "keep_alive_interval", "keep_alive_max_attempt", "is_host",
                  "use_libuv", "rank")


def parse_std(spec: str) -> StdSpec:
    """``"3"`` or ``"0:1,1:2"`` → StdSpec; raises ValueError on another form or a value ∉ 0–3."""
    spec = (spec or "0").strip()

    def val(s: str) -> int:
        if s not in ("0", "1", "2", "3"):
            raise ValueError(f"{spec!r}: each value must be 0 (none), 1 (stdout), 2 (stderr) "
                             f"or 3 (both)")
        return int(s)

    if ":" not in spec:
        return StdSpec(default=val(spec))
    pairs = []
    for part in spec.split(","):
        lr, sep, v = part.partition(":")
        if not sep or not lr.strip().isdigit():
            raise ValueError(f"{spec!r}: per-rank form is <local rank>:<0-3>,…")
        pairs.append((int(lr), val(v.strip())))
    return StdSpec(per_rank=tuple(pairs))


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4). Raises ValueError."""
    lo, sep, hi = value.partition(":")
    try:
        a, b = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise ValueError(f"--nnodes {value!r}: give N or MIN:MAX") from None
    if a < 1 or b < a:
        raise ValueError(f"--nnodes {value!r}: need 1 ≤ MIN ≤ MAX")
    return a, b


def gpu_count() -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else NVML's count (0 when
    NVML is missing)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return 0


def parse_nproc(value: str) -> int:
    """``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto`` (torchrun's meanings).
    Raises ValueError."""
    v = value.strip().lower()
    if v.isdigit():
        return int(v)
    if v == "cpu":
        return os.cpu_count() or 1
    if v in ("gpu", "cuda"):
        n = gpu_count()
        if not n:
            raise ValueError("--nproc-per-node gpu: no GPU visible (NVML finds none)")
        return n
    if v == "auto":
        return gpu_count() or os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node {value!r}: give a number, cpu, gpu or auto")


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` → dict; raises ValueError for a malformed pair or an unknown key."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (value or "").split(","))):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"--rdzv-conf {part!r}: give key=value")
        if k not in RDZV_CONF_KEYS:
            raise ValueError(f"--rdzv-conf: unknown key {k!r} (known: "
                             f"{', '.join(RDZV_CONF_KEYS)})")
        out[k] = v
    return out


def _both(p: argparse.ArgumentParser, name: str, *more: str, **kw):
    """Add ``--a-b`` with its ``--a_b`` twin (torchrun accepts both)."""
    names = [name] + ([name.replace("-", "_").replace("__", "--", 1)] if "-" in name[2:]
                      else []) + list(more)
    return p.add_argument(*names, **kw)


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainguard launch", description=description,
                                allow_abbrev=False)
    env = os.environ.get
    tg = p.add_argument_group("torchrun's flags")
    _both(tg, "--nnodes", default="1", help="N or MIN:MAX")
    _both(tg, "--nproc-per-node", default="1", help="a number, cpu, gpu or auto")
    _both(tg, "--node-rank", type=int, default=None)
    tg.add_argument("--standalone", action="store_true",
                    help="one node; starts an embedded stack when none is configured")
    _both(tg, "--rdzv-backend", default="static", help="c10d or static")
    _both(tg, "--rdzv-endpoint", default=None, help="host:port of the rendezvous store")
    _both(tg, "--rdzv-id", default=None, help="the job name unless --job is given")
    _both(tg, "--rdzv-conf", default="", help="k=v,…: join_timeout sets the start-up allowance")
    _both(tg, "--master-addr", default=None)
    _both(tg, "--master-port", type=int, default=None)
    _both(tg, "--max-restarts", type=int, default=None,
          help="action mode: retry budget; observe mode: group restarts, as torchrun")
    _both(tg, "--monitor-interval", type=float, default=0.5)
    tg.add_argument("--role", default="default")
    _both(tg, "--log-dir", default=None)
    tg.add_argument("-r", "--redirects", default="0")
    tg.add_argument("-t", "--tee", default="0")
    _both(tg, "--local-ranks-filter", default="")
    _both(tg, "--no-python", action="store_true")
    _both(tg, "--run-path", action="store_true")
    _both(tg, "--start-method", default="spawn", choices=("spawn", "fork", "forkserver"))
    _both(tg, "--local-addr", default=None)
    tg.add_argument("-m", "--module", action="store_true", help="run the script as a module")
    for flag in UNSUPPORTED:
        _both(tg, flag, default=None, help=argparse.SUPPRESS)
    own = p.add_argument_group("trainguard's flags")
    own.add_argument("--node", default=subjects.default_node(),
                     help="this node's name (default: $TG_NODE or the short host name)")
    own.add_argument("--job", default=None,
                     help="the job's name (default: the Slurm directive's, else $TG_JOB, else "
                          "--rdzv-id, else slurm-$SLURM_JOB_ID under Slurm, else 'default')")
    own.add_argument("--mode", choices=("observe", "action"), default=None,
                     help="observe (decisions published, none carried out) or action (default: "
                          "the Slurm directive's, else $TG_MODE, else observe)")
    own.add_argument("--nats-url", default=env("NATS_URL", ""))
    own.add_argument("--redis-url", default=env("REDIS_URL", ""))
    own.add_argument("--ckpt-dir", default=env("TG_CKPT_DIR", ""))
    own.add_argument("--spares", type=int, default=None,
                     help="warm spare processes per node (default: --nproc-per-node, so that a "
                          "whole worker group restarts from warm spares)")
    own.add_argument("--spare-node", action="store_true",
                     help="start no ranks; wait to replace an excluded node")
    own.add_argument("--hang-timeout", type=float, default=0.0,
                     help="seconds of rank heartbeat silence that make a hang (default 0: the "
                          "detector's own, 5 s, 10 s in start-up, checkpoint, eval and recovery "
                          "phases; a rank beating but making no step progress hangs after 5× "
                          "its p99 step time, at least 10 s)")
    own.add_argument("--startup-timeout", type=float, default=None)
    own.add_argument("--node-timeout", type=float, default=3.0)
    own.add_argument("--retry-budget", type=int, default=None)
    own.add_argument("--min-world-size", type=int, default=None)
    own.add_argument("--warm-import", default="", help="modules the spares import ahead, a,b,c")
    own.add_argument("--no-node-writer", action="store_true",
                     help="no checkpoint writer daemon for the node: each rank starts its own")
    own.add_argument("--no-fork-spares", action="store_true",
                     help="start each spare as a process of its own instead of forking it from "
                          "the node's warm template (each then imports torch itself)")
    own.add_argument("--no-job-imports", action="store_true",
                     help="do not pre-import the modules the job's ranks imported in the spares' "
                          "template (by default a replacement rank finds its framework imported)")
    own.add_argument("--no-auto-resume", action="store_true",
                     help="a restarted Lightning / Hugging Face Trainer given no checkpoint "
                          "starts from step 0 instead of its newest complete checkpoint "
                          "(exports TG_AUTO_RESUME=0)")
    own.add_argument("--faults", default="", metavar="SCHEDULE",
                     help="a fault schedule (YAML or JSON, trainguard.core.fault_schedule): its rank "
                          "faults fire inside the ranks at their step or time")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def load_faults(path: str, job: str, world_size: int | None = None) -> tuple[str, str]:
    """``--faults PATH`` → ``(rank faults as JSON, marker directory)`` for the ranks'
    environment (``TG_FAULTS``, ``TG_FAULTS_DIR``: ``$TG_FAULTS_DIR`` or
    ``<PATH>.fired/<job>``, beside the schedule, so that ranks moved to another node sharing
    that file system do not fire a fault twice). Node faults are left to the cluster harness
    (said once). A rank fault naming a rank past ``world_size`` (the largest world of the job)
    would never fire: refused. Raises ``FaultScheduleError``."""
    from trainguard.core.fault_schedule import FaultScheduleError, dumps, load

    faults = load(path)
    for f in faults:
        if f.on_rank and world_size is not None and f.rank is not None and f.rank >= world_size:
            raise FaultScheduleError(f"{path} fault {f.id}", f"rank {f.rank} is not a rank of "
                                     f"this job (ranks 0-{world_size - 1}): it would never fire")
    node = [f for f in faults if not f.on_rank]
    if node:
        print(f"trainguard launch: --faults {path}: {len(node)} node fault(s) "
              f"({', '.join(sorted({f.kind for f in node}))}) are carried out by the cluster "
              f"harness (trainguard.cluster), not by the launcher", file=sys.stderr)
    where = os.environ.get("TG_FAULTS_DIR") or os.path.join(os.path.abspath(path) + ".fired",
                                                            job)
    return dumps([f for f in faults if f.on_rank]), where


#: Seconds the launcher waits for ``squeue`` to print its own Slurm job's comment.
SQUEUE_TIMEOUT_S = 5.0
#: The launch flags a Slurm directive may set (``schemas.slurm.DIRECTIVE_FIELDS``): directive
#: field → argparse destination.
DIRECTIVE_FLAGS = {"mode": "mode", "retry_budget": "retry_budget",
                   "min_world_size": "min_world_size", "spares": "spares", "job": "job"}


def slurm_directive(environ=None, run=subprocess.run):
    """``(directive, note)`` of this launch's own Slurm job (env ``SLURM_JOB_ID``): its comment
    read with ``squeue -h -j <id> -o %k`` (``SQUEUE_TIMEOUT_S`` at most) and parsed by
    ``schemas.slurm.directive_or_default``. ``(None, "")`` outside Slurm or for a comment with
    no directive; ``(None, why)`` when squeue cannot say; an invalid directive is an observe
    one and the error. Never raises."""
    from trainguard.schemas.slurm import directive_or_default

    environ = os.environ if environ is None else environ
    jid = environ.get("SLURM_JOB_ID", "")
    if not jid:
        return None, ""
    try:
        p = run([shutil.which("squeue") or "squeue", "-h", "-j", jid, "-o", "%k"],
                capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot read the comment of Slurm job {jid} ({exc})"
    if p.returncode != 0:
        return None, (f"cannot read the comment of Slurm job {jid} (squeue exited "
                      f"{p.returncode}: {(p.stderr or '').strip()[:200]})")
    comment = p.stdout.strip()
    if comment in ("(null)", ""):
        return None, ""
    return directive_or_default(comment)


def apply_directive(a: argparse.Namespace, directive, note: str = "") -> None:
    """Fill the flags not given on the command line from the Slurm ``directive``, then from
    the environment (``TG_MODE``, ``TG_JOB``), then the defaults (observe): a flag wins over
    the directive, the directive over the environment. ``note`` (an unreadable or invalid
    directive) is printed; an invalid directive is observe (``slurm_directive``)."""
    if note:
        print(f"trainguard launch: {note}" + ("; launching in observe mode unless --mode says "
                                              "otherwise" if directive is not None else ""),
              file=sys.stderr)
    given = directive.given() if directive is not None else {}
    for field_, dest in DIRECTIVE_FLAGS.items():
        if getattr(a, dest) is None and field_ in given:
            setattr(a, dest, given[field_])
    if a.mode is None:
        a.mode = os.environ.get("TG_MODE") or "observe"
    if a.mode not in ("observe", "action"):
        raise SystemExit(f"trainguard launch: TG_MODE={a.mode!r}: use observe or action")
    if a.job is None:
        a.job = os.environ.get("TG_JOB") or None


def parse(argv: list[str], description: str = ""):
    """Parse ``trainguard launch`` arguments into a ``trainguard.launch.launcher.LaunchConfig``.
    Bad input exits through argparse's usage error (status 2) with the reason."""
    from trainguard.launch.config import LaunchConfig

    p = build_parser(description)
    a = p.parse_args(argv)
    for flag, why in UNSUPPORTED.items():
        if getattr(a, flag[2:].replace("-", "_")) is not None:
            p.error(f"{flag} is not supported: {why}")
    apply_directive(a, *slurm_directive())
    try:
        nmin, nmax = parse_nnodes(a.nnodes)
        nproc = parse_nproc(a.nproc_per_node)
        conf = parse_rdzv_conf(a.rdzv_conf)
        redirects, tee = parse_std(a.redirects), parse_std(a.tee)
    except ValueError as exc:
        p.error(str(exc))
    if a.rdzv_backend not in ("c10d", "static"):
        p.error(f"--rdzv-backend {a.rdzv_backend!r} is not supported: trainguard meets at its "
                f"own rendezvous store; use c10d or static (both mean that store)")
    jid = os.environ.get("SLURM_JOB_ID", "")
    job = a.job or a.rdzv_id or (f"slurm-{jid}" if jid else "default")
    if a.standalone and (nmin, nmax) != (1, 1):
        p.error("--standalone is a single node: drop --nnodes or give --nnodes 1")
    node_rank = a.node_rank
    if node_rank is None:
        if nmax > 1 and not a.spare_node:
            p.error(f"--node-rank is needed with --nnodes {a.nnodes}: trainguard does not "
                    f"number nodes by arrival (Slurm: --node-rank $SLURM_NODEID)")
        node_rank = 0
    rdzv = a.rdzv_endpoint
    if rdzv is None and (a.master_addr or a.master_port):
        rdzv = f"{a.master_addr or '127.0.0.1'}:{a.master_port or 29500}"
    if rdzv is None:
        rdzv = os.environ.get("TG_RDZV_ENDPOINT", "")
    filt = set()
    for part in filter(None, (x.strip() for x in a.local_ranks_filter.split(","))):
        if not part.isdigit():
            p.error(f"--local-ranks-filter {a.local_ranks_filter!r}: give local ranks 0,1,…")
        filt.add(int(part))
    # an explicit MIN:MAX range sets the floor; a plain N keeps trainguard's default of 1 (a
    # job shrinks when nodes are excluded, down to --min-world-size)
    min_world = (a.min_world_size if a.min_world_size is not None
                 else nmin * nproc if ":" in a.nnodes else 1)
    for k in sorted(set(conf) - {"join_timeout"}):
        print(f"trainguard launch: --rdzv-conf {k}={conf[k]} has no effect here: it tunes "
              f"torch's own rendezvous store, and ranks meet at trainguard's (only join_timeout "
              f"is read: the start-up allowance)", file=sys.stderr)
    startup = a.startup_timeout
    if startup is None:
        startup = float(conf.get("join_timeout", 120.0))
    budget = a.retry_budget
    if budget is None:
        budget = a.max_restarts if (a.max_restarts is not None and a.mode == "action") else 10
    if a.no_python and a.module:
        p.error("--no-python and -m cannot be combined (as with torchrun)")
    if a.no_python and not shutil.which(a.script) and not os.path.isfile(a.script):
        p.error(f"--no-python: no program {a.script!r} on PATH")
    faults = faults_dir = ""
    if a.faults:
        from trainguard.core.fault_schedule import FaultScheduleError

        try:
            faults, faults_dir = load_faults(a.faults, job, nmax * nproc)
        except FaultScheduleError as exc:
            p.error(f"--faults: {exc}")
    cfg = LaunchConfig(
        script=a.script, script_args=a.script_args, module=a.module, nnodes=nmax,
        nproc_per_node=nproc, node_rank=node_rank, node=a.node, job=job, mode=a.mode,
        rdzv_endpoint=rdzv, nats_url=a.nats_url, redis_url=a.redis_url, ckpt_dir=a.ckpt_dir,
        spares=a.spares if a.spares is not None else nproc, spare_node=a.spare_node,
        hang_timeout_s=a.hang_timeout, startup_timeout_s=startup,
        node_timeout_s=a.node_timeout, retry_budget=budget, min_world_size=min_world,
        warm_imports=a.warm_import, node_writer=not a.no_node_writer,
        fork_spares=not a.no_fork_spares, job_imports=not a.no_job_imports,
        auto_resume=not a.no_auto_resume,
        max_restarts=a.max_restarts or 0, role=a.role, log_dir=a.log_dir or "",
        redirects=redirects, tee=tee, local_ranks_filter=frozenset(filt),
        no_python=a.no_python, monitor_interval_s=a.monitor_interval,
        standalone=a.standalone, faults=faults, faults_dir=faults_dir)
    _check(p, cfg)
    return cfg


def _check(p: argparse.ArgumentParser, c) -> None:
    """Refuse settings that cannot describe a job (argparse's usage error, exit status 2)."""
    for name, val, check in (("--job", c.job, subjects.job_name),
                             ("--node", c.node, subjects.token)):
        try:
            check(val)
        except ValueError as exc:
            p.error(f"{name}: {exc}")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("TG_NODE") \
            and c.node == subjects.default_node():
        # in a pod the host name is the pod's: decisions would name a node that does not exist
        print(f"trainguard launch: warning: in a Kubernetes pod without TG_NODE: --node is the "
              f"pod's host name {c.node!r}, not its node; set TG_NODE from the downward API "
              f"(env valueFrom fieldRef spec.nodeName, deploy/kubernetes)", file=sys.stderr)
    if c.nnodes < 1 or c.nproc_per_node < 1:
        p.error(f"--nnodes and --nproc-per-node must be ≥ 1 (got {c.nnodes} and "
                f"{c.nproc_per_node})")
    if not 0 <= c.node_rank < c.nnodes and not c.spare_node:
        p.error(f"--node-rank must be in [0, {c.nnodes - 1}] for --nnodes {c.nnodes} (got "
                f"{c.node_rank}); a node that only waits to replace another takes --spare-node")
    if not 1 <= c.min_world_size <= c.world_size:
        p.error(f"--min-world-size must be in [1, {c.world_size}] (the world size), got "
                f"{c.min_world_size}")
    for name, val in (("--spares", c.spares), ("--retry-budget", c.retry_budget),
                      ("--hang-timeout", c.hang_timeout_s), ("--max-restarts", c.max_restarts)):
        if val < 0:
            p.error(f"{name} must be ≥ 0, got {val}")
    if c.ckpt_dir and os.path.exists(c.ckpt_dir) and not os.path.isdir(c.ckpt_dir):
        p.error(f"--ckpt-dir {c.ckpt_dir!r} is a file: give a directory (created if missing)")
    for name, val in (("--startup-timeout", c.startup_timeout_s),
                      ("--node-timeout", c.node_timeout_s),
                      ("--monitor-interval", c.monitor_interval_s)):
        if val <= 0:
            p.error(f"{name} must be > 0 seconds, got {val}")

"""The Slurm side of node exclusion as pure functions: the ``scontrol``/``scancel``/``squeue``
argv lists ``trainguard.scheduler.slurm.controller`` runs, whether an exclusion requeues
(``should_requeue``), what a requeue or a stop does given Slurm's state as ``scontrol show``
prints it (``requeue_commands``, ``stop_plan``), and the parsers of that output. Nothing here
runs a command or reads a clock but ``requeue_commands``'s default ``now``;
``tests/test_remediator_controllers.py`` tables them without Slurm. Slurm's behaviour each rule
follows is Slurm 22.05's (Debian 12's ``slurm-wlm``), as seen on the cluster harness
(``trainguard.cluster``) and said at each rule.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

__all__ = ["slurm_drain_command", "slurm_requeue_command", "slurm_squeue_command",
           "slurm_stop_commands", "slurm_reason", "parse_squeue_state", "stop_plan",
           "parse_scontrol", "requeue_commands", "should_requeue", "SLURM_REASON_MAX",
           "ENDED_STATES", "REQUEUED_STATES", "SCANCEL_ENDED", "UNREACHABLE_FAULTS"]

#: Slurm drain reasons are shown by ``sinfo -R``; keep them short and on one line.
SLURM_REASON_MAX = 120
#: Job states after which there is nothing to cancel (``squeue``/``scontrol`` JobState).
ENDED_STATES = ("CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")
#: What ``scancel`` says of a job that ended before it could be cancelled.
SCANCEL_ENDED = ("already completing or completed", "Invalid job id")
#: Job states that mean a requeue has happened (or is under way).
REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING")
#: Fault classes (the job record's ``last_fault``, the exclusion's own) of a node whose slurmd
#: answers no more either: a requeue sets it DOWN. ``node_lost``: the node agent's heartbeats
#: stopped (a power-off, a partition); slurmctld itself would set it DOWN only after
#: ``SlurmdTimeout`` (300 s by default), and until then the requeued job stays COMPLETING on
#: it and cannot start again. A node that still answers (an XID, a straggler) is drained only:
#: DOWN would kill every other job on it.
UNREACHABLE_FAULTS = ("node_lost",)


def slurm_drain_command(node: str, reason: str, scontrol: str = "scontrol") -> list[str]:
    """argv that drains ``node`` with ``reason`` (one line, at most ``SLURM_REASON_MAX``
    characters; Slurm shows it in ``sinfo -R``)."""
    return [scontrol, "update", f"nodename={node}", "state=drain", f"reason={slurm_reason(reason)}"]


def slurm_requeue_command(job_id: str, scontrol: str = "scontrol") -> list[str]:
    """argv that requeues Slurm job ``job_id`` (it restarts without the drained node)."""
    return [scontrol, "requeue", str(job_id)]


def requeue_commands(job_id: str, node: str, job: dict[str, str], node_state: str,
                     reason: str, lost: bool, now: datetime | None = None,
                     scontrol: str = "scontrol") -> list[tuple[list[str], str | None]]:
    """The commands of a requeue of Slurm job ``job_id`` without ``node`` (module docstring),
    each with why it is skipped (None: run it), given the job as ``scontrol show job`` gives it
    (``job``: ``JobState``, ``ExcNodeList``, ``EligibleTime``), ``node_state`` (its ``State``),
    and whether trainguard found the node unreachable (``lost``). ``now``: local time, as
    Slurm prints times (default: now). Pure: doing a requeue again skips what is done."""
    now = now or datetime.now()
    st = job.get("JobState", "")
    out: list[tuple[list[str], str | None]] = []
    if lost:
        out.append(([scontrol, "update", f"nodename={node}", "state=down",
                     f"reason={slurm_reason(reason)}"],
                    f"{node} is DOWN already ({node_state})" if "DOWN" in node_state else None))
    out.append((slurm_requeue_command(job_id, scontrol),
                f"job {job_id} is {st} already" if st in REQUEUED_STATES else None))
    exc = [n for n in job.get("ExcNodeList", "(null)").split(",") if n and n != "(null)"]
    out.append(([scontrol, "update", f"jobid={job_id}",
                 f"excnodelist={','.join([*exc, node] if node not in exc else exc)}"],
                f"{node} is excluded already" if node in exc else None))
    try:
        eligible = datetime.fromisoformat(job.get("EligibleTime", ""))
    except ValueError:
        eligible = None  # Unknown: release it anyway
    out.append(([scontrol, "update", f"jobid={job_id}", "starttime=now"],
                f"eligible since {eligible:%H:%M:%S}" if st in REQUEUED_STATES and eligible
                and eligible <= now else None))
    return out


def slurm_squeue_command(job_id: str, squeue: str = "squeue") -> list[str]:
    """argv that prints Slurm job ``job_id``'s state alone (``RUNNING``, ``CANCELLED``…; ``-t
    all``: an ended job too, while slurmctld still holds it, ``MinJobAge``)."""
    return [squeue, "-h", "-t", "all", "-j", str(job_id), "-o", "%T"]


def parse_squeue_state(rc: int, out: str) -> str:
    """``squeue`` exit status and output (``slurm_squeue_command``) → the job state, or
    ``GONE`` when Slurm no longer knows the job (no line; ``Invalid job id specified``); raises
    OSError for any other failure (slurmctld out of reach: nothing is known)."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if rc == 0:
        return lines[0].split()[0] if lines else "GONE"
    if "Invalid job id" in out:
        return "GONE"
    raise OSError(f"squeue exited {rc}: {out[:300]}")


def slurm_reason(reason: str) -> str:
    """``reason`` as Slurm is given it: ``trainguard: `` and one line of at most
    ``SLURM_REASON_MAX`` characters."""
    return "trainguard: " + (" ".join(reason.split())[:SLURM_REASON_MAX].rstrip() or "trainguard")


def slurm_stop_commands(job_id: str, reason: str, scontrol: str = "scontrol",
                        scancel: str = "scancel") -> list[list[str]]:
    """argvs of a stop: record ``reason`` on the job (``AdminComment``, shown by ``scontrol
    show job``), then cancel it (``scancel <id>``: SIGTERM to its steps, SIGKILL ``KillWait``
    later)."""
    return [[scontrol, "update", f"jobid={job_id}", f"admincomment={slurm_reason(reason)}"],
            [scancel, str(job_id)]]


def stop_plan(state: str, in_force: int | None, generation: int | None,
              job_id: str = "") -> tuple[str, str]:
    """What a stop decision of ``generation`` does to Slurm job ``job_id`` in ``state``
    (``parse_squeue_state``), the job record's generation being ``in_force`` (None: unknown;
    a ``generation`` None: any): ``("cancel" | "skip", why)``. A later generation in force
    means a new run of the job (requeued, submitted again) that this stop was not about."""
    if generation is not None and in_force is not None and in_force > generation:
        return "skip", (f"superseded: generation {in_force} is in force, the stop was for "
                        f"generation {generation}: Slurm job {job_id} left as it is")
    if state == "GONE":
        return "skip", f"Slurm job {job_id} already ended (Slurm no longer knows it)"
    if state in ENDED_STATES:
        return "skip", f"Slurm job {job_id} already ended ({state})"
    if state == "COMPLETING":  # its processes are ending (a cancel just before, or its end)
        return "skip", f"Slurm job {job_id} already ending (COMPLETING)"
    return "cancel", f"Slurm job {job_id} is {state}"


def should_requeue(mode: str, record: Any, out: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether an exclusion requeues the job, by ``SlurmConfig.requeue`` ``mode``: ``always``,
    ``never``, or ``auto``: the job cannot go on in place — its record (a ``JobRecord``; None:
    unknown, no requeue) says it stopped or failed, the world it is left with is below its
    minimum, or every member's node is ``out`` (excluded: a decision that leaves no world keeps
    the record's members as they were)."""
    if mode != "auto":
        return mode == "always"
    if record is None:
        return False
    nodes = {m.get("node") for m in record.members or []}
    return record.status in ("stopped", "failed") or bool(nodes and nodes <= set(out)) or (
        0 < record.world_size < record.min_world_size)


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show … -o`` one-line output → its ``Key=Value`` pairs (a value runs to the
    next `` Key=``; ``Reason=`` may hold spaces and is kept whole)."""
    out: dict[str, str] = {}
    key = None
    for tok in text.strip().split(" "):
        k, sep, v = tok.partition("=")
        if sep and k and (k[0].isupper() or k in ("nodename",)) and k.replace("_", "").isalnum():
            key = k
            out[key] = v
        elif key is not None:
            out[key] += " " + tok
    return {k: v.strip() for k, v in out.items()}

"""The fault vocabulary: fault classes, layers and actions, and the one table of fault classes.

Every service speaks these words and nothing else:

* the detector reports evidence and a ``FaultClass`` (with a ``Layer`` hint where the evidence
  names one);
* the attributor chooses the root cause and its ``Layer`` (``VOCABULARY`` gives the default layer
  and the root-cause priority of each class);
* only the remediator chooses an ``Action``: its policy table (``remediator.policy_table.TABLE``)
  maps (fault class, layer) to an action, with one any-layer row per fault class
  (``tests/test_vocabulary.py`` checks it).

``Action`` is ordered: a later member is a stronger action (``stronger``), so "stronger" means one
thing everywhere. The values are the wire strings of the corpus vocabulary
(../shared/corpus/README.md); the enums are ``StrEnum``, so a member equals, hashes and formats
as its string and events keep carrying plain strings.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class FaultClass(StrEnum):
    """What kind of fault the evidence shows (the corpus vocabulary, plus ``checkpoint_save``:
    a checkpoint save failed while training went on, which the corpus has no class for)."""

    CRASH = "crash"
    HANG = "hang"
    OOM_GPU = "oom_gpu"
    OOM_HOST = "oom_host"
    GPU_XID = "gpu_xid"
    ECC = "ecc"
    NVLINK = "nvlink"
    NETWORK = "network"
    FILESYSTEM = "filesystem"
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"
    NODE_LOST = "node_lost"
    APP_EXCEPTION = "app_exception"
    NAN_LOSS = "nan_loss"
    STRAGGLER = "straggler"
    THERMAL = "thermal"
    RENDEZVOUS = "rendezvous"
    CHECKPOINT_SAVE = "checkpoint_save"


class Layer(StrEnum):
    """Where a fault lives (attribution)."""

    HARDWARE = "hardware"
    SYSTEM_SOFTWARE = "system_software"
    APPLICATION = "application"
    INFRASTRUCTURE = "infrastructure"
    UNKNOWN = "unknown"


class Action(StrEnum):
    """What the remediator decides, weakest first: the member order is the strength order (the
    nested recovery layers of docs/design.md: flag < in-process restart < worker restart < node
    service < a person fixes the configuration < stop).

    ``reset_gpu`` and ``fix_config`` are corpus words without an executor; a policy that names
    them has them carried out as ``exclude_node_and_requeue`` / ``stop_job_notify_user``
    (``remediator.policy_table.ACTION_ALIASES``)."""

    NONE = "none"
    RESTART_IN_PROCESS = "restart_in_process"
    RESTART_WORKERS = "restart_workers"
    RESET_GPU = "reset_gpu"
    EXCLUDE_NODE_AND_REQUEUE = "exclude_node_and_requeue"
    FIX_CONFIG = "fix_config"
    STOP_JOB_NOTIFY_USER = "stop_job_notify_user"


_STRENGTH: dict[str, int] = {a.value: i for i, a in enumerate(Action)}


def strength(action: str) -> int:
    """Position of ``action`` in ``Action`` (0 = ``none``); an unknown word counts as ``none``."""
    return _STRENGTH.get(str(action), 0)


def stronger(action: str, than: str) -> bool:
    """True when ``action`` is strictly stronger than ``than`` (the ``Action`` order)."""
    return strength(action) > strength(than)


@dataclass(frozen=True)
class FaultSpec:
    """One row of ``VOCABULARY``.

    * ``layer`` — the layer attributed when the evidence names none;
    * ``priority`` — how much the class explains as a root cause (higher wins: a GPU's XID
      explains the crash of the rank on it, the OOM killer explains the SIGKILL, a crash explains
      a hang of the same rank);
    * ``program`` — False for classes that name hardware or the cluster, not the program: the
      attributor's history rule never turns them into an application fault;
    * ``why`` — the reasoning behind the layer and the priority.
    """

    fault_class: FaultClass
    layer: Layer
    priority: int
    program: bool
    why: str


def _row(fc: FaultClass, layer: Layer, priority: int, program: bool, why: str) -> FaultSpec:
    return FaultSpec(fc, layer, priority, program, why)


F, L = FaultClass, Layer

#: One row per fault class: default layer, root-cause priority, whether the program can be at
#: fault. The policy row of each class is its any-layer row of ``remediator.policy_table.TABLE``.
ROWS: tuple[FaultSpec, ...] = (
    _row(F.ECC, L.HARDWARE, 92, False,
         "uncorrectable GPU memory error: explains whatever the process on that GPU did next"),
    _row(F.NVLINK, L.HARDWARE, 91, False, "NVLink fault of the GPU or its switch"),
    _row(F.GPU_XID, L.HARDWARE, 90, False,
         "the driver reported the GPU failing (NVIDIA XID catalog); application XIDs get their "
         "layer from the XID table"),
    _row(F.NODE_LOST, L.INFRASTRUCTURE, 88, False,
         "every heartbeat of the node stopped: explains the silence of its ranks"),
    _row(F.OOM_HOST, L.APPLICATION, 80, True,
         "the kernel OOM killer: explains the SIGKILL of the process it killed"),
    _row(F.OOM_GPU, L.APPLICATION, 80, True,
         "the caching allocator ran out of device memory: batch, model or activations too large"),
    _row(F.FILESYSTEM, L.INFRASTRUCTURE, 78, True,
         "a full or failing file system: explains the crash of the rank writing to it"),
    _row(F.CHECKPOINT_CORRUPT, L.INFRASTRUCTURE, 77, True,
         "a checkpoint that cannot be read back: explains the failed restore"),
    _row(F.NAN_LOSS, L.APPLICATION, 72, True, "numerics or data: a named cause of a bare crash"),
    _row(F.NETWORK, L.INFRASTRUCTURE, 70, False,
         "a link, NIC or socket failed: mostly a symptom of a peer's death, ranked below it"),
    _row(F.RENDEZVOUS, L.INFRASTRUCTURE, 65, True,
         "the ranks never all met: a node missing, a wrong endpoint or run id"),
    _row(F.APP_EXCEPTION, L.APPLICATION, 60, True,
         "an exception the program raised: explains the exit that follows it"),
    _row(F.CRASH, L.UNKNOWN, 50, True,
         "a process died by a signal or an exit code: the cause is unknown until a named one "
         "explains it; a crash explains a hang of the same rank"),
    _row(F.HANG, L.UNKNOWN, 45, True,
         "no progress: usually the effect of something else, ranked below a crash"),
    _row(F.THERMAL, L.HARDWARE, 40, False,
         "thermal throttling slows a GPU but breaks nothing: explains only slowness"),
    _row(F.CHECKPOINT_SAVE, L.INFRASTRUCTURE, 35, True,
         "a failed save leaves training going: explains nothing else"),
    _row(F.STRAGGLER, L.UNKNOWN, 30, False,
         "a slow rank: the weakest explanation, any named fault outranks it"),
)
#: ``ROWS`` by fault class.
VOCABULARY: dict[FaultClass, FaultSpec] = {r.fault_class: r for r in ROWS}

del F, L


def spec(fault_class: str) -> FaultSpec | None:
    """The ``VOCABULARY`` row of ``fault_class``; None for a word outside the vocabulary."""
    try:
        return VOCABULARY.get(FaultClass(fault_class))
    except ValueError:
        return None


def priority(fault_class: str) -> int:
    """Root-cause priority of ``fault_class`` (0 for an unknown class)."""
    s = spec(fault_class)
    return s.priority if s else 0


def default_layer(fault_class: str) -> Layer:
    """The layer of ``fault_class`` when the evidence names none (``unknown`` for an unknown
    class)."""
    s = spec(fault_class)
    return s.layer if s else Layer.UNKNOWN


_NORM = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?|/[\w./-]+|'[^']*'|\"[^\"]*\"")
_TAG = re.compile(r"^\[(?:root|fault|symptom) \S+ [^\]]*\] ")


def signature(ev: Any) -> str:
    """Failure signature of an anomaly or a verdict, for cross-job history and loop detection:
    ``<fault class>|<rule or pattern>|<text>``, where the text is ``signal=… exit=…`` for a
    crash, ``xid=…`` for a GPU fault, else the first evidence line with numbers, addresses,
    paths and quoted strings masked (so two runs of the same bug match).

    A verdict carries its root anomaly's signature in ``detail["signature"]``, which is returned
    as it is; a verdict without one is signed from its own fields (``detail["root_kind"]``, the
    first evidence line without the attributor's ``[root …]`` tag)."""
    detail = ev.detail or {}
    given = detail.get("signature")
    if isinstance(given, str) and given:
        return given
    own_kind = getattr(ev, "kind", None)  # an anomaly has one; a verdict names its root's
    kind = own_kind or detail.get("root_kind") or ""
    rule = detail.get("pattern") or detail.get("rule") or kind
    if kind == "crash":
        text = f"signal={detail.get('signal')} exit={detail.get('exit_code')}"
    elif kind == "gpu_fault":
        text = f"xid={detail.get('xid')}"
    else:
        first = ev.evidence[0] if ev.evidence else ""
        first = first if own_kind else _TAG.sub("", first)
        text = re.sub(r"\s+", " ", _NORM.sub("#", first)[:160]).strip()
    return f"{ev.fault_class}|{rule}|{text}"


#: The plain strings of each enum, in order (for the schemas' docs and the tables).
FAULT_CLASSES: tuple[str, ...] = tuple(f.value for f in FaultClass)
LAYERS: tuple[str, ...] = tuple(x.value for x in Layer)
ACTIONS: tuple[str, ...] = tuple(a.value for a in Action)

__all__ = ["FaultClass", "Layer", "Action", "FaultSpec", "ROWS", "VOCABULARY", "spec", "priority",
           "default_layer", "strength", "stronger", "signature", "FAULT_CLASSES", "LAYERS",
           "ACTIONS", "first_error_line"]


def first_error_line(evidence: str, limit: int = 300) -> str:
    """The line of an evidence entry that says what went wrong: the last non-empty line of a
    traceback (``ValueError: …``), without the attributor's ``[tag kind who]`` label."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", evidence.strip())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else text)[:limit]

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

from trainguard.detector.pattern_types import LogPattern, PatternMatch
from trainguard.detector.patterns_machine import MACHINE_ROWS
from trainguard.detector.patterns_software import SOFTWARE_ROWS

__all__ = ["LogPattern", "PatternMatch", "PATTERNS", "IGNORE", "OWN_REPORTS", "match_line",
           "line_rank", "line_local_rank", "line_device", "step_time_of", "rate_of", "step_of"]


# The table is grouped by fault *kind*; within a kind the rows cover the formats the kind is
# printed in by the components that see it (kernel, scheduler, container runtime, framework,
# communication library). ``why`` names the source of each format: the file that prints it or
# the documentation page that describes it. Order matters (first match wins): specific rows
# come before the generic ones at the end.
PATTERNS: tuple[LogPattern, ...] = MACHINE_ROWS + SOFTWARE_ROWS

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
    re.compile(r"^trainguard launch \[[^\]]*\]: rank (?P<rank>\d+) \(pid"),  # its own launcher
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

"""The types of the log-pattern table (``trainguard.detector.patterns``): a row, a match, the
row constructor and the regex pieces rows share."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from trainguard.schemas.vocabulary import FaultClass, Layer

__all__ = ["LogPattern", "PatternMatch", "row"]


@dataclass(frozen=True)
class LogPattern:
    """One row of the table (the fields are described in ``trainguard.detector.patterns``)."""

    name: str
    regex: re.Pattern
    fault_class: FaultClass
    layer: Layer
    symptom: bool = False
    weight: float = 0.7
    why: str = ""
    #: where the row was learned: the URLs of the real incidents (public issue threads of
    #: ``bench/corpus/real_logs.jsonl``'s dev split) whose logs it was written for; empty for the
    #: rows written from the components' message formats alone (their ``why`` names the file)
    source: tuple[str, ...] = ()


@dataclass
class PatternMatch:
    """A matched line: the table row and the named groups it captured (non-empty only)."""

    pattern: LogPattern
    groups: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.pattern.name


def row(name: str, regex: str, fault_class: str, layer: str, symptom: bool = False,
       weight: float = 0.7, why: str = "", flags: int = re.IGNORECASE,
       source: tuple[str, ...] = ()) -> LogPattern:
    return LogPattern(name, re.compile(regex, flags), FaultClass(fault_class), Layer(layer),
                      symptom, weight, why, tuple(source))


_PCI = r"(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
#: a loss scale that has reached the floor of dynamic loss scaling: 0, 1, a fraction or 1e-N
_TINY = r"(?:0(?:\.\d+)?|1(?:\.0+)?|\d(?:\.\d+)?e-\d+)(?![\d.])"
#: an NCCL line at INFO level: the setup rows below ignore it (NCCL and aws-ofi-nccl print their
#: probing at INFO; old NCCL printed IB completion errors at INFO, so that row reads INFO too)
_NOT_INFO = r"^(?!.*\bNCCL INFO\b)"

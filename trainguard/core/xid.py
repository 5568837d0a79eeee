"""GPU XID errors: parse the driver's kernel-log lines and look XIDs up in the project's table.

``parse_xid_line(line) -> XidMatch | None`` accepts every form the NVIDIA driver (``NVRM``)
prints, with whatever prefix the log reader adds:

* ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.``
* without the ``PCI:`` prefix (``NVRM: Xid (0000:3b:00): 13, …``) and with a function number
  (``0000:3b:00.0``); without the domain (``(PCI:3b:00)``);
* ``pid='<unknown>', name=<unknown>`` (GSP-era drivers), no pid at all (older drivers),
  ``pid=…`` with no ``name=``;
* NVLink (74 and 144–150) with the link number and register words
  (``NVLink: fatal error detected on link 6(0x10000, 0x0, …)``), ECC / row-remapping /
  page-retirement variants (48, 63, 64, 92, 94, 95: ``Row Remapper: New row (0x…) marked for
  remapping``, ``Dynamic Page Retirement: New page retired …``, ``Contained: SM (0x1). RST: No``);
* prefixes: ``dmesg`` (``[12345.678901]``), ``dmesg -T`` (``[Wed Jan 27 23:04:35 2021]``),
  syslog/journal (``Aug 26 15:28:16 node-001 kernel: [87474.832707]``), ISO journal
  (``2024-01-02T03:04:05.123456+00:00 node-001 kernel:``) and raw ``/dev/kmsg`` records
  (``4,1234,5678901234,-;NVRM: …``).

``xid_info(xid) -> XidInfo`` returns mnemonic, description, fault class, layer and severity
from ``schemas/xid_table.csv``, which is derived from NVIDIA's public XID catalog
(docs.nvidia.com/deploy/xid-errors) by ``attributor/xid_table_build.py`` (the mapping rules
are there). An XID that is not in the catalog gets an ``unknown``-layer entry, never an error.
"""
from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import schemas as _schemas

#: The XID table, beside the fault vocabulary it maps XIDs onto (``trainguard.schemas``).
TABLE_PATH = Path(_schemas.__file__).resolve().parent / "xid_table.csv"

# A PCI address as the driver prints it: [domain:]bus:device[.function], hex.
_PCI = r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"
_XID_RE = re.compile(
    r"NVRM:\s*Xid\s*\(\s*(?:PCI:)?(?P<pci>" + _PCI + r")\s*\)\s*:\s*(?P<xid>\d+)\s*(?:,\s*(?P<rest>.*))?$"
)
_PID_RE = re.compile(r"^pid\s*=\s*'?(?P<pid><unknown>|\d+)'?\s*(?:,\s*|$)")
_NAME_RE = re.compile(r"^name\s*=\s*(?P<name>[^,]*?)\s*(?:,\s*|$)")
_LINK_RE = re.compile(r"\blink\s+(?P<link>\d+)\s*(?:\((?P<regs>[^)]*)\))?", re.IGNORECASE)
_ADDR_RE = re.compile(r"\((?P<addr>0x[0-9A-Fa-f]+)\)")
# The GPU announcement that maps a PCI address to a UUID: "NVRM: GPU at PCI:0000:17:00: GPU-…"
_GPU_AT_RE = re.compile(r"NVRM:\s*GPU at (?:PCI:)?(?P<pci>" + _PCI + r")\s*:\s*(?P<uuid>GPU-[0-9A-Za-z-]+)")


@dataclass
class XidMatch:
    """One parsed XID line.

    ``xid`` — XID number; ``pci`` — the PCI address as printed (``"0000:3b:00"``, lower case);
    ``pid`` — the process the driver blamed (None when absent or ``<unknown>``);
    ``process_name`` — its name (``""`` when absent); ``message`` — the driver's text after the
    pid/name fields; ``raw`` — the whole input line, stripped. ``details`` holds what the
    message adds for some XIDs: ``link`` (int) and ``registers`` (list of str) for NVLink,
    ``address`` (hex str) for row remapping / page retirement, ``contained`` (bool) for 94/95.
    """

    xid: int
    pci: str
    pid: int | None
    process_name: str
    message: str
    raw: str
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class XidInfo:
    """What the project knows about one XID (a row of ``schemas/xid_table.csv``).

    ``layer`` — hardware | system_software | application | unknown (``schemas.vocabulary``);
    ``severity`` — fatal | error | info | unknown; ``source`` — where the row comes from. No
    action: what to do about an XID is the remediator's policy."""

    xid: int
    mnemonic: str
    description: str
    fault_class: str
    layer: str
    severity: str
    source: str


def parse_xid_line(line: str) -> XidMatch | None:
    """Parse one kernel-log line; None when it is not an XID report. Never raises."""
    if not line or "Xid" not in line:
        return None
    raw = line.strip()
    m = _XID_RE.search(raw)
    if not m:
        return None
    rest = (m.group("rest") or "").strip()
    pid: int | None = None
    name = ""
    # pid= and name= come first, in that order on current drivers; accept either order.
    for _ in range(2):
        pm = _PID_RE.match(rest)
        if pm:
            pid = int(pm.group("pid")) if pm.group("pid").isdigit() else None
            rest = rest[pm.end():]
            continue
        nm = _NAME_RE.match(rest)
        if nm:
            name = nm.group("name").strip()
            if name == "<unknown>":
                name = ""
            rest = rest[nm.end():]
    xid = int(m.group("xid"))
    message = rest.strip()
    return XidMatch(xid=xid, pci=m.group("pci").lower(), pid=pid, process_name=name,
                    message=message, raw=raw, details=_details(xid, message))


def _details(xid: int, message: str) -> dict:
    d: dict = {}
    info = xid_info(xid)
    if info.fault_class == "nvlink" or "nvlink" in message.lower():
        lm = _LINK_RE.search(message)
        if lm:
            d["link"] = int(lm.group("link"))
            if lm.group("regs"):
                d["registers"] = [w.strip() for w in lm.group("regs").split(",") if w.strip()]
    if info.fault_class == "ecc":
        am = _ADDR_RE.search(message)
        if am:
            d["address"] = am.group("addr")
        low = message.lower()
        if low.startswith("contained"):
            d["contained"] = True
        elif low.startswith("uncontained"):
            d["contained"] = False
    return d


def parse_gpu_uuid_line(line: str) -> tuple[str, str] | None:
    """``(pci, uuid)`` from the driver's ``NVRM: GPU at PCI:0000:17:00: GPU-…`` line, else None."""
    m = _GPU_AT_RE.search(line or "")
    return (m.group("pci").lower(), m.group("uuid")) if m else None


@functools.lru_cache(maxsize=1)
def xid_table(path: str | None = None) -> dict[int, XidInfo]:
    """The XID table, keyed by XID. Raises FileNotFoundError naming the file to restore
    (``python -m trainguard.attributor.xid_table_build`` regenerates it)."""
    p = Path(path) if path else TABLE_PATH
    if not p.exists():
        raise FileNotFoundError(f"XID table {p} is missing: regenerate it with "
                                f"`python -m trainguard.attributor.xid_table_build xid_catalog.csv > {p}`")
    with open(p, newline="") as fh:
        lines = [ln for ln in fh if not ln.startswith("#")]
    out: dict[int, XidInfo] = {}
    for r in csv.DictReader(lines):
        x = int(r["xid"])
        out[x] = XidInfo(xid=x, mnemonic=r["mnemonic"], description=r["description"],
                         fault_class=r["fault_class"], layer=r["layer"],
                         severity=r["severity"], source=r["source"])
    return out


def xid_info(xid: int) -> XidInfo:
    """Table entry of ``xid``; an XID not in NVIDIA's catalog gets layer/severity ``unknown`` and
    fault class ``gpu_xid``, so a new driver's XID is still reported, not dropped."""
    info = xid_table().get(int(xid))
    if info is not None:
        return info
    return XidInfo(xid=int(xid), mnemonic="UNKNOWN_XID", description="not in the XID catalog",
                   fault_class="gpu_xid", layer="unknown",
                   severity="unknown", source="not in NVIDIA XID catalog")


__all__ = ["XidMatch", "XidInfo", "parse_xid_line", "parse_gpu_uuid_line", "xid_info",
           "xid_table", "TABLE_PATH"]

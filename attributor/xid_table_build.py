"""Derive ``schemas/xid_table.csv`` from NVIDIA's public XID catalog.

Source: NVIDIA "XID Errors" catalog (docs.nvidia.com/deploy/xid-errors), as exported to
``xid_catalog.csv`` (columns: xid, mnemonic, description, a100, h100, b100, gb200,
immediate_action, investigatory_action, xid154_linkage, nvsentinel_recommended_action).

Run ``python -m trainguard.attributor.xid_table_build CATALOG.csv > schemas/xid_table.csv`` to
regenerate. The table keeps fault class and layer, not actions: what to do about a fault is the
remediator's policy (``remediator.policy_table.TABLE``). NVIDIA's immediate action tells the layer and
the severity; the mapping is the data below:

* ``IMMEDIATE`` maps NVIDIA's immediate action to a default layer and a severity;
* ``INVESTIGATORY_LAYER`` refines the layer from NVIDIA's investigatory action (an XID whose
  investigation is "check the application / CUDA code" is an application fault);
* ``CLASS_BY_XID`` names the XIDs whose fault class is ``ecc`` or ``nvlink`` instead of the
  generic ``gpu_xid``;
* ``OVERRIDES`` are the few rows where NVIDIA's text says more than its action column (each has
  its reason next to it).

Output columns: xid, mnemonic, description, fault_class, layer, severity
(``fatal`` = the job cannot continue on that GPU, ``error`` = the process that hit it fails,
``info`` = informational), nvidia_action, source.
"""
from __future__ import annotations

import csv
import sys

SOURCE = "NVIDIA XID catalog (docs.nvidia.com/deploy/xid-errors), trainguard mapping"

#: NVIDIA immediate action -> (layer, severity)
IMMEDIATE: dict[str, tuple[str, str]] = {
    "RESTART_APP": ("hardware", "error"),
    "IGNORE": ("hardware", "info"),
    "RESET_GPU": ("hardware", "fatal"),
    "RESTART_BM": ("hardware", "fatal"),
    "RESTART_VM": ("hardware", "fatal"),
    "CHECK_MECHANICALS": ("hardware", "fatal"),
    "UPDATE_SWFW": ("system_software", "fatal"),
    "CHECK_UVM": ("system_software", "fatal"),
    "CONTACT_SUPPORT": ("hardware", "fatal"),
    "WORKFLOW_NVLINK_ERR": ("hardware", "fatal"),
    "WORKFLOW_NVLINK5_ERR": ("hardware", "fatal"),
    "WORKFLOW_XID_48": ("hardware", "fatal"),
    "WORKFLOW_XID_45": ("hardware", "info"),
    "XID_154": ("hardware", "info"),
    # rows with no catalog action: NVSentinel's parser default is CONTACT_SUPPORT
    "": ("hardware", "fatal"),
}

#: NVIDIA investigatory action -> layer (refines the immediate action's layer)
INVESTIGATORY_LAYER: dict[str, str] = {
    "CHECK_APP/CUDA": "application",
    "WORKFLOW_XID_13": "application",
    "WORKFLOW_XID_31": "application",
    "INVESTIGATE_SW": "system_software",
    "INVESTIGATE_SW_USER": "system_software",
    "UPDATE_SWFW": "system_software",
}

CLASS_BY_XID: dict[int, str] = {
    **{x: "ecc" for x in (48, 63, 64, 92, 94, 95, 140, 156, 157, 171, 172)},
    **{x: "nvlink" for x in (74, 136, 137, 144, 145, 146, 147, 148, 149, 150, 155)},
}

#: xid -> {column: value}; reason in the comment.
OVERRIDES: dict[int, dict[str, str]] = {
    # "GPU stopped processing" after the user's channel was reset: the application's own fault
    # (an illegal access or a kill); NVIDIA lists 13/31/43 together as application XIDs.
    43: {"layer": "application", "severity": "error"},
    # Row remapping / page retirement *event*: the bad row is contained; reset to activate.
    63: {"severity": "info"},
    # Contained memory error: only the process that touched it fails.
    94: {"severity": "error"},
    # Fell off the bus: the GPU is gone until the node is rebooted (RESTART_BM).
    79: {"severity": "fatal"},
}


def derive(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Table rows (dicts of the output columns) from catalog rows, sorted by XID."""
    out = []
    for r in rows:
        xid = int(r["xid"])
        imm = r.get("immediate_action", "").strip()
        layer, severity = IMMEDIATE.get(imm, IMMEDIATE[""])
        layer = INVESTIGATORY_LAYER.get(r.get("investigatory_action", "").strip(), layer)
        row = {
            "xid": str(xid), "mnemonic": r["mnemonic"].strip(),
            "description": r["description"].strip(),
            "fault_class": CLASS_BY_XID.get(xid, "gpu_xid"), "layer": layer, "severity": severity, "nvidia_action": imm or "(none)", "source": SOURCE,
        }
        row.update(OVERRIDES.get(xid, {}))
        out.append(row)
    return sorted(out, key=lambda r: int(r["xid"]))


COLUMNS = ["xid", "mnemonic", "description", "fault_class", "layer", "severity",
           "nvidia_action", "source"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m trainguard.attributor.xid_table_build XID_CATALOG.csv > xid_table.csv",
              file=sys.stderr)
        return 2
    with open(argv[0], newline="") as fh:
        rows = list(csv.DictReader(fh))
    print(f"# Derived from {argv[0].rsplit('/', 1)[-1]}: {SOURCE}. "
          f"Regenerate with python -m trainguard.attributor.xid_table_build.")
    w = csv.DictWriter(sys.stdout, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(derive(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

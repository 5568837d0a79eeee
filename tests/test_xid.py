"""XID line parsing in every driver format, and the XID table lookup."""
from __future__ import annotations

import pytest

from trainguard.core.xid import parse_gpu_uuid_line, parse_xid_line, xid_info, xid_table

CASES = [
    # (line, xid, pci, pid, name, message starts with)
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=2210, name=python3, GPU has fallen off the bus.",
     79, "0000:3b:00", 2210, "python3", "GPU has fallen off the bus."),
    ("NVRM: Xid (0000:86:00): 13, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address",
     13, "0000:86:00", None, "", "Graphics SM Warp Exception"),
    ("[ 5123.441902] NVRM: Xid (PCI:0000:c1:00.0): 48, pid=77, name=train.py, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 3, subpartition 1.",
     48, "0000:c1:00.0", 77, "train.py", "An uncorrectable double bit error"),
    ("[Tue Mar  4 10:02:11 2025] NVRM: Xid (PCI:0000:07:00): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 11(0x10000, 0x0, 0x0, 0x0, 0x0, 0x0, 0x0)",
     74, "0000:07:00", None, "", "NVLink: fatal error detected on link 11"),
    ("Mar  4 10:02:11 node-017 kernel: [  904.100233] NVRM: Xid (PCI:0000:41:00): 63, pid=1900, name=python, Row Remapper: New row (0x00000000000044a1) marked for remapping, reset gpu to activate.",
     63, "0000:41:00", 1900, "python", "Row Remapper: New row"),
    ("2025-03-04T10:02:11.123456+00:00 node-017 kernel: NVRM: Xid (PCI:0000:41:00): 64, pid=1900, name=python, Row Remapper: Failed to remap row (0x0000000000001b20)",
     64, "0000:41:00", 1900, "python", "Row Remapper: Failed"),
    ("4,2231,90412345678,-;NVRM: Xid (PCI:0000:9d:00): 94, pid=3301, name=pt_main_thread, Contained: SM (0x1). RST: No, D-RST: No",
     94, "0000:9d:00", 3301, "pt_main_thread", "Contained: SM"),
    ("NVRM: Xid (PCI:0000:9d:00): 95, pid=3301, name=pt_main_thread, Uncontained: FBHUB. RST: Yes, D-RST: No",
     95, "0000:9d:00", 3301, "pt_main_thread", "Uncontained: FBHUB"),
    ("NVRM: Xid (PCI:0000:02:00): 63, Dynamic Page Retirement: New page retired, reboot to activate (0x00000000001a2b3c).",
     63, "0000:02:00", None, "", "Dynamic Page Retirement"),
    ("NVRM: Xid (PCI:3b:00): 31, pid=812, Ch 0000001c, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f11_20000000. Fault is of type FAULT_PDE ACCESS_TYPE_READ",
     31, "3b:00", 812, "", "Ch 0000001c"),
    ("NVRM: Xid (PCI:0000:b7:00): 119, pid=5511, name=python, Timeout after 6s of waiting for RPC response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801348 0x4).",
     119, "0000:b7:00", 5511, "python", "Timeout after 6s"),
    ("NVRM: Xid (PCI:0000:b7:00): 145, pid=1, name=init, NVLink: RLW error on link 3 (0x0, 0x0)",
     145, "0000:b7:00", 1, "init", "NVLink: RLW error"),
]


@pytest.mark.parametrize("line,xid,pci,pid,name,msg", CASES)
def test_parse_every_format(line, xid, pci, pid, name, msg):
    m = parse_xid_line(line)
    assert m is not None, line
    assert (m.xid, m.pci, m.pid, m.process_name) == (xid, pci, pid, name)
    assert m.message.startswith(msg)
    assert m.raw == line.strip()


def test_nvlink_link_and_register_words():
    m = parse_xid_line(CASES[3][0])
    assert m.details["link"] == 11
    assert m.details["registers"][0] == "0x10000" and len(m.details["registers"]) == 7


def test_row_remap_address_and_containment():
    assert parse_xid_line(CASES[4][0]).details["address"] == "0x00000000000044a1"
    assert parse_xid_line(CASES[6][0]).details["contained"] is True
    assert parse_xid_line(CASES[7][0]).details["contained"] is False


@pytest.mark.parametrize("line", [
    "", "hello", "NVRM: GPU at PCI:0000:17:00: GPU-1a2b3c4d-0000-1111-2222-333344445555",
    "nvidia-nvswitch0: SXid (PCI:0000:86:00.0): 12028, Non-fatal, Link 44",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    "Xid mentioned in prose without a number",
])
def test_non_xid_lines(line):
    assert parse_xid_line(line) is None


def test_gpu_uuid_line():
    assert parse_gpu_uuid_line("[ 12.5] NVRM: GPU at PCI:0000:17:00: GPU-1a2b3c4d-0000-1111") == \
        ("0000:17:00", "GPU-1a2b3c4d-0000-1111")


def test_xid_info_from_table():
    i79 = xid_info(79)
    assert (i79.layer, i79.fault_class, i79.severity) == ("hardware", "gpu_xid", "fatal")
    assert "catalog" in i79.source
    assert xid_info(48).fault_class == "ecc" and xid_info(74).fault_class == "nvlink"
    assert xid_info(13).layer == "application" and xid_info(31).layer == "application"
    assert xid_info(43).layer == "application"
    assert xid_info(63).severity == "info"  # a row-remap event: informational, not a fault
    assert not hasattr(i79, "action")  # what to do is the remediator's policy, not the table
    assert xid_info(119).layer == "system_software"


def test_unknown_xid_is_reported_not_dropped():
    i = xid_info(9999)
    assert i.layer == "unknown" and i.fault_class == "gpu_xid" and i.severity == "unknown"


def test_table_covers_catalog():
    from pathlib import Path
    import csv

    catalog = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "xid_catalog.csv"
    if not catalog.exists():
        pytest.skip("catalog not present in this checkout")
    with open(catalog) as fh:
        xids = {int(r["xid"]) for r in csv.DictReader(fh)}
    assert xids == set(xid_table())

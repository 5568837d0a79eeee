"""Fault kinds as real stacks print them: ``tests/fixtures/log_kinds.jsonl``.

Each case is a multi-line log of one fault kind (host OOM from the kernel, a memory cgroup, Slurm,
the kubelet or a framework's memory monitor; GPU OOM; fp16 loss-scale collapse; eviction,
preemption and node failure; zero-byte or truncated checkpoint shards; c10d store timeouts;
EFA/libfabric and IB errors; CUDA errors on many ranks; driver and kernel lines), written from
the message formats of the components that print them — each case names its sources — and
mixed with the noise around them (NCCL INFO lines, progress bars, warnings). The ``benign``
cases are such noise alone: they must give no verdict. None of the cases comes from the corpus
(../shared/corpus), which only bench/attribution.py reads.

The cases run through ``trainguard diagnose --json`` (the CLI's ``main``) and through
``diagnose_lines``; both must give the case's fault class and layer.
"""
from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from trainguard.tools import diagnose
from trainguard.detector import patterns as pat

FIXTURE = Path(__file__).parent / "fixtures" / "log_kinds.jsonl"
CASES = [json.loads(ln) for ln in FIXTURE.read_text().splitlines() if ln.strip()]
FAULTS = [c for c in CASES if c["fault_class"] is not None]
BENIGN = [c for c in CASES if c["fault_class"] is None]


def _ids(cases):
    return [c["id"] for c in cases]


def test_fixture_is_well_formed():
    assert len({c["id"] for c in CASES}) == len(CASES)
    for c in CASES:
        assert c["sources"] and all(isinstance(s, str) and s for s in c["sources"]), c["id"]
        assert len(c["log"].splitlines()) >= 1, c["id"]
    kinds = collections.Counter(c["kind"] for c in FAULTS)
    # every kind the issue names has cases
    for kind in ("host_oom_kernel", "host_oom_cgroup", "host_oom_slurm", "host_oom_container",
                 "host_oom_framework", "loss_scale_collapse", "preemption", "eviction",
                 "checkpoint_truncated", "c10d_store_timeout", "efa_libfabric", "nccl_ib",
                 "cuda_many_ranks", "driver"):
        assert kinds[kind] >= 1, kind
    assert len(BENIGN) >= 3


@pytest.mark.parametrize("case", FAULTS, ids=_ids(FAULTS))
def test_kind_gets_its_fault_class_and_layer(case):
    v = diagnose.diagnose_lines(case["log"].splitlines(), case["id"])
    assert v is not None, f"{case['id']}: no verdict"
    assert (v.fault_class, v.layer) == (case["fault_class"], case["layer"]), case["id"]


@pytest.mark.parametrize("case", BENIGN, ids=_ids(BENIGN))
def test_benign_log_gives_no_verdict(case):
    assert diagnose.diagnose_lines(case["log"].splitlines(), case["id"]) is None
    for line in case["log"].splitlines():
        assert pat.match_line(line) is None, line


def test_cli_json_over_every_case(tmp_path, capsys):
    """The same through ``trainguard diagnose --json FILE``: exit 0 with the class and layer,
    exit 1 and ``fault_class: null`` for a benign log."""
    got, want = {}, {}
    for c in CASES:
        path = tmp_path / f"{c['id']}.log"
        path.write_text(c["log"] + "\n")
        rc = diagnose.main([str(path), "--json"])
        out = json.loads(capsys.readouterr().out)
        got[c["id"]] = (rc, out["fault_class"], out["layer"])
        want[c["id"]] = ((0, c["fault_class"], c["layer"]) if c["fault_class"] is not None
                         else (1, None, "unknown"))
    assert {k: v for k, v in got.items() if v != want[k]} == {}


def test_per_kind_accuracy_is_complete():
    """Per kind: every case right (the figure the issue asks for, ≥ 90 % class and ≥ 80 %
    layer, is met with margin only when no kind is below 100 % here)."""
    per: dict[str, list[bool]] = collections.defaultdict(list)
    for c in FAULTS:
        v = diagnose.diagnose_lines(c["log"].splitlines(), c["id"])
        per[c["kind"]].append(v is not None and (v.fault_class, v.layer)
                              == (c["fault_class"], c["layer"]))
    assert {k: f"{sum(v)}/{len(v)}" for k, v in per.items() if not all(v)} == {}


# ---- single lines that must not be read as faults (routine lines next to fault formats) -------
ROUTINE = [
    "node-001:4021:4109 [0] NCCL INFO NET/IB : mlx5_0:1 Got non-fatal async event: port active(9)",
    "node-001:4021:4109 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)",
    "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 16384, reducing to 8192",
    "[deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: 131072, "
    "reducing to 65536",
    "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 16384.0",
    " iteration 10/ 100 | lm loss: 7.1E+00 | loss scale: 65536.0 | grad norm: 1.234 | number of "
    "skipped iterations:   0 | number of nan iterations:   0 |",
    " iteration 20/ 100 | lm loss: 7.0E+00 | loss scale: 1.0 | grad norm: 0.91 | number of "
    "skipped iterations:   0 | number of nan iterations:   0 |",
    "[W socket.cpp:663] [c10d] The client socket has failed to connect to [node-001]:29500 "
    "(errno: 111 - Connection refused).",
    "[rank3]:[W310 15:54:45.5 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=86): "
    "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown "
    "or crash?",
    "[Sat Jun  8 07:00:00 2024] EDAC MC0: 1 CE memory read error on CPU_SrcID#0_MC#0_Chan#1",
    "  Normal   Killing    3m   kubelet  Stopping container pytorch",
    "Loading checkpoint shards: 100%|██████████| 4/4 [00:05<00:00,  1.31s/it]",
    "{'loss': 0.4121, 'grad_norm': 0.77, 'learning_rate': 2e-05, 'epoch': 1.0}",
    # huggingface_hub's retry of a request (huggingface_hub/utils/_http.py http_backoff: "'%s'
    # thrown while requesting %s %s", then 'Retrying in %ss [Retry %d/%d].'): a retry, not the
    # failed download (the download_unreachable row reads only the final error)
    "WARNING:huggingface_hub.utils._http:'(MaxRetryError(\"HTTPSConnectionPool(host='huggingface"
    ".co', port=443): Max retries exceeded with url: /org/model/resolve/main/config.json (Caused "
    "by NewConnectionError('<urllib3.connection.HTTPSConnection object at 0x7f01>: Failed to "
    "establish a new connection: [Errno 101] Network is unreachable'))\"), '(Request ID: 5f72)')' "
    "thrown while requesting HEAD https://huggingface.co/org/model/resolve/main/config.json",
    "'(ReadTimeoutError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. "
    "(read timeout=10)\"), '(Request ID: 9a1c)')' thrown while requesting HEAD "
    "https://huggingface.co/org/model/resolve/main/tokenizer_config.json",
    "Retrying in 1s [Retry 1/5].",
]


@pytest.mark.parametrize("line", ROUTINE)
def test_routine_line_is_no_fault(line):
    assert pat.match_line(line) is None


def test_every_row_names_a_source_or_reason():
    for p in pat.PATTERNS:
        assert len(p.why) > 20, p.name
    assert len({p.name for p in pat.PATTERNS}) == len(pat.PATTERNS)


def test_pg_rank_prefix_of_newer_torch():
    assert pat.line_rank("[PG ID 0 PG GUID 0(default_pg) Rank 45] Process group watchdog") == 45


def test_literal_gates_never_change_a_match():
    """The per-row literal gates only skip rows that cannot match: every line of the fixture
    (and the routine lines) gets the same row gated and ungated, and the gates are words the
    rows' regexes require."""
    lines = [ln for c in CASES for ln in c["log"].splitlines()] + ROUTINE
    for line in lines:
        a, b = pat.match_line(line), pat.match_line(line, gated=False)
        assert (a and a.name) == (b and b.name), line
    gated = [p.name for p, g in pat._GATES if g is not None]
    assert len(gated) >= len(pat.PATTERNS) - 2  # nearly every row has a gate
    for p, gate in pat._GATES:
        for w in gate or ():
            assert w == w.lower() and len(w) >= 3, (p.name, w)

"""``python -m trainguard.agents.canary [--json] [--procs N] [--size N] [--timeout S] [--nvml-module
SPEC]``: the health canary a node must pass before trainguard returns it to service
(``NodeController.readmit``; on Slurm run on the node by ``srun``, see
``trainguard.scheduler.slurm.controller``).

Checks (``CHECKS``), each passed, failed or skipped with a one-line detail:

* ``allreduce`` — ``--procs`` (2) processes on this node join one gloo group (a ``TCPStore`` this
  process holds on 127.0.0.1) and all-reduce a tensor of ``--size``² float32 values; each must
  get the exact sum ``Σ (rank + 1)``. Catches a broken torch/gloo install, a host that cannot
  run processes or loopback TCP, a hang (``--timeout`` seconds, default 60).
* ``compute`` — a seeded ``--size``×``--size`` (256) float32 matmul on every device (each CUDA GPU
  when there is one, TF32 off; else the CPU) against a float64 reference computed on the CPU:
  the largest error relative to the largest reference value must be ≤ ``COMPUTE_RTOL`` (1e-4:
  float32 accumulation over 256 terms errs by ~1e-6; a wrong result is off by orders more).
* ``nvml`` — one NVML reading of every GPU (``trainguard.agents.nvml.NvmlSampler``, the
  agent's; ``--nvml-module`` names a module with pynvml's API instead, as the agent's does)
  checked against ``NVML_RULES``; skipped (passed) on a host without NVML.

Fault injection for tests and drills: env ``TG_CANARY_FAIL=<check>[,<check>][@node,node]``
makes those checks fail (compute: a corrupted product; allreduce: a wrong contribution of rank
1; nvml: a reported failure) on the nodes named (``TG_NODE``, else ``SLURMD_NODENAME``, else
the host name), on every node without ``@``.

Output: first ``canary started on <host> (pid N)`` (``CANARY_STARTED``), then one line per
check; with ``--json`` a last line ``{"ok", "node", "checks":
[{"name", "ok", "skipped", "detail"}], "summary", "seconds"}``. Exit status 0 when every check
passed, 1 when one failed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from trainguard.scheduler.base import CANARY_STARTED

__all__ = ["CANARY_STARTED", "CHECKS", "NVML_RULES", "COMPUTE_RTOL", "nvml_problems", "injected", "main"]

#: largest |result - reference| / max |reference| a float32 matmul of 256 terms may show
COMPUTE_RTOL = 1e-4

#: NVML readings that keep a node out: (field of ``schemas.GpuSample``, failed when, reason).
#: Source: NVML API reference (ECC, page retirement, row remapping) and NVIDIA's GPU memory
#: error management guide: a pending retirement/remap or a remap failure needs a GPU reset or
#: an RMA before the GPU is trusted again.
NVML_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("ecc_volatile_uncorrected", lambda v: v is not None and v > 0,
     "uncorrectable ECC errors since the last driver load"),
    ("remapped_rows_failure", lambda v: bool(v), "a row remap failed: RMA"),
    ("remapped_rows_pending", lambda v: bool(v), "a row remap waits for a GPU reset"),
    ("retired_pages_pending", lambda v: bool(v), "a page retirement waits for a GPU reset"),
    ("clock_event_names", lambda v: bool(set(v or ()) & {"hw_slowdown", "hw_thermal",
                                                         "hw_power_brake"}),
     "hardware clock slowdown at idle (thermal or power brake)"),
]


def nvml_problems(samples: list[Any]) -> list[str]:
    """The ``NVML_RULES`` that ``samples`` (``GpuSample``) break, one line each."""
    out = []
    for g in samples:
        for fld, failed, why in NVML_RULES:
            v = getattr(g, fld, None)
            if failed(v):
                out.append(f"GPU {g.index} {fld}={v}: {why}")
    return out


def this_node() -> str:
    return os.environ.get("TG_NODE") or os.environ.get("SLURMD_NODENAME") or \
        socket.gethostname().split(".")[0]


def injected(check: str, node: str, spec: str | None = None) -> bool:
    """Whether ``TG_CANARY_FAIL`` (or ``spec``) makes ``check`` fail on ``node``."""
    spec = os.environ.get("TG_CANARY_FAIL", "") if spec is None else spec
    checks, _, nodes = spec.partition("@")
    if check not in {c.strip() for c in checks.split(",")}:
        return False
    return not nodes or node in {n.strip() for n in nodes.split(",")}


def _worker(rank: int, world: int, port: int, size: int, timeout_s: float, bad: bool) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world + 1, False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.full((size, size), float(rank + 1) + (0.5 if bad and rank == 1 else 0.0))
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    ok = bool(torch.all(t == want))
    store.set(f"result{rank}", json.dumps({"ok": ok, "got": float(t.flatten()[0]),
                                           "want": want}))
    dist.destroy_process_group()
    return 0


def check_allreduce(procs: int, size: int, timeout_s: float, bad: bool) -> tuple[bool, str]:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, procs + 1, True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    argv = [sys.executable, "-m", "trainguard.agents.canary", "--worker", "--world", str(procs),
            "--port", str(store.port), "--size", str(size), "--timeout", str(timeout_s)]
    env = {**os.environ, "TG_CANARY_BAD_RANK": "1" if bad else ""}
    kids = [subprocess.Popen([*argv, "--rank", str(r)], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(procs)]
    deadline = time.monotonic() + timeout_s + 30
    outs = []
    for k in kids:
        try:
            outs.append(k.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for kk in kids:
                kk.kill()
            return False, f"{procs} ranks did not finish the all-reduce in {timeout_s:.0f} s"
    bad_exit = [(r, k.returncode, o.decode(errors="replace").strip().splitlines()[-1:])
                for r, (k, o) in enumerate(zip(kids, outs)) if k.returncode != 0]
    if bad_exit:
        return False, f"rank(s) exited non-zero: {bad_exit}"[:300]
    results = [json.loads(store.get(f"result{r}")) for r in range(procs)]
    wrong = [(r, x["got"], x["want"]) for r, x in enumerate(results) if not x["ok"]]
    if wrong:
        return False, (f"gloo all-reduce of {procs} ranks gave the wrong sum: "
                       f"(rank, got, want) {wrong}")
    return True, f"gloo all-reduce of {procs} ranks × {size}² float32: exact"


def check_compute(size: int, bad: bool) -> tuple[bool, str]:
    import torch

    g = torch.Generator().manual_seed(1234)
    a = torch.randn(size, size, generator=g, dtype=torch.float64)
    b = torch.randn(size, size, generator=g, dtype=torch.float64)
    ref = a @ b
    scale = float(ref.abs().max())
    devices = ([f"cuda:{i}" for i in range(torch.cuda.device_count())]
               if torch.cuda.is_available() else ["cpu"])
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
    worst: list[str] = []
    errs = []
    for dev in devices:
        got = (a.float().to(dev) @ b.float().to(dev)).double().cpu()
        if bad:
            got[0, 0] += scale
        err = float((got - ref).abs().max()) / scale
        errs.append(err)
        if not err <= COMPUTE_RTOL:
            worst.append(f"{dev} relative error {err:.2e} > {COMPUTE_RTOL:g}")
    if worst:
        return False, f"{size}² float32 matmul against a float64 reference: {'; '.join(worst)}"
    return True, (f"{size}² float32 matmul on {', '.join(devices)}: relative error "
                  f"{max(errs):.1e} <= {COMPUTE_RTOL:g}")


def check_nvml(module: str, bad: bool) -> tuple[bool | None, str]:
    """``(passed, detail)``; ``None`` when there is no NVML here (skipped)."""
    from trainguard.agents.nvml import NvmlConfig, NvmlSampler, load_module

    mod = load_module(module, this_node()) if module else None
    s = NvmlSampler(NvmlConfig(xid_events=False, module=""), module=mod)
    if not s.open():
        return None, f"no NVML here ({s.reason})" if getattr(s, "reason", "") else "no NVML"
    try:
        samples = s.sample()
    finally:
        s.close()
    problems = nvml_problems(samples)
    if bad:
        problems.append("injected NVML failure (TG_CANARY_FAIL)")
    if problems:
        return False, "; ".join(problems)[:300]
    return True, f"{len(samples)} GPU(s): no uncorrectable ECC, no pending retirement or remap"


CHECKS = ("allreduce", "compute", "nvml")


def run_checks(a: argparse.Namespace) -> dict[str, Any]:
    node = this_node()
    t0 = time.monotonic()
    rows = []
    for name in CHECKS:
        if name in a.skip:
            continue
        bad = injected(name, node)
        try:
            if name == "allreduce":
                ok, detail = check_allreduce(a.procs, a.size // 4 or 1, a.timeout, bad)
            elif name == "compute":
                ok, detail = check_compute(a.size, bad)
            else:
                ok, detail = check_nvml(a.nvml_module, bad)
        except Exception as exc:  # noqa: BLE001 - a check that raises has failed
            ok, detail = False, f"raised {type(exc).__name__}: {exc}"[:300]
        rows.append({"name": name, "ok": ok is not False, "skipped": ok is None,
                     "detail": detail})
    failed = [r for r in rows if not r["ok"]]
    summary = ("; ".join(f"{r['name']}: {r['detail']}" for r in failed) if failed else
               f"passed on {node}: " + ", ".join(r["name"] + (" (skipped)" if r["skipped"]
                                                             else "") for r in rows))
    return {"ok": not failed, "node": node, "checks": rows, "summary": summary,
            "seconds": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.agents.canary",
                                description="health canary of this node")
    p.add_argument("--json", action="store_true")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--nvml-module", default=os.environ.get("TG_CANARY_NVML_MODULE", ""))
    p.add_argument("--skip", action="append", default=[], choices=CHECKS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return _worker(a.rank, a.world, a.port, a.size, a.timeout,
                       os.environ.get("TG_CANARY_BAD_RANK") == "1")
    if a.procs < 2 or a.size < 8 or a.timeout <= 0:
        p.error("--procs must be >= 2, --size >= 8, --timeout > 0")
    print(f"{CANARY_STARTED} on {socket.gethostname()} (pid {os.getpid()})", flush=True)
    res = run_checks(a)
    for r in res["checks"]:
        mark = "skip" if r["skipped"] else ("ok" if r["ok"] else "FAIL")
        print(f"canary {r['name']:<9} {mark:<4} {r['detail']}", flush=True)
    if a.json:
        print(json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

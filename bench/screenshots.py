"""The README's pictures of the operator's view, from one real run.

    python bench/screenshots.py [--out docs] [--chromium /usr/bin/chromium]

Starts the embedded stack (every service, metrics on), the console (reader role) and a demo
job (4 gloo ranks on 2 simulated nodes, action mode; a SIGKILL of rank 1, a Python exception in
rank 2, a hang of rank 3), then writes:

* ``OUT/console.png`` — the console's front page (jobs, node table), and
  ``OUT/console-job.png`` — the job's page (incidents with their times, verdicts, decisions,
  recovery paths; its nodes, checkpoints and audit trail), both taken by headless Chromium
  through Playwright (``pip install playwright``; Debian's ``chromium`` package: Playwright's own
  browser download is not used);
* ``OUT/timeline.png`` — ``trainguard report``'s timeline picture of the same job
  (``trainguard[report]``: matplotlib).

About 40 s on a 2-core machine. Prints the paths written.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = "demo-console"


def _console(st, port: int) -> subprocess.Popen:
    nats_url, redis_url = st.urls("reader")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": nats_url, "REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.tools.console", "--port", str(port),
                             "--refresh-s", "2"], env=env)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the console did not start")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs"))
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = p.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("screenshots: pip install playwright (the test extra has it)", file=sys.stderr)
        return 2
    if not os.path.exists(args.chromium):
        print(f"screenshots: no Chromium at {args.chromium} (Debian: apt-get install chromium)",
              file=sys.stderr)
        return 2
    from trainguard.demo.config import DemoConfig
    from trainguard.demo.harness import Demo
    from trainguard.stack.process import free_port
    from trainguard.tools.report import job_events, write
    from trainguard.stack.local import Stack

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tg-screenshots-"))
    st = Stack(services=("agent", "detector", "attributor", "remediator",
                         "checkpoint_validator"), agent_nodes=("node0", "node1"),
               rendezvous=True, log_dir=str(tmp / "logs"), kernel_log_dir=str(tmp),
               env={"TG_METRICS_PORT": "0"})
    st.start(timeout=120)
    console = None
    try:
        port = free_port()
        console = _console(st, port)
        faults = [{"id": 1, "kind": "sigkill", "rank": 1, "step": 30},
                  {"id": 2, "kind": "exception", "rank": 2, "step": 60},
                  {"id": 3, "kind": "hang", "rank": 3, "step": 90}]
        Demo(DemoConfig(mode="action", job=JOB, steps=120, faults=faults,
                        run_dir=str(tmp / "demo"), ckpt_every=10, step_sleep_s=0.01,
                        recovery_timeout_s=60, quiet=True), stack=st).run()
        time.sleep(1.0)  # the last events stored
        base = f"http://127.0.0.1:{port}/"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium,
                                         args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 700})
                page.goto(base)
                page.screenshot(path=str(out / "console.png"), full_page=True)
                page.goto(f"{base}job/{JOB}")
                page.wait_for_selector("#incidents")
                page.screenshot(path=str(out / "console-job.png"), full_page=True)
            finally:
                browser.close()
        nats_url, redis_url = st.urls("reader")
        events = asyncio.run(job_events(nats_url, JOB))
        paths = write(JOB, events, None, str(tmp / "report"))
        if "png" in paths:
            shutil.copy(paths["png"], out / "timeline.png")
    finally:
        if console is not None:
            console.terminate()
            console.wait(10)
        st.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for name in ("console.png", "console-job.png", "timeline.png"):
        if (out / name).exists():
            print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

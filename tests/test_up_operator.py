"""`trainguard up` serves the operator's view by default: it prints a console URL whose page lists
the running jobs and a Prometheus ``/metrics`` URL for every service; ``--no-console`` and
``--no-metrics`` leave them out. Real processes: the stack, its services, a launched job."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from trainguard.stack.endpoints import kept_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = "up-console"


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def _up(tmp_path, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """``trainguard up`` (agent and detector only: two services and the console are enough to
    check every URL); returns the process, its export line and its stderr so far."""
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    env["PYTHONPATH"] = ROOT
    err = tmp_path / "up.err"
    with open(err, "w") as fh:
        up = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "up", "--services",
                               "agent,detector", "--log-dir", str(tmp_path / "logs"),
                               "--timeout", "90", "--ephemeral", *extra],
                              stdout=subprocess.PIPE, stderr=fh, env=env, text=True, cwd=ROOT)
    line = up.stdout.readline()  # after the URLs: they go to stderr first
    assert line.startswith("export NATS_URL="), (line, err.read_text()[-3000:])
    return up, line, err.read_text()


def _stop(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(30) == 0
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()


def test_up_prints_a_console_listing_the_jobs_and_a_metrics_url_per_service(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from trainguard.schemas import subjects

    up, line, err = _up(tmp_path)
    launcher = None
    try:
        console = re.search(r"^trainguard up: console (\S+)$", err, re.M)
        assert console, err
        console = console.group(1)
        assert console.startswith("http://127.0.0.1:") and console.endswith("/")
        metrics = dict(re.findall(r"^trainguard up: metrics (\S+) (\S+)$", err, re.M))
        agent = f"agent-{subjects.default_node()}"
        assert set(metrics) == {agent, "detector", "console"}, err
        assert len({u for u in metrics.values()}) == 3
        for name, url in metrics.items():
            ctype, body = _get(url)
            assert ctype.startswith("text/plain"), (name, ctype)
            fams = {f.name: f for f in text_string_to_metric_families(body)}  # parses, or raises
            if name == "console":
                assert "tg_job_training_goodput" in fams, body[:2000]
            else:  # the service's own counters, labelled with its name
                samples = fams["tg_events_handled"].samples
                assert [s.labels["service"] for s in samples] == [name], samples

        ctype, page = _get(console)
        assert ctype.startswith("text/html") and "no job in the state store" in page

        # a job launched against the printed line appears on the console's landing page
        exports = dict(kv.split("=", 1) for kv in line.split()[1:])
        script = tmp_path / "job.py"
        script.write_text("import time\ntime.sleep(120)\n")
        out = open(tmp_path / "launch.out", "w")
        launcher = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "launch", "--nproc-per-node", "1", "--job",
             JOB, str(script)], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**os.environ, **exports, "PYTHONPATH": ROOT})
        deadline = time.monotonic() + 60
        while JOB not in page:
            assert time.monotonic() < deadline, (tmp_path / "launch.out").read_text()[-3000:]
            assert launcher.poll() is None, (tmp_path / "launch.out").read_text()[-3000:]
            time.sleep(0.5)
            page = _get(console)[1]
        assert re.search(rf'<a href="job/{JOB}">{JOB}</a>', page), page
        ctype, job_page = _get(console + f"job/{JOB}")
        assert f'<span id="job">{JOB}</span>' in job_page
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(20)
            except subprocess.TimeoutExpired:
                launcher.kill()
        _stop(up)


def test_up_without_console_nor_metrics_prints_neither(tmp_path):
    up, _, err = _up(tmp_path, "--no-console", "--no-metrics")
    try:
        assert "trainguard up: console" not in err and "trainguard up: metrics" not in err, err
        assert not (tmp_path / "logs" / "console.log").exists()
    finally:
        _stop(up)


def test_kept_ports_are_reused_while_free_and_replaced_when_taken(tmp_path):
    import socket

    first = kept_ports(["console", "metrics-detector"], "127.0.0.1", tmp_path)
    assert len(set(first.values())) == 2
    assert kept_ports(["console", "metrics-detector"], "127.0.0.1", tmp_path) == first
    with socket.socket() as s:  # someone else listens on the console's port now
        s.bind(("127.0.0.1", first["console"]))
        s.listen()
        again = kept_ports(["console", "metrics-detector"], "127.0.0.1", tmp_path)
    assert again["console"] != first["console"]
    assert again["metrics-detector"] == first["metrics-detector"]
    (tmp_path / "http-ports.json").write_text("not json")  # a damaged file: fresh ports
    assert set(kept_ports(["console"], "127.0.0.1", tmp_path)) == {"console"}

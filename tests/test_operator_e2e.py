"""The operator's view end to end, on one real demo run (4 gloo ranks on 2 simulated nodes,
action mode; a SIGKILL, a Python exception and a hang: event-driven and tick-driven detection)
on an embedded stack whose services serve ``/metrics`` on ephemeral ports:

* the run's stored history, re-decided offline (``trainguard replay decide``) through the
  current detector, attributor and remediator, gives exactly the recorded decisions; a changed
  policy row changes them;
* every metric the Grafana dashboard queries is exported by a running service or the console;
* ``trainguard report`` and the console's goodput API read the same history.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
JOB = "ops-e2e"


@pytest.fixture(scope="module")
def run():
    """The stack (metrics on), one demo run of JOB, its stored history and its settings.
    Its own temporary directory: pytest's numbered ones are shared by every pytest run of the
    user, which removes the older ones (the demo's checkpoints with them) while this runs."""
    import pathlib
    import shutil
    import tempfile

    from trainguard.demo.harness import Demo, DemoConfig
    from trainguard.replay import history, read_recording
    from trainguard.stack import Stack
    from trainguard.state import StateStore

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tg-ops-e2e-"))
    st = Stack(services=("agent", "detector", "attributor", "remediator",
                         "checkpoint_validator"), agent_nodes=("node0", "node1"),
               rendezvous=True, log_dir=str(tmp / "logs"), kernel_log_dir=str(tmp),
               env={"TG_METRICS_PORT": "0"})
    st.start(timeout=120)
    try:
        faults = [{"id": 1, "kind": "sigkill", "rank": 1, "step": 30},
                  {"id": 2, "kind": "exception", "rank": 2, "step": 60},
                  {"id": 3, "kind": "hang", "rank": 3, "step": 90}]
        cfg = DemoConfig(mode="action", job=JOB, steps=120, faults=faults,
                         run_dir=str(tmp / "demo"), ckpt_every=10, step_sleep_s=0.01,
                         recovery_timeout_s=60, quiet=True)
        rep = Demo(cfg, stack=st).run()
        time.sleep(0.5)  # the last events stored
        buf = io.StringIO()
        asyncio.run(history(st.nats_url, buf, "tg.>"))
        path = tmp / "history.jsonl"
        path.write_text(buf.getvalue())
        if os.environ.get("TG_KEEP_RECORDING"):  # a copy to look at after the test
            shutil.copy(path, os.environ["TG_KEEP_RECORDING"])

        async def settings():
            s = StateStore(st.redis_url)
            try:
                return (await s.job(JOB)).settings()
            finally:
                await s.close()
        import dataclasses
        snap = dataclasses.asdict(asyncio.run(settings()))
        (tmp / "job.json").write_text(json.dumps(snap))
        yield {"stack": st, "demo": rep, "path": path, "records": list(read_recording(
            io.StringIO(buf.getvalue()))), "snapshot": snap, "tmp": tmp}
    finally:
        st.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _faults(rows):
    """The decisions of the injected faults, in order (a loaded machine adds others: a
    start-up that outlasts its allowance, failed saves flagged)."""
    return [(d.fault_class, d.action, d.ranks) for d in rows
            if (d.fault_class, d.action) in (("crash", "restart_workers"),
                                            ("app_exception", "restart_in_process"),
                                            ("hang", "restart_workers")) and len(d.ranks) == 1]


def test_replay_reproduces_the_recorded_decisions_and_a_policy_change_changes_them(run):
    from trainguard.replay_decide import decide, parse_row, policy_with

    rep = run["demo"]
    assert all(f["recovered"] for f in rep["faults"]), rep["faults"]
    res = decide(run["records"], job_records={JOB: run["snapshot"]})
    assert _faults(res.replayed) == [("crash", "restart_workers", [1]),
                                     ("app_exception", "restart_in_process", [2]),
                                     ("hang", "restart_workers", [3])], res.rows
    # every recovery decision exactly as recorded. A flag (action none) of a rule the detector
    # evaluates on its timer (straggler, throughput) may come out differently: it sees the
    # windows at the ticks' instants, which a recording does not hold; under load (ticks late)
    # one of four runs had a straggler flag only the replay raised. Reported, not failed.
    recovery = [r for r in res.changed if "none" not in {
        d.action for d in (r["recorded"], r["replayed"]) if d is not None}]
    assert not recovery, [(r["status"], r["recorded"], r["replayed"]) for r in recovery]
    if res.changed:
        warnings.warn(f"flags differ in the replay: {res.changed}")
    # the demo saw the same recoveries on the bus
    seen = [(d["action"], d["generation"]) for d in rep["decisions"] if d["action"] != "none"]
    assert [(d.action, d.generation) for d in res.replayed if d.action != "none"] == seen

    # backtest: a crash stops the job → its decision changes, the later ones never happen
    res2 = decide(run["records"], policy_with([parse_row("crash=stop_job_notify_user")]),
                  job_records={JOB: run["snapshot"]})
    at = next(i for i, r in enumerate(res2.rows)
              if r["recorded"] is not None and r["recorded"].fault_class == "crash")
    crash = res2.rows[at]
    assert crash["status"] == "changed" and crash["differs"][:1] == ["action"], crash
    assert crash["replayed"].action == "stop_job_notify_user"
    assert all(r["status"] == "same" for r in res2.rows[:at]
               if r["recorded"] is not None and r["recorded"].action != "none")
    assert any(r["status"] == "missing" for r in res2.rows[at + 1:])

    # the command line says the same
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", "decide",
                          str(run["path"]), "--job-record", str(run["tmp"] / "job.json"),
                          "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["changed"] == len(res.changed)
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", "decide",
                          str(run["path"]), "--job-record", str(run["tmp"] / "job.json"),
                          "--set", "crash=stop_job_notify_user"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "≠" in out.stdout and "stop_job_notify_user" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", "decide",
                          str(run["path"]), "--set", "crash=reboot_the_moon"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "unknown action 'reboot_the_moon'" in bad.stderr


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _console(run):
    from trainguard.embedded import free_port

    st = run["stack"]
    port = free_port()
    nats_url, redis_url = st.urls("reader")
    env = {**os.environ, "PYTHONPATH": ROOT, "NATS_URL": nats_url, "REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.console", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"console did not start: {proc.stderr.read().decode()[-2000:]}")


def test_dashboard_queries_only_metrics_the_services_export(run):
    from trainguard.metrics import METRIC_NAMES

    st = run["stack"]
    texts = {}
    for name in ("detector", "attributor", "remediator", "checkpoint_validator",
                 "agent-node0"):
        port = st.health(name, timeout=3.0)["metrics_port"]
        assert port, name
        texts[name] = _scrape(port)
    proc, port = _console(run)
    try:
        for _ in range(100):  # the console's first goodput refresh
            texts["console"] = _scrape(port)
            if f'tg_job_training_goodput{{job="{JOB}"}}' in texts["console"]:
                break
            time.sleep(0.2)
        goodput = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/jobs/{JOB}/goodput", timeout=30).read())
    finally:
        proc.terminate()
        proc.wait(10)
    exported = {m.group(1) for t in texts.values()
                for m in re.finditer(r"^# TYPE (\w+) ", t, re.M)}
    exported |= {n + "_total" for n in list(exported)}  # a counter's TYPE line has no _total
    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "trainguard.json")))
    queried = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            queried |= set(re.findall(r"\btg_[a-z0-9_]+", t["expr"]))
    queried = {re.sub(r"_(bucket|sum|count)$", "", q) for q in queried}
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, sorted(queried - exported)
    assert queried <= set(METRIC_NAMES)
    # real values behind them: the faults were counted and timed
    det, rem = texts["detector"], texts["remediator"]
    assert re.search(r'tg_anomalies_total\{fault_class="crash"', det), det[-3000:]
    assert re.search(r'tg_fault_to_decision_seconds_count\{action="restart_workers",'
                     r'fault_class="crash"\} [1-9]', rem), rem[-3000:]
    assert re.search(r'tg_events_handled_total\{service="detector"\} [1-9]', det)
    assert re.search(r'tg_node_cpu_percent\{node="node0"\} ', texts["agent-node0"])
    assert f'tg_job_training_goodput{{job="{JOB}"}}' in texts["console"]
    assert 0 < goodput["training_goodput"] <= 1 and len(goodput["incidents"]) >= 3


def test_report_of_the_stored_history(run, tmp_path):
    st = run["stack"]
    nats_url, redis_url = st.urls("reader")
    env = {**os.environ, "PYTHONPATH": ROOT, "NATS_URL": nats_url, "REDIS_URL": redis_url}
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "report", JOB, "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads((tmp_path / f"{JOB}-report.json").read_text())
    by = {(r["fault_class"], r["action"]): r for r in rep["recoveries"]
          if r["verdict"] and len(r["verdict"]["ranks"]) == 1}
    kill, exc = by[("crash", "restart_workers")], by[("app_exception", "restart_in_process")]
    hang = by[("hang", "restart_workers")]
    assert kill["action"] == "restart_workers" and kill["verdict"]["ranks"] == [1]
    assert exc["action"] == "restart_in_process" and exc["verdict"]["ranks"] == [2]
    assert hang["action"] == "restart_workers" and hang["decision"]["ranks"] == [3]
    demo = {f["kind"]: f for f in run["demo"]["faults"]}
    assert kill["restored_step"] == demo["sigkill"]["restored_step"]
    for r in (kill, exc, hang):
        s = r["seconds_from_fault"]
        assert 0 <= s["detected"] <= s["decided"] < s["resumed"] < 30, r
        assert r["loss_after"] is not None, r
    # the loss at the restored step before the fault: recorded for the later faults (the
    # first fault's restored step can precede the first loss the history kept)
    assert exc["loss_before"] is not None and hang["loss_before"] is not None
    assert rep["audit"]["by_type"].get("decision", 0) >= 3
    md = (tmp_path / f"{JOB}-report.md").read_text()
    assert "crash → restart_workers" in md and "## Recovery 3:" in md
    png = (tmp_path / f"{JOB}-timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

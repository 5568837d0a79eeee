"""The node agent service against a real NATS: heartbeats, telemetry, XIDs from a followed
kernel log file and from the NVML event set, OOM-kill lines, the missing-NVML report."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.agents import KERNEL_KIND, AgentConfig, NodeAgent
from trainguard.agents.kernel_log import KernelLogConfig
from trainguard.agents.nvml import NvmlConfig
from trainguard.schemas import LogLine, NodeHeartbeat, NodeTelemetry, XidEvent, subjects
from trainguard.clients.bus import Bus
from trainguard.services.base import ServiceConfig, health_subject

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "agent"))
import fake_pynvml as fk  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_n = 0


def node_name() -> str:
    global _n
    _n += 1
    return f"tnode-{os.getpid()}-{_n}"


class Collector:
    def __init__(self) -> None:
        self.items: list[tuple[float, str, object]] = []
        self.cond = asyncio.Condition()

    async def __call__(self, subject: str, ev: object) -> None:
        async with self.cond:
            self.items.append((time.monotonic(), subject, ev))
            self.cond.notify_all()

    async def wait(self, pred, n: int = 1, timeout: float = 5.0) -> list:
        async with self.cond:
            await asyncio.wait_for(
                self.cond.wait_for(lambda: len([e for _, _, e in self.items if pred(e)]) >= n),
                timeout)
        return [e for _, _, e in self.items if pred(e)]


async def start_agent(servers, node: str, agent_cfg: AgentConfig, nvml_module=None):
    agent = NodeAgent(ServiceConfig(nats_url=servers.nats_url, node=node, tick_s=0.5),
                      agent_cfg, nvml_module=nvml_module)
    task = asyncio.create_task(agent.run())
    return agent, task


async def stop_agent(agent: NodeAgent, task: asyncio.Task) -> None:
    agent.stop()
    await asyncio.wait_for(task, 10.0)


@pytest.fixture
async def bus(servers):
    b = await Bus(servers.nats_url, "agent-test").connect()
    yield b
    await b.close()


async def test_heartbeats_at_configured_rate_with_increasing_seq(servers, bus):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "heartbeat"), got)
    await bus.flush()
    cfg = AgentConfig(heartbeat_interval_s=0.2, interval_s=5.0,
                      kernel=KernelLogConfig(source="none"), nvml=NvmlConfig(enabled=False))
    agent, task = await start_agent(servers, node, cfg)
    try:
        beats = await got.wait(lambda e: isinstance(e, NodeHeartbeat), n=8, timeout=10.0)
    finally:
        await stop_agent(agent, task)
    times = [t for t, _, e in got.items if isinstance(e, NodeHeartbeat)]
    seqs = [b.seq for b in beats]
    assert seqs[:8] == list(range(seqs[0], seqs[0] + 8))
    assert seqs[0] == 0  # subscribed before the agent started: nothing was missed
    b = beats[0]
    assert (b.role, b.node, b.pid, b.interval_s) == ("agent", node, os.getpid(), 0.2)
    period = (times[7] - times[0]) / 7
    assert 0.15 <= period <= 0.3, period


async def test_telemetry_host_metrics_latency_and_no_nvml_reported_once(servers, bus, caplog):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "telemetry"), got)
    await bus.flush()
    listener = socket.create_server(("127.0.0.1", 0))
    open_peer = f"127.0.0.1:{listener.getsockname()[1]}"
    closed = socket.create_server(("127.0.0.1", 0))
    closed_peer = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there any more: connection refused
    cfg = AgentConfig(interval_s=0.25, heartbeat_interval_s=0.5, peers=(open_peer, closed_peer),
                      probe_timeout_s=0.5, kernel=KernelLogConfig(source="none"))
    caplog.set_level(logging.INFO)
    agent, task = await start_agent(servers, node, cfg)  # real pynvml: no driver here
    try:
        tel = await got.wait(lambda e: isinstance(e, NodeTelemetry), n=4, timeout=10.0)
        reply = json.loads(await bus.request(health_subject(f"agent-{node}"), timeout=2.0))
    finally:
        await stop_agent(agent, task)
        listener.close()
    t = tel[-1]
    assert t.node == node and t.nvml is False and t.gpus == []
    assert 0.0 <= t.cpu_percent <= 100.0
    assert 0 < t.mem_used_bytes < t.mem_total_bytes
    assert t.load1 >= 0.0
    assert 0 < t.net_latency_s["bus"] < 0.5
    assert 0 < t.net_latency_s[open_peer] < 0.5
    assert math.isinf(t.net_latency_s[closed_peer])
    assert reply["ok"] and reply["name"] == f"agent-{node}" and reply["node"] == node
    assert reply["nvml"] is False and reply["nvml_reason"]
    assert reply["heartbeat_seq"] >= 0 and reply["sent_telemetry"] >= 1
    reason = agent.nvml.reason
    said = [r for r in caplog.records if reason in r.getMessage()]
    assert len(said) == 1, "a missing GPU is reported once"
    assert said[0].levelno == logging.INFO  # and is not an error


async def test_kernel_log_file_lines_become_xid_events_and_oom_lines(servers, bus, tmp_path):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "xid"), got)
    await bus.subscribe(subjects.node(node, KERNEL_KIND), got)
    await bus.flush()
    kern = tmp_path / "kern.log"
    kern.write_text("[ 9000.000001] NVRM: Xid (PCI:0000:3b:00): 13, old line, must not appear\n")
    fake = fk.FakePynvml([fk.h100(), fk.t4()])
    cfg = AgentConfig(interval_s=5.0, kernel=KernelLogConfig(source=str(kern), poll_s=0.05),
                      nvml=NvmlConfig(event_wait_ms=50))
    agent, task = await start_agent(servers, node, cfg, nvml_module=fake)
    try:
        for _ in range(100):  # until the follower has opened the file
            if agent.follower is not None and agent.follower.is_alive():
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.15)
        lines = (Path(__file__).parent / "fixtures" / "agent" / "kernel_xid.log").read_text()
        with open(kern, "a") as fh:
            fh.write(lines)
            fh.write("4,2400,9800000000,-;NVRM: Xid (PCI:0000:af:00): 94, pid=7001, "
                     "name=python3, Contained: SM (0x1). RST: No, D-RST: No\n")
        xids = await got.wait(lambda e: isinstance(e, XidEvent), n=5)
        kernel = await got.wait(lambda e: isinstance(e, LogLine), n=5)
        await asyncio.sleep(0.2)  # nothing else may follow
    finally:
        await stop_agent(agent, task)
    assert [x.xid for x in xids] == [79, 48, 74, 63, 94]
    h100_uuid, t4_uuid = fake.gpus[0].uuid, fake.gpus[1].uuid
    x79 = xids[0]
    assert (x79.pci, x79.gpu_index, x79.gpu_uuid) == ("0000:3b:00", 0, h100_uuid)
    assert (x79.pid, x79.process_name, x79.source, x79.node) == (4121, "python3", "file", node)
    assert "fallen off the bus" in x79.message and x79.raw.startswith("[ 9301.772210] NVRM")
    assert (xids[1].pci, xids[1].gpu_index, xids[1].gpu_uuid) == ("0000:af:00", 1, t4_uuid)
    assert xids[3].gpu_index == 1  # driver form without "PCI:"
    assert xids[4].raw.startswith("NVRM: Xid")  # the /dev/kmsg record header is gone
    kinds = [ln.line.split("] ", 1)[-1][:14] for ln in kernel]
    assert kinds == ["NVRM: GPU 0000", "Out of memory:", "oom-kill:const", "python3[6001]:",
                     "INFO: task pyt"]
    assert len([e for _, _, e in got.items]) == 5 + 5  # not the old line, not the others
    oom = kernel[1]
    assert (oom.stream, oom.source, oom.job, oom.node) == ("kernel", "agent", None, node)
    assert "Killed process 5533 (python3)" in oom.line


async def test_xid_without_nvml_gets_uuid_from_driver_announcement(servers, bus, tmp_path):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "xid"), got)
    await bus.flush()
    kern = tmp_path / "kern.log"
    kern.write_text("")
    cfg = AgentConfig(interval_s=5.0, kernel=KernelLogConfig(source=str(kern), poll_s=0.05),
                      nvml=NvmlConfig(enabled=False))
    agent, task = await start_agent(servers, node, cfg)
    try:
        await asyncio.sleep(0.3)
        with open(kern, "a") as fh:
            fh.write("[ 8124.019873] NVRM: GPU at PCI:0000:3b:00: "
                     "GPU-5f3c1b2e-8a4d-4c6e-9f10-2b7d3e4a5c61\n")
            fh.write("[ 9301.772210] NVRM: Xid (PCI:0000:3b:00): 119, pid=4121, name=python3, "
                     "Timeout after 6s of waiting for RPC response from GPU0 GSP!\n")
        (x,) = await got.wait(lambda e: isinstance(e, XidEvent))
    finally:
        await stop_agent(agent, task)
    assert (x.xid, x.pci, x.gpu_index) == (119, "0000:3b:00", None)
    assert x.gpu_uuid == "GPU-5f3c1b2e-8a4d-4c6e-9f10-2b7d3e4a5c61"


async def test_nvml_telemetry_and_nvml_xid_event_on_the_bus(servers, bus):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "xid"), got)
    await bus.subscribe(subjects.node(node, "telemetry"), got)
    await bus.flush()
    fake = fk.FakePynvml([fk.h100(), fk.t4()])
    cfg = AgentConfig(interval_s=0.3, kernel=KernelLogConfig(source="none"),
                      nvml=NvmlConfig(event_wait_ms=50))
    agent, task = await start_agent(servers, node, cfg, nvml_module=fake)
    try:
        (tel,) = (await got.wait(lambda e: isinstance(e, NodeTelemetry)))[:1]
        for _ in range(100):
            if fake.inject_xid(1, 79):
                break
            await asyncio.sleep(0.02)
        (x,) = await got.wait(lambda e: isinstance(e, XidEvent))
    finally:
        await stop_agent(agent, task)
    assert tel.nvml is True and [g.index for g in tel.gpus] == [0, 1]
    assert tel.gpus[0].clock_event_names == ["sw_power_cap", "hw_thermal"]
    assert tel.gpus[0].nvlink_errors["3.crc_flit"] == 12
    assert tel.gpus[1].remapped_rows_pending is None and tel.gpus[1].retired_pages_dbe == 1
    assert (x.xid, x.source, x.gpu_index, x.pci) == (79, "nvml", 1, "0000:af:00")
    assert x.gpu_uuid == fake.gpus[1].uuid
    assert fake.initialised == 0 and fake._sets == {}  # NVML shut down, event set freed


def test_bad_node_name_is_refused_with_advice():
    with pytest.raises(SystemExit, match="--node"):
        NodeAgent(ServiceConfig(nats_url="nats://127.0.0.1:1", node="gpu01 *"))
    # a Kubernetes node name (downward API spec.nodeName) has dots: it is a node name
    a = NodeAgent(ServiceConfig(nats_url="nats://127.0.0.1:1", node="ip-10-0-1-2.ec2.internal"))
    assert a.node == "ip-10-0-1-2.ec2.internal"
    with pytest.raises(SystemExit, match="interval_s"):
        NodeAgent(ServiceConfig(nats_url="nats://127.0.0.1:1", node="n1"),
                  AgentConfig(interval_s=0))


async def test_python_m_agents_runs_and_stops_on_sigterm(servers, bus, tmp_path):
    node = node_name()
    got = Collector()
    await bus.subscribe(subjects.node(node, "heartbeat"), got)
    await bus.flush()
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "REDIS_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.agents", "--node", node, "--nats-url", servers.nats_url,
         "--heartbeat-interval", "0.2", "--interval", "1", "--kmsg", str(tmp_path / "k.log")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        beats = await got.wait(lambda e: isinstance(e, NodeHeartbeat), n=2, timeout=20.0)
        assert beats[0].pid == proc.pid and beats[0].interval_s == 0.2
        reply = json.loads(await bus.request(health_subject(f"agent-{node}"), timeout=2.0))
        assert reply["node"] == node and reply["kernel_log"] == str(tmp_path / "k.log")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert out.count("host metrics only") == 1, out

"""Metrics: the port option, what the event metrics count, the endpoint over real HTTP."""
import urllib.request

import pytest

from trainguard import schemas
from trainguard.services.metrics import METRIC_NAMES, Metrics, MetricsError, port_from_env

B = 1_700_000_000 * 10**9


def test_port_option(monkeypatch):
    monkeypatch.delenv("TG_METRICS_PORT", raising=False)
    assert port_from_env() is None  # off by default
    assert port_from_env("0") == 0 and port_from_env("9464") == 9464
    for bad in ("x", "70000", "-1"):
        with pytest.raises(MetricsError, match="not a port"):
            port_from_env(bad)


def test_event_metrics_and_the_endpoint():
    m = Metrics()
    m.observe(schemas.Anomaly(job="j", kind="crash", fault_class="crash", first_ts=B,
                              ts=B + 300_000_000))
    m.observe(schemas.Decision(job="j", action="restart_workers", idempotency_key="k",
                               fault_class="crash", fault_ts=B, ts=B + 1_500_000_000))
    m.observe(schemas.NodeTelemetry(node="n0", cpu_percent=12.5, mem_used_bytes=1024,
                                    mem_total_bytes=4096, load1=0.5, gpus=[schemas.GpuSample(
                                        index=1, util_percent=90.0, temperature_c=70.0)]))
    port = m.serve(0, host="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        m.close()
    text = text.decode()
    assert 'tg_anomalies_total{fault_class="crash",kind="crash"} 1.0' in text
    # 0.3 s lands in the 0.5 s bucket, not the 0.25 s one
    assert 'tg_fault_to_anomaly_seconds_bucket{fault_class="crash",le="0.25"} 0.0' in text
    assert 'tg_fault_to_anomaly_seconds_bucket{fault_class="crash",le="0.5"} 1.0' in text
    assert ('tg_fault_to_decision_seconds_sum{action="restart_workers",fault_class="crash"} '
            '1.5') in text
    assert 'tg_node_cpu_percent{node="n0"} 12.5' in text
    assert 'tg_gpu_utilization_percent{gpu="1",node="n0"} 90.0' in text
    assert 'tg_gpu_power_watts{' not in text  # not measured: no sample
    for name in METRIC_NAMES:
        if not name.startswith(("tg_job_", "tg_events", "tg_handler", "tg_reducer")):
            # a counter's TYPE line names it with or without _total (prometheus-client version)
            assert (f"# TYPE {name} " in text
                    or f"# TYPE {name.removesuffix('_total')} " in text), name

"""Detector: raw signals (heartbeats, worker exits, log lines, XIDs, telemetry) -> anomalies.

``rules`` is the one import of the pure rules (``core``: parameters and ``Finding``;
``progress``: rank/job windows and the hang, straggler, throughput and NaN-loss rules;
``signals``: crash, log, failed-save, XID, telemetry and node-lost rules), ``patterns`` the
log-pattern table, ``reducer`` the detector's ``step`` (dedup, fan-out, record refresh, cadence,
memory), ``service`` the ``Detector`` service that wires it (``python -m trainguard.detector``)."""

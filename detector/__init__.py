"""Detector: raw signals (heartbeats, worker exits, log lines, XIDs, telemetry) -> anomalies.

``rules`` holds the pure rules, ``patterns`` the log-pattern table, ``service`` the
``Detector`` service (``python -m trainguard.detector``)."""

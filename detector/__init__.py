"""Detector: raw signals (heartbeats, worker exits, log lines, XIDs, telemetry) -> anomalies.

``rules`` holds the pure rules, ``patterns`` the log-pattern table, ``service`` the
``Detector`` service (``python -m detector``)."""
from trainguard.syspath import working_dir_off_path_under_m

working_dir_off_path_under_m()  # `python -m` here: a ./schemas folder must not shadow ours

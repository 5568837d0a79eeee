"""Attributor: anomalies -> one verdict per incident (fault class, layer, culprit, action).

``decide`` is the pure attribution, ``service`` the ``Attributor`` service
(``python -m attributor``), ``xid_table.csv`` the XID table derived from NVIDIA's catalog."""
from trainguard.syspath import working_dir_off_path_under_m

working_dir_off_path_under_m()  # `python -m` here: a ./schemas folder must not shadow ours

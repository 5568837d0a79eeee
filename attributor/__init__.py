"""Attributor: anomalies -> one verdict per incident (fault class, layer, culprit, action).

``decide`` is the pure attribution, ``service`` the ``Attributor`` service
(``python -m attributor``), ``xid_table.csv`` the XID table derived from NVIDIA's catalog."""

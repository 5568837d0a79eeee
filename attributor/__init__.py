"""Attributor: anomalies -> one verdict per incident (fault class, layer, culprit, action).

``decide`` is the pure attribution, ``incidents`` the pure incident grouping around it (the
reducer), ``service`` the ``Attributor`` service
(``python -m trainguard.attributor``); the XID table it reads is ``schemas/xid_table.csv``, derived from NVIDIA's catalog by ``xid_table_build``."""

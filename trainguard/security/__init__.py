"""Roles and rights (``roles``), the credentials kept for them (``credentials``), the servers'
configuration that enforces them (``server_config``), TLS and private files."""

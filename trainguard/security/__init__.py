"""Roles and rights, credentials, TLS and private files."""

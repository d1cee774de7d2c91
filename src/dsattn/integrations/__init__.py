"""Integrations of dsattn's operators into other libraries (optional dependencies)."""

"""Registers the built-in tasks (filled in as they land)."""

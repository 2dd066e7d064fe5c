"""A persistent key-value store, private to the user running the inferlet.

Values are strings (hold JSON in them for structured data); on a server
they live in SQLite and survive restarts. ``tartlet run`` uses an
in-memory store.
"""

from __future__ import annotations

from . import _binding


def get(key: str, default: str | None = None) -> str | None:
    """The value of ``key``, or ``default`` when absent."""
    value = _binding.host().store_get(key)
    return default if value is None else value


def set(key: str, value: str) -> None:  # noqa: A001 - the store's verb
    """Store ``value`` (a str of at most 1 MiB) under ``key`` (1 to 1024 characters).

    Raises:
        ValueError: bad key or value.
    """
    _binding.host().store_set(key, value)


def delete(key: str) -> bool:
    """Remove ``key``; whether it existed."""
    return _binding.host().store_delete(key)


def keys(prefix: str = "") -> list[str]:
    """The user's keys that start with ``prefix``, sorted."""
    return _binding.host().store_keys(prefix)

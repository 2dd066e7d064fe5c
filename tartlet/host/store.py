"""The persistent key-value store of inferlets, scoped per user, on SQLite.

One table ``kv(user, key, value)``; every call is one short transaction,
so values survive a server restart (and a crash after the call returned).
Values are strings (the SDK may hold JSON in them). ``":memory:"`` gives a
store that lives as long as the process (``tartlet run``, tests).
:class:`KVStore` is the interface the host uses; ``tartlet.host.pg_store``
implements it on PostgreSQL for replicas that share state (``[store] url``),
with the same checks (the ``_check_*`` functions here).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Protocol

from ..sdk.errors import StoreError

#: Longest key, characters.
MAX_KEY_CHARS = 1024
#: Largest value, bytes of UTF-8.
MAX_VALUE_BYTES = 1 << 20


def _utf8_len(what: str, s: str) -> int:
    """Bytes of ``s`` in UTF-8; StoreError for a lone surrogate (not Unicode text)."""
    try:
        return len(s.encode())
    except UnicodeEncodeError as e:
        raise StoreError(f"a store {what} must be valid Unicode text, got a lone surrogate at index {e.start}") from None


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise StoreError(f"a store key is a non-empty str of at most {MAX_KEY_CHARS} characters, got {key!r:.80}")
    _utf8_len("key", key)


def _check_value(value: str) -> None:
    if not isinstance(value, str):
        raise StoreError(f"store values are str (encode other data as JSON), got {type(value).__name__}")
    n = _utf8_len("value", value)
    if n > MAX_VALUE_BYTES:
        raise StoreError(f"store value of {n} bytes is larger than {MAX_VALUE_BYTES}")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str):
        raise StoreError(f"prefix must be a str, got {type(prefix).__name__}")
    _utf8_len("prefix", prefix)


class KVStore(Protocol):
    """What the host calls on a key-value store (:class:`Store`, or
    ``tartlet.host.pg_store.PgStore``). Every method raises ``StoreError``
    for a bad key, value or prefix."""

    def get(self, user: str, key: str) -> str | None: ...
    def set(self, user: str, key: str, value: str) -> None: ...
    def delete(self, user: str, key: str) -> bool: ...
    def keys(self, user: str, prefix: str = "") -> list[str]: ...
    def close(self) -> None: ...


class Store:
    """SQLite-backed key-value store.

    A new database file is created 0600 (a new folder 0700); SQLite gives
    its ``-wal`` and ``-shm`` files the database file's permissions.

    Args:
        path: database file (created with its folder), or ``":memory:"``.
    """

    def __init__(self, path: str | Path = ":memory:") -> None:
        if str(path) != ":memory:":
            p = Path(path).expanduser()
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(p, os.O_RDWR | os.O_CREAT, 0o600))  # before SQLite creates it with the umask's mode
            path = p
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS kv (user TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, "
            "PRIMARY KEY (user, key))"
        )

    def get(self, user: str, key: str) -> str | None:
        """The value of ``key`` for ``user``, or None."""
        _check_key(key)
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE user=? AND key=?", (user, key)).fetchone()
        return None if row is None else row[0]

    def set(self, user: str, key: str, value: str) -> None:
        """Store ``value`` under ``key``.

        Raises:
            StoreError: bad key, non-str value, value over 1 MiB, text with a lone surrogate.
        """
        _check_key(key)
        _check_value(value)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO kv (user, key, value) VALUES (?, ?, ?)", (user, key, value))

    def delete(self, user: str, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        _check_key(key)
        with self._lock:
            cur = self._db.execute("DELETE FROM kv WHERE user=? AND key=?", (user, key))
        return cur.rowcount > 0

    def keys(self, user: str, prefix: str = "") -> list[str]:
        """The user's keys starting with ``prefix``, sorted."""
        _check_prefix(prefix)
        with self._lock:
            rows = self._db.execute(
                "SELECT key FROM kv WHERE user=? AND substr(key, 1, ?)=? ORDER BY key", (user, len(prefix), prefix)
            ).fetchall()
        return [r[0] for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()

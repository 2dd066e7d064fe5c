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

from ..sdk.errors import LimitError, StoreError

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
    for a bad key, value or prefix; ``set`` raises ``LimitError`` when the
    user's bytes or keys would pass the store's :class:`StoreQuota`.
    ``usage`` is ``(bytes, keys)`` of one user."""

    def get(self, user: str, key: str) -> str | None: ...
    def set(self, user: str, key: str, value: str) -> None: ...
    def delete(self, user: str, key: str) -> bool: ...
    def keys(self, user: str, prefix: str = "") -> list[str]: ...
    def usage(self, user: str) -> tuple[int, int]: ...
    def close(self) -> None: ...


class StoreQuota:
    """Per-user bounds of a store (None: unbounded).

    Attributes:
        max_bytes: bytes of UTF-8 one user's keys and values may hold in all.
        max_keys: keys one user may have.
    """

    def __init__(self, max_bytes: int | None = None, max_keys: int | None = None) -> None:
        self.max_bytes, self.max_keys = max_bytes, max_keys

    def check(self, user: str, bytes_now: int, keys_now: int, bytes_after: int, keys_after: int) -> None:
        """Raise LimitError when a write would take ``user`` from
        ``bytes_now``/``keys_now`` to totals over a bound (a write that
        shrinks the user's use is always allowed)."""
        if self.max_keys is not None and keys_after > self.max_keys and keys_after > keys_now:
            raise LimitError(
                f"user {user or '(local)'!r} has {keys_now} store keys, the limit ([limits] max_store_keys_per_user "
                f"= {self.max_keys}); delete some first"
            )
        if self.max_bytes is not None and bytes_after > self.max_bytes and bytes_after > bytes_now:
            raise LimitError(
                f"this write would make user {user or '(local)'!r}'s store hold {bytes_after} bytes, over the limit "
                f"([limits] max_store_bytes_per_user = {self.max_bytes}); {bytes_now} bytes are in use"
            )


def entry_bytes(key: str, value: str) -> int:
    """Bytes a key and its value count against the store quota (UTF-8)."""
    return len(key.encode()) + len(value.encode())


class Store:
    """SQLite-backed key-value store.

    A new database file is created 0600 (a new folder 0700); SQLite gives
    its ``-wal`` and ``-shm`` files the database file's permissions. Each
    user's bytes (keys and values, UTF-8) and keys are counted in a table
    ``kv_usage`` kept in the same transaction as every write, so the
    quota is checked without reading the user's values.

    Args:
        path: database file (created with its folder), or ``":memory:"``.
        max_bytes_per_user: bytes one user's keys and values may hold (None: unbounded).
        max_keys_per_user: keys one user may have (None: unbounded).
    """

    def __init__(self, path: str | Path = ":memory:", max_bytes_per_user: int | None = None, max_keys_per_user: int | None = None) -> None:
        if str(path) != ":memory:":
            p = Path(path).expanduser()
            p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(p, os.O_RDWR | os.O_CREAT, 0o600))  # before SQLite creates it with the umask's mode
            path = p
        self.path = str(path)
        self.quota = StoreQuota(max_bytes_per_user, max_keys_per_user)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS kv (user TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, "
                "PRIMARY KEY (user, key))"
            )
            fresh = self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='kv_usage'").fetchone() is None
            if fresh:  # a store written before usage was counted: count it once
                self._db.execute("CREATE TABLE kv_usage (user TEXT PRIMARY KEY, bytes INTEGER NOT NULL, keys INTEGER NOT NULL)")
                self._db.execute(
                    "INSERT INTO kv_usage SELECT user, SUM(length(CAST(key AS BLOB)) + length(CAST(value AS BLOB))), COUNT(*) "
                    "FROM kv GROUP BY user"
                )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def get(self, user: str, key: str) -> str | None:
        """The value of ``key`` for ``user``, or None."""
        _check_key(key)
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE user=? AND key=?", (user, key)).fetchone()
        return None if row is None else row[0]

    def usage(self, user: str) -> tuple[int, int]:
        """``(bytes, keys)`` the user's entries hold (bytes of UTF-8)."""
        with self._lock:
            row = self._db.execute("SELECT bytes, keys FROM kv_usage WHERE user=?", (user,)).fetchone()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    def set(self, user: str, key: str, value: str) -> None:
        """Store ``value`` under ``key``.

        Raises:
            StoreError: bad key, non-str value, value over 1 MiB, text with a lone surrogate.
            LimitError: the user's keys or bytes would pass
                ``max_keys_per_user`` / ``max_bytes_per_user`` (nothing is written).
        """
        _check_key(key)
        _check_value(value)
        size = entry_bytes(key, value)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT bytes, keys FROM kv_usage WHERE user=?", (user,)).fetchone()
                used, keys = (0, 0) if row is None else (int(row[0]), int(row[1]))
                old = db.execute(
                    "SELECT length(CAST(key AS BLOB)) + length(CAST(value AS BLOB)) FROM kv WHERE user=? AND key=?", (user, key)
                ).fetchone()
                after_bytes = used + size - (int(old[0]) if old else 0)
                after_keys = keys + (0 if old else 1)
                self.quota.check(user, used, keys, after_bytes, after_keys)
                db.execute("INSERT OR REPLACE INTO kv (user, key, value) VALUES (?, ?, ?)", (user, key, value))
                db.execute("INSERT OR REPLACE INTO kv_usage (user, bytes, keys) VALUES (?, ?, ?)", (user, after_bytes, after_keys))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def delete(self, user: str, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        _check_key(key)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                old = db.execute(
                    "SELECT length(CAST(key AS BLOB)) + length(CAST(value AS BLOB)) FROM kv WHERE user=? AND key=?", (user, key)
                ).fetchone()
                if old is not None:
                    db.execute("DELETE FROM kv WHERE user=? AND key=?", (user, key))
                    db.execute("UPDATE kv_usage SET bytes = bytes - ?, keys = keys - 1 WHERE user=?", (int(old[0]), user))
                    db.execute("DELETE FROM kv_usage WHERE user=? AND keys <= 0", (user,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return old is not None

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

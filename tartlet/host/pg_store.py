"""The inferlets' key-value store on PostgreSQL (``[store] url``), shared
by every server replica configured with the same URL.

The same interface, checks and errors as the SQLite :class:`~tartlet.host.store.Store`
(per-user keys, 1 MiB values, keys sorted by code point); one table::

    tartlet_kv (owner TEXT, key TEXT COLLATE "C", value TEXT, PRIMARY KEY (owner, key))

Every call is one autocommit statement (a ``set`` under a per-user quota:
one transaction holding the user's advisory lock), durable when it
returns; a lost connection is reopened once (:class:`tartlet.host.pg.SharedConnection`).
PostgreSQL text cannot hold NUL characters: a key or value with one is a
``StoreError`` here (SQLite stores it).
"""

from __future__ import annotations

from ..sdk.errors import StoreError
from .pg import Conn, SharedConnection, create_tables
from .store import StoreQuota, _check_key, _check_prefix, _check_value, entry_bytes

_SCHEMA = """CREATE TABLE IF NOT EXISTS tartlet_kv (
    owner TEXT COLLATE "C" NOT NULL,
    key TEXT COLLATE "C" NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (owner, key))"""


def _usage(c: Conn, user: str) -> tuple[int, int]:
    """``(bytes, keys)`` of ``user`` (``octet_length`` reads a stored
    value's size from its header, not the value)."""
    row = c.execute(
        "SELECT COALESCE(SUM(octet_length(key) + octet_length(value)), 0), COUNT(*) FROM tartlet_kv WHERE owner = %s", (user,)
    ).fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


def _no_nul(what: str, s: str) -> None:
    if "\x00" in s:
        raise StoreError(f"a store {what} on PostgreSQL cannot contain NUL characters")


class PgStore:
    """Key-value store in the PostgreSQL database at ``url`` (table
    ``tartlet_kv``, created when missing).

    Args:
        url: libpq connection URL (``postgresql://user:pass@host/db``).

    Raises:
        StoreError: the database cannot be reached or the table created
            (the message has no password). Every method raises StoreError
            for a bad key, value or prefix (as :class:`~tartlet.host.store.Store`),
            a NUL character, and a database unreachable even after one reconnect.
    """

    def __init__(self, url: str, max_bytes_per_user: int | None = None, max_keys_per_user: int | None = None) -> None:
        self._db = SharedConnection(url, "key-value store", lambda c: create_tables(c, _SCHEMA))
        self.quota = StoreQuota(max_bytes_per_user, max_keys_per_user)

    def get(self, user: str, key: str) -> str | None:
        """The value of ``key`` for ``user``, or None."""
        _check_key(key)
        _no_nul("key", key)

        def q(c: Conn) -> str | None:
            row = c.execute("SELECT value FROM tartlet_kv WHERE owner = %s AND key = %s", (user, key)).fetchone()
            return None if row is None else str(row[0])

        return self._db.run(q)

    def set(self, user: str, key: str, value: str) -> None:
        """Store ``value`` under ``key`` (insert or replace).

        Raises:
            StoreError: bad key, non-str value, value over 1 MiB, a NUL character.
            LimitError: the user's keys or bytes would pass the quota
                (``max_keys_per_user`` / ``max_bytes_per_user``; nothing is written).
        """
        _check_key(key)
        _check_value(value)
        _no_nul("key", key)
        _no_nul("value", value)
        upsert = (
            "INSERT INTO tartlet_kv (owner, key, value) VALUES (%s, %s, %s) "
            "ON CONFLICT (owner, key) DO UPDATE SET value = EXCLUDED.value"
        )
        if self.quota.max_bytes is None and self.quota.max_keys is None:
            self._db.run(lambda c: c.execute(upsert, (user, key, value)))
            return
        size = entry_bytes(key, value)

        def q(c: Conn) -> None:
            with c.transaction():  # replicas write concurrently: one writer per user at a time
                c.execute("SELECT pg_advisory_xact_lock(hashtext('tartlet_kv'), hashtext(%s))", (user,))
                used, keys = _usage(c, user)
                row = c.execute(
                    "SELECT octet_length(key) + octet_length(value) FROM tartlet_kv WHERE owner = %s AND key = %s", (user, key)
                ).fetchone()
                old = 0 if row is None else int(row[0])
                self.quota.check(user, used, keys, used + size - old, keys + (0 if row else 1))
                c.execute(upsert, (user, key, value))

        self._db.run(q)

    def usage(self, user: str) -> tuple[int, int]:
        """``(bytes, keys)`` the user's entries hold (bytes of UTF-8)."""
        return self._db.run(lambda c: _usage(c, user))

    def delete(self, user: str, key: str) -> bool:
        """Remove ``key``; whether it existed."""
        _check_key(key)
        _no_nul("key", key)
        return self._db.run(lambda c: c.execute("DELETE FROM tartlet_kv WHERE owner = %s AND key = %s", (user, key)).rowcount > 0)

    def keys(self, user: str, prefix: str = "") -> list[str]:
        """The user's keys starting with ``prefix`` (``%`` and ``_`` are
        plain characters), sorted by code point."""
        _check_prefix(prefix)
        _no_nul("prefix", prefix)
        rows = self._db.run(lambda c: c.execute(
            'SELECT key FROM tartlet_kv WHERE owner = %s AND left(key, %s) = %s ORDER BY key COLLATE "C"',
            (user, len(prefix), prefix),
        ).fetchall())  # fmt: skip
        return [str(r[0]) for r in rows]

    def close(self) -> None:
        """Close the connection; later calls raise StoreError."""
        self._db.close()

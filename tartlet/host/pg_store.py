"""The inferlets' key-value store on PostgreSQL (``[store] url``), shared
by every server replica configured with the same URL.

The same interface, checks and errors as the SQLite :class:`~tartlet.host.store.Store`
(per-user keys, 1 MiB values, keys sorted by code point); one table::

    tartlet_kv (owner TEXT, key TEXT COLLATE "C", value TEXT, PRIMARY KEY (owner, key))

Every call is one autocommit statement, durable when it returns; a lost
connection is reopened once (:class:`tartlet.host.pg.SharedConnection`).
PostgreSQL text cannot hold NUL characters: a key or value with one is a
``StoreError`` here (SQLite stores it).
"""

from __future__ import annotations

from ..sdk.errors import StoreError
from .pg import Conn, SharedConnection, create_tables
from .store import _check_key, _check_prefix, _check_value

_SCHEMA = """CREATE TABLE IF NOT EXISTS tartlet_kv (
    owner TEXT COLLATE "C" NOT NULL,
    key TEXT COLLATE "C" NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (owner, key))"""


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

    def __init__(self, url: str) -> None:
        self._db = SharedConnection(url, "key-value store", lambda c: create_tables(c, _SCHEMA))

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
        """
        _check_key(key)
        _check_value(value)
        _no_nul("key", key)
        _no_nul("value", value)
        self._db.run(lambda c: c.execute(
            "INSERT INTO tartlet_kv (owner, key, value) VALUES (%s, %s, %s) "
            "ON CONFLICT (owner, key) DO UPDATE SET value = EXCLUDED.value",
            (user, key, value),
        ))  # fmt: skip

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

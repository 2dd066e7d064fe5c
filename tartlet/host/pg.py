"""PostgreSQL connections for the state that server replicas share
(``[store] url``: the key-value store, the API keys, messaging).

Imported only when a URL is configured, so the single-process server never
imports psycopg. Errors are :class:`tartlet.sdk.errors.StoreError`; their
messages name the server with its password replaced by ``***``
(:func:`redact`) and never echo the password.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import LiteralString, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import psycopg
from psycopg.rows import TupleRow

from ..sdk.errors import StoreError

#: Seconds one connection attempt may take.
CONNECT_TIMEOUT_S = 10
#: Key of the advisory lock :func:`create_tables` holds ("tartlet" in ASCII).
SCHEMA_LOCK = 0x74617274_6C6574

Conn = psycopg.Connection[TupleRow]
T = TypeVar("T")


def redact(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@``, ``?password=``) replaced by ``***``."""
    try:
        u = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = u.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        if ":" in user:
            user = user.split(":", 1)[0] + ":***"
        netloc = f"{user}@{host}"
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", u.query)
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def _passwords(url: str) -> list[str]:
    """The password of ``url`` as written and decoded (what a message must not show)."""
    try:
        u = urlsplit(url)
        found = [u.password or ""] + [v for k, v in parse_qsl(u.query, keep_blank_values=True) if k.lower() == "password"]
    except ValueError:
        return []
    out = {p for p in found if p} | {unquote(p) for p in found if p}
    return sorted(out, key=len, reverse=True)


def describe(url: str, e: BaseException) -> str:
    """The message of ``e`` on one line, with any password of ``url`` replaced by ``***``."""
    msg = " ".join(str(e).split()) or type(e).__name__
    for secret in _passwords(url):
        msg = msg.replace(secret, "***")
    return msg.replace(url, redact(url))


def connect(url: str, autocommit: bool = True) -> Conn:
    """A new psycopg connection to ``url`` (libpq URL syntax), opened within
    :data:`CONNECT_TIMEOUT_S` seconds.

    Raises:
        StoreError: the server cannot be reached, refuses the login, or the
            URL is invalid (the message has no password).
    """
    try:
        return psycopg.connect(url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.Error as e:
        raise StoreError(f"cannot connect to PostgreSQL at {redact(url)}: {describe(url, e)}") from None


def create_tables(conn: Conn, *statements: LiteralString) -> None:
    """Run ``CREATE ... IF NOT EXISTS`` statements in one transaction holding
    the advisory lock :data:`SCHEMA_LOCK`, so replicas starting together do not
    race (two concurrent ``CREATE TABLE IF NOT EXISTS`` may fail in PostgreSQL).

    Raises:
        psycopg.Error: the statements fail.
    """
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        for s in statements:
            conn.execute(s)


class SharedConnection:
    """One autocommit connection used by many threads, one call at a time.

    A connection lost (PostgreSQL restarted, the backend terminated, the
    network dropped) is opened again once, transparently, and the call
    repeated, so keep each call idempotent (one statement or one transaction).

    Args:
        url: libpq connection URL.
        what: what it serves, for error messages (``"key-value store"``).
        setup: called on the first connection (e.g. :func:`create_tables`).

    Raises:
        StoreError: the first connection or ``setup`` fails.
    """

    def __init__(self, url: str, what: str, setup: Callable[[Conn], None] | None = None) -> None:
        self._url = url
        self.what = what
        self._lock = threading.Lock()
        self._closed = False
        self._conn: Conn | None = connect(url)
        if setup is not None:
            self.run(setup)

    def __repr__(self) -> str:
        return f"SharedConnection({redact(self._url)!r}, {self.what!r})"

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # a broken connection may fail to close; it is gone either way
                pass
            self._conn = None

    def run(self, fn: Callable[[Conn], T]) -> T:
        """``fn(connection)`` under the lock; after a lost connection
        (``psycopg.OperationalError``) connect again and call ``fn`` once more.

        Raises:
            StoreError: closed; PostgreSQL unreachable twice in a row; any
                other database error (a message without the password).
        """
        with self._lock:
            if self._closed:
                raise StoreError(f"the {self.what} is closed")
            for attempt in (0, 1):
                if self._conn is None or self._conn.closed:
                    self._conn = connect(self._url)
                try:
                    return fn(self._conn)
                except psycopg.OperationalError as e:
                    self._drop()
                    if attempt:
                        raise StoreError(f"{self.what} on PostgreSQL at {redact(self._url)}: {describe(self._url, e)}") from None
                except psycopg.Error as e:
                    raise StoreError(f"{self.what} on PostgreSQL: {describe(self._url, e)}") from None
            raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the connection; later calls raise StoreError."""
        with self._lock:
            self._closed = True
            self._drop()

"""API keys: ``tartlet auth add|list|remove`` and the server's check.

Keys live in a JSON file (``[auth] keys_file``) as SHA-256 hashes, never in
clear: ``{"keys": [{"user", "sha256", "prefix", "created"}]}``. A key is
``tk_`` + 32 random hex digits; it is shown once, when added. The server
rereads the file when it changes, so new keys work without a restart.
With ``[store] url`` they live in PostgreSQL instead (:class:`PgKeyStore`,
table ``tartlet_api_keys``), shared by every replica; :func:`key_store`
picks the one a config names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..host.pg import Conn
    from .config import ServerConfig

_USER = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class AuthError(PermissionError):
    """A missing or invalid API key."""


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _new_key(user: str) -> str:
    if not _USER.match(user or ""):
        raise ValueError(f"user names are 1-64 characters of letters, digits, _ . @ -, got {user!r}")
    return "tk_" + secrets.token_hex(16)


def _no_key() -> AuthError:
    return AuthError("this server needs an API key (Authorization: Bearer KEY; see `tartlet auth add`)")


class ApiKeyStore(Protocol):
    """What the server and ``tartlet auth`` call on a key store
    (:class:`KeyStore` or :class:`PgKeyStore`)."""

    def add(self, user: str) -> str: ...
    def list(self) -> list[dict[str, Any]]: ...
    def remove(self, who: str) -> int: ...
    def user_of(self, key: str | None) -> str: ...
    def close(self) -> None: ...


def key_store(cfg: ServerConfig) -> ApiKeyStore:
    """The API keys of ``cfg``: :class:`PgKeyStore` on ``[store] url`` when
    set, else :class:`KeyStore` on ``[auth] keys_file``.

    Raises:
        StoreError: the PostgreSQL database cannot be reached.
    """
    if cfg.store.url:
        return PgKeyStore(cfg.store.url)
    return KeyStore(cfg.auth.keys_file)


class KeyStore:
    """The keys file.

    Args:
        path: JSON file (created on the first ``add``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        self._cache: tuple[float, list[dict[str, Any]]] | None = None

    def _load(self) -> list[dict[str, Any]]:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return []
        if self._cache and self._cache[0] == mtime:
            return self._cache[1]
        try:
            keys: list[dict[str, Any]] = json.loads(self.path.read_text()).get("keys", [])
        except (json.JSONDecodeError, AttributeError) as e:
            raise AuthError(f"keys file {self.path} is not valid: {e}") from None
        self._cache = (mtime, keys)
        return keys

    def _save(self, keys: list[dict[str, Any]]) -> None:
        """Write the file atomically, created 0600 (its folder 0700 when new)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps({"keys": keys}, indent=2))
        tmp.replace(self.path)
        self._cache = None

    def add(self, user: str) -> str:
        """A new key for ``user`` (returned once, stored hashed).

        Raises:
            ValueError: a user name outside ``[A-Za-z0-9_.@-]{1,64}``.
        """
        key = _new_key(user)
        with self._lock:
            keys = list(self._load())
            keys.append({"user": user, "sha256": _digest(key), "prefix": key[:7], "created": int(time.time())})
            self._save(keys)
        return key

    def list(self) -> list[dict[str, Any]]:
        """``[{"user", "prefix", "created"}]`` (no hashes)."""
        with self._lock:
            return [{k: e[k] for k in ("user", "prefix", "created")} for e in self._load()]

    def remove(self, who: str) -> int:
        """Remove the keys of user ``who`` (or the key with prefix ``who``);
        returns how many were removed."""
        with self._lock:
            keys = self._load()
            kept = [e for e in keys if e["user"] != who and e["prefix"] != who]
            if len(kept) != len(keys):
                self._save(kept)
            return len(keys) - len(kept)

    def user_of(self, key: str | None) -> str:
        """The user owning ``key``.

        Raises:
            AuthError: no key, or an unknown one.
        """
        if not key:
            raise _no_key()
        d = _digest(key)
        with self._lock:
            for e in self._load():
                if hmac.compare_digest(e["sha256"], d):
                    user: str = e["user"]
                    return user
        raise AuthError("invalid API key")

    def close(self) -> None:
        """Nothing to release (the file is opened per call)."""


_PG_SCHEMA = """CREATE TABLE IF NOT EXISTS tartlet_api_keys (
    sha256 TEXT PRIMARY KEY,
    username TEXT NOT NULL,
    prefix TEXT NOT NULL,
    created BIGINT NOT NULL)"""


class PgKeyStore:
    """API keys in PostgreSQL (table ``tartlet_api_keys``: ``sha256``,
    ``username``, ``prefix``, ``created``; created when missing), the same
    interface as :class:`KeyStore`. Every call reads the table, so a key
    added or removed anywhere counts at once on every replica.

    Args:
        url: libpq connection URL (``[store] url``).

    Raises:
        StoreError: here and from every method: PostgreSQL cannot be
            reached (even after one reconnect); the message has no password.
    """

    def __init__(self, url: str) -> None:
        from ..host.pg import SharedConnection, create_tables

        self._db = SharedConnection(url, "API key store", lambda c: create_tables(c, _PG_SCHEMA))

    def add(self, user: str) -> str:
        """A new key for ``user`` (returned once, stored hashed).

        Raises:
            ValueError: a user name outside ``[A-Za-z0-9_.@-]{1,64}``.
        """
        key = _new_key(user)
        self._db.run(lambda c: c.execute(
            "INSERT INTO tartlet_api_keys (sha256, username, prefix, created) VALUES (%s, %s, %s, %s)",
            (_digest(key), user, key[:7], int(time.time())),
        ))  # fmt: skip
        return key

    def list(self) -> list[dict[str, Any]]:
        """``[{"user", "prefix", "created"}]`` (no hashes), oldest first."""
        rows = self._db.run(lambda c: c.execute("SELECT username, prefix, created FROM tartlet_api_keys ORDER BY created, prefix").fetchall())
        return [{"user": u, "prefix": p, "created": int(t)} for u, p, t in rows]

    def remove(self, who: str) -> int:
        """Remove the keys of user ``who`` (or the key with prefix ``who``);
        returns how many were removed."""

        def q(c: Conn) -> int:
            return c.execute("DELETE FROM tartlet_api_keys WHERE username = %s OR prefix = %s", (who, who)).rowcount

        return self._db.run(q)

    def user_of(self, key: str | None) -> str:
        """The user owning ``key`` (looked up by its hash).

        Raises:
            AuthError: no key, or an unknown one.
        """
        if not key:
            raise _no_key()
        d = _digest(key)
        row = self._db.run(lambda c: c.execute("SELECT username FROM tartlet_api_keys WHERE sha256 = %s", (d,)).fetchone())
        if row is None:
            raise AuthError("invalid API key")
        return str(row[0])

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

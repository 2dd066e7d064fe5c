"""Stored responses of ``POST /v1/responses`` (``store: true``), per user.

A record is one JSON file, ``<root>/<user key>/<response id>.json``
(``<user key>``: the first 32 hex digits of the SHA-256 of the user name;
files 0600, written to a temp file and renamed), holding the response
object, the conversation as chat messages (the reply included), the tools
it was rendered with, and the name of the KV snapshot that holds that
conversation's rendering (``resp-<id>``, in the user's own snapshot
namespace, saved by the ``openai-responses`` inferlet). Records and their
snapshots survive a restart (snapshots are persisted by the host), expire
``ttl_s`` after creation, and at most ``max_per_user`` are kept per user
(the oldest are deleted first). A user never sees another user's records:
their ids answer as unknown.

Pruning reads no record: the store keeps, per user, the ids it knows with
their creation and expiry times (read from the user's files once, at the
user's first store after a start), so a ``put`` costs one file write
however many records the user has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

_ID = re.compile(r"resp_[0-9a-f]{16,64}")


def snapshot_name(rid: str) -> str:
    """The KV snapshot name of response ``rid``."""
    return f"resp-{rid}"


class ResponseStore:
    """Records on disk under ``root``.

    Args:
        root: the folder (created 0700).
        ttl_s: seconds a record lives.
        max_per_user: records kept per user.
        drop_snapshot: ``drop_snapshot(user, name)`` deletes a KV snapshot
            (absent ones are ignored), called when a record goes.
    """

    def __init__(self, root: Path, ttl_s: float, max_per_user: int, drop_snapshot: Callable[[str, str], None]) -> None:
        self.root, self.ttl_s, self.max_per_user, self.drop_snapshot = Path(root), ttl_s, max_per_user, drop_snapshot
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._known: dict[str, dict[str, tuple[float, float]]] = {}  # user -> {id: (created, expires)}

    def _dir(self, user: str) -> Path:
        return self.root / hashlib.sha256(user.encode()).hexdigest()[:32]

    def _path(self, user: str, rid: str) -> Path | None:
        return self._dir(user) / f"{rid}.json" if _ID.fullmatch(rid) else None

    def put(self, user: str, record: dict[str, Any]) -> None:
        """Store ``record`` (``id``, ``created``, ...) for ``user``;
        drops expired records and the oldest past ``max_per_user``."""
        d = self._dir(user)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        record = dict(record, user=user, expires=record["created"] + self.ttl_s)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.chmod(tmp, 0o600)
            os.replace(tmp, d / f"{record['id']}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self._index(user)[record["id"]] = (record["created"], record["expires"])
        self.prune(user)

    def _index(self, user: str) -> dict[str, tuple[float, float]]:
        """``user``'s ``{id: (created, expires)}``, read from the user's
        files on first use (call with the lock held)."""
        known = self._known.get(user)
        if known is None:
            known = self._known[user] = {}
            for p in self._dir(user).glob("resp_*.json"):
                try:
                    rec = json.loads(p.read_text())
                except (OSError, ValueError):
                    continue
                known[p.stem] = (rec.get("created", 0), rec.get("expires", 0))
        return known

    def get(self, user: str, rid: str) -> dict[str, Any] | None:
        """``user``'s record ``rid``, or None (unknown, expired or another user's)."""
        p = self._path(user, rid)
        if p is None:
            return None
        try:
            rec: dict[str, Any] = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        if rec.get("user") != user:
            return None
        if rec.get("expires", 0) <= time.time():
            self._remove(user, rid)
            return None
        return rec

    def delete(self, user: str, rid: str) -> bool:
        """Delete ``user``'s record ``rid`` and its snapshot; False when absent."""
        if self.get(user, rid) is None:
            return False
        self._remove(user, rid)
        return True

    def _remove(self, user: str, rid: str) -> None:
        p = self._path(user, rid)
        if p is None:
            return
        with self._lock:
            self._known.get(user, {}).pop(rid, None)
            try:
                p.unlink()
            except FileNotFoundError:
                return
        try:
            self.drop_snapshot(user, snapshot_name(rid))
        except Exception:  # absent already, or its model is not served any more
            log.debug("snapshot of %s not deleted", rid, exc_info=True)

    def prune(self, user: str) -> None:
        """Drop ``user``'s expired records, then the oldest past ``max_per_user``."""
        now = time.time()
        with self._lock:
            known = list(self._index(user).items())
        live: list[tuple[float, str]] = []
        for rid, (created, expires) in known:
            if expires <= now:
                self._remove(user, rid)
            else:
                live.append((created, rid))
        live.sort()
        for _, rid in live[: max(0, len(live) - self.max_per_user)]:
            self._remove(user, rid)

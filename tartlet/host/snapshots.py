"""Named KV snapshots of one engine, in per-user namespaces.

A snapshot is an immutable sequence registered under a name. It holds
references to its pages (charged to its owner's snapshot account), so it
outlives the inferlet that saved it and is visible to later inferlets of the
same user until deleted or taken.

Namespaces. A name belongs to the user that saved it: another user neither
sees it in :meth:`SnapshotRegistry.names` nor can open, take or delete it
(to them it does not exist). Names starting with ``public/`` are shared:
every user can list and open them, only their creator can take or delete
them, and a public name is unique across users. Without auth every client is
the one user ``local``, so all snapshots are shared as before.

With a :class:`tartlet.host.snapshot_store.SnapshotStore` a snapshot is also
written to the data dir; after a restart it is registered again *on disk
only* (``seq`` is None) and its pages are loaded on first open or take. When
several replicas share the folder, a name saved by another replica is
registered on disk only when first asked for (see
:mod:`tartlet.host.snapshot_manager`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.core.sequence import Sequence
from ..sdk.errors import LimitError, SnapshotError

#: prefix of names every user may list and open
PUBLIC_PREFIX = "public/"
#: longest snapshot name, characters
MAX_NAME_CHARS = 256


@dataclass
class Snapshot:
    """A saved context.

    Attributes:
        owner: the user that saved it.
        name: its name (``public/...`` for a shared one).
        tokens: the token ids it holds.
        seq: its pages in the pool, or None while it lies on disk only.
        path: its file in the data dir (None: not persisted).
        last_used: ``time.time()`` of the last save/open, for LRU disk eviction.
        sha256: the checksum stamped in its file (``""``: not written yet);
            tells this copy from the file another replica saved under the
            same name.
        stamp: ``(inode, size, mtime ns)`` of its file when last checked
            against ``sha256`` (a cheap test that the file did not change).
        blobs: the page files its ``tartlet-kv-snapshot/2`` file names (hex
            SHA-256 ids, see :mod:`tartlet.host.snapshot_pages`); empty for
            a ``/1`` file or none.
    """

    owner: str
    name: str
    tokens: list[int]
    seq: Sequence | None = None
    path: Path | None = None
    last_used: float = field(default_factory=time.time)
    #: set once deleted or taken (a pending disk write then removes its file)
    deleted: bool = False
    #: serializes loading it from disk
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    sha256: str = ""
    stamp: tuple[int, int, int] | None = None
    blobs: tuple[str, ...] = ()


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid snapshot name.

    Raises:
        SnapshotError: not a string, empty, longer than 256 characters, or
            holding control characters.
    """
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"snapshot name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        raise SnapshotError(f"snapshot name is {len(name)} characters long, the limit is {MAX_NAME_CHARS}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise SnapshotError(f"snapshot name {name[:40]!r} holds control characters")
    if name.startswith(PUBLIC_PREFIX) and len(name) == len(PUBLIC_PREFIX):
        raise SnapshotError(f"a public snapshot needs a name after {PUBLIC_PREFIX!r}")
    return name


def _key(owner: str, name: str) -> tuple[str | None, str]:
    """Registry key: public names live in namespace None, others in their owner's."""
    return (None, name) if name.startswith(PUBLIC_PREFIX) else (owner, name)


class SnapshotRegistry:
    """``(namespace, name) -> Snapshot`` map of one engine. Thread-safe.

    Args:
        max_per_user: most snapshots one user may hold, public ones
            included (None: unlimited).
    """

    def __init__(self, max_per_user: int | None = None) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str | None, str], Snapshot] = {}
        self.max_per_user = max_per_user

    def add(self, snap: Snapshot, enforce_limit: bool = True) -> None:
        """Register ``snap`` under its owner's namespace (``enforce_limit``
        False: a snapshot restored from disk or put back, not counted
        against ``max_per_user``).

        Raises:
            SnapshotError: an invalid name, or the name is taken.
            LimitError: the owner holds ``max_per_user`` snapshots already.
        """
        check_name(snap.name)
        key = _key(snap.owner, snap.name)
        with self._lock:
            if key in self._by_key:
                raise SnapshotError(f"a snapshot named {snap.name!r} already exists")
            cap = self.max_per_user
            if enforce_limit and cap is not None and self.count(snap.owner, locked=True) >= cap:
                raise LimitError(
                    f"user {snap.owner or '(local)'!r} holds {cap} snapshots, the limit "
                    "(limits.max_snapshots_per_user): delete some first"
                )
            self._by_key[key] = snap

    def get(self, owner: str, name: str) -> Snapshot:
        """The snapshot ``owner`` sees under ``name`` (its own or a public one).

        Raises:
            SnapshotError: no such snapshot for this user.
        """
        check_name(name)
        with self._lock:
            snap = self._by_key.get(_key(owner, name))
        if snap is None:
            raise SnapshotError(f"no snapshot named {name!r}")
        return snap

    def pop(self, owner: str, name: str) -> Snapshot:
        """Remove and return ``owner``'s snapshot ``name``.

        Raises:
            SnapshotError: absent, or a public snapshot another user created.
        """
        check_name(name)
        key = _key(owner, name)
        with self._lock:
            snap = self._by_key.get(key)
            if snap is None:
                raise SnapshotError(f"no snapshot named {name!r}")
            if snap.owner != owner:
                raise SnapshotError(f"snapshot {name!r} belongs to another user: only its creator may take or delete it")
            del self._by_key[key]
            return snap

    def discard(self, snap: Snapshot) -> None:
        """Unregister ``snap`` if it is still registered (a failed save)."""
        key = _key(snap.owner, snap.name)
        with self._lock:
            if self._by_key.get(key) is snap:
                del self._by_key[key]

    def names(self, owner: str) -> list[str]:
        """Names ``owner`` can open: its own and the public ones, sorted."""
        with self._lock:
            return sorted(n for (ns, n) in self._by_key if ns is None or ns == owner)

    def all_names(self) -> list[str]:
        """Every name of every user, sorted (for operators and tests)."""
        with self._lock:
            return sorted(n for (_, n) in self._by_key)

    def all(self) -> list[Snapshot]:
        """Every registered snapshot, of every user."""
        with self._lock:
            return list(self._by_key.values())

    def owned_by(self, owner: str) -> list[Snapshot]:
        """``owner``'s snapshots (public ones it created included)."""
        with self._lock:
            return [s for s in self._by_key.values() if s.owner == owner]

    def count(self, owner: str, locked: bool = False) -> int:
        """Snapshots ``owner`` holds (``locked``: the caller holds the lock)."""
        if not locked:
            with self._lock:
                return self.count(owner, locked=True)
        return sum(1 for s in self._by_key.values() if s.owner == owner)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

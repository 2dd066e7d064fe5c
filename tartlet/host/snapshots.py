"""Named KV snapshots, engine-wide.

A snapshot is an immutable sequence registered under a name. It holds
references to its pages, so it outlives the inferlet that saved it and is
visible to every later inferlet on the same engine until deleted or taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..engine.sequence import Sequence
from .errors import SnapshotError


@dataclass
class Snapshot:
    """A saved context: its sequence (filled on the scheduler thread) and
    the tokens it holds."""

    seq: Sequence
    tokens: list[int]


class SnapshotRegistry:
    """Name -> :class:`Snapshot` map of one engine. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Snapshot] = {}

    def add(self, name: str, snap: Snapshot) -> None:
        """Register ``snap``.

        Raises:
            SnapshotError: the name is taken, empty or not a string.
        """
        if not isinstance(name, str) or not name:
            raise SnapshotError(f"snapshot name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._by_name:
                raise SnapshotError(f"a snapshot named {name!r} already exists")
            self._by_name[name] = snap

    def get(self, name: str) -> Snapshot:
        """Raises: SnapshotError when no snapshot has this name."""
        with self._lock:
            try:
                return self._by_name[name]
            except KeyError:
                raise SnapshotError(f"no snapshot named {name!r}") from None

    def pop(self, name: str) -> Snapshot:
        """Remove and return a snapshot. Raises: SnapshotError when absent."""
        with self._lock:
            try:
                return self._by_name.pop(name)
            except KeyError:
                raise SnapshotError(f"no snapshot named {name!r}") from None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

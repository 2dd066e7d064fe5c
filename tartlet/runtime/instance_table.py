"""The instance table of a server's runtimes: every running instance, and
the recently ended ones, bounded.

``list`` and ``attach`` of the protocol show an ended instance for a while
(its status, result, error; a reattached client gets its output backlog),
so ended instances are kept, but not without bound: a server that answered
one OpenAI request or launch per 10 ms would otherwise hold 60,000 ended
instances after the :data:`RETAIN_ENDED_S` window, scanned on every launch
(issue 40's soak: the server slowed down and grew ~60 MiB per 2-minute
cycle, all of it finished instances and their channels). The table keeps:

- the running instances, indexed, so the per-user instance caps and the
  ``running`` gauge cost O(running), not O(everything ever launched);
- the ended ones in the order they ended, each dropped after
  :data:`RETAIN_ENDED_S` seconds, or sooner when more than
  :data:`MAX_ENDED_PER_OWNER` ended instances of its owner or
  :data:`MAX_ENDED` in all are kept (oldest first). ``on_drop`` (the
  server's: drops the instance's client channel) is called for each.

A dict subclass: the runtimes and the server read it as the plain
``id -> Instance`` map it was; :meth:`ended` is the runtimes' call when an
instance ends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .instance import Instance

#: Seconds an ended instance stays listed (and attachable).
RETAIN_ENDED_S = 600.0
#: Ended instances kept in all, and per owner (the oldest dropped first).
MAX_ENDED = 2048
MAX_ENDED_PER_OWNER = 256


class InstanceTable(dict[str, Instance]):
    """Instances by id: the running ones and the most recent ended ones
    (module docstring).

    Attributes:
        on_drop: called with the id of each ended instance dropped from
            the table (None: nothing).
    """

    def __init__(self, retain_s: float = RETAIN_ENDED_S, max_ended: int = MAX_ENDED,
                 max_ended_per_owner: int = MAX_ENDED_PER_OWNER) -> None:  # fmt: skip
        super().__init__()
        self.retain_s, self.max_ended, self.max_ended_per_owner = retain_s, max_ended, max_ended_per_owner
        self.on_drop: Callable[[str], None] | None = None
        self._running: dict[str, Instance] = {}
        self._ended: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (when it ended, owner), oldest first
        self._ended_by_owner: dict[str, OrderedDict[str, None]] = {}

    def __setitem__(self, iid: str, inst: Instance) -> None:
        if iid in self:
            self._forget(iid)
        super().__setitem__(iid, inst)
        if inst.finished_at is None:
            self._running[iid] = inst
        else:
            self._note_ended(inst)

    def __delitem__(self, iid: str) -> None:
        super().__delitem__(iid)
        self._forget(iid)

    def pop(self, iid: str, *default: Any) -> Any:
        inst = super().pop(iid, *default)
        self._forget(iid)
        return inst

    def clear(self) -> None:
        super().clear()
        self._running.clear()
        self._ended.clear()
        self._ended_by_owner.clear()

    # -- the runtimes' side ---------------------------------------------------------
    def ended(self, inst: Instance) -> None:
        """``inst`` ended (its ``finished_at`` is set): move it from the
        running index to the ended ones, and drop what is past the bounds."""
        if inst.id in self and self._running.pop(inst.id, None) is not None:
            self._note_ended(inst)
        self.prune()

    def running(self, owner: str | None = None) -> list[Instance]:
        """Running instances (of ``owner`` when given), in launch order."""
        return [i for i in self._running.values() if owner is None or i.owner == owner]

    def running_count(self) -> int:
        return len(self._running)

    def prune(self, now: float | None = None) -> None:
        """Drop the ended instances past :attr:`retain_s`, and the oldest
        beyond the count bounds."""
        now = time.time() if now is None else now
        while self._ended:
            iid, (at, _owner) = next(iter(self._ended.items()))
            if now - at <= self.retain_s and len(self._ended) <= self.max_ended:
                break
            self._drop(iid)

    # -- internals ------------------------------------------------------------------
    def _note_ended(self, inst: Instance) -> None:
        self._ended[inst.id] = (inst.finished_at or time.time(), inst.owner)
        mine = self._ended_by_owner.setdefault(inst.owner, OrderedDict())
        mine[inst.id] = None
        while len(mine) > self.max_ended_per_owner:
            self._drop(next(iter(mine)))

    def _drop(self, iid: str) -> None:
        if iid in self:
            del self[iid]
        else:
            self._forget(iid)
        if self.on_drop is not None:
            self.on_drop(iid)

    def _forget(self, iid: str) -> None:
        self._running.pop(iid, None)
        entry = self._ended.pop(iid, None)
        if entry is not None:
            mine = self._ended_by_owner.get(entry[1])
            if mine is not None:
                mine.pop(iid, None)
                if not mine:
                    del self._ended_by_owner[entry[1]]

"""Per-user reservations of a resource held while instances run (the linear
memory sandboxed instances may grow to, for one)."""

from __future__ import annotations

import threading

from ..sdk.errors import LimitError


class UserReservations:
    """Amounts reserved per user against one cap.

    Args:
        cap: the most one user may hold at once (None: unbounded; amounts
            are still counted).
        key: the config key of the cap, named in errors
            (``"[limits] max_sandbox_memory_mb_per_user"``).
        unit: the amounts' unit, for messages (``"MiB"``).
    """

    def __init__(self, cap: int | None, key: str, unit: str) -> None:
        self.cap, self.key, self.unit = cap, key, unit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def reserve(self, owner: str, amount: int) -> None:
        """Hold ``amount`` more for ``owner``.

        Raises:
            LimitError: ``owner`` would hold more than ``cap`` (nothing is reserved).
        """
        with self._lock:
            held = self._held.get(owner, 0)
            if self.cap is not None and held + amount > self.cap:
                raise LimitError(
                    f"user {owner or '(local)'!r} holds {held} {self.unit} of sandbox memory in running instances; "
                    f"another {amount} {self.unit} would pass the limit ({self.key} = {self.cap})"
                )
            self._held[owner] = held + amount

    def release(self, owner: str, amount: int) -> None:
        """Give back ``amount`` of what ``owner`` reserved."""
        with self._lock:
            left = self._held.get(owner, 0) - amount
            if left > 0:
                self._held[owner] = left
            else:
                self._held.pop(owner, None)

    def held(self, owner: str) -> int:
        """What ``owner`` holds now."""
        with self._lock:
            return self._held.get(owner, 0)

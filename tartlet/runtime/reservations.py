"""Per-user reservations of a resource held while instances run (the linear
memory sandboxed instances may grow to, for one), and per-user CPU shares of
sandboxed instance threads."""

from __future__ import annotations

import threading
import time

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


class CpuShares:
    """A CPU-time budget per user for sandboxed instance threads: a user's
    threads together may use ``cores`` CPU-seconds per second of wall time
    (a token bucket of CPU-seconds holding ``burst_s`` seconds' worth); a
    thread whose user is over budget is told to sleep until it refills.

    Args:
        cores: CPU-seconds per second one user's threads may use together
            (None: unbounded).
        burst_s: wall seconds' worth of CPU a user may use at once, ahead of
            the rate.
    """

    def __init__(self, cores: float | None, burst_s: float = 0.2) -> None:
        self.cores, self.burst_s = cores, burst_s
        self._buckets: dict[str, tuple[float, float]] = {}  # owner -> (CPU-seconds left, at)
        self._lock = threading.Lock()

    def charge(self, owner: str, cpu_s: float) -> float:
        """Count ``cpu_s`` CPU-seconds used by one of ``owner``'s threads;
        returns the seconds that thread should sleep (0: within budget)."""
        if self.cores is None:
            return 0.0
        now = time.monotonic()
        cap = self.cores * self.burst_s
        with self._lock:
            left, at = self._buckets.get(owner, (cap, now))
            left = min(cap, left + (now - at) * self.cores) - cpu_s
            self._buckets[owner] = (left, now)
            if len(self._buckets) > 10_000:  # forget full buckets of gone users
                self._buckets = {o: (x, t) for o, (x, t) in self._buckets.items() if x + (now - t) * self.cores < cap}
        return -left / self.cores if left < 0 else 0.0

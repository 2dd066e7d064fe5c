"""Whether the configured per-user limits fit the machine's memory.

Every per-user bound on memory (``[limits]`` and ``[code]``) holds for one
user; ``users`` of them at their maxima may together need more memory than
the machine has. :func:`memory_warnings` says so (``tartlet serve`` logs
each line at start): with ``users`` the users that have API keys when the
server starts (1 with auth off), it adds up, per user,

- sandboxed instances' linear memory: ``max_sandbox_memory_mb_per_user``,
  or ``[programs] sandbox_memory_mb`` times ``max_instances_per_user`` when
  that is smaller;
- session messages waiting (``max_backlog_bytes``) and messaging bytes
  (``max_messaging_bytes_per_user``);
- code runs: ``[code] max_running_per_user`` times ``max_memory_mb`` (the
  worker processes are shared, at most ``[code] workers`` of them run).

KV pages are not counted: the page pool is allocated once, whatever users do.
"""

from __future__ import annotations

import os

from .config import ServerConfig

MIB = 2**20


def machine_ram() -> int | None:
    """Physical memory of this machine, bytes (None when unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def per_user_bytes(cfg: ServerConfig) -> dict[str, int | None]:
    """The most memory one user may hold through each bounded resource,
    bytes (None: unbounded)."""
    lim, code = cfg.limits, cfg.code
    caps = [c for c in (
        lim.max_sandbox_memory_mb_per_user,
        None if lim.max_instances_per_user is None else cfg.programs.sandbox_memory_mb * lim.max_instances_per_user,
    ) if c is not None]  # fmt: skip
    out: dict[str, int | None] = {
        "sandboxed instances (max_sandbox_memory_mb_per_user)": min(caps) * MIB if caps else None,
        "session messages waiting (max_backlog_bytes)": lim.max_backlog_bytes,
        "messaging (max_messaging_bytes_per_user)": lim.max_messaging_bytes_per_user,
    }
    if code.enabled:
        out["code runs ([code] max_running_per_user x max_memory_mb)"] = min(code.max_running_per_user, code.workers) * code.max_memory_mb * MIB
    return out


def memory_warnings(cfg: ServerConfig, users: int, ram: int | None) -> list[str]:
    """Warnings (empty when all is well) when ``users`` users at their
    per-user maxima would need more than ``ram`` bytes, or a per-user
    memory bound is unlimited."""
    parts = per_user_bytes(cfg)
    out = [f"{what} is unbounded per user: one user can use all the memory" for what, n in parts.items() if n is None]
    if ram is None or out:
        return out
    one = sum(n for n in parts.values() if n is not None)
    users = max(1, users)
    if one * users > ram:
        detail = ", ".join(f"{what} {n / MIB:.0f} MiB" for what, n in parts.items() if n)
        out.append(
            f"{users} user(s) at their [limits] maxima may hold {one * users / MIB:.0f} MiB, more than this machine's "
            f"{ram / MIB:.0f} MiB of RAM (per user: {detail}); lower those limits or expect the server to run out of memory"
        )
    return out


def user_count(keys: object, auth: bool) -> int:
    """Users with API keys (1 with auth off, or when they cannot be listed)."""
    if not auth:
        return 1
    try:
        return len({e["user"] for e in keys.list()})  # type: ignore[attr-defined]
    except Exception:  # a key store that cannot be read now: the server reports that itself
        return 1

"""What the host shares across inferlet instances: the loaded engines, their
users' KV page accounts and their named snapshots."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.core.engine import Engine
from ..sdk._binding import hold_wakeups
from .adapter_manager import AdapterManager
from .code_sandbox import CodeSandbox
from .fair_gate import FairGate
from .kv_quotas import KvAccounts, KvLimits
from .messaging import Bus, MessageBus
from .rate_limits import RateLimits
from .snapshot_manager import SnapshotManager

if TYPE_CHECKING:
    from .http import HttpFetcher
    from .store import KVStore


class ModelSlot:
    """One served model: its engine, its users' page accounts and its
    named snapshots."""

    def __init__(self, engine: Engine, limits: KvLimits | None = None, speculative: dict[str, Any] | None = None) -> None:
        self.engine = engine
        #: the server's speculative decoding for this model (``[[models]]
        #: speculative``: method, max_draft, max_ngram, min_ngram, max_batch), or None
        self.speculative = speculative
        self.accounts = KvAccounts(limits, engine.pool.num_pages)
        #: per-user queues in front of the scheduler: every forward pass and
        #: context command of the host goes through it (:mod:`.fair_gate`)
        self.gate = FairGate(engine.scheduler)
        self.snapshots = SnapshotManager(engine, self.accounts, self.gate)
        #: the served and the users' LoRA adapters (:mod:`tartlet.host.adapter_manager`)
        self.adapters = AdapterManager(engine)


class HostState:
    """Engines by model name; the first one added is the default model.

    Raises (``model``):
        ValueError: an unknown model name, listing the served ones.
    """

    def __init__(self) -> None:
        self.models: dict[str, ModelSlot] = {}
        self.default_model: str | None = None
        self.bus: Bus = MessageBus()  # inferlet messaging (tartlet.host.messaging; pg_messaging for replicas)
        self.store: KVStore | None = None  # tartlet.host.store.Store or pg_store.PgStore; None: an in-memory one on first use
        self.http: HttpFetcher | None = None  # tartlet.host.http.HttpFetcher; None: HTTP from inferlets is off
        self.mcp_servers: dict[str, str] = {}  # configured MCP servers: name -> endpoint URL
        self.kv_limits = KvLimits()
        #: runs Python snippets in WASM for inferlets (``code-run``); builds nothing until first used
        self.code_sandbox: CodeSandbox | None = CodeSandbox()
        #: per-user rates of launches, builds, allocating calls and messaging (None: unlimited)
        self.rates: RateLimits | None = None

    def add_engine(self, engine: Engine, name: str | None = None, speculative: dict[str, Any] | None = None) -> None:
        """Serve ``engine`` as ``name`` (default: the engine's), with the
        server's speculative decoding settings for it (see :class:`ModelSlot`)."""
        name = name or engine.name
        self.models[name] = ModelSlot(engine, self.kv_limits, speculative)
        # a step's token streams wake the inferlets' event loop once
        engine.scheduler.hold_wakeups = hold_wakeups
        if self.default_model is None:
            self.default_model = name

    def configure_kv(self, limits: KvLimits, snapshot_dir: Path | None = None, shared: bool = False) -> int:
        """Apply KV limits to every served model and, with ``snapshot_dir``,
        persist named snapshots there (restoring those already saved).
        Returns the number of snapshots restored.

        ``shared``: other servers (replicas, each with its own host state)
        use the same ``snapshot_dir``: a save returns once its file is on
        disk, and names saved, saved again or deleted through another
        replica are seen here (see :mod:`tartlet.host.snapshot_manager`;
        quotas stay per replica). Ignored without ``snapshot_dir``.

        Raises:
            OSError: ``snapshot_dir`` cannot be created.
        """
        self.kv_limits = limits
        restored = 0
        budget = None if limits.max_snapshot_disk_mb_per_user is None else int(limits.max_snapshot_disk_mb_per_user * 2**20)
        for slot in self.models.values():
            slot.accounts.set_limits(limits)
            slot.snapshots.registry.max_per_user = limits.max_snapshots_per_user
            if snapshot_dir is not None:
                restored += slot.snapshots.enable_persistence(Path(snapshot_dir), budget, shared=shared)
        return restored

    def configure_adapters(self, max_bytes_per_user: int | None, adapter_dir: Path | None = None, shared: bool = False) -> int:
        """Apply the per-user adapter quota (bytes, None: unlimited) to every
        served model and, with ``adapter_dir``, keep users' saved adapters
        there (registering those already saved). Returns how many were
        restored.

        ``shared``: other servers (replicas, each with its own host state)
        use the same ``adapter_dir``: adapters saved, saved again or deleted
        through another replica are seen here at their next use or listing,
        and the quota counts the folder's (see
        :mod:`tartlet.host.adapter_manager`). Ignored without ``adapter_dir``.

        Raises:
            OSError: ``adapter_dir`` cannot be created.
        """
        restored = 0
        for slot in self.models.values():
            slot.adapters.max_bytes_per_user = max_bytes_per_user
            if adapter_dir is not None:
                restored += slot.adapters.enable_persistence(Path(adapter_dir), shared=shared)
        return restored

    def model(self, name: str | None) -> ModelSlot:
        key = name or self.default_model
        try:
            if key is None:  # no model added yet
                raise KeyError(name)
            return self.models[key]
        except KeyError:
            served = ", ".join(self.models) or "none"
            raise ValueError(f"model {name!r} is not served here (served: {served})") from None

    def close(self) -> None:
        """Stop the code sandbox, write every queued snapshot (waiting for
        saves still queued on a scheduler) and stop the engines."""
        if self.code_sandbox is not None:
            self.code_sandbox.close()
        for slot in self.models.values():
            slot.snapshots.close()
            slot.engine.close()


def gc_for_serving(young: int = 20_000) -> int:
    """Set the garbage collector up for a long run, once the models are
    loaded and the server or run is set up (``tartlet serve``, ``tartlet
    run``, a Ray replica): collect, then move every object alive now into
    the permanent generation (:func:`gc.freeze`), and let ``young``
    container allocations (not 700) pass before a young collection.

    The engine, torch, the tokenizers and the modules are a few hundred
    thousand tracked objects that live as long as the process: each full
    collection walked them all (~100 ms holding the GIL, every ~2 s of 64
    concurrent text-completion streams on the CPU with the tiny model;
    more objects with a real one), and a decode step of 64 streams
    allocates past 700 objects, so a young collection (~0.1 ms) ran about
    once a step. Objects frozen here that become cyclic garbage later are
    not freed (reference counting still frees the rest);
    :func:`gc.unfreeze` and :func:`gc.set_threshold` undo it.

    Returns:
        The number of objects frozen.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)
    return gc.get_freeze_count()

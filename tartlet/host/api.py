"""The host API: every call an inferlet can make, implemented once.

One :class:`HostApi` object serves one inferlet instance. The native runtime
calls it directly (through :mod:`tartlet.sdk._binding`); the WASM runtime calls it
from its WIT host functions. Arguments are plain data (ints, strings, lists,
dicts) and the SDK's typed records (:class:`tartlet.sdk.forward.OutputSlot`), so
the same calls map onto WIT types. Every argument is validated here, because
a sandboxed caller is untrusted: a bad call raises a ``ValueError`` subclass
naming the problem and changes nothing.

Handles are small integers private to the instance. Calls that wait on the
engine return a :class:`concurrent.futures.Future`; the runtime turns it into
something the inferlet can await (native) or block on (WASM ``wait-any``).

Ordering: context edits (fork, truncate, mask, save, ...) are queued on the
scheduler behind earlier forward passes of the same context, so an inferlet
sees its calls take effect in the order it made them. The host keeps each
context's token list as submitted, so lengths and bounds are checked at call
time.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..engine.core.kv_accounting import PageAccount
from .adapter_api import AdapterFork, AdapterHostMixin
from .context_api import HostContext
from .grammar import Matcher
from .inference_api import InferenceHostMixin
from .io_api import ChildLauncher, IoHostMixin
from .model_api import ModelHostMixin
from .session import Session
from .snapshot_api import SnapshotHostMixin
from .state import HostState
from .token_stream import TokenStream

if TYPE_CHECKING:
    from .messaging import Message


class HostApi(ModelHostMixin, AdapterHostMixin, SnapshotHostMixin, InferenceHostMixin, IoHostMixin):
    """Host calls of one instance, one mixin per WIT interface: models
    (:class:`~.model_api.ModelHostMixin`; LoRA adapters:
    :class:`~.adapter_api.AdapterHostMixin`), contexts and snapshots
    (:class:`~.context_api.ContextHostMixin`,
    :class:`~.snapshot_api.SnapshotHostMixin`), forward passes
    (:class:`~.inference_api.InferenceHostMixin`, with the grammar matchers
    of :class:`~.grammar_api.GrammarHostMixin`), I/O
    (:class:`~.io_api.IoHostMixin`); here the instance's state and its end.

    Everything an instance's calls depend on is given here, once; nothing
    is set on it afterwards.

    Args:
        state: the engines and registries shared by all instances.
        session: this instance's client session.
        instance_id: shown in errors and logs, names its page account.
        owner: the instance's user: scopes snapshots, messaging, the store,
            code runs and KV quotas ("" locally).
        runtime: launches the instance's children (``child_launch``;
            None: children are refused).
        max_pages: distinct KV pages the instance's contexts may hold per
            model (None: unlimited; its page account enforces it, see
            :mod:`tartlet.host.kv_quotas`).
    """

    def __init__(
        self,
        state: HostState,
        session: Session | None = None,
        *,
        instance_id: str = "",
        owner: str = "",
        runtime: ChildLauncher | None = None,
        max_pages: int | None = None,
    ) -> None:
        self.state = state
        self.session = session or Session()
        self.instance_id = instance_id
        self.owner = owner
        self.runtime = runtime
        self.max_pages = max_pages
        self._init_io()
        self._matchers: dict[int, Matcher] = {}
        self._contexts: dict[int, HostContext] = {}
        self._accounts: dict[int, PageAccount] = {}  # id(slot) -> this instance's page account there
        self._decoders: dict[int, Any] = {}
        self._streams: dict[int, TokenStream] = {}
        self._adapter_forks: dict[tuple[int, str], AdapterFork] = {}  # (id(model slot), name) -> this instance's fork
        self._ids = itertools.count(1)
        self.closed = False

    # -- stats -------------------------------------------------------------------
    def kv_stats(self, model: str | None) -> dict[str, int]:
        """Page counts of a model's pool: ``total``, ``free``, ``cached``,
        ``used``, ``page_size``; and its engine's load, ``batch_requests``:
        the requests of its last model call (:attr:`SchedulerStats.last_batch
        <tartlet.engine.core.stats.SchedulerStats.last_batch>`), which
        speculative decoding reads to stop drafting when the batch is full."""
        engine = self.state.model(model).engine
        return {**vars(engine.pool.stats()), "batch_requests": engine.scheduler.stats.last_batch}

    # -- session -----------------------------------------------------------------
    def session_send(self, msg: str | bytes) -> None:
        self.session.send(msg)

    def session_receive(self) -> Future[Message]:
        return self.session.receive()

    # -- end of instance -----------------------------------------------------------
    def close(self) -> None:
        """Free every context, decoder and adapter fork this instance still
        holds (the instance ended, failed or was killed). Snapshots and
        saved adapters stay."""
        if self.closed:
            return
        self.closed = True
        for ctx in self._contexts.values():
            self._free_later(ctx)
        self._contexts.clear()
        self._decoders.clear()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._grammar_close()
        self._adapters_close()

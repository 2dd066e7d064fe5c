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
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import torch

from ..engine.core.engine import Engine
from ..engine.core.kv_accounting import PageAccount
from ..engine.core.sampler import OutputSlot as EngineSlot, ProbeSpec, SamplerSpec
from ..engine.core.scheduler import ForwardRequest
from ..engine.core.sequence import Sequence
from ..sdk.errors import InvalidHandleError, KvCacheFullError, LimitError, SamplingError
from ..sdk.forward import OutputSlot
from ..sdk.sampler import step_seed
from .grammar import GrammarOutputSlot, Matcher
from .grammar_api import GrammarHostMixin
from .io_api import ChildLauncher, IoHostMixin
from .session import Session
from .state import HostState, ModelSlot
from .token_stream import TokenStream

if TYPE_CHECKING:
    from .messaging import Message

T = TypeVar("T")

#: Largest number of input tokens in one forward call.
MAX_FORWARD_TOKENS = 65536
#: Largest number of output slots in one forward call.
MAX_OUTPUT_SLOTS = 4096


class HostContext:
    """Host-side record of one inferlet context."""

    def __init__(self, slot: ModelSlot, seq: Sequence, tokens: list[int]) -> None:
        self.slot = slot
        self.seq = seq
        self.tokens = tokens  # as submitted
        self.lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        return self.slot.engine


class HostApi(IoHostMixin, GrammarHostMixin):
    """Host calls of one instance (context, forward pass and model calls
    here; I/O in :class:`IoHostMixin`, grammar matchers in
    :class:`GrammarHostMixin`).

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
        self._ids = itertools.count(1)
        self.closed = False

    # -- models --------------------------------------------------------------
    def model_names(self) -> list[str]:
        """Names of the served models; the first is the default."""
        names = list(self.state.models)
        d = self.state.default_model
        return [d] + [n for n in names if n != d] if d else names

    def model_info(self, model: str | None) -> dict[str, Any]:
        """Facts about a model: ``name``, ``vocab_size``, ``eos_token_ids``,
        ``bos_token_id``, ``page_size``, ``max_seq_len``,
        ``has_chat_template``, ``add_bos_token`` (the model expects
        ``bos_token_id`` first in every sequence).

        Raises:
            ValueError: the model is not served.
        """
        slot = self.state.model(model)
        e = slot.engine
        return {
            "name": model or self.state.default_model,
            "vocab_size": e.config.vocab_size,
            "eos_token_ids": list(e.tokenizer.eos_token_ids),
            "bos_token_id": e.tokenizer.bos_token_id,
            "page_size": e.pool.page_size,
            "max_seq_len": e.scheduler.max_seq_len,
            "has_chat_template": e.tokenizer.chat_template is not None,
            "add_bos_token": e.tokenizer.add_bos_token,
        }

    def tokenize(self, model: str | None, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings become special tokens."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize takes a str, got {type(text).__name__}")
        return self.state.model(model).engine.tokenizer.encode(text)

    def detokenize(self, model: str | None, ids: list[int]) -> str:
        """Text of token ids (special tokens included).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        e = self.state.model(model).engine
        self._check_ids(e, ids)
        return e.tokenizer.decode(ids)

    def apply_chat_template(
        self, model: str | None, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the model's own chat template (jinja2).

        Args:
            messages: dicts with ``role`` (str) and ``content`` (str or
                None); an assistant message may carry ``tool_calls`` (a list
                of ``{"id", "type": "function", "function": {"name",
                "arguments": dict}}``, the Hugging Face convention), a tool
                message ``tool_call_id`` and ``name`` (str).
            add_generation_prompt: append the assistant header.
            tools: the template's ``tools`` variable (OpenAI shape, see
                :mod:`tartlet.sdk.tools`), or None.

        Raises:
            ValueError: the model has no chat template, a message or the
                tool list has the wrong shape, or the template rejects them.
        """
        tok = self.state.model(model).engine.tokenizer
        if tok.chat_template is None:
            raise ValueError(f"model {model or self.state.default_model!r} has no chat template")
        msgs = [_chat_message(i, m) for i, m in enumerate(messages)]
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of dicts (OpenAI shape: {'type': 'function', 'function': {...}})")
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)

    def decoder_new(self, model: str | None) -> int:
        """A streaming detokenizer handle (UTF-8 safe, see ``decoder_push``)."""
        h = next(self._ids)
        self._decoders[h] = self.state.model(model).engine.tokenizer.decode_stream()
        return h

    def decoder_push(self, handle: int, ids: list[int]) -> str:
        """Feed token ids; returns the text they complete (possibly empty
        while a multi-byte character is still split)."""
        dec = self._decoders.get(handle)
        if dec is None:
            raise InvalidHandleError(f"no decoder with handle {handle}")
        return "".join(dec.step(i) for i in ids)

    def decoder_free(self, handle: int) -> None:
        self._decoders.pop(handle, None)

    # -- contexts --------------------------------------------------------------
    def _ctx(self, handle: int) -> HostContext:
        c = self._contexts.get(handle)
        if c is None:
            raise InvalidHandleError(f"no context with handle {handle!r} (destroyed, or never created)")
        return c

    def _add(self, ctx: HostContext) -> int:
        h = next(self._ids)
        self._contexts[h] = ctx
        return h

    def _account(self, slot: ModelSlot) -> PageAccount:
        """This instance's page account on ``slot``'s model (made on first use)."""
        acc = self._accounts.get(id(slot))
        if acc is None:
            acc = slot.accounts.instance(self.owner, self.instance_id, self.max_pages)
            self._accounts[id(slot)] = acc
        return acc

    def _new_seq(self, slot: ModelSlot) -> Sequence:
        """An empty sequence on ``slot``'s pool, charged to this instance.

        Raises:
            LimitError: the instance has ``max_contexts_per_instance`` contexts open.
        """
        cap = slot.accounts.limits.max_contexts_per_instance
        if cap is not None and len(self._contexts) >= cap:
            raise LimitError(
                f"the instance has {len(self._contexts)} contexts open, the limit "
                "(limits.max_contexts_per_instance): free some first"
            )
        return Sequence(slot.engine.pool, self._account(slot))

    def context_new(self, model: str | None) -> int:
        """An empty context on ``model``; returns its handle.

        Raises:
            LimitError: too many open contexts.
        """
        slot = self.state.model(model)
        return self._add(HostContext(slot, self._new_seq(slot), []))

    def context_fork(self, handle: int) -> int:
        """A copy of a context sharing its full pages (copy-on-write); the
        copy happens after the parent's queued forward passes.

        Raises:
            KvQuotaError: the copied tail page would pass a page quota.
            LimitError: too many open contexts.
        """
        parent = self._ctx(handle)
        seq = self._new_seq(parent.slot)
        fresh = 1 if len(parent.tokens) % parent.engine.pool.page_size else 0  # the copied tail page
        child = HostContext(parent.slot, seq, list(parent.tokens))
        _pending(seq.account, fresh, lambda: self._fork_later(parent.engine, parent.seq, child.seq))
        return self._add(child)

    def _fork_later(self, engine: Engine, src: Sequence, dst: Sequence) -> Future[None]:
        def run() -> None:
            if src.freed:
                dst.free(src.error or "forked from a destroyed context")
                return
            try:
                src.fork_into(dst)
            except KvCacheFullError as e:
                dst.free(f"fork failed: {e}")
                raise

        return engine.scheduler.command(run, src, dst)

    def context_free(self, handle: int) -> None:
        """Destroy a context and release its pages (after its queued passes)."""
        ctx = self._contexts.pop(handle, None)
        if ctx is None:
            raise InvalidHandleError(f"no context with handle {handle!r}")
        self._free_later(ctx)

    def _free_later(self, ctx: HostContext) -> None:
        seq = ctx.seq
        try:
            ctx.engine.scheduler.command(seq.free, seq)
        except RuntimeError:  # scheduler stopped: nothing runs any more
            seq.free()

    def context_tokens(self, handle: int) -> list[int]:
        """Token ids of the context, as submitted so far."""
        return list(self._ctx(handle).tokens)

    def context_len(self, handle: int) -> int:
        return len(self._ctx(handle).tokens)

    def context_truncate(self, handle: int, n: int) -> None:
        """Keep the first ``n`` tokens.

        Raises:
            ValueError: ``n`` outside ``[0, len]``.
        """
        ctx = self._ctx(handle)
        with ctx.lock:
            if not isinstance(n, int) or not 0 <= n <= len(ctx.tokens):
                raise ValueError(f"truncate to {n!r} outside [0, {len(ctx.tokens)}]")
            del ctx.tokens[n:]
        ctx.engine.scheduler.command(lambda: ctx.seq.truncate(min(n, len(ctx.seq))), ctx.seq)

    def context_mask(self, handle: int, start: int, end: int, masked: bool) -> None:
        """Hide (``masked=True``) or show tokens ``[start, end)`` from all
        later forward passes.

        Raises:
            ValueError: the range is empty-reversed or outside the context.
        """
        ctx = self._ctx(handle)
        n = len(ctx.tokens)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ValueError(f"mask range [{start!r}, {end!r}) outside the context's [0, {n})")
        ctx.engine.scheduler.command(lambda: ctx.seq.mask_range(start, end, bool(masked)), ctx.seq)

    def context_drop_masked_pages(self, handle: int) -> Future[int]:
        """Release full pages whose tokens are all masked; future of the
        number of pages dropped."""
        ctx = self._ctx(handle)
        return ctx.engine.scheduler.command(ctx.seq.drop_masked_pages, ctx.seq)

    def context_stats(self, handle: int) -> Future[dict[str, int]]:
        """Future of ``{"tokens", "pages", "live_pages", "shared_pages"}``
        of a context, after its queued passes (``shared_pages``: pages also
        referenced by another context or snapshot)."""
        ctx = self._ctx(handle)
        seq = ctx.seq

        def stats() -> dict[str, int]:
            live = [p for p in seq.pages if p is not None]
            return {
                "tokens": len(seq),
                "pages": len(seq.pages),
                "live_pages": len(live),
                "shared_pages": sum(1 for p in live if seq.pool.refcount(p) > 1),
            }

        return ctx.engine.scheduler.command(stats, seq)

    # -- snapshots -------------------------------------------------------------
    # Names are per user; ``public/...`` names are listed and opened by every
    # user, taken and deleted only by their creator (tartlet.host.snapshots).
    def snapshot_save(self, handle: int, name: str) -> None:
        """Save the context under ``name`` in the owner's namespace (it
        outlives this instance; persisted when the server has a data dir).

        Raises:
            SnapshotError: invalid name, or the name exists already.
            LimitError: the user has ``max_snapshots_per_user`` snapshots.
            KvQuotaError: the snapshot's pages would pass a page quota.
        """
        ctx = self._ctx(handle)
        ctx.slot.snapshots.save(self.owner, ctx.seq, list(ctx.tokens), name)

    def snapshot_open(self, model: str | None, name: str) -> int:
        """A new context forked from snapshot ``name`` (which stays); a
        snapshot restored from disk is loaded into the pool first.

        Raises:
            SnapshotError: no such snapshot for this user, or its file is
                corrupt or of another model.
            KvQuotaError, KvCacheFullError: no room for its pages.
            LimitError: too many open contexts.
        """
        slot = self.state.model(model)
        snap, src = slot.snapshots.fork_source(self.owner, name)
        seq = self._new_seq(slot)
        fresh = 1 if len(snap.tokens) % slot.engine.pool.page_size else 0
        child = HostContext(slot, seq, list(snap.tokens))
        _pending(seq.account, fresh, lambda: self._fork_later(slot.engine, src, child.seq))
        return self._add(child)

    def snapshot_take(self, model: str | None, name: str) -> int:
        """A context that takes over snapshot ``name``'s pages (no copy);
        the name and its file are removed.

        Raises:
            SnapshotError: absent, or a public snapshot of another user.
            KvQuotaError: the instance cannot hold its pages.
            LimitError: too many open contexts.
        """
        slot = self.state.model(model)
        seq = self._new_seq(slot)
        tokens = slot.snapshots.take(self.owner, name, seq)
        return self._add(HostContext(slot, seq, list(tokens)))

    def snapshot_delete(self, model: str | None, name: str) -> None:
        """Remove snapshot ``name``, its pages and its file.

        Raises:
            SnapshotError: absent, or a public snapshot of another user.
        """
        self.state.model(model).snapshots.delete(self.owner, name)

    def snapshot_names(self, model: str | None) -> list[str]:
        """Snapshot names this instance's user can open (its own and the
        ``public/`` ones), sorted."""
        return self.state.model(model).snapshots.names(self.owner)

    # -- forward pass ----------------------------------------------------------
    def forward(
        self,
        handle: int,
        tokens: list[int],
        positions: list[int] | None = None,
        attention: list[list[int]] | None = None,
        outputs: list[OutputSlot] | None = None,
    ) -> Future[list[object]]:
        """Append ``tokens`` to the context and run them through the model.

        Args:
            handle: the context.
            tokens: input token ids (1 to 65,536).
            positions: RoPE position per token (default: consecutive from the
                context's length).
            attention: per token, a BRLE mask over the context's logical
                positions after this pass (True = may attend); shorter masks
                are padded with False. Default: causal.
            outputs: :class:`tartlet.sdk.forward.OutputSlot` records: ``index``
                (input token whose logits are used), ``kind`` (``sample``,
                ``distribution``, ``logits``, ``logprobs``, ``entropy``), the
                kind's parameters (``temperature``, ``top_k``, ``top_p``,
                ``min_p``, ``seed``; ``k``; ``token_ids``) and an optional
                ``logit_mask`` (BRLE over the vocabulary, True = allowed)
                and/or ``grammar`` (a matcher handle from ``grammar_new``:
                the host computes its mask during the pass).

        Returns:
            A future of one result per output slot: an int token id for
            ``sample``; ``(ids, probs)`` for ``distribution``; a list of
            floats for ``logits`` and ``logprobs``; a float for ``entropy``.

        Raises:
            ValueError: any malformed argument (nothing is queued then).
        """
        return self._forward(handle, tokens, positions, attention, outputs)

    def _forward(self, handle: int, tokens: list[int], positions: list[int] | None, attention: list[list[int]] | None,
                 outputs: list[OutputSlot] | None,
                 then: Callable[[HostContext], Callable[[list[object]], tuple[list[int], list[EngineSlot]] | None]] | None = None,
                 matcher: Matcher | None = None) -> Future[list[object]]:  # fmt: skip
        """:meth:`forward`, and ``then(ctx)`` as the request's continuation
        (:class:`~tartlet.engine.core.scheduler.ForwardRequest`), if given;
        ``matcher`` masks the slots that name a grammar instead of their
        handle's (see :meth:`_slot`)."""
        ctx = self._ctx(handle)
        e = ctx.engine
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("forward needs a non-empty list of input tokens")
        if len(tokens) > MAX_FORWARD_TOKENS:
            raise ValueError(f"forward takes at most {MAX_FORWARD_TOKENS} tokens, got {len(tokens)}")
        self._check_ids(e, tokens)
        with ctx.lock:
            start = len(ctx.tokens)
            end = start + len(tokens)
            if end > e.scheduler.max_seq_len:
                raise ValueError(f"context would hold {end} tokens, more than the model's {e.scheduler.max_seq_len}")
            ps = e.pool.page_size
            fresh = -(-end // ps) - -(-start // ps)
            pos = None
            if positions is not None:
                cap = e.scheduler.max_seq_len
                if len(positions) != len(tokens) or not all(type(p) is int and 0 <= p < cap for p in positions):
                    raise ValueError(
                        f"positions must be {len(tokens)} ints in [0, {cap}) (the model's context), one per input token"
                    )
                pos = list(positions)
            attn = None
            if attention is not None:
                if len(attention) != len(tokens):
                    raise ValueError(f"attention needs one mask per input token ({len(tokens)}), got {len(attention)}")
                attn = [_brle_tensor(m, end, f"attention mask {j}") for j, m in enumerate(attention)]
            slots = [self._slot(e, o, len(tokens), matcher) for o in (outputs or [])]
            span = [start, end]  # the tokens of the request's current pass in ctx.tokens
            cont = None
            if then is not None:
                inner = then(ctx)

                def cont(results: list[object]) -> tuple[list[int], list[EngineSlot]] | None:
                    nxt = inner(results)
                    if nxt is not None:
                        with ctx.lock:
                            span[:] = [len(ctx.tokens), len(ctx.tokens) + len(nxt[0])]
                            ctx.tokens.extend(nxt[0])
                    return nxt

            req = ForwardRequest(ctx.seq, list(tokens), pos, attn, slots, user=self.owner, then=cont)
            fut = _pending(ctx.seq.account, fresh, lambda: e.scheduler.submit(req))
            ctx.tokens.extend(tokens)

        def on_done(f: Future[list[object]]) -> None:
            if f.cancelled() or f.exception() is not None:
                with ctx.lock:  # the scheduler rolled the sequence back (the failed pass)
                    if len(ctx.tokens) == span[1]:
                        del ctx.tokens[span[0] :]

        fut.add_done_callback(on_done)
        return fut

    def generate(
        self,
        handle: int,
        tokens: list[int],
        sampler: OutputSlot,
        grammar: int | None,
        first_step: int,
        max_steps: int,
        stop_ids: list[int],
    ) -> Future[list[int]]:
        """Decode up to ``max_steps`` tokens host-side: the same passes that
        ``max_steps`` calls of :meth:`forward` with one ``sample`` slot each
        would run (``tokens``, then each sampled token in turn), without a
        round trip to the inferlet per token. Each next pass is queued from
        the previous pass's completion, on the scheduler thread, before the
        scheduler builds its next batch, so the steps of concurrent
        generations stay in one batch.

        Args:
            handle: the context.
            tokens: the pending input tokens of the first pass (>= 1).
            sampler: a ``sample`` :class:`~tartlet.sdk.forward.OutputSlot`
                (``Sampler.slot``): its ``temperature``, ``top_k``, ``top_p``,
                ``min_p`` and ``seed`` apply; ``index`` is set here. With a ``seed``, step ``first_step + i`` samples
                with the seed the SDK's ``Sampler.slot`` derives for it.
                A ``logit_mask`` applies to every pass; its ``grammar`` must
                be None (pass the matcher as ``grammar``).
            grammar: a matcher handle (``grammar_new``) that constrains the
                tokens, or None: the host masks each pass with its own copy
                of the matcher, advances the copy with each sampled token,
                and stops after the token that finishes the grammar
                (:meth:`grammar_is_finished`). The handle's matcher is left
                as it was: the caller advances it with the tokens it keeps,
                as a step-by-step generation would.
            first_step: generation step of the first sampled token.
            max_steps: most tokens to sample (>= 1).
            stop_ids: sampling one of these ends the generation.

        Returns:
            A future of the sampled token ids (the last one not yet run
            through the model: it is the caller's pending token). An error
            of a later pass fails it; the passes before it stay in the
            context, as with :meth:`forward`. Cancelling it stops after the
            pass in flight.

        Raises:
            ValueError: a malformed argument (nothing is queued then).
            InvalidHandleError: an unknown context or grammar handle.
            GrammarError: the grammar was compiled for another model, or its
                matcher failed.
        """
        out: list[int] = []
        result: Future[list[int]] = Future()

        def done(f: Future[list[object]]) -> None:
            if result.done():  # cancelled by the caller
                return
            if f.cancelled():
                result.cancel()
            elif f.exception() is not None:
                result.set_exception(f.exception())
            else:
                result.set_result(out)

        self._decode(handle, tokens, sampler, grammar, first_step, max_steps, stop_ids, out.append,
                     result.done).add_done_callback(done)
        return result

    def generate_stream(self, handle: int, tokens: list[int], sampler: OutputSlot, grammar: int | None, first_step: int,
                        max_steps: int, stop_ids: list[int]) -> int:
        """Start the passes :meth:`generate` would run and hand their tokens
        over as they are sampled (:class:`~tartlet.host.token_stream.TokenStream`):
        the scheduler queues each next pass itself, so the model does not
        wait for the inferlet to take a token. Same arguments, passes and
        tokens as :meth:`generate`.

        Returns:
            A stream handle for :meth:`stream_next` and :meth:`stream_close`
            (the context is busy until the stream is closed).

        Raises:
            ValueError: a malformed argument (nothing is queued then).
            InvalidHandleError: an unknown context or grammar handle.
            GrammarError: the grammar was compiled for another model, or its
                matcher failed.
        """
        stream = TokenStream()
        fut = self._decode(handle, tokens, sampler, grammar, first_step, max_steps, stop_ids, stream.push,
                           lambda: stream.stopping or self.closed)

        def ended(f: Future[list[object]]) -> None:
            if f.cancelled():
                stream.end(RuntimeError("a pass of the token stream was cancelled"))
            else:
                stream.end(f.exception())

        fut.add_done_callback(ended)
        h = next(self._ids)
        self._streams[h] = stream
        return h

    def stream_next(self, handle: int, count: int) -> Future[list[int]]:
        """Future of the stream's next tokens: with ``count`` 0, those
        sampled since the last call (at least one; several when the inferlet
        lags behind the model); with ``count`` >= 1, the next ``count``
        (fewer only at the end), so an inferlet that handles tokens in
        chunks wakes once a chunk while the passes go on. ``[]`` once the
        generation ended (``max_steps``, a stop token, the grammar) and
        every token was taken. Fails with the error of a failed pass, after
        the tokens sampled before it.

        Raises:
            InvalidHandleError: no open stream ``handle``.
            ValueError: a ``stream_next`` of this stream is still pending,
                or ``count`` is not an int >= 0.
        """
        return self._stream(handle).next(count)

    def stream_close(self, handle: int) -> Future[list[int]]:
        """Stop the stream after the pass in flight and release the handle;
        future of the tokens sampled and not taken (their last one, if any,
        is not in the context: it is the caller's pending token; with none,
        the last token taken is), once no pass of it is left.

        Raises:
            InvalidHandleError: no open stream ``handle``.
        """
        stream = self._stream(handle)
        del self._streams[handle]
        return stream.close()

    def _stream(self, handle: int) -> TokenStream:
        stream = self._streams.get(handle)
        if stream is None:
            raise InvalidHandleError(f"no token stream with handle {handle!r}")
        return stream

    def _decode(self, handle: int, tokens: list[int], sampler: OutputSlot, grammar_h: int | None, first_step: int, max_steps: int,
                stop_ids: list[int], on_token: Callable[[int], None], stopped: Callable[[], bool]) -> Future[list[object]]:
        """Queue the passes of :meth:`generate`: ``on_token`` gets each
        sampled token (on the scheduler thread), and no pass follows once
        ``stopped()`` is true (the token of the pass in flight then is the
        last one given: the context holds every token before it); the
        future of the chain (done after its last pass). Malformed arguments
        raise ValueError and queue nothing."""
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise ValueError(f"first_step must be an int >= 0, got {first_step!r}")
        if not isinstance(sampler, OutputSlot) or sampler.kind != "sample":
            raise ValueError(f"sampler is a `sample` tartlet.sdk.forward.OutputSlot (Sampler.slot), got {sampler!r}")
        seed = sampler.seed
        stop = frozenset(int(t) for t in stop_ids)
        count = [0]  # tokens sampled so far
        # a grammar masks the passes through a copy of its matcher that the
        # chain advances itself (the inferlet advances its own with the
        # tokens it keeps, so nothing is rolled back when it stops early)
        if sampler.grammar is not None:
            raise ValueError("a generate sampler slot carries no grammar: pass the matcher handle as `grammar`")
        grammar = None if grammar_h is None else self._matcher_for(grammar_h, self._ctx(handle).engine).fork()

        def slot(n_inputs: int) -> OutputSlot:
            step = None if seed is None else step_seed(seed, first_step + count[0])
            return replace(sampler, index=n_inputs - 1, seed=step, grammar=grammar_h)

        def continuation(ctx: HostContext) -> Callable[[list[object]], tuple[list[int], list[EngineSlot]] | None]:
            # the engine slot of a one-token pass, built and validated once; a
            # grammar's slot is a new one each pass around the same spec and
            # logit mask (its mask is the matcher's state then)
            base = self._slot(ctx.engine, replace(sampler, index=0, seed=None), 1)

            def then(results: list[object]) -> tuple[list[int], list[EngineSlot]] | None:  # on the scheduler thread
                tok = int(cast(int, results[0]))  # a `sample` slot yields its token id
                count[0] += 1
                on_token(tok)
                if grammar is not None:
                    grammar.advance(tok)  # the masked sampler drew it: raises only for a failed matcher
                    if grammar.is_finished():
                        return None
                if count[0] >= max_steps or tok in stop or stopped():
                    return None
                spec = base.spec if seed is None else replace(cast(SamplerSpec, base.spec),
                                                               seed=step_seed(seed, first_step + count[0]))
                if grammar is not None:
                    return [tok], [GrammarOutputSlot(0, spec, grammar, base.allowed)]
                return [tok], [base if seed is None else replace(base, spec=spec)]

            return then

        # each next pass is queued by the scheduler itself when the pass
        # before it is done, before it builds the next batch (ForwardRequest.then)
        try:
            fut = self._forward(handle, list(tokens), None, None, [slot(len(tokens))], then=continuation, matcher=grammar)
        except BaseException:
            if grammar is not None:
                grammar.close()
            raise
        if grammar is not None:
            fut.add_done_callback(lambda _: grammar.close())
        return fut

    def _slot(self, e: Engine, o: OutputSlot, n_inputs: int, matcher: Matcher | None = None) -> EngineSlot:
        """The engine's slot for output request ``o`` (validated here). A
        slot naming a ``grammar`` is masked by ``matcher`` when given (a
        host-side generation's own copy of it, see :meth:`_decode`), else
        by the handle's matcher."""
        if not isinstance(o, OutputSlot):
            raise ValueError(f"an output slot is a tartlet.sdk.forward.OutputSlot, got {type(o).__name__}")
        idx = o.index
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n_inputs:
            raise ValueError(f"output index {idx!r} outside the {n_inputs} input tokens")
        try:
            if o.kind == "sample":
                spec: SamplerSpec | ProbeSpec = SamplerSpec(
                    temperature=float(0.0 if o.temperature is None else o.temperature),
                    top_k=o.top_k,
                    top_p=float(o.top_p),
                    min_p=float(o.min_p),
                    seed=o.seed,
                )
            else:
                spec = ProbeSpec(
                    kind=o.kind,
                    k=o.k,
                    token_ids=tuple(o.token_ids),
                    temperature=float(1.0 if o.temperature is None else o.temperature),
                )
        except (TypeError, ValueError) as err:
            raise SamplingError(str(err)) from None
        if isinstance(spec, ProbeSpec) and spec.kind == "logprobs":
            self._check_ids(e, list(spec.token_ids))
        if isinstance(spec, SamplerSpec) and spec.seed is not None and not isinstance(spec.seed, int):
            raise SamplingError(f"seed must be an int, got {spec.seed!r}")
        allowed = None if o.logit_mask is None else _brle_tensor(o.logit_mask, e.config.vocab_size, "logit mask")
        if o.grammar is not None:  # mask computed by the host from a matcher
            if matcher is not None:
                return GrammarOutputSlot(idx, spec, matcher, allowed)
            return self._grammar_output_slot(e, idx, spec, o.grammar, allowed)
        return EngineSlot(idx, spec, allowed)

    @staticmethod
    def _check_ids(e: Engine, ids: list[int]) -> None:
        v = e.config.vocab_size
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < v:
                raise ValueError(f"token id {t!r} outside the vocabulary [0, {v})")

    # -- stats -------------------------------------------------------------------
    def kv_stats(self, model: str | None) -> dict[str, int]:
        """Page counts of a model's pool: ``total``, ``free``, ``cached``,
        ``used``, ``page_size``."""
        return vars(self.state.model(model).engine.pool.stats())

    # -- session -----------------------------------------------------------------
    def session_send(self, msg: str | bytes) -> None:
        self.session.send(msg)

    def session_receive(self) -> Future[Message]:
        return self.session.receive()

    # -- end of instance -----------------------------------------------------------
    def close(self) -> None:
        """Free every context and decoder this instance still holds (the
        instance ended, failed or was killed). Snapshots stay."""
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


def _pending(acc: PageAccount | None, fresh: int, queue: Callable[[], Future[T]]) -> Future[T]:
    """Pre-check ``fresh`` new pages against ``acc`` (counting calls still
    queued), then call ``queue()`` and count the pages as pending until its
    future is done.

    Raises:
        KvQuotaError: the pages would pass a quota; nothing is queued.
    """
    if acc is None or not fresh:
        return queue()
    acc.precheck(fresh)
    acc.pend(fresh)
    try:
        fut = queue()
    except BaseException:
        acc.pend(-fresh)
        raise
    fut.add_done_callback(lambda _: acc.pend(-fresh))
    return fut


def _brle_tensor(runs: Any, size: int, what: str) -> torch.Tensor:
    """Decode a BRLE list into a bool tensor ``[size]`` (padded with False).

    Raises:
        ValueError: not a list of non-negative ints, or longer than ``size``.
    """
    if not isinstance(runs, (list, tuple)) or not all(isinstance(r, int) and r >= 0 for r in runs):
        raise ValueError(f"{what} must be a list of non-negative run lengths (BRLE)")
    total = sum(runs)
    if total > size:
        raise ValueError(f"{what} covers {total} positions, more than {size}")
    values = torch.arange(len(runs)) % 2 == 1
    bits = torch.repeat_interleave(values, torch.tensor(runs, dtype=torch.long)) if runs else torch.zeros(0, dtype=torch.bool)
    if total < size:
        bits = torch.cat([bits, torch.zeros(size - total, dtype=torch.bool)])
    return bits


#: Chat message keys besides role and content, with their types.
_MESSAGE_EXTRAS = {"tool_calls": list, "tool_call_id": str, "name": str}


def _chat_message(i: int, m: Any) -> dict[str, Any]:
    """A checked copy of chat message ``i`` (see :meth:`HostApi.apply_chat_template`).

    Raises:
        ValueError: not a dict, no str ``role``, ``content`` neither str nor
            None, an extra key of the wrong type, or an unknown key.
    """
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}]: a chat message is a dict with a str `role` and `content`, got {m!r}")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a str or None, got {type(content).__name__}")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    for key, value in m.items():
        if key in ("role", "content"):
            continue
        kind = _MESSAGE_EXTRAS.get(key)
        if kind is None:
            raise ValueError(f"messages[{i}]: unknown key {key!r} (known: role, content, {', '.join(_MESSAGE_EXTRAS)})")
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"messages[{i}].{key} must be a {kind.__name__}, got {type(value).__name__}")
        if value is not None:
            out[key] = value
    return out

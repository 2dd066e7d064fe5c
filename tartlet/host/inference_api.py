"""Forward-pass host calls (WIT interface ``inference``): ``forward``,
host-side ``generate`` and token streams, output slots (samplers, probes,
logit masks) turned into the engine's (:class:`InferenceHostMixin`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import torch

from ..engine.core.attention_probe import AttentionProbeSpec
from ..engine.core.dry import DryParams, process_breakers
from ..engine.core.engine import Engine
from ..engine.core.hidden_states import HiddenSpec, layer_index
from ..engine.core.requests import ForwardRequest
from ..engine.core.sampler import OutputSlot as EngineSlot
from ..engine.core.sampler import ProbeSpec, SamplerSpec
from ..engine.models.lora import LoraAdapter
from ..sdk.attention_probe import AttentionProbe, probe_layers
from ..sdk.errors import InvalidHandleError, SamplingError
from ..sdk.forward import OutputSlot
from ..sdk.sampler import slot_dry, step_seed, validate_filters
from .context_api import ContextHostMixin, HostContext, _pending
from .grammar import GrammarOutputSlot, Matcher
from .grammar_api import GrammarHostMixin
from .model_api import check_ids
from .state import ModelSlot
from .token_stream import TokenStream

T = TypeVar("T")
#: A pass's continuation (``ForwardRequest.then``): the next pass, or None to stop.
Continuation = Callable[[list[object]], "tuple[list[int], list[EngineSlot]] | None"]

#: Largest number of input tokens in one forward call.
MAX_FORWARD_TOKENS = 65536
#: Most values one attention probe may return (layers x rows x positions).
MAX_PROBE_VALUES = 1 << 22
#: Largest number of output slots in one forward call.
MAX_OUTPUT_SLOTS = 4096


class InferenceHostMixin(ContextHostMixin, GrammarHostMixin):
    """The ``forward``/``generate``/``stream-*`` calls."""

    _streams: dict[int, TokenStream]

    if TYPE_CHECKING:
        def _lora(self, slot: ModelSlot, name: str) -> LoraAdapter: ...  # AdapterHostMixin's

    def forward(
        self,
        handle: int,
        tokens: list[int],
        positions: list[int] | None = None,
        attention: list[list[int]] | None = None,
        outputs: list[OutputSlot] | None = None,
        adapter: str | None = None,
        probe: AttentionProbe | None = None,
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
                ``distribution``, ``logits``, ``logprobs``, ``entropy``,
                ``hidden``), the kind's parameters (``temperature``,
                ``top_k``, ``top_p``, ``min_p``, ``seed``; ``k``;
                ``token_ids``; ``layer``) and an optional
                ``logit_mask`` (BRLE over the vocabulary, True = allowed)
                and/or ``grammar`` (a matcher handle from ``grammar_new``:
                the host computes its mask during the pass).
            adapter: the name of a LoRA adapter this instance sees on the
                context's model (:meth:`adapter_names`: served, the user's
                saved ones, its forks): this pass runs with it, with the
                version it has now, even if a fork is edited before the pass
                runs (its rows share the batch with every other row,
                adapted or not), or None: the base model.
            probe: an attention-score probe
                (:class:`tartlet.sdk.attention_probe.AttentionProbe`), or
                None: the attention mass each of the context's positions
                receives from this pass's queries, computed inside the
                pass's attention (:mod:`tartlet.engine.core.attention_probe`);
                such a pass is never served from the prefix cache.

        Returns:
            A future of one result per output slot: an int token id for
            ``sample``; ``(ids, probs)`` for ``distribution``; a list of
            floats for ``logits`` and ``logprobs``; a float for ``entropy``;
            ``hidden_size`` floats (float32 values) for ``hidden``: the
            final hidden state after the final norm (``layer`` None) or
            decoder layer ``layer``'s output. With a ``probe``, one more
            result after the slots': its
            :class:`~tartlet.sdk.attention_probe.AttentionScores`.

        Raises:
            ValueError: any malformed argument (nothing is queued then), a
                ``hidden`` layer outside the model's (``SamplingError``), a
                malformed probe or one that would return more than
                :data:`MAX_PROBE_VALUES` values (``SamplingError``).
            AdapterError: the model serves no adapter named ``adapter``.
        """
        return self._forward(handle, tokens, positions, attention, outputs, adapter, probe=probe)

    def _forward(self, handle: int, tokens: list[int], positions: list[int] | None, attention: list[list[int]] | None,
                 outputs: list[OutputSlot] | None, adapter: str | None,
                 then: Callable[[HostContext], tuple[Continuation, EngineSlot | None]] | None = None,
                 matcher: Matcher | None = None, probe: AttentionProbe | None = None) -> Future[list[object]]:  # fmt: skip
        """:meth:`forward`, and ``then(ctx)`` as the request's continuation
        (:class:`~tartlet.engine.core.requests.ForwardRequest`), if given,
        with the slot it feeds each sampled token back with, if it always
        does (``feed_back``); ``matcher`` masks the slots that name a
        grammar instead of their handle's (see :meth:`_slot`)."""
        ctx = self._ctx(handle)
        e = ctx.engine
        if adapter is not None and not isinstance(adapter, str):
            raise TypeError(f"adapter is an adapter name (str) or None, got {type(adapter).__name__}")
        lora = None if adapter is None else self._lora(ctx.slot, adapter)  # this pass's version (adapter_api.py)
        if not isinstance(tokens, list) or not tokens:
            raise ValueError("forward needs a non-empty list of input tokens")
        if len(tokens) > MAX_FORWARD_TOKENS:
            raise ValueError(f"forward takes at most {MAX_FORWARD_TOKENS} tokens, got {len(tokens)}")
        if outputs is not None and len(outputs) > MAX_OUTPUT_SLOTS:
            raise ValueError(f"forward takes at most {MAX_OUTPUT_SLOTS} output slots, got {len(outputs)}")
        check_ids(e, tokens)
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
            spec = None if probe is None else _probe_spec(e, probe, end)
            span = [start, end]  # the tokens of the request's current pass in ctx.tokens
            cont = None
            feed_back = None
            if then is not None:
                inner, feed_back = then(ctx)

                def cont(results: list[object]) -> tuple[list[int], list[EngineSlot]] | None:
                    nxt = inner(results)
                    if nxt is not None:
                        with ctx.lock:
                            span[:] = [len(ctx.tokens), len(ctx.tokens) + len(nxt[0])]
                            ctx.tokens.extend(nxt[0])
                    return nxt

            req = ForwardRequest(ctx.seq, list(tokens), pos, attn, slots, user=self.owner, then=cont, adapter=lora,
                                 probe=spec, feed_back=feed_back)
            fut = _pending(ctx.seq.account, fresh, lambda: ctx.slot.gate.submit(req))  # per-user queue (fair_gate.py)
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
        adapter: str | None = None,
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
            adapter: a LoRA adapter name every pass runs with (see
                :meth:`forward`), or None: the base model.

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

        self._decode(handle, tokens, sampler, grammar, first_step, max_steps, stop_ids, adapter, out.append,
                     result.done).add_done_callback(done)
        return result

    def generate_stream(self, handle: int, tokens: list[int], sampler: OutputSlot, grammar: int | None, first_step: int,
                        max_steps: int, stop_ids: list[int], adapter: str | None = None) -> int:
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
        fut = self._decode(handle, tokens, sampler, grammar, first_step, max_steps, stop_ids, adapter, stream.push,
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
                stop_ids: list[int], adapter: str | None, on_token: Callable[[int], None],
                stopped: Callable[[], bool]) -> Future[list[object]]:
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

        def continuation(ctx: HostContext) -> tuple[Continuation, EngineSlot | None]:
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
                sspec = cast(SamplerSpec, base.spec)  # a `sample` slot (checked above)
                spec = sspec if seed is None else replace(sspec, seed=step_seed(seed, first_step + count[0]))
                if grammar is not None:
                    return [tok], [GrammarOutputSlot(0, spec, grammar, base.allowed)]
                return [tok], [base if seed is None else replace(base, spec=spec)]

            # unseeded and unconstrained, each next pass is (token, base): the
            # scheduler may queue it before the token reaches the host (lookahead.py)
            return then, base if seed is None and grammar is None else None

        # each next pass is queued by the scheduler itself when the pass
        # before it is done, before it builds the next batch (ForwardRequest.then)
        try:
            fut = self._forward(handle, list(tokens), None, None, [slot(len(tokens))], adapter, then=continuation,
                                matcher=grammar)
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
        if o.kind == "hidden":  # the residual stream at idx, not its logits (hidden_states.py)
            if o.logit_mask is not None or o.grammar is not None:
                raise SamplingError("a hidden-state slot reads no logits: it takes no logit_mask or grammar")
            return EngineSlot(idx, HiddenSpec(layer_index(o.layer, e.config.num_hidden_layers)))
        try:
            if o.kind == "sample":
                validate_filters(o.typical_p, o.xtc_probability, o.xtc_threshold)
                spec: SamplerSpec | ProbeSpec = SamplerSpec(
                    temperature=float(0.0 if o.temperature is None else o.temperature),
                    top_k=o.top_k,
                    top_p=float(o.top_p),
                    min_p=float(o.min_p),
                    seed=o.seed,
                    typical_p=float(o.typical_p),
                    xtc_probability=float(o.xtc_probability),
                    xtc_threshold=float(o.xtc_threshold),
                    dry=_dry(e, o),
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
            check_ids(e, list(spec.token_ids))
        if isinstance(spec, SamplerSpec) and spec.seed is not None and not isinstance(spec.seed, int):
            raise SamplingError(f"seed must be an int, got {spec.seed!r}")
        allowed = None if o.logit_mask is None else _brle_tensor(o.logit_mask, e.config.vocab_size, "logit mask")
        if o.grammar is not None:  # mask computed by the host from a matcher
            if matcher is not None:
                return GrammarOutputSlot(idx, spec, matcher, allowed)
            return self._grammar_output_slot(e, idx, spec, o.grammar, allowed)
        return EngineSlot(idx, spec, allowed)


def _probe_spec(e: Engine, probe: AttentionProbe, n_tokens: int) -> AttentionProbeSpec:
    """The engine's spec of an attention ``probe`` of a pass that leaves the
    context ``n_tokens`` long.

    Raises:
        SamplingError: a malformed probe, or one of more than
            :data:`MAX_PROBE_VALUES` values.
    """
    c = e.config
    layers = probe_layers(probe, c.num_hidden_layers)
    rows = c.num_key_value_heads if probe.per_kv_head else 1
    n = n_tokens if probe.per == "token" else -(-n_tokens // e.pool.page_size)
    if len(layers) * rows * n > MAX_PROBE_VALUES:
        raise SamplingError(f"the attention probe would return {len(layers)} layers x {rows} rows x {n} "
                            f"{probe.per}s, more than {MAX_PROBE_VALUES} values: ask for fewer layers, or per page")
    return AttentionProbeSpec(layers, probe.reduce, probe.per, probe.per_kv_head)


def _dry(e: Engine, o: OutputSlot) -> DryParams | None:
    """A ``sample`` slot's DRY penalty for the engine (None when off: a
    multiplier or ``dry_penalty_last_n`` of 0), its sequence breakers
    matched against ``e``'s vocabulary (:func:`~tartlet.engine.core.dry.process_breakers`).

    Raises:
        SamplingError: a DRY parameter out of range (named).
    """
    dry = slot_dry(o)
    if dry is None:
        return None
    mult, base, allowed, last_n, breakers = dry
    return DryParams(mult, base, allowed, last_n, process_breakers(e.tokenizer, tuple(breakers)))


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



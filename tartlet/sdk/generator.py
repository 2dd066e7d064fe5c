"""Token-by-token generation over a context.

Each step runs one forward pass: the pending tokens go in, one token (or,
with a drafter, several) comes out and becomes the new pending token. Steps
stream as :class:`Step` objects; ``collect_*`` drain the generator.

Speculative decoding: with a ``drafter``, a step sends the pending token plus
the drafter's guesses, samples at every position in one pass, and keeps
guesses while they equal the sampled tokens (then one more, the correction
or bonus token). The KV of rejected guesses is dropped with ``truncate``.
Every kept token is the sampler's own draw given the kept prefix, so the
output is exactly what plain decoding with the same sampler gives (token for
token with greedy sampling); only the number of passes changes.

A drafter whose ``active`` turns False (:class:`~tartlet.drafter.AdaptiveDrafter`)
is dropped: the fast paths below apply from the next step (with such a
drafter ``overlap=True`` is allowed, and applies once it stops).

Overlap (``overlap=True``): once a step's token is accounted and the
generation goes on, the next pass is queued before the step is returned, so
what the caller does with a step (detokenized text sent to its client, say)
runs while the model computes the next one, instead of between passes (the
idea of SGLang's overlap scheduler and vLLM's asynchronous output
processing). Same passes, same tokens. The price: while a pass is queued
ahead the context is busy, so the caller must not use it until the
generation has ended or :meth:`Generator.aclose` has returned.

Token streams (``overlap=True`` with an engine-side sampler, no drafter, and
no constraint or a host grammar's): the host queues every next pass itself, from the
completion of the pass before (``generate_stream``), and the generator takes
the tokens sampled since its last step, one when it keeps up, several when
it lags. The model then never waits for the inferlet, whose code (and
whose client's streaming) runs beside the passes: the decoupling of vLLM's
engine core from its output processing. Any stop condition applies: it is
checked here, token by token, and the passes run past a stop are dropped
(the stream is closed and the context truncated), so the tokens, text and
context are what stepping gives. Same passes, same tokens. A host grammar
(:class:`~tartlet.constraint.HostGrammar`) is masked and advanced by the
host's own copy of its matcher between passes, which also stops the stream
after the token that completes it; the generator advances the constraint
itself with the tokens it takes, as stepping does (so a stop string that
ends the generation early leaves it at the kept tokens). Python
constraints (``mask()``) still step, one round trip per token.

Chunks (``chunk=N``): with a token stream (``overlap=True``), each step
takes the next 1, 2, 4, ... up to N tokens of the stream (``stream_next``
with a count), so the caller's code and a sandboxed inferlet's host round
trips run once a chunk while the passes go on. Without overlap, when nothing
needs to run between tokens (stops only
``max_tokens`` and EOS, an engine-side sampler, no drafter, no constraint or a
host grammar's, as for streams),
each step decodes its tokens host-side in one ``generate`` call, 1, 2, 4, ...
up to N of them, each next pass queued by the host as the last resolves.
A step then carries several tokens (as with a drafter) and the caller's
code between steps, and a sandboxed inferlet's host round trips, run once
per chunk instead of once per token (vLLM's ``stream_interval`` trades the
same granularity for the same cost). Same passes, same tokens.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from . import _binding
from .constraint import host_grammar_handle, slot_fields
from .forward import OutputSlot
from .sampler import Sampler
from .stop import AnyOf, EosTokens, MaxTokens, StopCondition, StopStrings

if TYPE_CHECKING:
    from .context import Context


class Drafter(Protocol):
    """Proposes tokens for speculative decoding.

    ``update(tokens)`` is called first with every token of the context, then
    after each step with the tokens accepted in it; ``draft()`` returns the
    guessed continuation (possibly empty). Optional ``active``: once False
    after ``update``, the generator drops the drafter (module docstring).
    """

    def update(self, tokens: list[int]) -> None: ...

    def draft(self) -> list[int]: ...


@dataclass
class Step:
    """One generation step: the tokens it produced and their text (the text
    may lag behind the tokens while a stop string or a multi-byte character
    is undecided)."""

    tokens: list[int]
    text: str


@dataclass
class GenerationStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Generator:
    """Async iterator of :class:`Step`; see :meth:`Context.generate`.

    Attributes:
        tokens: generated token ids (the final stop token included).
        text: generated text (stop tokens and stop strings excluded).
        finish_reason: ``"eos"``, ``"stop"``, ``"length"``, ``"constraint"``
            or None while running.
        stats: steps, drafted and accepted token counts.
    """

    def __init__(
        self,
        ctx: "Context",
        sampler: Sampler,
        *,
        max_tokens: int | None,
        stop: StopCondition | list[str] | str | None,
        eos: bool,
        drafter: Drafter | None,
        constraint: Any,
        overlap: bool = False,
        chunk: int | None = None,
        adapter: str | None = None,
    ) -> None:
        if overlap and drafter is not None and not hasattr(drafter, "active"):
            raise ValueError("overlap=True needs a drafter that can stop (an `active` attribute, as AdaptiveDrafter): "
                             "while it drafts, a step's draft depends on the last, so overlap only applies once it stops")
        if drafter is not None and getattr(sampler, "_mirostat", None) is not None:
            raise ValueError("a Mirostat sampler cannot verify drafts (its state changes with each token): drop the drafter")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be an int >= 1 or None, got {chunk!r}")
        self.ctx = ctx
        #: the LoRA adapter (its host name) every pass runs with, or None
        self.adapter = adapter
        self.overlap = overlap
        #: most tokens per step decoded host-side (chunked streaming), or None
        self.chunk = chunk
        self._next_chunk = 1  # chunks grow 1, 2, 4, ... up to `chunk`: the first token comes at once
        #: the pass queued ahead with overlap: (host future, its input tokens)
        self._ahead: tuple[Any, list[int]] | None = None
        self.sampler = sampler
        conds: list[StopCondition] = []
        if max_tokens is not None:
            conds.append(MaxTokens(max_tokens))
        if eos:
            conds.append(EosTokens(ctx.model.eos_token_ids))
        if isinstance(stop, str):
            stop = [stop]
        if isinstance(stop, list):
            stop = StopStrings(stop) if stop else None
        if stop is not None:
            conds.append(stop)
        self._stop = AnyOf(conds)
        self._strings = self._stop.find(StopStrings)
        #: no stop condition reads the text (only ``max_tokens`` and EOS)
        self._text_unread = all(isinstance(c, (MaxTokens, EosTokens)) for c in self._stop.conditions)
        self._eos = self._stop.find(EosTokens)
        self.drafter = drafter
        self.constraint = constraint
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = GenerationStats()
        self._raw = ""  # decoded text before stop-string cutting
        self._emitted = 0
        self._decoder: int | None = None
        self._started = False
        #: the open token stream: (handle, its first pass's inputs, KV length
        #: once they ran, tokens taken from it), or None
        self._stream: tuple[int, list[int], int, int] | None = None
        self._turn_end_due = False  # a finish while streaming: the turn is recorded once the stream closes

    def __aiter__(self) -> "Generator":
        return self

    async def __anext__(self) -> Step:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        if not self._started:
            self._start()
        n0 = len(self.tokens)
        try:
            await self._step()
        except BaseException:
            self._finish(None)
            raise
        new = self.tokens[n0:]
        text = self._visible()[self._emitted :]
        self._emitted += len(text)
        return Step(new, text)

    def _start(self) -> None:
        self._started = True
        ctx = self.ctx
        ctx._begin_assistant_turn()
        if not ctx.pending:
            n = ctx.kv_len
            if n == 0:
                raise ValueError("generate on an empty context: fill a prompt first")
            # re-run the last token to get its logits
            last = ctx.tokens[-1]
            ctx._truncate(n - 1)
            ctx._set_pending([last])
        if self.drafter is not None:
            self.drafter.update(ctx.tokens)
            self._drop_stopped_drafter()
        cmodel = getattr(self.constraint, "model", None)
        if isinstance(cmodel, str) and cmodel != ctx.model.name:
            raise ValueError(f"the constraint was compiled for model {cmodel!r}, the context is on {ctx.model.name!r}")
        self._decoder = _binding.host().decoder_new(ctx.model.name)

    def _slots(self, base: int, n: int) -> list[OutputSlot]:
        slots = []
        for i in range(n):
            slot = self.sampler.slot(base + i, len(self.tokens) + i)
            if self.constraint is not None:
                slot = replace(slot, **slot_fields(self.constraint))
            slots.append(slot)
        return slots

    async def _step(self) -> None:
        if self._stream is not None or (self.overlap and self._ahead is None and self._streamable()):
            await self._step_stream()
            return
        if self.chunk is not None and self._ahead is None and self._host_decodable():
            await self._step_on_host()
            return
        ctx = self.ctx
        if self._ahead is not None:  # queued by the last step (overlap): no draft
            fut, inputs = self._ahead
            self._ahead = None
            draft: list[int] = []
            kv0 = -1  # not needed: without a draft nothing is truncated
        else:
            inputs = ctx.pending
            draft = self._draft()
            # the KV length only matters for truncating rejected drafts; without a
            # draft it is not read (a host call per token less)
            kv0 = ctx.kv_len if draft else -1
            slots = self._slots(len(inputs) - 1, len(draft) + 1)
            ctx._take_pending()
            fut = None
        try:
            if fut is None:
                fut = _binding.host().forward(ctx._h, inputs + draft, None, None, slots, self.adapter)
            results = await _binding.wait(fut)
        except BaseException:
            ctx._restore_pending(inputs)
            raise
        self.stats.steps += 1
        accepted: list[int] = []
        for i, r in enumerate(results):
            tok = self.sampler.pick(r)
            accepted.append(tok)
            if i >= len(draft) or draft[i] != tok:
                break
        self.stats.drafted += len(draft)
        self.stats.accepted += len(accepted) - 1
        used = len(accepted)
        for j, tok in enumerate(accepted):
            self.tokens.append(tok)
            if self._consume(tok):
                used = j + 1
                break
        # keep the KV of the inputs and the used drafts; the last token is pending
        if used - 1 < len(draft):
            ctx._truncate(kv0 + len(inputs) + used - 1)
        ctx._set_pending([accepted[used - 1]])
        if self.drafter is not None:
            self.drafter.update(accepted[:used])
            self._drop_stopped_drafter()  # then the next step may open a token stream (overlap)
        elif self.overlap and self.finish_reason is None:
            self._queue_ahead()

    def _drop_stopped_drafter(self) -> None:
        """Drop a drafter whose ``active`` is False: the generation goes on
        as without one (token streams, host-side chunks)."""
        if self.drafter is not None and not getattr(self.drafter, "active", True):
            self.drafter = None

    def _queue_ahead(self) -> None:
        """Queue the next pass now (overlap). A failure to queue leaves the
        pending token where it was: the next step submits it again and
        raises then, where the caller expects errors."""
        ctx = self.ctx
        inputs = ctx.pending
        try:
            fut = _binding.host().forward(ctx._h, inputs, None, None, self._slots(len(inputs) - 1, 1), self.adapter)
        except Exception:
            return
        ctx._take_pending()
        self._ahead = (fut, inputs)

    async def aclose(self) -> None:
        """End the generation here: waits for a pass queued ahead (overlap)
        so the context can be used again. Its token stays in the KV cache
        and its sampled token is dropped (a later generation recomputes
        it). An unfinished generation ends with ``finish_reason`` ``"stop"``
        (its text so far is the assistant turn). Idempotent."""
        if self._ahead is not None:
            fut, inputs = self._ahead
            self._ahead = None
            try:
                await _binding.wait(fut)
            except Exception:
                self.ctx._restore_pending(inputs)  # the pass did not run: its token is pending again
        if self._stream is not None:
            await self._close_stream()
        if self.finish_reason is None:
            self._finish("stop")

    def _draft(self) -> list[int]:
        if self.drafter is None:
            return []
        draft = list(self.drafter.draft())
        vocab = self.ctx.model.vocab_size
        for t in draft:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"drafter returned token id {t!r} outside the vocabulary [0, {vocab})")
        if self.constraint is not None:
            return []  # a draft would need masks for states not reached yet
        room = self.ctx.model.max_seq_len - self.ctx.seq_len - 1
        return draft[: max(0, room)]

    def _consume(self, tok: int, held: list[int] | None = None) -> bool:
        """Account one generated token; True when generation must end.
        ``held``: no stop condition reads the text (``_text_unread``),
        so the token's text is decoded later, with the others of its step
        (:meth:`_flush`: one host call a step instead of one a token)."""
        is_eos = any(tok in e.ids for e in self._eos)
        if not is_eos:
            if held is not None:
                held.append(tok)
            else:
                assert self._decoder is not None  # open from start() until _finish()
                self._raw += _binding.host().decoder_push(self._decoder, [tok])
        if self.constraint is not None:
            self.constraint.advance(tok)
        if is_eos:
            self._flush(held)
            self._finish("eos")
            return True
        for s in self._strings:
            if s.cut(self._raw) is not None:
                self._finish("stop")
                return True
        if self.constraint is not None and self.constraint.is_finished():
            self._flush(held)
            self._finish("constraint")
            return True
        if self._stop.should_stop(self.tokens, self._raw):
            self._flush(held)
            self._finish("length" if any(isinstance(c, MaxTokens) and c.should_stop(self.tokens, "") for c in self._stop.conditions) else "stop")
            return True
        return False

    def _flush(self, held: list[int] | None) -> None:
        """Decode the text of the tokens ``_consume`` held back."""
        if held:
            assert self._decoder is not None  # open from start() until _finish()
            self._raw += _binding.host().decoder_push(self._decoder, held)
            held.clear()

    def _visible(self) -> str:
        raw = self._raw
        cuts = [c for c in (s.cut(raw) for s in self._strings) if c is not None]
        if cuts:
            return raw[: min(cuts)]
        if self.finish_reason is None and self._strings:
            hold = max(s.holdback(raw) for s in self._strings)
            return raw[: len(raw) - hold]
        return raw

    def _finish(self, reason: str | None) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason or "error"
        self.text = self._visible()
        if self._decoder is not None:
            _binding.host().decoder_free(self._decoder)
            self._decoder = None
        if reason is not None:
            if self._stream is not None:  # the context holds passes past this token until the stream closes
                self._turn_end_due = True
            else:
                self.ctx._end_assistant_turn(self.text, stopped_on_eos=reason == "eos")

    # -- draining ------------------------------------------------------------
    async def collect_tokens(self) -> list[int]:
        """Run to the end; the generated token ids."""
        await self._run_on_host()
        async for _ in self:
            pass
        return self.tokens

    async def collect_text(self) -> str:
        """Run to the end; the generated text."""
        await self._run_on_host()
        async for _ in self:
            pass
        return self.text

    def _host_decodable(self) -> bool:
        """Whether the host can decode the next tokens without code of ours
        between them (``generate``): stops only ``max_tokens`` (>= 1) and
        EOS tokens, an engine-side sampler, no drafter, no constraint but a
        host grammar (which the host masks and advances itself)."""
        if self.drafter is not None or not self._constraint_on_host() or not self._engine_sampler():
            return False
        limits = self._stop.find(MaxTokens)
        return (not limits or min(c.n for c in limits) >= 1) and self._text_unread

    async def _decode_on_host(self, max_steps: int | None) -> None:
        """Up to ``max_steps`` tokens (None: to ``max_tokens``) in one host
        call (``generate``), accounted as stepping would account them: same
        passes, same tokens, same text and finish reason."""
        ctx = self.ctx
        limits = self._stop.find(MaxTokens)
        left = min(c.n for c in limits) - len(self.tokens) if limits else None
        n = left if max_steps is None else max_steps if left is None else min(max_steps, left)
        assert n is not None and n >= 1  # a generation at its limit has finished
        stop_ids = self._eos_ids()
        inputs = ctx._take_pending()
        try:
            fut = _binding.host().generate(ctx._h, inputs, self.sampler.slot(0), self._host_grammar(), len(self.tokens), n,
                                           stop_ids, self.adapter)
            toks = await _binding.wait(fut)
        except BaseException:
            ctx._restore_pending(inputs)
            raise
        self.stats.steps += len(toks)
        self.tokens.extend(toks)
        text = [t for t in toks if t not in stop_ids]
        if text:
            assert self._decoder is not None  # open from start() until _finish()
            self._raw += _binding.host().decoder_push(self._decoder, text)
        c = self.constraint
        if c is not None:  # the host masked with its own copy: ours follows the tokens kept
            for t in toks:
                c.advance(t)
        # in the order _step keeps (EOS, the constraint, max_tokens); the
        # turn ends before the last token is pending
        if toks[-1] in stop_ids:
            self._finish("eos")
        elif c is not None and c.is_finished():  # the host stops at the token that completes it
            self._finish("constraint")
        elif left is not None and len(toks) >= left:
            self._finish("length")
        ctx._set_pending([toks[-1]])

    def _eos_ids(self) -> list[int]:
        """The token ids of the EOS stop conditions, for the host to stop on."""
        return sorted({i for e in self._eos for i in e.ids})

    def _streamable(self) -> bool:
        """Whether the passes can run as a token stream (see the module
        docstring): an engine-side sampler, no drafter, no constraint but a
        host grammar (any stop condition: they are checked here)."""
        return self.drafter is None and self._constraint_on_host() and self._engine_sampler()

    def _constraint_on_host(self) -> bool:
        """No constraint, or one the host can apply between passes itself
        (:func:`~tartlet.constraint.host_grammar_handle`)."""
        return self.constraint is None or host_grammar_handle(self.constraint) is not None

    def _host_grammar(self) -> int | None:
        """The matcher handle host-side passes (``generate``,
        ``generate_stream``) are constrained by: the constraint's, if any."""
        return None if self.constraint is None else host_grammar_handle(self.constraint)

    def _engine_sampler(self) -> bool:
        """Whether the engine draws every token as the sampler would: a
        plain :class:`Sampler` (a subclass may override ``slot`` or
        ``pick``, as the OpenAI inferlet's logit-bias sampler does), no
        custom function, not Mirostat (:attr:`Sampler.on_engine`)."""
        cls = type(self.sampler)
        return self.sampler.on_engine and cls.slot is Sampler.slot and cls.pick is Sampler.pick

    async def _step_stream(self) -> None:
        """One step of a token stream: the tokens sampled since the last
        step (opening the stream on the first), accounted as :meth:`_step`
        accounts them; at a stop the stream is closed and the passes run
        past it are dropped."""
        if self._stream is None:
            self._open_stream()
        assert self._stream is not None
        h, inputs, base, taken = self._stream
        count = 0  # every token sampled since the last step
        if self.chunk is not None:  # the next 1, 2, 4, ... up to `chunk` tokens
            count = self._next_chunk
            self._next_chunk = min(2 * count, self.chunk)
        held: list[int] | None = [] if self._text_unread else None  # the step's text decoded at once
        try:
            toks = await _binding.wait(_binding.host().stream_next(h, count))
            self.stats.steps += len(toks)
            for tok in toks:
                self.tokens.append(tok)
                taken += 1
                if self._consume(tok, held):
                    break
            self._flush(held)
        except BaseException:  # a failed pass, a failing stop check, cancellation: no pass may go on
            try:  # the text of the tokens taken, as stepping would have it
                self._flush(held)
            except Exception:  # the instance is ending: the first error is the one to report
                pass
            self._stream = (h, inputs, base, taken)
            try:
                await self._close_stream()
            except Exception:  # the instance is ending: the first error is the one to report
                pass
            raise
        self._stream = (h, inputs, base, taken)
        if not toks:  # the host stopped at its step bound (the model's context is full)
            self._finish("length")  # the turn is recorded as the stream closes
        if self.finish_reason is not None:
            await self._close_stream()

    def _open_stream(self) -> None:
        ctx = self.ctx
        limits = self._stop.find(MaxTokens)
        kv = ctx.kv_len
        inputs = ctx.pending
        # each pass adds one token; the last sampled one is not run
        room = ctx.model.max_seq_len - kv - len(inputs) + 1
        n = min([room] + [c.n - len(self.tokens) for c in limits])
        if n < 1:
            raise ValueError(f"the context ({kv + len(inputs)} tokens) leaves no room to generate in the model's "
                             f"{ctx.model.max_seq_len}")
        stop_ids = self._eos_ids()
        h = _binding.host().generate_stream(ctx._h, inputs, self.sampler.slot(0), self._host_grammar(), len(self.tokens),
                                            n, stop_ids, self.adapter)
        ctx._take_pending()
        self._stream = (h, inputs, kv + len(inputs), 0)

    async def _close_stream(self) -> None:
        """Close the stream and leave the context as stepping would: every
        token taken before the last in the KV cache, the last pending (the
        first pass's inputs pending again if no token was taken), the turn
        recorded if the generation finished meanwhile."""
        assert self._stream is not None
        h, inputs, base, taken = self._stream
        ctx = self.ctx
        try:
            await _binding.wait(_binding.host().stream_close(h))  # once no pass is left (its tokens: not taken)
        finally:
            self._stream = None
        # the KV cache holds the inputs and every sampled token but the last;
        # keep it up to the last token taken. Past it: those not handed over
        # and, after a stop, the rest of the step that held the stop (handed
        # over, not taken: a chunk or a lagging step holds several)
        keep = base - 1 + taken if taken else base - len(inputs)
        if ctx.kv_len > keep:
            ctx._truncate(keep)
        ctx._set_pending([self.tokens[-1]] if taken else inputs)
        if self._turn_end_due:
            self._turn_end_due = False
            pending = ctx._take_pending()  # as _step ends a turn: before the last token is pending
            ctx._end_assistant_turn(self.text, stopped_on_eos=self.finish_reason == "eos")
            ctx._set_pending(pending)

    async def _step_on_host(self) -> None:
        """One chunked step (``chunk``): the next 1, 2, 4, ... up to
        ``chunk`` tokens decoded host-side, so code between steps (streaming
        the text, say) runs once per chunk instead of once per token."""
        n = self._next_chunk
        assert self.chunk is not None  # chunked generation
        self._next_chunk = min(2 * n, self.chunk)
        await self._decode_on_host(n)

    async def _run_on_host(self) -> None:
        """Drain a generation that needs no code of ours between tokens in
        one host call (``generate``), instead of a host round trip per token:
        same passes, same tokens, same result. Only for an unstarted
        generation bounded by ``max_tokens`` (see :meth:`_host_decodable`);
        anything else (stop strings, custom samplers, ...) steps here."""
        if self._started or not self._stop.find(MaxTokens) or not self._host_decodable():
            return
        self._start()
        try:
            await self._decode_on_host(None)
        except BaseException:
            self._finish(None)
            raise

    async def collect_json(self) -> Any:
        """Run to the end and parse the text as JSON.

        Raises:
            ValueError: the text is not valid JSON (message shows the text).
        """
        text = await self.collect_text()
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            why = " (generation stopped at max_tokens)" if self.finish_reason == "length" else ""
            raise ValueError(f"generated text is not valid JSON{why} ({e}): {text[:200]!r}") from None

    # -- forking ---------------------------------------------------------------
    def fork(self, sampler: Sampler | None = None) -> "Generator":
        """Continue this generation in two branches: a generator over a fork
        of the context (:meth:`Context.fork`, KV pages shared) with the same
        tokens, text, stop conditions and a fork of the constraint (its
        matcher state copied), so both branches keep satisfying it.

        Args:
            sampler: the branch's sampler (default: this one; with a seeded
                sampler both branches then draw the same tokens; a Mirostat
                sampler is copied, its state included).

        Raises:
            ValueError: the generation has finished, or uses a drafter.
        """
        if self.finish_reason is not None:
            raise ValueError(f"cannot fork a finished generation (finish_reason {self.finish_reason!r})")
        if self.drafter is not None:
            raise ValueError("cannot fork a generation that uses a drafter (its state is not copyable)")
        if not self._started:
            self._start()
        child = Generator.__new__(Generator)
        child.__dict__.update(self.__dict__)
        child.ctx = self.ctx.fork()
        child.sampler = sampler or (copy.copy(self.sampler) if getattr(self.sampler, "_mirostat", None) is not None else self.sampler)
        child.constraint = self.constraint.fork() if self.constraint is not None else None
        child.tokens = list(self.tokens)
        child.stats = GenerationStats(self.stats.steps, self.stats.drafted, self.stats.accepted)
        host = _binding.host()
        child._decoder = host.decoder_new(child.ctx.model.name)
        eos = set(self._eos_ids())
        host.decoder_push(child._decoder, [t for t in self.tokens if t not in eos])
        return child

"""Context: a token sequence with its KV cache, owned by an inferlet.

Tokens enter a context in two steps: ``fill``/``fill_tokens`` (and the chat
helpers ``system``/``user``/``assistant``) append *pending* tokens; a forward
pass (``flush``, ``forward`` or each step of ``generate``) moves pending
tokens into the KV cache. ``seq_len`` counts both. Contexts can be forked
(copy-on-write: full pages are shared), truncated, masked, saved as named
snapshots and reopened by later inferlets.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import _binding, brle
from . import tools as _tools
from .adapter import Adapter, adapter_name
from .attention_probe import AttentionProbe
from .chat_transcript import ChatTranscript
from .forward import OutputSlot
from .generator import Generator
from .sampler import Sampler
from .stop import StopCondition

if TYPE_CHECKING:
    from .model import Model


class ContextClosedError(ValueError):
    """A call on a context after :meth:`Context.close`."""


class ChatNotAdoptedError(ValueError):
    """A chat helper (``system``/``user``/``assistant``/``tool``/
    ``add_message``) on a context opened from a snapshot that holds tokens,
    before :meth:`Context.adopt_chat` said which messages they are.
    Snapshots keep tokens, not messages: rendering the new turn as the
    start of a chat would put the template's preamble (e.g. a default system
    prompt) in the middle of the context."""


class Context:
    """A context on ``model``. Create with :meth:`Model.new_context`,
    :meth:`fork`, :meth:`open` or :meth:`take`.

    Raises (any method that reaches the KV cache):
        ContextClosedError: the context was closed.
    """

    def __init__(self, model: "Model", _handle: int | None = None) -> None:
        self.model = model
        self._h = _binding.host().context_new(model.name) if _handle is None else _handle
        self._pending: list[int] = []
        self._messages: list[dict[str, Any]] = []
        self._tools: list[dict[str, Any]] | None = None
        self._transcript = ChatTranscript()  # the template's text filled so far, and where each fill ended
        self._turn_start = 0
        self._closed = False
        #: opened from a non-empty snapshot and not yet adopted (see ChatNotAdoptedError)
        self._needs_adopt = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ContextClosedError(f"{what} on a closed context (handle {self._h}): it was closed and its pages freed")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    # -- facts -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.model.page_size

    @property
    def kv_len(self) -> int:
        """Tokens already run through the model (in the KV cache)."""
        self._check_open("kv_len")
        return _binding.host().context_len(self._h)

    @property
    def seq_len(self) -> int:
        """All tokens of the context: in the KV cache plus pending."""
        return self.kv_len + len(self._pending)

    @property
    def tokens(self) -> list[int]:
        """Token ids of the context, pending ones included."""
        self._check_open("tokens")
        return _binding.host().context_tokens(self._h) + self._pending

    @property
    def pending(self) -> list[int]:
        """Filled tokens not yet run through the model."""
        return list(self._pending)

    def _take_pending(self) -> list[int]:
        """Hand the pending tokens to a pass about to be queued: returns
        them, and none are pending after. If the pass then fails to queue
        or to run, :meth:`_restore_pending` puts them back."""
        tokens, self._pending = self._pending, []
        return tokens

    def _restore_pending(self, tokens: list[int]) -> None:
        """Put back ``tokens`` taken by a pass that did not run, before any
        filled since."""
        self._pending = list(tokens) + self._pending

    def _set_pending(self, tokens: list[int]) -> None:
        """Make ``tokens`` the pending ones (a generation leaves its last
        sampled token pending: its KV is computed by the next pass)."""
        self._pending = list(tokens)

    @property
    def text(self) -> str:
        return self.model.detokenize(self.tokens)

    # -- filling -------------------------------------------------------------------
    def fill(self, text: str) -> None:
        """Append the tokens of ``text`` (pending until the next pass).

        The first fill of an empty context starts with the model's BOS token
        when the model asks for one (``Model.add_bos_token``, e.g. Gemma) and
        ``text`` does not already begin with it (chat templates write it).
        """
        ids = self.model.tokenize(text)
        bos = self.model.bos_token_id
        if self.model.add_bos_token and bos is not None and not self._pending and not self.tokens \
                and ids[:1] != [bos]:
            ids.insert(0, bos)
        self._pending += ids

    def fill_tokens(self, ids: list[int]) -> None:
        """Append token ids (pending until the next pass).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        ids = list(ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.model.vocab_size:
                raise ValueError(f"token id {t!r} outside the vocabulary [0, {self.model.vocab_size})")
        self._pending += ids

    def system(self, text: str, *, tools: list[dict[str, Any]] | None = None) -> None:
        """Append a system message, rendered with the model's chat template
        (``tools``: see :meth:`set_tools`)."""
        if tools is not None:
            self.set_tools(tools)
        self._chat("system", text)

    def user(self, text: str, *, tools: list[dict[str, Any]] | None = None) -> None:
        """Append a user message, rendered with the model's chat template
        (``tools``: see :meth:`set_tools`)."""
        if tools is not None:
            self.set_tools(tools)
        self._chat("user", text)

    def assistant(self, text: str | None, *, tool_calls: list[Any] | None = None) -> None:
        """Append an assistant message, rendered with the model's chat
        template; ``tool_calls``: :class:`tartlet.tools.ToolCall` objects or
        OpenAI ``{"id", "type", "function": {"name", "arguments"}}`` dicts."""
        if tool_calls is None:
            self._chat("assistant", text)
            return
        calls = [c.to_openai() if isinstance(c, _tools.ToolCall) else dict(c) for c in tool_calls]
        self.add_message({"role": "assistant", "content": text, "tool_calls": calls})

    def tool(self, content: str, *, tool_call_id: str | None = None, name: str | None = None) -> None:
        """Append a tool result (OpenAI ``role: "tool"``) for the call
        ``tool_call_id``, rendered with the model's template (or as a
        ``<tool_response>`` user turn, see :func:`tartlet.tools.template_messages`)."""
        msg: dict[str, Any] = {"role": "tool", "content": content}
        if tool_call_id is not None:
            msg["tool_call_id"] = tool_call_id
        if name is not None:
            msg["name"] = name
        self.add_message(msg)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (OpenAI shape), or None."""
        return self._tools

    def set_tools(self, tools: list[dict[str, Any]] | None) -> None:
        """Tools for the chat template (OpenAI shape, checked by
        :func:`tartlet.tools.normalize_tools`); None removes them. Set them
        before the first message: set later, the template usually renders
        them at the start and the chat is filled again from there.

        Raises:
            ToolSpecError: a malformed tool list.
        """
        self._tools = None if tools is None else _tools.normalize_tools(tools)

    def add_message(self, message: dict[str, Any]) -> None:
        """Append one chat message in the OpenAI shape: ``role`` (system,
        user, assistant or tool), ``content`` (str; None for an assistant
        message with ``tool_calls``), ``tool_calls`` (assistant),
        ``tool_call_id`` and ``name`` (tool).

        Raises:
            ValueError: an unknown role, a content of the wrong type, or an
                unknown key.
        """
        if not isinstance(message, dict):
            raise TypeError(f"a chat message is a dict, got {type(message).__name__}")
        self._check_adopted()
        role = message.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message role must be system, user, assistant or tool, got {role!r}")
        extra = set(message) - {"role", "content", "tool_calls", "tool_call_id", "name"}
        if extra:
            raise ValueError(f"unknown chat message key(s): {', '.join(sorted(extra))}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise TypeError(f"message content must be a str, got {type(content).__name__}")
        self._messages.append({k: v for k, v in message.items() if v is not None or k == "content"})
        self._fill_rendered(self._render(False))

    def adopt_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> None:
        """Declare that this context's tokens already hold ``messages``
        rendered with the chat template (with ``tools``; typically after
        :meth:`open` of a snapshot saved from a chat: snapshots keep tokens,
        not messages), so later :meth:`user`/:meth:`assistant` calls append
        only the new turns.

        Raises:
            ValueError: the context's text is not exactly the rendering of
                ``messages``.
        """
        tools = None if tools is None else _tools.normalize_tools(tools)
        rendered = _tools.render_chat(self.model, list(messages), False, tools)
        if self.text != rendered:
            raise ValueError("adopt_chat: the context's tokens are not the chat template rendering of these messages")
        self._messages = [dict(m) for m in messages]
        self._tools = tools
        self._transcript.adopt(rendered, self.seq_len)
        self._needs_adopt = False

    def end_turn(self, message: dict[str, Any] | None = None) -> None:
        """Fill now what the chat template writes after the last message
        (its closing markup, e.g. ``<|im_end|>\n``), which the next chat
        helper would otherwise fill; with ``message``, first record the
        assistant turn just generated as ``message`` (OpenAI shape, e.g.
        with the ``tool_calls`` parsed out of the text): where the template
        renders it differently from the generated text, the context is cut
        back to the assistant header and the rendering filled. Afterwards
        :attr:`text` is the template's rendering of the messages, so a
        snapshot saved then (after ``flush``) reopens with
        :meth:`adopt_chat` of the same messages. A no-op outside a chat.

        Raises:
            ValueError: ``message`` is not an assistant message, or there is
                no assistant turn to record it as.
            ChatNotAdoptedError: see :meth:`open`.
        """
        self._check_adopted()
        if message is not None:
            if not isinstance(message, dict) or message.get("role") != "assistant":
                raise ValueError("end_turn(message): message must be an assistant message (OpenAI shape)")
            if not self._messages or self._messages[-1]["role"] != "assistant":
                raise ValueError("end_turn(message): there is no assistant turn to record")
            self._messages[-1] = {k: v for k, v in message.items() if v is not None or k == "content"}
        if self._messages:
            self._fill_rendered(self._render(False))

    @property
    def chat_text(self) -> str:
        """The chat template's text of the conversation so far (what the
        chat helpers filled, in the template's own spelling), ``""`` outside
        a chat; e.g. to see whether the prompt opens ``<think>``."""
        return self._transcript.rendered

    def begin_assistant(self) -> None:
        """Append the chat template's generation prompt (the assistant
        header), so the next tokens are the assistant's reply.
        :meth:`generate` does this itself; call it before decoding with
        :meth:`forward`, or to prefill the header once before forking. A
        no-op outside a chat or when the assistant turn is already open."""
        self._begin_assistant_turn()

    def _render(self, add_generation_prompt: bool) -> str:
        return _tools.render_chat(self.model, self._messages, add_generation_prompt, self._tools)

    def _check_adopted(self) -> None:
        if self._needs_adopt:
            raise ChatNotAdoptedError(
                "this context was opened from a snapshot holding tokens, not chat messages: call "
                "ctx.adopt_chat(messages) with the messages the snapshot holds before adding chat turns "
                "(or ctx.fill(text) for raw text)"
            )

    def _chat(self, role: str, content: str | None) -> None:
        self._check_adopted()
        if not isinstance(content, str):
            raise TypeError(f"message content must be a str, got {type(content).__name__}")
        self._messages.append({"role": role, "content": content})
        self._fill_rendered(self._render(False))

    def _fill_rendered(self, rendered: str) -> None:
        """Fill what the template adds beyond what is already rendered. When
        the template rewrote part of what is already filled (a tool call
        rendered with other spacing than generated, consecutive tool results
        merged into one turn), cut the context back to the last chat fill
        before the first difference and fill the rendering from there."""
        keep, text = self._transcript.refill(rendered, self.seq_len)
        if keep != self.seq_len:
            self._truncate(keep)
        self.fill(text)
        self._transcript.filled(rendered, self.seq_len)

    def _begin_assistant_turn(self) -> None:
        if self._messages and self._messages[-1]["role"] != "assistant":
            self._fill_rendered(self._render(True))
            self._messages.append({"role": "assistant", "content": None})
            self._turn_start = len(self._transcript.rendered)

    def _end_assistant_turn(self, text: str, stopped_on_eos: bool) -> None:
        """Record the reply. What the template adds after it (the rest of
        the end-of-turn markup) is filled lazily by the next chat helper, so
        a generation cut by ``max_tokens`` can be resumed by another
        ``generate`` (a snapshot taken after it holds no closing markup)."""
        if not self._messages or self._messages[-1] != {"role": "assistant", "content": None}:
            return
        self._messages[-1] = {"role": "assistant", "content": text}
        self._transcript.extend(text + (self.model.detokenize(self._pending[-1:]) if stopped_on_eos else ""), self.seq_len)

    def _replace_assistant_turn(self, message: dict[str, Any], text: str) -> None:
        """Record the open (or just ended) assistant turn as ``message``,
        its filled text being ``text`` (after the assistant header)."""
        if not self._messages or self._messages[-1]["role"] != "assistant":
            raise ValueError("no assistant turn to record")
        self._messages[-1] = message
        self._transcript.replace_from(self._turn_start, text, self.seq_len)

    # -- forward passes -------------------------------------------------------------
    async def flush(self, *, adapter: Adapter | str | None = None) -> None:
        """Run pending tokens through the model (prefill), sampling nothing;
        with ``adapter`` (:meth:`Model.adapter`), through that LoRA adapter."""
        self._check_open("flush")
        name = adapter_name(self.model, adapter)
        if self._pending:
            tokens, self._pending = self._pending, []
            try:
                await _binding.wait(_binding.host().forward(self._h, tokens, None, None, [], name))
            except BaseException:
                self._pending = tokens + self._pending
                raise

    async def forward(
        self,
        tokens: list[int] | None = None,
        *,
        positions: list[int] | None = None,
        attention: list[list[int]] | None = None,
        outputs: Sequence[OutputSlot | AttentionProbe] = (),
        adapter: Adapter | str | None = None,
    ) -> list[Any]:
        """One explicit forward pass over pending tokens followed by ``tokens``.

        Args:
            tokens: input token ids after the pending ones.
            positions: RoPE positions of ``tokens`` (pending tokens get
                consecutive ones).
            attention: per token of ``tokens``, a BRLE mask over the
                context's positions (True = may attend); pending tokens attend
                causally.
            outputs: :class:`~tartlet.forward.OutputSlot` records (helpers in
                :mod:`tartlet.forward`); their ``index`` counts
                within ``tokens`` (or within the pending tokens when
                ``tokens`` is empty). At most one
                :class:`~tartlet.attention_probe.AttentionProbe` may be among
                them: its result is the pass's attention scores.
            adapter: a LoRA adapter (:meth:`Model.adapter`, or its name)
                the whole pass runs with, pending tokens included; None:
                the base model.

        Returns:
            One result per output slot (see :mod:`tartlet.forward`).

        Raises:
            AdapterError: the model serves no such adapter, or it is
                another model's.
            ValueError: no input at all; a position outside
                ``[0, model.max_seq_len)``; the pass would outgrow the
                model's context; positions, masks or slots that do not match
                ``tokens``; an output index outside the input; two attention
                probes, or a malformed one (``SamplingError``).
            ContextClosedError: the context was closed.
        """
        self._check_open("forward")
        name = adapter_name(self.model, adapter)
        tokens = list(tokens or [])
        pending = self._pending
        if not pending and not tokens:
            raise ValueError("forward needs input: the context has no pending tokens and no tokens were given")
        n0 = len(pending)
        start = self.kv_len
        limit = self.model.max_seq_len
        if start + n0 + len(tokens) > limit:
            raise ValueError(f"forward would make the context {start + n0 + len(tokens)} tokens long, more than the model's {limit}")
        pos = None
        if positions is not None:
            positions = list(positions)
            if len(positions) != len(tokens):
                raise ValueError(f"positions: need one per token of `tokens` ({len(tokens)}), got {len(positions)}")
            for p in positions:
                if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < limit:
                    raise ValueError(f"position {p!r} outside the model's context [0, {limit})")
            pos = list(range(start, start + n0)) + positions
        attn = None
        if attention is not None:
            attention = list(attention)
            if len(attention) != len(tokens):
                raise ValueError(f"attention: need one mask per token of `tokens` ({len(tokens)}), got {len(attention)}")
            attn = [brle.causal(start + j) for j in range(n0)] + [list(m) for m in attention]
        shift = n0 if tokens else 0
        n_out = len(tokens) if tokens else n0
        slots: list[OutputSlot] = []
        probe, probe_at = None, 0
        for o in outputs:
            if isinstance(o, AttentionProbe):  # a pass-wide probe: no index; its result goes back in its place
                if probe is not None:
                    raise ValueError("forward takes at most one attention probe")
                probe, probe_at = o, len(slots)
                continue
            if not isinstance(o, OutputSlot):
                raise ValueError(f"an output is a tartlet.forward.OutputSlot (see the helpers there), got {type(o).__name__}")
            i = o.index
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_out:
                where = "`tokens`" if tokens else "the pending tokens"
                raise ValueError(f"output index {i!r} outside {where} (0..{n_out - 1})")
            slots.append(replace(o, index=i + shift))
        self._take_pending()
        try:
            fut = _binding.host().forward(self._h, pending + tokens, pos, attn, slots, name, probe=probe)
        except BaseException:
            self._restore_pending(pending)
            raise
        results: list[Any] = await _binding.wait(fut)
        if probe is not None:  # the host returns the probe's scores after the slots' results
            results = [*results[:probe_at], results[-1], *results[probe_at:-1]]
        return results

    def generate(
        self,
        sampler: Sampler | None = None,
        *,
        max_tokens: int | None = 256,
        stop: StopCondition | list[str] | str | None = None,
        eos: bool = True,
        drafter: Any = None,
        constraint: Any = None,
        overlap: bool = False,
        chunk: int | None = None,
        adapter: Adapter | str | None = None,
    ) -> Generator:
        """Generate from the context: ``async for step in ctx.generate(...)``
        or ``await ctx.generate(...).collect_text()``.

        Args:
            sampler: token selection (default greedy).
            max_tokens: stop after this many tokens (None: only other stops).
            stop: extra stop condition, or stop string(s).
            eos: stop at the model's end-of-sequence tokens.
            drafter: speculative-decoding drafter (see :mod:`tartlet.drafter`).
            constraint: grammar constraint whose allowed tokens mask the logits.
            overlap: let the model run ahead of the caller, so its work on
                a step overlaps the next passes: with an engine-side
                sampler, no drafter and no constraint but a built-in (host)
                grammar, a host token stream (each step takes the tokens
                sampled since the last, one or several; with ``chunk``, the
                next chunk), else the next pass queued before each step is
                returned; the context is then busy until the generation
                ends or ``await gen.aclose()`` (see :mod:`tartlet.generator`).
            chunk: stream in steps of up to this many tokens (1, 2, 4, ...
                up to ``chunk``: the first token comes at once): taken from
                the token stream with ``overlap``, else decoded host-side
                between steps when only ``max_tokens`` and EOS stop the
                generation and the sampler, drafter and constraint leave
                nothing to do between tokens (otherwise one token a step as
                without it). Same tokens and text; the code between steps
                runs once per chunk. None: one token a step.
            adapter: a LoRA adapter (:meth:`Model.adapter`, or its name)
                every pass of the generation runs with (the pending prompt
                tokens too); None: the base model.

        Raises:
            AdapterError: an :class:`Adapter` of another model (an unknown
                name fails the first step).
            ContextClosedError: the context was closed.
            ValueError: the context is empty (nothing to condition on),
                ``overlap`` with a ``drafter``, or ``chunk`` not an int >= 1.
        """
        self._check_open("generate")
        return Generator(self, sampler or Sampler.greedy(), max_tokens=max_tokens, stop=stop, eos=eos, drafter=drafter,
                         constraint=constraint, overlap=overlap, chunk=chunk, adapter=adapter_name(self.model, adapter))

    # -- KV management -----------------------------------------------------------------
    def fork(self) -> "Context":
        """A copy of this context (pending tokens and chat state included)
        that shares its full KV pages; only the partly filled last page is
        copied.

        Raises:
            ContextClosedError: this context was closed.
        """
        self._check_open("fork")
        child = Context(self.model, _handle=_binding.host().context_fork(self._h))
        child._pending = list(self._pending)
        child._messages = [dict(m) for m in self._messages]
        child._tools = self._tools
        child._transcript = self._transcript.copy()
        child._turn_start = self._turn_start
        child._needs_adopt = self._needs_adopt
        return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the context (pending included).
        Chat tracking restarts: later chat helpers render only new turns.

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]``.
        """
        self._truncate(n)
        self._messages = []
        self._transcript.reset()
        self._needs_adopt = False

    def _truncate(self, n: int) -> None:
        kv = self.kv_len
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= kv + len(self._pending):
            raise ValueError(f"truncate to {n!r} outside [0, {kv + len(self._pending)}]")
        if n >= kv:
            del self._pending[n - kv :]
        else:
            _binding.host().context_truncate(self._h, n)
            self._pending = []

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide tokens ``[start, end)`` of the KV cache from attention of
        every later pass (``masked=False`` shows them again).

        Raises:
            ValueError: the range is outside ``[0, kv_len]`` (pending tokens
                cannot be masked: flush first).
        """
        self._check_open("mask_token_range")
        _binding.host().context_mask(self._h, start, end, masked)

    async def drop_masked_pages(self) -> int:
        """Free the KV pages whose tokens are all masked; returns how many.
        Their tokens stay in :attr:`tokens` but can never be attended again."""
        self._check_open("drop_masked_pages")
        return await _binding.wait(_binding.host().context_drop_masked_pages(self._h))

    async def stats(self) -> dict[str, int]:
        """``tokens``, ``pages``, ``live_pages``, ``shared_pages`` of this
        context's KV cache (``live_pages`` excludes dropped pages,
        ``shared_pages`` counts pages another context or snapshot also holds)."""
        self._check_open("stats")
        return await _binding.wait(_binding.host().context_stats(self._h))

    # -- snapshots --------------------------------------------------------------------
    def save(self, name: str, *, pending: bool = False) -> list[int]:
        """Save the KV cache under ``name``, engine-wide; the snapshot
        outlives this inferlet and is immutable. ``pending=True``: save
        without a pass, the pending tokens left out; returns them (``[]``
        otherwise), for ``fill_tokens`` after :meth:`open` (no model call
        now: the next pass computes them with what follows).

        Raises:
            ValueError: pending tokens without ``pending=True`` (flush
                first), or the name exists (``tartlet.errors.SnapshotError``).
        """
        self._check_open("save")
        if self._pending and not pending:
            raise ValueError(f"save({name!r}): {len(self._pending)} pending tokens; await ctx.flush() first")
        _binding.host().snapshot_save(self._h, name)
        return list(self._pending)

    def snapshot(self) -> str:
        """Save under a generated unique name and return it."""
        name = f"snapshot-{uuid.uuid4().hex}"
        self.save(name)
        return name

    @classmethod
    def open(cls, model: "Model", name: str) -> "Context":
        """A new context forked from snapshot ``name`` (which stays).

        A snapshot keeps tokens, not chat messages: to continue a chat on
        it, call :meth:`adopt_chat` with the messages it holds first; chat
        helpers before that raise :class:`ChatNotAdoptedError` (``fill``,
        ``fill_tokens`` and ``generate`` need nothing).

        Raises:
            ValueError: no snapshot of that name.
        """
        return cls(model, _handle=_binding.host().snapshot_open(model.name, name))._opened()

    @classmethod
    def take(cls, model: "Model", name: str) -> "Context":
        """A context that takes over snapshot ``name``; the name disappears.
        Chat helpers need :meth:`adopt_chat` first, as after :meth:`open`.

        Raises:
            ValueError: no snapshot of that name.
        """
        return cls(model, _handle=_binding.host().snapshot_take(model.name, name))._opened()

    def _opened(self) -> "Context":
        self._needs_adopt = self.kv_len > 0
        return self

    @staticmethod
    def delete(model: "Model", name: str) -> None:
        """Delete snapshot ``name`` and free its pages.

        Raises:
            ValueError: no snapshot of that name.
        """
        _binding.host().snapshot_delete(model.name, name)

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Free this context's pages. Idempotent; contexts still open when
        the inferlet ends are closed by the host."""
        if not self._closed:
            self._closed = True
            _binding.host().context_free(self._h)

    async def __aenter__(self) -> "Context":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
from typing import TYPE_CHECKING, Any

from . import _binding, brle
from .generator import Generator
from .sampler import Sampler
from .stop import StopCondition

if TYPE_CHECKING:
    from .model import Model


class Context:
    """A context on ``model``. Create with :meth:`Model.new_context`,
    :meth:`fork`, :meth:`open` or :meth:`take`.

    Raises (any method):
        tartlet.host.errors.InvalidHandleError: the context was closed.
    """

    def __init__(self, model: "Model", _handle: int | None = None) -> None:
        self.model = model
        self._h = _binding.host().context_new(model.name) if _handle is None else _handle
        self._pending: list[int] = []
        self._messages: list[dict[str, Any]] = []
        self._rendered = ""
        self._closed = False

    # -- facts -------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.model.page_size

    @property
    def kv_len(self) -> int:
        """Tokens already run through the model (in the KV cache)."""
        return _binding.host().context_len(self._h)

    @property
    def seq_len(self) -> int:
        """All tokens of the context: in the KV cache plus pending."""
        return self.kv_len + len(self._pending)

    @property
    def tokens(self) -> list[int]:
        """Token ids of the context, pending ones included."""
        return _binding.host().context_tokens(self._h) + self._pending

    @property
    def pending(self) -> list[int]:
        """Filled tokens not yet run through the model."""
        return list(self._pending)

    @property
    def text(self) -> str:
        return self.model.detokenize(self.tokens)

    # -- filling -------------------------------------------------------------------
    def fill(self, text: str) -> None:
        """Append the tokens of ``text`` (pending until the next pass)."""
        self._pending += self.model.tokenize(text)

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

    def system(self, text: str) -> None:
        """Append a system message, rendered with the model's chat template."""
        self._chat("system", text)

    def user(self, text: str) -> None:
        """Append a user message, rendered with the model's chat template."""
        self._chat("user", text)

    def assistant(self, text: str) -> None:
        """Append an assistant message, rendered with the model's chat template."""
        self._chat("assistant", text)

    def _chat(self, role: str, content: str) -> None:
        if not isinstance(content, str):
            raise TypeError(f"message content must be a str, got {type(content).__name__}")
        self._messages.append({"role": role, "content": content})
        self._fill_rendered(self.model.apply_chat_template(self._messages, add_generation_prompt=False))

    def _fill_rendered(self, rendered: str) -> None:
        """Fill what the template adds beyond what is already rendered."""
        if rendered.startswith(self._rendered):
            self.fill(rendered[len(self._rendered) :])
        else:  # the template rewrote earlier turns; keep the context as is
            self.fill(rendered)
        self._rendered = rendered

    def _begin_assistant_turn(self) -> None:
        if self._messages and self._messages[-1]["role"] != "assistant":
            self._fill_rendered(self.model.apply_chat_template(self._messages, add_generation_prompt=True))
            self._messages.append({"role": "assistant", "content": None})

    def _end_assistant_turn(self, text: str, stopped_on_eos: bool) -> None:
        if not self._messages or self._messages[-1] != {"role": "assistant", "content": None}:
            return
        self._messages[-1] = {"role": "assistant", "content": text}
        have = self._rendered + text + (self.model.detokenize(self._pending[-1:]) if stopped_on_eos else "")
        full = self.model.apply_chat_template(self._messages, add_generation_prompt=False)
        if full.startswith(have):
            self.fill(full[len(have) :])
        self._rendered = full

    # -- forward passes -------------------------------------------------------------
    async def flush(self) -> None:
        """Run pending tokens through the model (prefill), sampling nothing."""
        if self._pending:
            tokens, self._pending = self._pending, []
            try:
                await _binding.wait(_binding.host().forward(self._h, tokens, None, None, []))
            except BaseException:
                self._pending = tokens + self._pending
                raise

    async def forward(
        self,
        tokens: list[int] | None = None,
        *,
        positions: list[int] | None = None,
        attention: list[list[int]] | None = None,
        outputs: list[dict[str, Any]] = (),
    ) -> list[Any]:
        """One explicit forward pass over pending tokens followed by ``tokens``.

        Args:
            tokens: input token ids after the pending ones.
            positions: RoPE positions of ``tokens`` (pending tokens get
                consecutive ones).
            attention: per token of ``tokens``, a BRLE mask over the
                context's positions (True = may attend); pending tokens attend
                causally.
            outputs: slots from :mod:`tartlet.forward`; their ``index`` counts
                within ``tokens`` (or within the pending tokens when
                ``tokens`` is empty).

        Returns:
            One result per output slot (see :mod:`tartlet.forward`).

        Raises:
            ValueError: no input at all, malformed positions, masks or slots.
        """
        tokens = list(tokens or [])
        pending = self._pending
        if not pending and not tokens:
            raise ValueError("forward needs input: the context has no pending tokens and no tokens were given")
        n0 = len(pending)
        start = self.kv_len
        pos = None
        if positions is not None:
            pos = list(range(start, start + n0)) + list(positions)
        attn = None
        if attention is not None:
            attn = [brle.causal(start + j) for j in range(n0)] + [list(m) for m in attention]
        shift = n0 if tokens else 0
        slots = [dict(o, index=o.get("index", 0) + shift) for o in outputs]
        self._pending = []
        try:
            fut = _binding.host().forward(self._h, pending + tokens, pos, attn, slots)
        except BaseException:
            self._pending = pending
            raise
        return await _binding.wait(fut)

    def generate(
        self,
        sampler: Sampler | None = None,
        *,
        max_tokens: int | None = 256,
        stop: StopCondition | list[str] | str | None = None,
        eos: bool = True,
        drafter: Any = None,
        constraint: Any = None,
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

        Raises:
            ValueError: the context is empty (nothing to condition on).
        """
        return Generator(self, sampler or Sampler.greedy(), max_tokens=max_tokens, stop=stop, eos=eos, drafter=drafter, constraint=constraint)

    # -- KV management -----------------------------------------------------------------
    def fork(self) -> "Context":
        """A copy of this context (pending tokens and chat state included)
        that shares its full KV pages; only the partly filled last page is
        copied."""
        child = Context(self.model, _handle=_binding.host().context_fork(self._h))
        child._pending = list(self._pending)
        child._messages = [dict(m) for m in self._messages]
        child._rendered = self._rendered
        return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens of the context (pending included).
        Chat tracking restarts: later chat helpers render only new turns.

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]``.
        """
        self._truncate(n)
        self._messages, self._rendered = [], ""

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
            ValueError: the range is outside ``[0, kv_len]``.
        """
        _binding.host().context_mask(self._h, start, end, masked)

    async def drop_masked_pages(self) -> int:
        """Free the KV pages whose tokens are all masked; returns how many.
        Their tokens stay in :attr:`tokens` but can never be attended again."""
        return await _binding.wait(_binding.host().context_drop_masked_pages(self._h))

    async def stats(self) -> dict[str, int]:
        """``tokens``, ``pages``, ``live_pages``, ``shared_pages`` of this
        context's KV cache."""
        return await _binding.wait(_binding.host().context_stats(self._h))

    # -- snapshots --------------------------------------------------------------------
    def save(self, name: str) -> None:
        """Save the KV cache under ``name``, engine-wide; the snapshot
        outlives this inferlet and is immutable.

        Raises:
            ValueError: pending tokens (flush first), or the name exists.
        """
        if self._pending:
            raise ValueError(f"save({name!r}): {len(self._pending)} pending tokens; await ctx.flush() first")
        _binding.host().snapshot_save(self._h, name)

    def snapshot(self) -> str:
        """Save under a generated unique name and return it."""
        name = f"snapshot-{uuid.uuid4().hex}"
        self.save(name)
        return name

    @classmethod
    def open(cls, model: "Model", name: str) -> "Context":
        """A new context forked from snapshot ``name`` (which stays).

        Raises:
            ValueError: no snapshot of that name.
        """
        return cls(model, _handle=_binding.host().snapshot_open(model.name, name))

    @classmethod
    def take(cls, model: "Model", name: str) -> "Context":
        """A context that takes over snapshot ``name``; the name disappears.

        Raises:
            ValueError: no snapshot of that name.
        """
        return cls(model, _handle=_binding.host().snapshot_take(model.name, name))

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

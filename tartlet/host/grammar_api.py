"""Host calls for grammar-constrained decoding (matchers that turn a grammar
state into a logit mask). Mixed into :class:`tartlet.host.api.HostApi`.

The grammar engine (llguidance, see :mod:`tartlet.host.grammar`) is native
code, so it lives on the host; the SDK's :mod:`tartlet.sdk.constraint` holds
only handles. A generation step names its matcher in the output slot
(``{"grammar": handle}``) and the host computes the mask itself, in a worker
thread, while the forward pass runs: no mask crosses the host boundary.
``grammar_mask`` still returns the mask (BRLE or packed bits) for inferlets
that combine it with logic of their own.

Handles are small integers private to the instance (shared counter with
contexts); :meth:`_grammar_close` drops them all when the instance ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ..engine.core.sampler import OutputSlot, ProbeSpec, SamplerSpec
from ..sdk.errors import GrammarError, InvalidHandleError
from .grammar import GRAMMAR_KINDS, GrammarOutputSlot, Matcher, bits_to_brle

if TYPE_CHECKING:
    from .state import HostState

#: Most live matchers one instance may hold.
MAX_MATCHERS = 4096


class GrammarHostMixin:
    """Grammar matcher host calls (``grammar_*``) over ``_matchers`` (handle
    -> matcher, made by ``HostApi.__init__``); handles come from HostApi's
    shared ``_ids`` counter."""

    state: HostState
    _matchers: dict[int, Matcher]
    _ids: Iterator[int]

    def _matcher(self, handle: Any) -> Matcher:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise InvalidHandleError(f"a grammar handle is an int, got {type(handle).__name__}")
        m = self._matchers.get(handle)
        if m is None:
            raise InvalidHandleError(f"no grammar matcher with handle {handle!r} (freed, or never created)")
        return m

    def _grammar_add(self, m: Matcher) -> int:
        ms = self._matchers
        if len(ms) >= MAX_MATCHERS:
            raise GrammarError(f"this instance already holds {MAX_MATCHERS} grammar matchers; free some (grammar_free)")
        h = next(self._ids)
        ms[h] = m
        return h

    def grammar_new(self, model: str | None, kind: str, spec: Any) -> int:
        """Compile a constraint for ``model``'s tokenizer; returns a matcher
        handle in the initial state.

        Args:
            model: served model name (None: the default).
            kind: ``json_schema`` (spec: dict, bool or JSON text),
                ``any_json`` (spec: None), ``regex`` (spec: pattern, full
                match, Rust ``regex`` syntax) or ``grammar`` (spec: Lark or
                GBNF/EBNF text).

        Raises:
            ValueError: the model is not served.
            GrammarError: unknown kind; invalid, unsupported or unsatisfiable
                spec (the message names what is wrong).
        """
        if not isinstance(kind, str) or kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r} (known: {', '.join(GRAMMAR_KINDS)})")
        engine = self.state.model(model).engine
        return self._grammar_add(Matcher.compile(engine, kind, spec))

    @overload
    def grammar_mask(self, handle: int, form: Literal["brle"] = ...) -> list[int]: ...
    @overload
    def grammar_mask(self, handle: int, form: Literal["bits"]) -> bytes: ...
    @overload
    def grammar_mask(self, handle: int, form: str) -> list[int] | bytes: ...
    def grammar_mask(self, handle: int, form: str = "brle") -> list[int] | bytes:
        """The allowed tokens of the matcher's current state.

        Args:
            form: ``brle`` (run lengths over ``vocab_size``, first run False,
                True = allowed) or ``bits`` (packed, ``ceil(vocab_size / 8)``
                bytes, bit ``i % 8`` of byte ``i // 8`` is token ``i``).

        Raises:
            InvalidHandleError: unknown handle.
            GrammarError: unknown form, or the matcher failed.
        """
        m = self._matcher(handle)
        if form not in ("brle", "bits"):
            raise GrammarError(f"unknown mask form {form!r} (known: brle, bits)")
        packed = m.bits()
        return bits_to_brle(packed, m.vocab_size) if form == "brle" else packed.tobytes()

    def grammar_advance(self, handle: int, token: int) -> None:
        """Consume a sampled token.

        Raises:
            InvalidHandleError: unknown handle.
            ValueError: ``token`` is not an id of the vocabulary.
            GrammarError: the grammar does not allow ``token`` here (state
                unchanged), or the matcher failed earlier.
        """
        m = self._matcher(handle)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < m.vocab_size:
            raise ValueError(f"token id {token!r} outside the vocabulary [0, {m.vocab_size})")
        m.advance(token)

    def grammar_fork(self, handle: int) -> int:
        """A new matcher in the same state (for a forked generation)."""
        return self._grammar_add(self._matcher(handle).fork())

    def grammar_reset(self, handle: int) -> None:
        """Back to the initial state."""
        self._matcher(handle).reset()

    def grammar_is_finished(self, handle: int) -> bool:
        """True when the grammar is complete and allows nothing more than the
        end-of-sequence tokens."""
        return self._matcher(handle).is_finished()

    def grammar_is_accepting(self, handle: int) -> bool:
        """True when the tokens consumed so far form a complete match."""
        return self._matcher(handle).is_accepting()

    def grammar_free(self, handle: int) -> None:
        """Drop a matcher.

        Raises:
            InvalidHandleError: unknown handle.
        """
        self._matcher(handle)
        self._matchers.pop(handle).close()

    def _grammar_output_slot(self, engine: Any, index: int, spec: SamplerSpec | ProbeSpec, handle: Any, allowed: torch.Tensor | None) -> OutputSlot:
        """An output slot masked by matcher ``handle`` (and ``allowed`` when
        the slot also carries a BRLE ``logit_mask``: both must allow a
        token). A sampling or probe slot starts its mask computation now, so
        it overlaps the pass; a greedy one checks its best token first (see
        :class:`GrammarOutputSlot`).

        Raises:
            InvalidHandleError: unknown handle.
            GrammarError: the matcher belongs to another model, or failed.
        """
        return GrammarOutputSlot(index, spec, self._matcher_for(handle, engine), allowed)

    def _matcher_for(self, handle: Any, engine: Any) -> Matcher:
        """Matcher ``handle``, checked to be compiled for ``engine``'s model.

        Raises:
            InvalidHandleError: unknown handle.
            GrammarError: the matcher belongs to another model.
        """
        m = self._matcher(handle)
        if m.engine is not engine:
            raise GrammarError(f"grammar matcher {handle} was compiled for another model than this context's")
        return m

    def _grammar_close(self) -> None:
        """Drop every matcher of this instance (the instance ended)."""
        ms = self._matchers
        for m in ms.values():
            m.close()
        ms.clear()

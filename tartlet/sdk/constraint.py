"""Constrained decoding: JSON Schema, regex and grammar constraints.

A constraint restricts which tokens a generation may pick: each step its
allowed-token set becomes the pass's logit mask (True = allowed), the sampled
token advances it, and the generation ends when it is complete::

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    answer = await ctx.generate(sampler, constraint=JsonSchema(schema)).collect_json()

Built-in constraints (:class:`JsonSchema`, :class:`AnyJson`, :class:`Regex`,
:class:`Grammar`) are compiled by the host's grammar engine (llguidance) for
the model's tokenizer; this module only holds a handle, so it stays pure
Python for WASM builds. Their masks never travel through the inferlet: the
generator names the matcher in the output slot and the host computes the
mask while the forward pass runs.

Custom constraints implement :class:`Constraint` (``mask``, ``advance``,
``is_finished``, ``fork``) in Python and return their mask as BRLE
(:mod:`tartlet.brle`).

A constraint object is stateful: it follows one generation. Use
:meth:`fork` (or a new object) for another one; :meth:`Generator.fork`
forks the constraint with the context.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from . import _binding


@runtime_checkable
class Constraint(Protocol):
    """What the generator needs from a constraint.

    ``mask()``: the allowed tokens of the current state as BRLE over the
    vocabulary (True = allowed), or None when every token is allowed.
    ``advance(token)``: consume the sampled token (raise ValueError if it is
    not allowed). ``is_finished()``: True when nothing but end-of-sequence
    may follow (the generator then stops with finish_reason
    ``"constraint"``). ``fork()``: an independent copy in the same state.

    Optional: ``slot_fields()`` returning extra :class:`~tartlet.forward.OutputSlot`
    fields (the built-ins return ``{"grammar": handle}`` so the host computes the mask);
    when present it replaces ``mask()`` in the generator.
    """

    def mask(self) -> list[int] | None: ...

    def advance(self, token: int) -> None: ...

    def is_finished(self) -> bool: ...

    def fork(self) -> "Constraint": ...


def slot_fields(constraint: Any) -> dict[str, Any]:
    """:class:`~tartlet.forward.OutputSlot` fields (for
    ``dataclasses.replace``) that apply ``constraint`` to one sampled position:
    ``{"grammar": handle}`` for host matchers, ``{"logit_mask": brle}`` for
    Python constraints, ``{}`` when everything is allowed."""
    fields = getattr(constraint, "slot_fields", None)
    if fields is not None:
        out: dict[str, Any] = fields()
        return out
    mask = constraint.mask()
    return {} if mask is None else {"logit_mask": list(mask)}


def host_grammar_handle(constraint: Any) -> int | None:
    """The matcher handle of a constraint whose every step is masked by a
    host matcher and nothing else (``slot_fields()`` is exactly
    ``{"grammar": handle}``, as the built-ins'), else None. The host can
    then mask and advance its own copy between passes (host-side decoding
    and token streams, ``HostApi.generate``) while the generator advances
    this one with the tokens it keeps."""
    fields = getattr(constraint, "slot_fields", None)
    if fields is None:
        return None
    f = fields()
    if not isinstance(f, dict) or set(f) != {"grammar"}:
        return None
    h: int = f["grammar"]
    return h


class HostGrammar:
    """A constraint compiled and matched by the host's grammar engine.

    Args:
        kind: ``json_schema``, ``any_json``, ``regex`` or ``grammar``.
        spec: the kind's spec (see the subclasses).
        model: model name whose tokenizer the grammar is compiled for
            (default: the host's default model); generation must use a
            context on that model.

    Raises:
        ValueError (``GrammarError``): invalid spec, unsupported feature, or
            a grammar no token sequence can satisfy; the message says what.
    """

    kind = ""

    def __init__(self, kind: str, spec: Any, model: str | None = None, *, _handle: int | None = None) -> None:
        host = _binding.host()
        self.model: str = model if model is not None else host.model_names()[0]
        self.spec = spec
        self.kind = kind
        self._h: int | None = host.grammar_new(self.model, kind, spec) if _handle is None else _handle

    @property
    def handle(self) -> int:
        """The host matcher handle.

        Raises:
            ValueError: the constraint was closed.
        """
        if self._h is None:
            raise ValueError(f"this {type(self).__name__} constraint was closed")
        return self._h

    def slot_fields(self) -> dict[str, Any]:
        return {"grammar": self.handle}

    def mask(self) -> list[int]:
        """Allowed tokens now, as BRLE over the vocabulary (one host call;
        the generator does not need it)."""
        return _binding.host().grammar_mask(self.handle, "brle")

    def mask_bits(self) -> bytes:
        """Allowed tokens now, packed: bit ``i % 8`` of byte ``i // 8`` is token ``i``."""
        return _binding.host().grammar_mask(self.handle, "bits")

    def advance(self, token: int) -> None:
        """Consume ``token``. Raises ValueError when the grammar does not allow it."""
        _binding.host().grammar_advance(self.handle, token)

    def is_finished(self) -> bool:
        """True when only end-of-sequence may follow."""
        return _binding.host().grammar_is_finished(self.handle)

    def is_accepting(self) -> bool:
        """True when the tokens consumed so far are a complete match."""
        return _binding.host().grammar_is_accepting(self.handle)

    def fork(self) -> "HostGrammar":
        """An independent copy in the same state (no recompilation)."""
        child = object.__new__(type(self))
        child.__dict__.update(self.__dict__)
        child._h = _binding.host().grammar_fork(self.handle)
        return child

    def reset(self) -> None:
        """Back to the initial state, to constrain another generation."""
        _binding.host().grammar_reset(self.handle)

    def close(self) -> None:
        """Free the host matcher (idempotent; the host frees what is left
        when the inferlet ends)."""
        if self._h is not None:
            h, self._h = self._h, None
            _binding.host().grammar_free(h)

    def __enter__(self) -> "HostGrammar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class JsonSchema(HostGrammar):
    """Output is one JSON value valid against ``schema`` (JSON Schema draft
    2020-12 subset supported by llguidance: types, properties, required,
    additionalProperties, items/prefixItems, min/maxItems, enum, const,
    anyOf/oneOf/allOf, $ref/$defs, numeric bounds, string length, pattern
    and common formats). JSON is compact (no whitespace).

    Raises:
        ValueError: invalid schema or unsupported keyword (named in the message).
    """

    def __init__(self, schema: dict[str, Any] | str | bool, model: str | None = None) -> None:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"JSON Schema text is not valid JSON: {e}") from None
        super().__init__("json_schema", schema, model)


class AnyJson(HostGrammar):
    """Output is any one JSON value (compact)."""

    def __init__(self, model: str | None = None) -> None:
        super().__init__("any_json", None, model)

    def __repr__(self) -> str:
        return "AnyJson()"


class Regex(HostGrammar):
    """Output matches ``pattern`` in full (Rust ``regex`` syntax, which
    agrees with Python's ``re`` on common constructs; no backreferences or
    lookaround).

    Raises:
        ValueError: the pattern does not parse or matches nothing.
    """

    def __init__(self, pattern: str, model: str | None = None) -> None:
        if not isinstance(pattern, str):
            raise TypeError(f"a regex pattern is a str, got {type(pattern).__name__}")
        super().__init__("regex", pattern, model)


class Grammar(HostGrammar):
    """Output is a sentence of a context-free grammar: Lark syntax
    (llguidance dialect, start rule ``start``; may embed ``%json{...}`` and
    regexes) or GBNF/EBNF as llama.cpp writes it (start rule ``root``,
    ``::=``), detected from the text.

    Raises:
        ValueError: the grammar does not parse, names an undefined rule, or
            no token can start it.
    """

    def __init__(self, text: str, model: str | None = None) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a grammar is a str, got {type(text).__name__}")
        super().__init__("grammar", text, model)


#: inferlet arguments that name a constraint, at most one per call
CONSTRAINT_ARGS = ("json_schema", "regex", "grammar")


def constraint_from_args(args: dict[str, Any], model_name: str, who: str = "inferlet") -> HostGrammar | None:
    """The constraint named by ``args`` (``json_schema``, ``regex`` or
    ``grammar``; the standard inferlets' argument names), compiled for
    ``model_name``; None when none is given. ``who`` prefixes the error.

    Raises:
        ValueError: more than one constraint argument, or an invalid spec.
        TypeError: ``regex`` / ``grammar`` is not a string.
    """
    given = [a for a in CONSTRAINT_ARGS if args.get(a) is not None]
    if len(given) > 1:
        raise ValueError(f"{who}: give at most one of `json_schema`, `regex`, `grammar`; got {' and '.join(f'`{a}`' for a in given)}")
    if not given:
        return None
    kind = given[0]
    if kind == "json_schema":
        return JsonSchema(args[kind], model_name)
    if kind == "regex":
        return Regex(args[kind], model_name)
    return Grammar(args[kind], model_name)

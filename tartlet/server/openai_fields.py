"""Checked field types of the ``/v1`` request models (:mod:`.openai_models`,
:class:`.openai_sampling.SamplerFields`, the Responses and embeddings
bodies).

Each type is a pydantic :class:`~pydantic.PlainValidator` that takes the raw
JSON value (no coercion: ``true`` is not a number, ``"1"`` is not an
integer) and raises :func:`invalid` with OpenAI's error ``code`` and a
message that names the parameter as ``{param}``;
:func:`.openai_errors.validation_error` turns the first such error into the
400 body (``param``: the field's path, ``messages[2].content``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from pydantic import PlainValidator, ValidationInfo
from pydantic_core import PydanticCustomError

from .openai_errors import PARAM, ApiError


def invalid(message: str, code: str = "invalid_value", *, at: str | None = None, field: str | None = None) -> PydanticCustomError:
    """A validation error of a ``/v1`` request field.

    Args:
        message: the error message; ``{param}`` stands for the parameter
            (``'temperature'`` at the top level, ``messages[1].role`` nested).
        code: OpenAI's ``code`` (``invalid_value``, ``unsupported_parameter``,
            ``missing_required_parameter``, ``invalid_json_schema``).
        at: the ``param`` itself, for a check across fields (a model
            validator, whose location is the request).
        field: a key under the error's location that ``param`` names
            (a model's ``before`` validator naming one of its fields).
    """
    ctx = {k: v for k, v in (("at", at), ("field", field)) if v is not None}
    return PydanticCustomError(code, message, ctx or None)


def _bounds(lo: float, hi: float, open_lo: bool = False) -> str:
    return f"{'(' if open_lo else '['}{lo:g}, {hi:g}]"


def number(lo: float, hi: float, open_lo: bool = False, finite: bool = False) -> PlainValidator:
    """A JSON number (not a boolean) in ``[lo, hi]`` (``(lo, hi]`` with
    ``open_lo``; NaN never, infinities only with ``hi`` infinite and not
    ``finite``), as a float; null is None."""
    return PlainValidator(_number_check(lo, hi, open_lo, finite))


def _number_check(lo: float, hi: float, open_lo: bool = False, finite: bool = False) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if open_lo else lo <= v) or not v <= hi or (finite and math.isinf(v)):
            raise invalid(f"{PARAM} must be a number in {_bounds(lo, hi, open_lo)}, got {v!r}")
        return float(v)

    return check


def nucleus() -> PlainValidator:
    """``top_p``: a number in ``[0, 1]`` (:func:`number`) above 0; null is None."""
    in_range = _number_check(0.0, 1.0)

    def check(v: Any) -> float | None:
        p = in_range(v)
        if p == 0.0:
            raise invalid(f"{PARAM} must be > 0")
        return p

    return PlainValidator(check)


def integer(lo: int | None = None, hi: int | None = None, *, hi_from: str | None = None, below: int | None = None) -> PlainValidator:
    """A JSON integer (not a boolean) in ``[lo, hi]``, ``hi`` read from the
    validation context's ``hi_from`` key when given (``max_seq_len``),
    and under ``below`` (a limit the message does not state); null is None."""

    def check(v: Any, info: ValidationInfo) -> int | None:
        if v is None:
            return None
        top = hi if hi_from is None else (info.context or {}).get(hi_from)
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (top is not None and v > top) or (
            below is not None and v >= below
        ):
            if lo is None:
                raise invalid(f"{PARAM} must be an integer")
            where = f"in [{lo}, {top}]" if top is not None else f">= {lo}"
            raise invalid(f"{PARAM} must be an integer {where}, got {v!r}")
        return v

    return PlainValidator(check)


def _boolean(v: Any) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise invalid(f"{PARAM} must be a boolean, got {v!r}")
    return v


#: A JSON boolean; null is None.
boolean = PlainValidator(_boolean)


def non_empty_string(what: str = "must be a non-empty string", code: str = "invalid_value") -> PlainValidator:
    """A non-empty JSON string; anything else (null included: give the
    field ``validate_default=True`` to require it) is an error saying
    ``{param} <what>``."""

    def check(v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise invalid(f"{PARAM} {what}", code)
        return v

    return PlainValidator(check)


def checked_by(parse: Callable[[Any], Any]) -> PlainValidator:
    """A field checked by ``parse(value)``, a parser shared with code that
    is not a model (``parse_response_format``, the Responses input items),
    whose :class:`~.openai_errors.ApiError` names the ``param`` itself."""

    def check(v: Any) -> Any:
        try:
            return parse(v)
        except ApiError as e:
            raise invalid(str(e), e.code or "invalid_value", at=e.param) from None

    return PlainValidator(check)

"""llama.cpp server's sampler fields on the OpenAI routes.

``/v1/completions`` and ``/v1/chat/completions`` take the extra fields
llama.cpp's server names (the official ``openai`` client sends them with
``extra_body``): ``min_p``, ``typical_p``, ``xtc_probability``,
``xtc_threshold``, ``dry_multiplier``, ``dry_base``, ``dry_allowed_length``,
``dry_penalty_last_n``, ``dry_sequence_breakers`` (engine-side filters of
:class:`tartlet.Sampler`), and ``mirostat`` (0 or 2; 1, Mirostat v1, is
refused) with ``mirostat_tau`` and ``mirostat_eta``
(:meth:`tartlet.Sampler.mirostat_v2`). Defaults are llama.cpp's, and so is
what ``mirostat: 2`` does: it replaces the other truncation samplers and
DRY (they are ignored), and with ``temperature`` 0 it is greedy.

Each field is checked here, by the pydantic fields of :class:`SamplerFields`
(an HTTP 400 naming it, :func:`.openai_errors.validation_error`). They cannot be combined
with ``logprobs``, ``logit_bias`` or the presence/frequency penalties,
whose sampler reads the raw logits in the inferlet.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, PlainValidator

from ..sdk.errors import SamplingError
from ..sdk.sampler import validate_dry
from .openai_errors import PARAM
from .openai_fields import integer, invalid, number

#: The fields, with llama.cpp's defaults.
DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "typical_p": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"], "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
}  # fmt: skip
SAMPLER_FIELDS = frozenset(DEFAULTS)


def _mirostat(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or v not in (0, 1, 2):
        raise invalid(f"{PARAM} must be 0 (off) or 2 (Mirostat v2), got {v!r}")
    if v == 1:
        raise invalid(f"{PARAM} 1 (Mirostat v1) is not supported: use 2 (Mirostat v2)", "unsupported_parameter")
    return int(v)


_INT32 = 2**31


class SamplerFields(BaseModel):
    """The llama.cpp sampler fields of a request model (each null or absent:
    llama.cpp's default, :data:`DEFAULTS`), checked as the fields are
    validated: a number out of range, a non-integer length, ``mirostat``
    other than 0 or 2 (1: ``unsupported_parameter``)."""

    min_p: Annotated[float | None, number(0.0, 1.0, finite=True)] = None
    typical_p: Annotated[float | None, number(0.0, 1.0, open_lo=True, finite=True)] = None
    xtc_probability: Annotated[float | None, number(0.0, 1.0, finite=True)] = None
    xtc_threshold: Annotated[float | None, number(0.0, 1.0, finite=True)] = None
    dry_multiplier: Annotated[float | None, number(0.0, math.inf, finite=True)] = None
    dry_base: Annotated[float | None, number(1.0, math.inf, finite=True)] = None
    dry_allowed_length: Annotated[int | None, integer(0, below=_INT32)] = None
    dry_penalty_last_n: Annotated[int | None, integer(-1, below=_INT32)] = None
    #: checked with the other DRY fields (:func:`tartlet.sdk.sampler.validate_dry`) by :meth:`sampler_args`
    dry_sequence_breakers: Any = None
    mirostat: Annotated[int | None, PlainValidator(_mirostat)] = None
    mirostat_tau: Annotated[float | None, number(0.0, math.inf, open_lo=True, finite=True)] = None
    mirostat_eta: Annotated[float | None, number(0.0, math.inf, finite=True)] = None

    def sampler_args(self, args: dict[str, Any]) -> None:
        """Put the fields that change anything into ``args`` (the inferlet
        args built from the rest of the request, ``logprobs``,
        ``logit_bias`` and the penalties included): ``args["sampler"]``
        (keyword arguments of :class:`tartlet.Sampler`) or, for ``mirostat:
        2``, ``args["mirostat"]`` (``{"tau", "eta"}``). Called from the
        request model's ``after`` validator.

        Raises:
            pydantic_core.PydanticCustomError: (:func:`.openai_fields.invalid`)
                bad DRY fields (``param`` ``dry_sequence_breakers``), or a
                field in use combined with ``logprobs``, ``logit_bias`` or a
                presence/frequency penalty (``unsupported_parameter``).
        """
        given = {k: getattr(self, k) for k in SAMPLER_FIELDS if getattr(self, k) is not None}
        if not given:
            return
        v = DEFAULTS | given
        try:
            validate_dry(v["dry_multiplier"], v["dry_base"], v["dry_allowed_length"], v["dry_penalty_last_n"], v["dry_sequence_breakers"])
        except SamplingError as e:
            raise invalid(str(e), at="dry_sequence_breakers") from None
        sampler = {k: v[k] for k in SAMPLER_FIELDS - {"mirostat", "mirostat_tau", "mirostat_eta"} if v[k] != DEFAULTS[k]}
        if "dry_multiplier" not in sampler:  # DRY off: its other fields change nothing
            sampler = {k: x for k, x in sampler.items() if not k.startswith("dry_")}
        mode = v["mirostat"]
        raw = [k for k in ("logprobs", "logit_bias", "presence_penalty", "frequency_penalty") if args.get(k) is not None]
        active = sorted(sampler) + (["mirostat"] if mode == 2 else [])
        if raw and active:
            raise invalid(f"'{active[0]}' cannot be combined with '{raw[0]}' (that sampler reads the raw logits in the inferlet)",
                          "unsupported_parameter", at=active[0])
        if mode == 2:
            args["mirostat"] = {"tau": v["mirostat_tau"], "eta": v["mirostat_eta"]}
        elif sampler:
            args["sampler"] = sampler

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

Each field is checked here (an HTTP 400 naming it). They cannot be combined
with ``logprobs``, ``logit_bias`` or the presence/frequency penalties,
whose sampler reads the raw logits in the inferlet.
"""

from __future__ import annotations

import math
from typing import Any

from ..sdk.errors import SamplingError
from ..sdk.sampler import validate_dry
from .openai_errors import bad_param

#: The fields, with llama.cpp's defaults.
DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "typical_p": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"], "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
}  # fmt: skip
SAMPLER_FIELDS = frozenset(DEFAULTS)

#: (lowest, highest, lowest excluded) of each number field.
_RANGES = {
    "min_p": (0.0, 1.0, False), "typical_p": (0.0, 1.0, True), "xtc_probability": (0.0, 1.0, False),
    "xtc_threshold": (0.0, 1.0, False), "dry_multiplier": (0.0, math.inf, False), "dry_base": (1.0, math.inf, False),
    "mirostat_tau": (0.0, math.inf, True), "mirostat_eta": (0.0, math.inf, False),
}  # fmt: skip
_INTS = {"dry_allowed_length": 0, "dry_penalty_last_n": -1}


def _value(body: dict[str, Any], key: str) -> Any:
    v = body.get(key)
    if v is None:
        return DEFAULTS[key]
    if key in _RANGES:
        lo, hi, open_lo = _RANGES[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not (lo < v if open_lo else lo <= v) or v > hi:
            where = f"({lo:g}, {hi:g}]" if open_lo else f"[{lo:g}, {hi:g}]"
            raise bad_param(f"'{key}' must be a number in {where}, got {v!r}", key)
        return float(v)
    if key in _INTS:
        if isinstance(v, bool) or not isinstance(v, int) or not _INTS[key] <= v < 2**31:
            raise bad_param(f"'{key}' must be an integer >= {_INTS[key]}, got {v!r}", key)
        return v
    return v


def parse_sampler_fields(body: dict[str, Any], args: dict[str, Any]) -> None:
    """Check the llama.cpp sampler fields of ``body`` and put those that
    change anything into ``args`` (the inferlet args :func:`.openai_protocol.parse_request`
    built from the rest, ``logprobs`` and ``logit_bias`` included): ``args["sampler"]`` (keyword arguments
    of :class:`tartlet.Sampler`) and ``args["mirostat"]`` (``{"tau",
    "eta"}``) for ``mirostat: 2``.

    Raises:
        ApiError: 400 naming the field: out of range, ``mirostat`` other
            than 0 or 2, or combined with ``logprobs``, ``logit_bias`` or a
            presence/frequency penalty.
    """
    given = [k for k in body if k in SAMPLER_FIELDS and body[k] is not None]
    if not given:
        return
    v = {k: _value(body, k) for k in SAMPLER_FIELDS}
    mode = v["mirostat"]
    if isinstance(mode, bool) or mode not in (0, 1, 2):
        raise bad_param(f"'mirostat' must be 0 (off) or 2 (Mirostat v2), got {mode!r}", "mirostat")
    if mode == 1:
        raise bad_param("'mirostat' 1 (Mirostat v1) is not supported: use 2 (Mirostat v2)", "mirostat", "unsupported_parameter")
    breakers = v["dry_sequence_breakers"]
    try:
        validate_dry(v["dry_multiplier"], v["dry_base"], v["dry_allowed_length"], v["dry_penalty_last_n"], breakers)
    except SamplingError as e:
        raise bad_param(str(e), "dry_sequence_breakers") from None
    sampler = {k: v[k] for k in SAMPLER_FIELDS - {"mirostat", "mirostat_tau", "mirostat_eta"} if v[k] != DEFAULTS[k]}
    if "dry_multiplier" not in sampler:  # DRY off: its other fields change nothing
        sampler = {k: x for k, x in sampler.items() if not k.startswith("dry_")}
    raw = [k for k in ("logprobs", "logit_bias", "presence_penalty", "frequency_penalty") if args.get(k) is not None]
    active = sorted(sampler) + (["mirostat"] if mode == 2 else [])
    if raw and active:
        raise bad_param(f"'{active[0]}' cannot be combined with '{raw[0]}' (that sampler reads the raw logits in the inferlet)",
                   active[0], "unsupported_parameter")
    if mode == 2:
        args["mirostat"] = {"tau": v["mirostat_tau"], "eta": v["mirostat_eta"]}
    elif sampler:
        args["sampler"] = sampler

"""Turning ``-- --key value --flag`` command-line words into inferlet args."""

from __future__ import annotations

import json
import re
from typing import Any


class ArgsError(ValueError):
    """Inferlet arguments that cannot be parsed (the message says where)."""


#: Decimal literals only: words like ``nan``, ``inf``, ``1_000`` or `` 3 ``
#: stay strings (Python's ``int``/``float`` would accept them).
_INT = re.compile(r"[+-]?\d+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?", re.ASCII)


def infer_value(text: str) -> Any:
    """``"3"`` -> 3, ``"-0.5"`` / ``"1e3"`` -> float, ``"true"``/``"false"``
    -> bool, ``"null"`` -> None, JSON objects/arrays parsed, anything else
    (``"nan"``, ``"inf"``, ``""`` included) a string.

    Raises:
        ArgsError: a value starting with ``[`` or ``{`` that is not valid JSON.
    """
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text[:1] and text[0] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ArgsError(f"value {text!r} looks like JSON but does not parse: {e}") from None
    return text


def parse_inferlet_args(words: list[str]) -> dict[str, Any]:
    """Parse ``--key value`` pairs; a ``--flag`` not followed by a value is
    ``True``; ``--key=value`` works too. Dashes in keys become underscores
    (``--max-tokens`` -> ``max_tokens``).

    Raises:
        ArgsError: a word that is not a ``--key`` where one is expected.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--") or len(w) == 2:
            raise ArgsError(f"expected --key, got {w!r} (inferlet args are --key value pairs)")
        key, eq, val = w[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[key] = infer_value(val)
            i += 1
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[key] = infer_value(words[i + 1])
            i += 2
        else:
            out[key] = True
            i += 1
    return out

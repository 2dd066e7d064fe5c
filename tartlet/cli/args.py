"""Turning ``-- --key value --flag`` command-line words into inferlet args."""

from __future__ import annotations

import json
from typing import Any


class ArgsError(ValueError):
    """Inferlet arguments that cannot be parsed (the message says where)."""


def infer_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool,
    ``"null"`` -> None, JSON objects/arrays parsed, anything else a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "null":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
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

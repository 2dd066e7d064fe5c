"""Tool calls as data: the OpenAI tool list checked (:func:`normalize_tools`),
a parsed call (:class:`ToolCall`) and its id. Pure Python, no model."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

#: OpenAI's rule for function names.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: The JSON Schema of a function without parameters.
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """A malformed tool list, tool choice or tool message. ``param`` names
    the offending field the way the OpenAI API does (``tools[0].function.name``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """Check a tool list and return it in the OpenAI shape, ``parameters``
    filled in (``{"type": "object", "properties": {}}`` when absent).

    Accepts ``{"type": "function", "function": {...}}`` items or bare
    function objects ``{"name", "description", "parameters"}``.

    Raises:
        ToolSpecError: not a non-empty list, an item of another type, a
            name not matching ``[A-Za-z0-9_-]{1,64}``, a repeated name, a
            non-string description, parameters that are not a JSON Schema
            object, or a non-boolean ``strict``.
    """
    if not isinstance(tools, list) or not tools:
        raise ToolSpecError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolSpecError(f"{where} must be an object, got {type(t).__name__}", where)
        if "function" in t or "type" in t:
            if t.get("type") != "function":
                raise ToolSpecError(f"{where}.type must be 'function', got {t.get('type')!r}", f"{where}.type")
            extra = set(t) - {"type", "function"}
            if extra:
                raise ToolSpecError(f"unknown field(s) in {where}: {', '.join(sorted(extra))}", where)
            fn, where = t.get("function"), f"{where}.function"
        else:
            fn = t
        if not isinstance(fn, dict):
            raise ToolSpecError(f"{where} must be an object with 'name' and 'parameters'", where)
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolSpecError(f"unknown field(s) in {where}: {', '.join(sorted(extra))}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ToolSpecError(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}", f"{where}.name")
        if name in seen:
            raise ToolSpecError(f"{where}.name {name!r} is used by two tools", f"{where}.name")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolSpecError(f"{where}.description must be a string", f"{where}.description")
        params = fn.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSpecError(f"{where}.parameters must be a JSON Schema object with type 'object'", f"{where}.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolSpecError(f"{where}.strict must be a boolean", f"{where}.strict")
        f: dict[str, Any] = {"name": name}
        if desc is not None:
            f["description"] = desc
        f["parameters"] = params
        out.append({"type": "function", "function": f})
    return out


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Names of a :func:`normalize_tools` list, in order."""
    return [t["function"]["name"] for t in tools]


def new_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One tool call.

    Attributes:
        name: the function name.
        arguments: the arguments as JSON text (an object), as the OpenAI API
            carries them.
        id: the call id (``call_...``).
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def args(self) -> dict[str, Any]:
        """The arguments parsed. Raises ValueError when they are not a JSON object."""
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"tool call arguments are not a JSON object: {self.arguments[:200]!r}")
        return value

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _args_object(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not NAME_RE.fullmatch(obj["name"]):
        return None
    raw: Any = next((obj[k] for k in args_keys if k in obj), {})
    args = _args_object(raw)
    if args is None:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

"""Errors of the OpenAI-compatible routes: :class:`ApiError` (an HTTP
status and OpenAI's error body), the 400s that name a parameter (among them
:func:`validation_error`, a request model's pydantic error), and an
instance's failure mapped to a status and code without Python class names."""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

from pydantic import ValidationError
from starlette.responses import JSONResponse

from ..runtime.instance import Instance

#: ``SomeError: `` / ``pkg.SomeException: `` prefixes: never shown to users.
_EXC_NAME = re.compile(r"\b(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?\s*")

log = logging.getLogger(__name__)


def clean_message(message: str) -> str:
    """``message`` without Python exception class names."""
    return _EXC_NAME.sub("", message).strip() or "the request failed"


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": clean_message(str(self)), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def launch_error(err: Exception) -> ApiError:
    """The API error for a launch the service refused (its
    :class:`~tartlet.protocol.ProtocolError`): 429 ``rate_limit_error`` for a
    ``limit`` code (a per-user rate or bound), else 400."""
    code = getattr(err, "code", None)
    if code == "limit":
        return ApiError(429, str(err), code=code, kind="rate_limit_error")
    return ApiError(400, str(err), code=code)


def generation_error(inst: Instance) -> ApiError:
    """The API error for a failed instance: 429 ``kv_quota_exceeded``
    (``KvQuotaError``), 503 ``kv_cache_full`` with ``Retry-After: 1``
    (``KvCacheFullError``), else 500 ``generation_failed`` (logged with the
    traceback)."""
    err = inst.error or inst.status.value
    if err.startswith("KvQuotaError"):
        return ApiError(429, f"the KV cache quota of this user is exhausted: {err}", code="kv_quota_exceeded", kind="rate_limit_error")
    if err.startswith("KvCacheFullError"):
        return ApiError(
            503, f"the KV cache is full, retry later: {err}", code="kv_cache_full", kind="server_error", headers={"Retry-After": "1"},
        )
    log.error("generation %s (instance %s) failed: %s\n%s", inst.status.value, inst.id, err, inst.traceback or "(no traceback)")
    return ApiError(500, f"generation {inst.status.value}: {err}", code="generation_failed", kind="server_error")


def bad_param(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    """An HTTP 400 ``invalid_request_error`` naming ``param`` (OpenAI's shape)."""
    return ApiError(400, message, param, code)


#: Where a field error's message names its parameter (:func:`.openai_fields.invalid`, filled in by :func:`validation_error`).
PARAM = "{param}"

#: The ``code`` of each error that :func:`.openai_fields.invalid` makes.
FIELD_CODES = frozenset({"invalid_value", "unsupported_parameter", "missing_required_parameter", "invalid_json_schema"})


def param_path(loc: Sequence[int | str]) -> str:
    """A pydantic error location as OpenAI writes a ``param``:
    ``("messages", 2, "content")`` -> ``messages[2].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(exc: ValidationError, unsupported: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP 400 of a ``/v1`` request body its pydantic model refused
    (:mod:`.openai_models`): the first error, an unknown parameter before
    any other.

    - an unknown top-level key: ``unsupported_parameter`` naming it (with
      ``unsupported[key]``, why a known OpenAI parameter is refused);
    - a body that is not an object: ``param`` null;
    - an error of :func:`.openai_fields.invalid`: its code and message,
      ``{param}`` replaced by the parameter (``'temperature'``,
      ``messages[1].role``); ``param`` is the location, the ``field`` of
      the error's context appended, or its ``at`` (a check across fields);
    - any other pydantic error: ``invalid_value`` (``missing`` ones:
      ``missing_required_parameter``) with pydantic's message.
    """
    errors = exc.errors(include_url=False)
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        key = param_path(loc)
        why = (unsupported or {}).get(key)
        return bad_param(f"unsupported parameter '{key}'" + (f": {why}" if why else ""), key, "unsupported_parameter")
    if not loc and kind == "model_type":
        return bad_param("the request body must be a JSON object")
    param = ctx.get("at") or param_path(loc + ((ctx["field"],) if "field" in ctx else ()))
    shown = f"'{param}'" if param.isidentifier() else param
    if kind in FIELD_CODES:
        return bad_param(str(err["msg"]).replace(PARAM, shown), param or None, kind)
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    return bad_param(f"invalid {shown}: {err['msg']}", param or None, code)

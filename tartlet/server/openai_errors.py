"""Errors of the OpenAI-compatible routes: :class:`ApiError` (an HTTP
status and OpenAI's error body), the 400s that name a parameter, and an
instance's failure mapped to a status and code without Python class names."""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

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

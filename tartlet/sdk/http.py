"""HTTP requests from inferlets, performed by the host.

``resp = await http.fetch(url, method="POST", headers={...}, body=...)``.
The host only contacts hosts on its allowlist, bounds request and response
sizes and the time taken, and does not follow redirects. The same call works
in the WASM sandbox, where inferlets have no sockets.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from . import _binding


@dataclass
class Response:
    """An HTTP response: ``status`` (int), ``headers`` (lower-case names),
    ``body`` (bytes)."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return _json.loads(self.body)


async def fetch(
    url: str,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes | str | None = None,
    json: Any = None,
) -> Response:
    """Send a request through the host.

    Args:
        url: ``http://`` or ``https://`` URL of an allowed host.
        method: GET, POST, PUT, PATCH, DELETE, HEAD or OPTIONS.
        headers: request headers.
        body: request body (str is sent as UTF-8).
        json: a value to send as a JSON body (sets ``content-type``).

    Raises:
        tartlet.errors.HttpError (a RuntimeError): host not allowed, body
            too big, timeout, connection failure, response too big.
    """
    headers = dict(headers or {})
    if json is not None:
        body = _json.dumps(json)
        headers.setdefault("content-type", "application/json")
    r = await _binding.wait(_binding.host().http_fetch(url, method, headers, body))
    return Response(r["status"], {k.lower(): v for k, v in r["headers"].items()}, r["body"])

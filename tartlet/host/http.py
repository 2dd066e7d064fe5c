"""HTTP requests made by the host on behalf of inferlets.

The inferlet never opens a socket: it asks the host (:meth:`HttpFetcher.fetch`)
and gets a future of the response, so the same call works inside the WASM
sandbox. A request must name an allowed host (``[http] allow_hosts``) or
be exactly an allowed endpoint URL (the configured MCP servers'
``[mcp.servers.NAME] url``: allowed to every inferlet, and nothing else on
their hosts is; their configured ``headers``, such as an ``Authorization``
token, are added by the host and never shown to inferlets). Request and
response bodies are size-limited, the whole exchange is time-limited, and
redirects are not followed (a redirect could leave the allowlist; the 3xx
response is returned as is).
"""

from __future__ import annotations

import fnmatch
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypedDict
from urllib.parse import urlsplit

from ..sdk.errors import HttpError

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


@dataclass
class HttpPolicy:
    """What inferlets may fetch.

    Attributes:
        allow_hosts: patterns ``host``, ``host:port`` or ``*.domain``
            (fnmatch); empty (and no ``endpoints``) = no HTTP at all.
        max_response_bytes: largest response body, bytes.
        max_request_bytes: largest request body, bytes.
        timeout_s: limit of the whole request, seconds.
        endpoints: endpoint URLs allowed exactly (scheme, host, port and
            path equal; any query), each with headers the host adds to
            every request to it (replacing the inferlet's of the same
            name): the configured MCP servers.
    """

    allow_hosts: list[str] = field(default_factory=list)
    max_response_bytes: int = 4 * 2**20
    max_request_bytes: int = 2**20
    timeout_s: float = 30.0
    endpoints: dict[str, dict[str, str]] = field(default_factory=dict)

    def endpoint(self, url: str) -> dict[str, str] | None:
        """The added headers of the endpoint ``url`` is (default ports
        filled in, host case and a trailing ``/`` of the path ignored), or
        None when it is none of ``endpoints``."""
        key = endpoint_key(url)
        if key is None:
            return None
        for u, headers in self.endpoints.items():
            if endpoint_key(u) == key:
                return headers
        return None

    def allowed(self, host: str, port: int | None) -> bool:
        host = host.lower()
        for pat in self.allow_hosts:
            pat = pat.lower()
            target = f"{host}:{port}" if ":" in pat and port is not None else host
            if fnmatch.fnmatchcase(target, pat):
                return True
        return False


def endpoint_key(url: str) -> tuple[str, str, int, str] | None:
    """``(scheme, host, port, path)`` of an http(s) URL, for comparing
    endpoints; None when it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.scheme, parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80), parts.path.rstrip("/") or "/"


class HttpResponse(TypedDict):
    """The result of :meth:`HttpFetcher.fetch`."""

    status: int
    headers: dict[str, str]
    body: bytes


class HttpFetcher:
    """Runs fetches on a small thread pool (``httpx`` underneath)."""

    def __init__(self, policy: HttpPolicy | None = None, workers: int = 16) -> None:
        self.policy = policy or HttpPolicy()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tartlet-http")
        self._client: Any = None

    def fetch(self, url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | str | None = None) -> Future[HttpResponse]:
        """Start a request; a future of ``{"status": int, "headers": {str: str},
        "body": bytes}``.

        Raises (immediately, nothing is sent):
            HttpError: bad URL or scheme, host not allowed, bad method,
                headers not ``str -> str``, body over the request limit.
        """
        if not isinstance(url, str):
            raise HttpError(f"url must be a str, got {type(url).__name__}")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpError(f"only http:// and https:// URLs with a host can be fetched, got {url!r:.200}")
        try:
            port = parts.port
        except ValueError:
            raise HttpError(f"bad port in {url!r:.200}") from None
        added = self.policy.endpoint(url)
        if added is None and not self.policy.allowed(parts.hostname, port):
            pol = self.policy
            allowed = ", ".join(pol.allow_hosts) or ("no hosts" if pol.endpoints else "none (HTTP is disabled)")
            urls = f"; endpoints: {', '.join(pol.endpoints)}" if pol.endpoints else ""
            raise HttpError(f"host {parts.hostname!r} is not in the HTTP allowlist (allowed: {allowed}{urls})")
        method = str(method).upper()
        if method not in METHODS:
            raise HttpError(f"unsupported HTTP method {method!r} (use one of {', '.join(METHODS)})")
        headers = dict(headers or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise HttpError("headers must map str to str")
        if added:
            names = {k.lower() for k in added}
            headers = {k: v for k, v in headers.items() if k.lower() not in names} | dict(added)
        data = body.encode() if isinstance(body, str) else (bytes(body) if body is not None else None)
        if data is not None and len(data) > self.policy.max_request_bytes:
            raise HttpError(f"request body of {len(data)} bytes is larger than {self.policy.max_request_bytes}")
        return self._pool.submit(self._do, url, method, headers, data)

    def _do(self, url: str, method: str, headers: dict[str, str], data: bytes | None) -> HttpResponse:
        import httpx

        if self._client is None:
            self._client = httpx.Client(follow_redirects=False, trust_env=False)
        limit = self.policy.max_response_bytes
        deadline = time.monotonic() + self.policy.timeout_s
        try:
            with self._client.stream(method, url, headers=headers, content=data, timeout=self.policy.timeout_s) as r:
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise HttpError(f"response from {url!r:.200} is larger than the limit of {limit} bytes")
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("total time limit")
                return {"status": r.status_code, "headers": dict(r.headers), "body": b"".join(chunks)}
        except httpx.TimeoutException:
            raise HttpError(f"{method} {url!r:.200} timed out after {self.policy.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise HttpError(f"{method} {url!r:.200} failed: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()

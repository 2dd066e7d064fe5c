"""HTTP requests made by the host on behalf of inferlets.

The inferlet never opens a socket: it asks the host (:meth:`HttpFetcher.fetch`)
and gets a future of the response, so the same call works inside the WASM
sandbox. A request must name an allowed host (``[http] allow_hosts``), its
body and the response body are size-limited, the whole exchange is
time-limited, and redirects are not followed (a redirect could leave the
allowlist; the 3xx response is returned as is).
"""

from __future__ import annotations

import fnmatch
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .errors import HostError

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


class HttpError(HostError):
    """A fetch refused (host not allowed, bad URL, body too big) or failed
    (timeout, connection error, response too big)."""


@dataclass
class HttpPolicy:
    """What inferlets may fetch.

    Attributes:
        allow_hosts: patterns ``host``, ``host:port`` or ``*.domain``
            (fnmatch); empty = no HTTP at all.
        max_response_bytes: largest response body, bytes.
        max_request_bytes: largest request body, bytes.
        timeout_s: limit of the whole request, seconds.
    """

    allow_hosts: list[str] = field(default_factory=list)
    max_response_bytes: int = 4 * 2**20
    max_request_bytes: int = 2**20
    timeout_s: float = 30.0

    def allowed(self, host: str, port: int | None) -> bool:
        host = host.lower()
        for pat in self.allow_hosts:
            pat = pat.lower()
            target = f"{host}:{port}" if ":" in pat and port is not None else host
            if fnmatch.fnmatchcase(target, pat):
                return True
        return False


class HttpFetcher:
    """Runs fetches on a small thread pool (``httpx`` underneath)."""

    def __init__(self, policy: HttpPolicy | None = None, workers: int = 16) -> None:
        self.policy = policy or HttpPolicy()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tartlet-http")
        self._client: Any = None

    def fetch(self, url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | str | None = None) -> Future:
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
        if not self.policy.allowed(parts.hostname, port):
            allowed = ", ".join(self.policy.allow_hosts) or "none (HTTP is disabled)"
            raise HttpError(f"host {parts.hostname!r} is not in the HTTP allowlist (allowed: {allowed})")
        method = str(method).upper()
        if method not in METHODS:
            raise HttpError(f"unsupported HTTP method {method!r} (use one of {', '.join(METHODS)})")
        headers = dict(headers or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise HttpError("headers must map str to str")
        data = body.encode() if isinstance(body, str) else (bytes(body) if body is not None else None)
        if data is not None and len(data) > self.policy.max_request_bytes:
            raise HttpError(f"request body of {len(data)} bytes is larger than {self.policy.max_request_bytes}")
        return self._pool.submit(self._do, url, method, headers, data)

    def _do(self, url: str, method: str, headers: dict[str, str], data: bytes | None) -> dict[str, Any]:
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

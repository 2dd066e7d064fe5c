"""The WebSocket protocol between clients and ``tartlet serve`` (``/ws``).

Every frame is a JSON object with a ``type``. Requests carry an ``id``
(any JSON value chosen by the client) echoed in the reply. Authenticate with
``Authorization: Bearer KEY`` on the upgrade request (or ``?key=KEY``).

Client -> server:

====================  =====================================================
``launch``            ``inferlet`` (a name) or ``program`` (``sha256:...`` of
                      an upload), ``args`` (object), ``attach`` (default
                      true), ``abort_on_disconnect`` (default false),
                      ``time_limit_s`` (may lower the server's wall-time limit)
                      -> ``launched`` {``instance``}
``upload``            ``files`` {relative path: text} -> ``uploaded`` {``program``}
``send``              ``instance``, ``data`` (text) or ``data_b64`` (bytes)
``close_input``       ``instance``: the inferlet's next ``receive`` raises EOFError
``attach``/``detach`` ``instance``: start/stop streaming its output
                      (``attach`` replays output buffered while detached)
``abort``             ``instance`` -> ``ok``
``list``              -> ``instances`` [{id, program, status, ...}]
``ping``              -> ``pong``
====================  =====================================================

Server -> client: ``output`` {``instance``, ``data`` | ``data_b64``},
``exit`` {``instance``, ``status``, ``result``, ``error``}, and
``error`` {``id``, ``code``, ``message``} with codes ``bad_request``,
``unauthorized``, ``not_found``, ``unknown_program``, ``limit``,
``too_large``, ``forbidden``.

Disconnect policy: an instance keeps running when its client disconnects
(reattach with ``attach``; up to :data:`BACKLOG` output messages are kept
meanwhile) unless it was launched with ``abort_on_disconnect``. Its wall-time
limit still applies.
"""

from __future__ import annotations

import hashlib

#: Output messages kept for an instance while no client is attached.
BACKLOG = 1000
#: Close code sent after an authentication failure.
CLOSE_UNAUTHORIZED = 4401


class ProtocolError(ValueError):
    """A request the server refuses; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def program_hash(files: dict[str, str]) -> str:
    """Content hash of an uploaded program: ``sha256:`` + hex of SHA-256 over
    the sorted entries, each ``len(path) path len(content) content`` with
    8-byte little-endian lengths (UTF-8)."""
    h = hashlib.sha256()
    for path in sorted(files):
        for part in (path.encode(), files[path].encode()):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return "sha256:" + h.hexdigest()

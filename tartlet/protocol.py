"""The WebSocket protocol between clients and ``tartlet serve`` (``/ws``).

Shared by both sides, so it sits below both layers: :mod:`tartlet.server`
(``ws.py`` speaks it) and :mod:`tartlet.client` (which computes
:func:`program_hash` of its uploads) import it, and it imports neither.
Host side only: WASM builds leave it out of the SDK they bundle.

Every frame is a JSON object with a ``type``. Requests carry an ``id``
(any JSON value chosen by the client) echoed in the reply. Authenticate with
``Authorization: Bearer KEY`` on the upgrade request (or ``?key=KEY``, for
browsers, which cannot set headers on a WebSocket; HTTP routes take the
header only).

Client -> server:

====================  =====================================================
``launch``            ``inferlet`` (a name) or ``program`` (``sha256:...`` of
                      an upload), ``args`` (object), ``attach`` (default
                      true), ``abort_on_disconnect`` (default false),
                      ``logs`` (default false: send what it prints as
                      ``log`` events), ``time_limit_s`` (a finite positive
                      number; may lower the server's wall-time limit)
                      -> ``launched`` {``instance``}
``upload``            ``files`` {relative path: text} -> ``uploaded`` {``program``}
``adapter_add``       ``name``, ``files`` {file name: base64 bytes} (a PEFT
                      folder's two files or one ``.gguf`` LoRA; omitted: the
                      pieces sent by ``adapter_chunk``), ``model``
                      (default: the default model) -> ``adapter_added``
                      {``model``, ``adapter``}: a LoRA adapter in the user's
                      namespace (``tartlet adapter add``)
``adapter_chunk``     ``name``, ``model``, ``file``, ``data_b64``: the next
                      piece of a file of the upload ``name`` -> ``ok``
``adapter_list``      ``model`` -> ``adapters`` {``model``, ``adapters``}
``adapter_remove``    ``name``, ``model`` -> ``ok``
``send``              ``instance``, ``data`` (text) or ``data_b64`` (bytes)
``close_input``       ``instance``: the inferlet's next ``receive`` raises EOFError
``attach``/``detach`` ``instance``: start/stop streaming its output
                      (``attach`` replays output buffered while detached;
                      both answer ``not_found`` for an id that is not one
                      of the user's instances)
``abort``             ``instance`` -> ``ok``
``list``              -> ``instances`` [{id, program, status, ...}]
``ping``              -> ``pong``
====================  =====================================================

Server -> client: ``output`` {``instance``, ``data`` | ``data_b64``},
``log`` {``instance``, ``stream`` (``stdout`` | ``stderr``), ``data``: one
line without its newline; only for launches with ``logs``, at most 256 KiB
per instance, then one ``[output truncated ...]`` line},
``exit`` {``instance``, ``status``, ``result``, ``error``}, and
``error`` {``id``, ``code``, ``message``} with codes ``bad_request``,
``unauthorized``, ``not_found``, ``unknown_program``, ``limit``,
``too_large``, ``forbidden``.

Disconnect policy: an instance keeps running when its client disconnects
(reattach with ``attach``; up to :data:`BACKLOG` output messages and
``[limits] max_backlog_bytes`` per user are kept meanwhile; the ``attached``
reply's ``dropped`` counts messages lost to those limits) unless it was
launched with ``abort_on_disconnect``. Its wall-time limit still applies.

Messages are at most ``[limits] max_message_bytes`` (one frame, or the
frames of a fragmented message together; larger: the connection is closed
with a close frame, code 1009) and nest arrays and objects at most ``max_json_depth``
deep (deeper: ``bad_request``). A field of the wrong type is ``bad_request``
naming the field.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

#: Output messages kept for an instance while no client is attached.
BACKLOG = 1000
#: Close code sent after an authentication failure.
CLOSE_UNAUTHORIZED = 4401


class ProtocolError(ValueError):
    """A request the server refuses; ``code`` is the protocol error code,
    ``request_id`` the request's ``id`` when known before it was refused."""

    def __init__(self, code: str, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


#: Nesting the stdlib parser handles well below the recursion limit: a frame
#: nested deeper than ``max_json_depth`` but not deeper than this is still
#: parsed, only to echo its ``id`` in the error.
SAFE_PARSE_DEPTH = 200


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


#: A JSON string literal (escapes included), matched in linear time.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON ``text`` (0 for a scalar),
    counted on the raw text without parsing it (brackets inside strings are
    skipped), in time linear in ``len(text)``. On malformed text the count
    is an upper bound of what a parser would reach."""
    import numpy as np

    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    return int(max(0, np.cumsum(steps).max()))


def decode_b64(value: object, what: str) -> bytes:
    """The bytes of ``value``, a base64 string (RFC 4648, standard alphabet,
    no characters outside it) in the field ``what`` names.

    Raises:
        ProtocolError: ``bad_request`` naming ``what``: not a string, or not
            valid base64 (characters outside ASCII included).
    """
    if not isinstance(value, str):
        raise ProtocolError("bad_request", f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:  # binascii.Error, or characters outside ASCII
        raise ProtocolError("bad_request", f"{what} is not valid base64") from None


def parse_json(data: str | bytes, max_depth: int) -> Any:
    """Parse a client's JSON (a WebSocket frame or an HTTP body).

    Args:
        data: the text (bytes are decoded as UTF-8).
        max_depth: deepest nesting of arrays and objects accepted.

    Raises:
        ProtocolError: ``bad_request``: not UTF-8, malformed JSON, or nested
            deeper than ``max_depth`` (checked before parsing, so deep input
            never reaches the recursive parser).
    """
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("bad_request", "the body is not UTF-8 text") from None
    if data.count("[") + data.count("{") > max_depth:  # only then can it nest too deep
        depth = json_depth(data)
        if depth > max_depth:
            rid = None
            if depth <= SAFE_PARSE_DEPTH:
                try:
                    obj = json.loads(data)
                    rid = obj.get("id") if isinstance(obj, dict) else None
                except (json.JSONDecodeError, RecursionError):
                    pass
            raise ProtocolError(
                "bad_request", f"JSON nested {depth} levels deep; the limit is {max_depth} ([limits] max_json_depth)", rid
            )
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise ProtocolError("bad_request", f"malformed JSON: {e}") from None
    except RecursionError:  # only when max_depth is set above the interpreter's recursion limit
        raise ProtocolError("bad_request", "JSON nested too deeply ([limits] max_json_depth)") from None

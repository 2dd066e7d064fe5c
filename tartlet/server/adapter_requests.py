"""The ``/ws`` requests of ``tartlet adapter add/list/remove``: a user's LoRA
adapters uploaded into, listed from and removed from its namespace
(:mod:`tartlet.host.adapter_manager`; the protocol in :mod:`tartlet.protocol`).

An upload's files (a PEFT folder's ``adapter_config.json`` and
``adapter_model.safetensors``, or one ``*.gguf`` LoRA file) come base64
encoded, either whole in the ``adapter_add`` request (``files``) or first in
pieces (``adapter_chunk`` requests, each one frame: the client sends 4 MiB
pieces, so an adapter of any size passes ``[limits] max_message_bytes``),
kept by the connection until its ``adapter_add``. What one connection keeps
is bounded by the user's ``max_adapter_mb_per_user`` (plus 1 MiB of file
headers). The adapter is loaded and checked against the model before
anything is stored: a bad one is ``bad_request`` with the
:class:`~tartlet.sdk.errors.AdapterError`'s message (the file and the module
at fault), and nothing is kept.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..protocol import ProtocolError, decode_b64
from ..sdk.errors import AdapterError
from .service import Event, Service

#: the request types this module answers
ADAPTER_REQUESTS = ("adapter_add", "adapter_chunk", "adapter_list", "adapter_remove")
#: what one connection may keep of uploads in pieces without a quota, bytes
MAX_STAGED_BYTES = 2**30
#: files of one upload (a PEFT folder has two)
MAX_STAGED_FILES = 2

#: one connection's uploads in pieces: (model, adapter name) -> file name -> its bytes so far
Staging = dict[tuple[str | None, str], dict[str, bytearray]]


def _str(req: dict[str, Any], key: str, required: bool = True) -> str | None:
    v = req.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v:
        raise ProtocolError("bad_request", f"`{key}` must be a non-empty string")
    return v


async def adapter_request(svc: Service, user: str, req: dict[str, Any], staging: Staging) -> Event:
    """Answer one adapter request of ``user`` (``staging``: its connection's
    uploads in pieces).

    Replies: ``adapter_added`` {``model``, ``adapter``: {name, modules, rank,
    weight_bytes}}, ``adapters`` {``model``, ``adapters``: [{name, owner
    ("served" or "user"), weight_bytes, modules, rank}]}, ``ok``.

    Raises:
        ProtocolError: ``bad_request`` (malformed request, invalid base64, a
            bad adapter), ``not_found`` (an unknown model, an adapter the user
            does not have), ``limit`` (the adapter quota, a rate).
    """
    t = req.get("type")
    model = _str(req, "model", required=False)
    try:
        slot = svc.state.model(model)
    except ValueError as e:
        raise ProtocolError("not_found", str(e)) from None
    served = model or svc.state.default_model
    if t == "adapter_list":
        return {"type": "adapters", "model": served, "adapters": slot.adapters.listing(user)}
    name = _str(req, "name")
    assert name is not None
    if t == "adapter_remove":
        try:
            slot.adapters.delete(user, name)
        except AdapterError as e:
            raise ProtocolError("not_found", str(e)) from None
        return {"type": "ok"}
    if t == "adapter_chunk":
        fname = _str(req, "file")
        assert fname is not None
        piece = _b64(fname, req.get("data_b64"))
        upload = staging.setdefault((model, name), {})
        if fname not in upload and len(upload) >= MAX_STAGED_FILES:
            raise ProtocolError("bad_request", f"an adapter upload has at most {MAX_STAGED_FILES} files")
        cap = slot.adapters.max_bytes_per_user
        cap = MAX_STAGED_BYTES if cap is None else cap + 2**20
        if sum(len(b) for u in staging.values() for b in u.values()) + len(piece) > cap:
            staging.pop((model, name), None)
            raise ProtocolError("limit", f"adapter upload larger than {cap} bytes (limits.max_adapter_mb_per_user)")
        upload.setdefault(fname, bytearray()).extend(piece)
        return {"type": "ok"}
    files = req.get("files")
    if files is None:  # sent in pieces
        data = {k: bytes(v) for k, v in staging.pop((model, name), {}).items()}
        if not data:
            raise ProtocolError("bad_request", f"no files for adapter {name!r:.80}: send `files`, or `adapter_chunk` pieces first")
    elif not isinstance(files, dict) or not files or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ProtocolError("bad_request", "`files` must be a non-empty object of {file name: base64 bytes}")
    else:
        data = {fname: _b64(fname, b64) for fname, b64 in files.items()}
    svc.take_rate(user, "alloc")  # [limits] max_allocs_per_s
    try:
        info = await asyncio.to_thread(slot.adapters.add_upload, user, name, data)  # reads and checks it: off the loop
    except AdapterError as e:
        raise ProtocolError("bad_request", str(e)) from None
    return {"type": "adapter_added", "model": served, "adapter": info}


def _b64(fname: str, b64: object) -> bytes:
    return decode_b64(b64, f"file {fname!r:.80}: its bytes")

"""Bulk conversion of scalar lists for wasmtime-py's component values.

wasmtime-py 50 converts ``list<u8|u32|u64|s64|f32|f64>`` element by element
through ctypes (about 1-2.5 µs per element each way). This patch packs or
unpacks the whole array of 32-byte ``wasmtime_component_val_t`` (a tag byte,
padding, then the payload at offset 8) with one ``struct`` call and one
``memmove``/``string_at``, 4-9x faster (measured in docs/wasm-spike.md §2).
It changes nothing else; other element types keep the stock path.

The patch reaches into wasmtime-py's private modules, so it is applied only
on the version it was written against (:data:`WASMTIME_MAJOR`, read with
:mod:`importlib.metadata`); on any other :func:`install` logs a warning and
leaves wasmtime-py's own (slower, correct) conversion in place.
:func:`wasmtime_supported` is that check, shared with :mod:`.wasm_fastcall`.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import struct
from typing import Any

log = logging.getLogger(__name__)

#: The wasmtime-py major version the private-module patches (this module's
#: and :mod:`.wasm_fastcall`'s) were written and tested against.
WASMTIME_MAJOR = 50


def _wasmtime_version() -> str | None:
    try:
        return importlib.metadata.version("wasmtime")
    except importlib.metadata.PackageNotFoundError:
        return None


def wasmtime_supported(what: str) -> bool:
    """Whether the installed wasmtime-py is the major version the patches
    were written for; if not, log (as a warning) that ``what`` is skipped."""
    version = _wasmtime_version()
    if version is not None and version.split(".")[0] == str(WASMTIME_MAJOR):
        return True
    log.warning("wasmtime-py %s is not version %d.x that %s was written against: not applied, "
                "using wasmtime-py's own code (slower host calls)", version or "(unknown)", WASMTIME_MAJOR, what)
    return False


_installed: bool | None = None  # None: not tried yet; False: skipped (another wasmtime-py)


_S: Any = None  # the wasmtime-py internals (_Internals), set by install() once the version is checked


class _Internals:
    """What the conversions need from wasmtime-py's private modules."""

    def __init__(self) -> None:
        from wasmtime import _ffi as ffi
        from wasmtime.component import _types as T

        self.ffi, self.T = ffi, T
        size, off = ctypes.sizeof(ffi.wasmtime_component_val_t), ffi.wasmtime_component_val_t.of.offset
        self.kinds = {
            T.U8: (ffi.WASMTIME_COMPONENT_U8.value, "B"),
            T.U32: (ffi.WASMTIME_COMPONENT_U32.value, "I"),
            T.U64: (ffi.WASMTIME_COMPONENT_U64.value, "Q"),
            T.S64: (ffi.WASMTIME_COMPONENT_S64.value, "q"),
            T.F32: (ffi.WASMTIME_COMPONENT_F32.value, "f"),
            T.F64: (ffi.WASMTIME_COMPONENT_F64.value, "d"),
        }
        fmts = [fmt for _, fmt in self.kinds.values()]
        self.size = size
        self.pack = {f: struct.Struct(f"<B{off - 1}x{f}{size - off - struct.calcsize(f)}x") for f in fmts}
        self.unpack = {f: struct.Struct(f"<{off}x{f}{size - off - struct.calcsize(f)}x") for f in fmts}
        self.orig_to, self.orig_from = T.ListType.convert_to_c, T.ListType.convert_from_c


def _kind(lt: Any) -> tuple[int, str] | None:
    kind: tuple[int, str] | None = _S.kinds.get(type(lt.element))
    return kind


def _convert_to_c(self: Any, store: Any, val: Any, ptr: Any) -> None:
    k = _kind(self)
    if k is None or not isinstance(val, (list, bytes)):
        _S.orig_to(self, store, val, ptr)
        return
    kind, fmt = k
    ffi, pack = _S.ffi, _S.pack[fmt].pack
    try:
        buf = b"".join([pack(kind, v) for v in val])
    except struct.error as e:
        raise ValueError(f"list element out of range for the WIT type: {e}") from None
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, len(val))
    if val:
        ctypes.memmove(raw.data, buf, len(buf))
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw


def _convert_from_c(self: Any, c: Any) -> Any:
    k = _kind(self)
    if k is None:
        return _S.orig_from(self, c)
    _, fmt = k
    try:
        n = c.of.list.size
        out = [t[0] for t in _S.unpack[fmt].iter_unpack(ctypes.string_at(c.of.list.data, n * _S.size))] if n else []
        return bytes(out) if fmt == "B" else out
    finally:
        _S.ffi.wasmtime_component_vallist_delete(ctypes.byref(c.of.list))


def install() -> bool:
    """Patch ``ListType`` once (idempotent) if wasmtime-py is the version
    this was written for; returns whether the patch is in place."""
    global _installed, _S
    if _installed is None:
        _installed = wasmtime_supported("tartlet's bulk list conversion (wasm_fastlist)")
        if _installed:
            _S = _Internals()
            _S.T.ListType.convert_to_c = _convert_to_c
            _S.T.ListType.convert_from_c = _convert_from_c
    return _installed


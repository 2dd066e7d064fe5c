"""Cheaper host calls for wasmtime-py's component model.

For every call from a component into a host function, wasmtime-py 50
rebuilds the function's type (``FuncType.params`` / ``.result``) and, while
converting each value, re-queries every nested type through ctypes
(``VariantType.cases``, ``ResultType.ok``/``err``, ``RecordType.fields``,
...), creating and freeing a Python wrapper per query. That type walk cost
more than the host function itself (profiled with py-spy on
``benchmarks/bench_wasm.py``: about 60% of the host-side time per token).

Component types are immutable, so this patch

* keeps each host function's (params, result) types on the Python function
  registered with ``add_func`` (computed on its first call), and
* memoises the type-structure properties on the type objects, which now live
  as long as that function.

Values are converted by the same wasmtime-py code as before; only the type
lookups are cached. :func:`install` must run before host functions are
added to a linker (:class:`~tartlet.runtime.wasm_engine.WasmEngine` does it).

The patch replaces private wasmtime-py code, so it is applied only on the
version it was written against (:data:`.wasm_fastlist.WASMTIME_MAJOR`); on
any other, :func:`install` logs a warning and wasmtime-py's own code runs.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .wasm_fastlist import wasmtime_supported

_SIG = "_tartlet_sig"
_installed: bool | None = None  # None: not tried yet; False: skipped (another wasmtime-py)

# wasmtime-py's private modules, imported by install() once the version is checked
L: Any = None
T: Any = None
ffi: Any = None
catch_exceptions: Any = None
_orig_tagged: Any = None

#: (class name in wasmtime.component._types, property) pairs memoised per type object
_MEMO = [
    ("ListType", "element"),
    ("RecordType", "fields"),
    ("TupleType", "elements"),
    ("VariantType", "cases"),
    ("OptionType", "payload"),
    ("ResultType", "ok"),
    ("ResultType", "err"),
    ("EnumType", "names"),
    ("FlagsType", "names"),
]


def _memo_property(cls: type, name: str) -> None:
    fget = cls.__dict__[name].fget
    slot = f"_tartlet_{name}"

    def get(self: Any) -> Any:
        d = self.__dict__
        if slot not in d:
            d[slot] = fget(self)
        return d[slot]

    get.__doc__ = fget.__doc__
    setattr(cls, name, property(get))


def _memo_tagged(self: Any) -> bool:
    d = self.__dict__
    if "_tartlet_tagged" not in d:
        d["_tartlet_tagged"] = _orig_tagged(self)
    tagged: bool = d["_tartlet_tagged"]
    return tagged


def _fast_lower(self: Any, store: Any, val: Any) -> tuple[str, Any]:
    """``VariantLikeType._lower`` (variant, option, result to C) with each
    case's Python classes computed once per type object: wasmtime-py
    rebuilds the class set of every case (a walk of the case's type) for
    every value of an untagged variant, e.g. for every ``result<T,
    call-error>`` a host function returns. Same case choice and errors."""
    d = self.__dict__
    plan = d.get("_tartlet_plan")
    if plan is None:
        tagged = self._tagged()
        cases = []
        for name, ty in self._cases():
            classes: tuple[type, ...] | None = None
            if not tagged and ty is not None:
                found: set[type] = set()
                ty.add_classes(found)
                classes = tuple(found)
            cases.append((name, ty, classes))
        plan = d["_tartlet_plan"] = (tagged, cases)
    tagged, cases = plan
    if tagged:
        if not isinstance(val, T.Variant):
            raise TypeError("expected Variant type")
        tag = val.tag
        for name, ty, _ in cases:
            if name == tag:
                break
        else:
            raise ValueError("value not valid for this variant")
        payload = val.payload
    else:
        for name, ty, classes in cases:
            if (val is None) if ty is None else isinstance(val, classes):
                break
        else:
            raise ValueError("value not valid for this variant")
        payload = val
    if ty is None:
        return (name, None)
    raw = ffi.wasmtime_component_val_t()
    ty.convert_to_c(store, payload, ctypes.pointer(raw))
    return (name, ffi.wasmtime_component_val_new(ctypes.byref(raw)))


def _str(vec: Any) -> str:
    """A ``wasm_byte_vec_t``'s UTF-8 text in one ``string_at`` (``_ffi.to_str``
    builds a ctypes array type, an array object and a bytearray first)."""
    n = vec.size
    return ctypes.string_at(vec.data, n).decode("utf-8") if n else ""


def _record_from_c(self: Any, c: Any) -> Any:
    """``RecordType.convert_from_c`` without decoding and comparing every
    field's name with the type's (a ctypes string per field per call; the
    value has the fields of its type, in order: wasmtime type-checked it)."""
    assert c.kind == ffi.WASMTIME_COMPONENT_RECORD.value
    rec = c.of.record
    try:
        ret = T.Record()
        d = ret.__dict__
        data = rec.data
        for i, (name, ty) in zip(range(rec.size), self.fields):
            raw = data[i].val
            d[name] = ty.convert_from_c(raw)
            raw.kind = ffi.WASMTIME_COMPONENT_BOOL
            raw.of.boolean = False
        return ret
    finally:
        ffi.wasmtime_component_valrecord_delete(rec)


def _variant_from_c(self: Any, c: Any) -> Any:
    """``VariantType.convert_from_c`` with the case name read by :func:`_str`."""
    assert c.kind == ffi.WASMTIME_COMPONENT_VARIANT.value
    var = c.of.variant
    tag = _str(var.discriminant)
    ffi.wasm_byte_vec_delete(ctypes.byref(var.discriminant))
    return self._lift(tag, var.val)


def _string_from_c(self: Any, c: Any) -> str:
    """``String.convert_from_c`` reading the bytes with :func:`_str`."""
    assert c.kind == ffi.WASMTIME_COMPONENT_STRING.value
    ret = _str(c.of.string)
    ffi.wasm_byte_vec_delete(ctypes.byref(c.of.string))
    return ret


def _func_impl(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
    """wasmtime-py's ``func_impl`` callback, with the signature cached on the function."""
    def run(store: Any) -> None:
        func = L.FUNCTIONS.get(idx or 0)
        sig = getattr(func, _SIG, None)
        if sig is None:
            with T.FuncType._from_ptr(ty_raw, owner=store) as fty:
                sig = (fty.params, fty.result)  # owned copies: they outlive fty
            try:
                setattr(func, _SIG, sig)
            except AttributeError:  # a callable that takes no attributes: no cache
                pass
        param_tys, result_ty = sig
        assert len(param_tys) == nargs and nresults == (0 if result_ty is None else 1)
        pyargs = [ty.convert_from_c(args[i]) for (_, ty), i in zip(param_tys, range(nargs))]
        result = func(store, *pyargs)
        if result_ty is None:
            assert result is None
        else:
            result_ty.convert_to_c(store, result, results)

    return catch_exceptions(context, run)


def install() -> bool:
    """Patch wasmtime-py once (idempotent) if it is the version this was
    written for; returns whether the patch is in place."""
    global _installed, L, T, ffi, catch_exceptions, _orig_tagged
    if _installed is not None:
        return _installed
    _installed = wasmtime_supported("tartlet's cached host-call types (wasm_fastcall)")
    if not _installed:
        return False
    from wasmtime import _ffi
    from wasmtime.component import _linker, _types
    from wasmtime.component._enter import catch_exceptions as catch

    L, T, ffi, catch_exceptions = _linker, _types, _ffi, catch
    _orig_tagged = T.VariantLikeType._tagged
    for cls, name in _MEMO:
        _memo_property(getattr(T, cls), name)
    T.VariantLikeType._tagged = _memo_tagged
    T.VariantLikeType._lower = _fast_lower
    T.RecordType.convert_from_c = _record_from_c
    T.VariantType.convert_from_c = _variant_from_c
    T.String.convert_from_c = _string_from_c
    L.func_impl = ffi.wasmtime_component_func_callback_t(_func_impl)
    return True

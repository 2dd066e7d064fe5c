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
"""

from __future__ import annotations

from typing import Any

from wasmtime import _ffi as ffi
from wasmtime.component import _linker as L
from wasmtime.component import _types as T
from wasmtime.component._enter import catch_exceptions

_SIG = "_tartlet_sig"
_installed = False

#: (class, property) pairs memoised per type object
_MEMO = [
    (T.ListType, "element"),
    (T.RecordType, "fields"),
    (T.TupleType, "elements"),
    (T.VariantType, "cases"),
    (T.OptionType, "payload"),
    (T.ResultType, "ok"),
    (T.ResultType, "err"),
    (T.EnumType, "names"),
    (T.FlagsType, "names"),
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
    return d["_tartlet_tagged"]


_orig_tagged = T.VariantLikeType._tagged


@ffi.wasmtime_component_func_callback_t
def _func_impl(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
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


def install() -> None:
    """Patch wasmtime-py once (idempotent)."""
    global _installed
    if _installed:
        return
    for cls, name in _MEMO:
        _memo_property(cls, name)
    T.VariantLikeType._tagged = _memo_tagged
    L.func_impl = _func_impl
    _installed = True

"""The Python side of the C kernels' ABI check (``abi.h``).

ctypes trusts its declarations: a :class:`ctypes.Structure` whose fields do
not match the C struct, or an enum value that drifted between a C file and
its wrapper, makes C read the wrong bytes (silent memory corruption). Each
kernel library therefore exports ``tq_abi()``, a NULL-terminated table of
``(const char *name, int64_t value)`` pairs describing its boundary as the C
compiler laid it out:

- ``version``: :data:`ABI_VERSION` (``TQ_ABI_VERSION``);
- ``size T``: ``sizeof(T)`` of each struct the wrapper builds;
- ``offset T.f``: ``offsetof(T, f)`` of each of its fields;
- ``enum E``: each enum value (or array bound) the wrapper passes.

:func:`check` compares that table with what the wrapper declares
(:func:`struct_entries` of its ctypes structures, its constants), in both
directions, and raises :class:`KernelAbiError` listing every difference.
The wrappers call it when they open a library, before any kernel runs.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

#: ``TQ_ABI_VERSION`` of ``abi.h``: raised when a field's meaning changes
#: without changing sizes or offsets.
ABI_VERSION = 2

#: KV pool row kind per pool dtype (``abi.h``'s ``TQ_KV_*``): the one enum
#: for both libraries and their wrappers.
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.float16: 2}
KV_KIND_NAMES = {torch.float32: "TQ_KV_F32", torch.int8: "TQ_KV_Q8", torch.float16: "TQ_KV_F16"}


class KernelAbiError(RuntimeError):
    """A kernel library's boundary differs from its ctypes wrapper's: the
    message lists each struct size, field offset, enum value or version that
    differs, or that one side has and the other lacks. A build of mismatched
    sources, never a user error: the library is refused."""


class _Entry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def read_table(lib: ctypes.CDLL) -> dict[str, int]:
    """``{name: value}`` of the library's ``tq_abi()`` table.

    Raises:
        KernelAbiError: the library exports no ``tq_abi``.
    """
    try:
        fn = lib.tq_abi
    except AttributeError:
        raise KernelAbiError(f"{getattr(lib, '_name', 'kernel library')}: no tq_abi() table (sources older than abi.h?)") from None
    fn.restype = ctypes.POINTER(_Entry)
    fn.argtypes = []
    table = fn()
    out: dict[str, int] = {}
    i = 0
    while table[i].name is not None:
        out[table[i].name.decode()] = int(table[i].value)
        i += 1
    return out


def struct_entries(c_name: str, struct: Any) -> dict[str, int]:
    """The ``size``/``offset`` entries a ctypes structure stands for: its
    C name ``c_name`` (e.g. ``"tq_linear_desc"``), ``ctypes.sizeof`` and each
    field's offset, under the C table's names (fields are named as in C)."""
    out = {f"size {c_name}": ctypes.sizeof(struct)}
    for name, *_ in struct._fields_:
        out[f"offset {c_name}.{name}"] = getattr(struct, name).offset
    return out


def kv_kind_entries() -> dict[str, int]:
    """The ``enum TQ_KV_*`` entries of :data:`KV_KINDS`."""
    return {f"enum {KV_KIND_NAMES[dt]}": kind for dt, kind in KV_KINDS.items()}


def check(lib: ctypes.CDLL, library: str, expected: dict[str, int]) -> None:
    """Refuse ``lib`` unless its ``tq_abi()`` table equals ``expected``
    (``version`` is added to ``expected`` here).

    Args:
        lib: the opened library.
        library: its name in the message (e.g. ``"quant kernels"``).
        expected: what the wrapper declares, e.g. ``struct_entries(...)``
            merged with its enum values as ``{"enum K_Q8": 0, ...}``.

    Raises:
        KernelAbiError: one line per difference.
    """
    c = read_table(lib)
    py = {"version": ABI_VERSION, **expected}
    problems = []
    for name in sorted(set(c) | set(py)):
        if name not in py:
            problems.append(f"{name} = {c[name]} in C, not declared by the Python wrapper")
        elif name not in c:
            problems.append(f"{name} = {py[name]} in the Python wrapper, not in the C library's table")
        elif c[name] != py[name]:
            problems.append(f"{name} is {c[name]} in C but {py[name]} in the Python wrapper")
    if problems:
        raise KernelAbiError(f"{library}: the C library and its ctypes wrapper disagree (refused; "
                             "fix the side that drifted):\n  " + "\n  ".join(problems))

"""A LoRA adapter as an inferlet names it for a pass, reads, forks, changes
and saves it (docs/adapters.md)."""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from . import _binding
from .errors import AdapterError

if TYPE_CHECKING:
    from .model import Model

#: a matrix as :meth:`Adapter.get` returns it: a list of rows of floats
Matrix = list[list[float]]


@dataclass(frozen=True)
class AdapterModule:
    """One module of an adapter (:meth:`Adapter.modules`).

    Attributes:
        name: PEFT's name of the module, ``model.layers.{i}.{module}``
            (e.g. ``model.layers.3.self_attn.q_proj``).
        rank: ``r``.
        in_features, out_features: of the projection it changes.
        scale: ``s`` of the update ``s * B (A x)`` (``lora_alpha / r``, or
            ``lora_alpha / sqrt(r)`` for rsLoRA), applied by the engine, not
            part of ``B``.
    """

    name: str
    rank: int
    in_features: int
    out_features: int
    scale: float

    @property
    def a_shape(self) -> tuple[int, int]:
        """``A``'s shape: ``(rank, in_features)`` (PEFT's ``lora_A``)."""
        return (self.rank, self.in_features)

    @property
    def b_shape(self) -> tuple[int, int]:
        """``B``'s shape: ``(out_features, rank)`` (PEFT's ``lora_B``)."""
        return (self.out_features, self.rank)


class Adapter:
    """A LoRA adapter of a model (``Model.adapter(name)``): pass it as
    ``adapter=`` to :meth:`Context.forward`, :meth:`Context.generate` or
    :meth:`Context.flush` and those passes run with it. Adapters are
    attached per pass: one context may run some passes with an adapter and
    others without, and the engine batches rows of every adapter (and of
    none) into the same model call.

    Served adapters (the server config's) and the user's saved ones are
    read-only. :meth:`fork` makes this instance's own copy, whose matrices
    :meth:`set` and :meth:`perturb` change; :meth:`save` keeps one under a
    name in the user's namespace (on disk, in PEFT's format, served after a
    restart); :meth:`drop` frees a fork (the end of the instance frees the
    rest). A pass runs with the adapter as it was when the pass was queued
    (a ``generate``: as its first pass found it).

    Attributes:
        model: the model it adapts.
        name: its name on the host.
    """

    def __init__(self, model: "Model", name: str) -> None:
        self.model = model
        self.name = name
        self._modules: list[AdapterModule] | None = None

    def __repr__(self) -> str:
        return f"Adapter({self.model.name!r}, {self.name!r})"

    def __enter__(self) -> "Adapter":
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving ``with a.fork() as f:`` drops the fork."""
        self.drop()

    # -- reading -------------------------------------------------------------------
    def modules(self) -> list[AdapterModule]:
        """Its modules, in (layer, module) order.

        Raises:
            AdapterError: the adapter is gone (deleted, dropped).
        """
        if self._modules is None:
            self._modules = [AdapterModule(**m) for m in _binding.host().adapter_info(self.model.name, self.name)]
        return self._modules

    def module(self, name: str) -> AdapterModule:
        """The module called ``name`` (:attr:`AdapterModule.name`).

        Raises:
            AdapterError: no module of that name.
        """
        for m in self.modules():
            if m.name == name:
                return m
        raise AdapterError(f"adapter {self.name!r} has no module {name!r} (e.g. {self.modules()[0].name})")

    def get(self, module: str) -> tuple[Matrix, Matrix]:
        """Module ``module``'s ``(A, B)`` as lists of rows: ``A`` is ``rank``
        rows of ``in_features`` floats, ``B`` is ``out_features`` rows of
        ``rank`` floats (float32 values; the scale not applied).

        Raises:
            AdapterError: no such module.
        """
        m = self.module(module)
        a, b = _binding.host().adapter_weights(self.model.name, self.name, module)
        return _rows(a, m.a_shape), _rows(b, m.b_shape)

    def tensors(self) -> dict[str, tuple[Matrix, Matrix]]:
        """Every module's ``(A, B)`` (:meth:`get`), by module name."""
        return {m.name: self.get(m.name) for m in self.modules()}

    # -- changing (a fork) --------------------------------------------------------------
    def set(self, module: str, *, A: Any = None, B: Any = None) -> None:
        """Set module ``module``'s ``A`` and/or ``B`` (None: keep it) of this
        fork. Each is a list of rows (:meth:`get`'s shape), a flat sequence
        of ``rows * cols`` numbers in row-major order, or float32 bytes
        (an ``array('f')`` too). Passes queued from now on run with it.

        Raises:
            AdapterError: not a fork of this inferlet, no such module, a
                wrong size, or a value that is not finite.
        """
        m = self.module(module)
        a = None if A is None else _to_bytes(A, m.a_shape, f"{module} A")
        b = None if B is None else _to_bytes(B, m.b_shape, f"{module} B")
        _binding.host().adapter_set_weights(self.model.name, self.name, module, a, b)

    def perturb(self, seed: int, scale: float) -> None:
        """Add ``scale * z`` to every ``A`` and ``B`` of this fork, ``z``
        standard normal drawn on the host from ``seed``: the same seed
        draws the same ``z``, so zeroth-order tuning (MeZO: Malladi et al.,
        2023) moves a copy by ``+eps z`` and ``-eps z`` and the adapter by
        ``-lr * g * z`` without sending ``z`` across.

        Raises:
            AdapterError: not a fork of this inferlet, ``seed`` not in
                ``[0, 2**63)``, ``scale`` not finite.
        """
        _binding.host().adapter_perturb(self.model.name, self.name, seed, scale)

    # -- lifetime -------------------------------------------------------------------------
    def fork(self, name: str | None = None) -> "Adapter":
        """A copy of this adapter that this inferlet may change, named
        ``name`` (None: a generated ``~fork-N``); it counts against the
        user's adapter quota until dropped or the inferlet ends.

        Raises:
            AdapterError: an invalid or taken name.
            LimitError: past the user's adapter quota.
        """
        return Adapter(self.model, _binding.host().adapter_fork(self.model.name, self.name, name))

    def save(self, name: str) -> "Adapter":
        """Save this adapter as it is now as ``name`` in the user's
        namespace (usable by the user's later inferlets and over the OpenAI
        routes as ``BASE:name``; written to the server's data dir in PEFT's
        format, loadable by ``peft``) and return it. A fork stays a fork.

        Raises:
            AdapterError: an invalid name or one the user sees already.
            LimitError: past the user's adapter quota.
        """
        _binding.host().adapter_save(self.model.name, self.name, name)
        return Adapter(self.model, name)

    def drop(self) -> None:
        """Free this fork (passes already queued with it still run).

        Raises:
            AdapterError: not a fork of this inferlet.
        """
        _binding.host().adapter_drop(self.model.name, self.name)

    @staticmethod
    def delete(model: "Model", name: str) -> None:
        """Delete the user's saved adapter ``name`` of ``model`` and its files.

        Raises:
            AdapterError: the user has no saved adapter of that name.
        """
        _binding.host().adapter_delete(model.name, name)


def adapter_name(model: "Model", adapter: "Adapter | str | None") -> str | None:
    """The host name of ``adapter`` for a pass on ``model`` (None: the base model).

    Raises:
        AdapterError: an :class:`Adapter` of another model.
        TypeError: neither an Adapter, a str nor None.
    """
    if adapter is None or isinstance(adapter, str):
        return adapter
    if isinstance(adapter, Adapter):
        if adapter.model.name != model.name:
            raise AdapterError(f"adapter {adapter.name!r} is for model {adapter.model.name!r}, the context is on {model.name!r}")
        return adapter.name
    raise TypeError(f"adapter is a tartlet.Adapter (Model.adapter(name)), a name or None, got {type(adapter).__name__}")


def _rows(data: bytes, shape: tuple[int, int]) -> Matrix:
    """Rows of float32 little-endian ``data`` of ``shape``."""
    vals = array("f")
    vals.frombytes(data)
    if sys.byteorder != "little":
        vals.byteswap()
    n, k = shape
    return [vals[i * k : (i + 1) * k].tolist() for i in range(n)]


def _to_bytes(value: Any, shape: tuple[int, int], what: str) -> bytes:
    """float32 little-endian bytes of ``value`` (see :meth:`Adapter.set`).

    Raises:
        AdapterError: not rows, numbers or bytes of ``shape``.
    """
    n, k = shape
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if len(data) != 4 * n * k:
            raise AdapterError(f"{what}: {len(data)} bytes, expected {4 * n * k} (float32 of shape [{n}, {k}])")
        return data
    if isinstance(value, array) and value.typecode == "f":
        flat: Sequence[Any] = value
    elif isinstance(value, Sequence) and value and isinstance(value[0], Sequence):
        if len(value) != n or any(len(row) != k for row in value):
            raise AdapterError(f"{what}: expected {n} rows of {k} numbers")
        flat = [x for row in value for x in row]
    elif isinstance(value, Sequence):
        flat = value
    else:
        raise AdapterError(f"{what}: expected a list of rows, a flat list of numbers or float32 bytes, "
                           f"got {type(value).__name__}")
    if len(flat) != n * k:
        raise AdapterError(f"{what}: {len(flat)} numbers, expected {n * k} (shape [{n}, {k}])")
    try:
        out = array("f", flat)
    except (TypeError, OverflowError):
        raise AdapterError(f"{what}: every value must be a number within float32's range") from None
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()

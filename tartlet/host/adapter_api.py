"""LoRA adapter host calls (WIT interface ``model``, the ``adapter-*``
functions): list, inspect, fork, edit, save, drop and delete adapters
(:class:`AdapterHostMixin`).

An instance names adapters by string. It sees the model's served adapters,
its user's saved ones (:mod:`.adapter_manager`) and its own *forks*: a
fork is a copy of an adapter this instance may change (new matrices for a
module, a seeded perturbation of all of them), counted against its user's
adapter quota until the instance drops it or ends. Served and saved
adapters are read-only; ``adapter_save`` makes a saved copy of any adapter
the instance sees.

Versions. An adapter object the engine runs is never changed: an edit
makes the fork's next version, built (fused for the model) when a pass
next names the fork. A pass runs entirely with the version its host call
found (a ``generate`` or token stream: every pass of it with the version
its first pass found), so rows in flight never see half an edit; passes
queued after an edit see all of it. Pages computed with one version are
keyed by its content, so the prefix cache never serves them to another.
A saved adapter is looked up by name at each host call: one deleted or
saved again meanwhile (through this server, or another replica sharing its
adapters folder, :mod:`.adapter_manager`) is gone (``AdapterError``) or
runs its new version from the next call on; a fork taken from it stays.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from ..engine.models.lora import LoraAdapter, ModuleLora
from ..engine.models.lora_edit import module_key, module_name, perturbed, with_weights
from ..sdk.errors import AdapterError, LimitError
from .adapter_manager import check_name
from .state import HostState, ModelSlot

#: most forks one instance may hold at once (each also counts against the adapter quota)
MAX_FORKS_PER_INSTANCE = 1024


@dataclass
class AdapterFork:
    """One of an instance's forks.

    Attributes:
        slot: the model it adapts.
        name: its name (given, or ``~fork-N``).
        parts: its matrices (never changed in place: an edit replaces the dict).
        version: the adapter built from ``parts``, or None after an edit
            (built when next used).
        source: what it was forked from, for messages.
        weight_bytes: what it counts against the user's quota.
    """

    slot: ModelSlot
    name: str
    parts: dict[tuple[int, str], ModuleLora]
    version: LoraAdapter | None
    source: Path
    weight_bytes: int


class AdapterHostMixin:
    """The ``adapter-*`` calls; :class:`~tartlet.host.api.HostApi` sets
    ``state``, ``owner`` and ``_adapter_forks``."""

    state: HostState
    owner: str
    _adapter_forks: dict[tuple[int, str], AdapterFork]

    if TYPE_CHECKING:
        def _rate(self, kind: str) -> None: ...  # IoHostMixin's

    # -- resolution ----------------------------------------------------------------------
    def _lora(self, slot: ModelSlot, name: str) -> LoraAdapter:
        """The adapter version a pass on ``slot`` named ``name`` runs with:
        this instance's fork (its current version, built now after an
        edit), else the user's saved one, else the served one.

        Raises:
            AdapterError: no such adapter for this instance.
        """
        f = self._adapter_forks.get((id(slot), name))
        if f is None:
            return slot.adapters.resolve(self.owner, name)
        if f.version is None:
            f.version = slot.engine.build_adapter(f.name, f.source, f.parts)
        return f.version

    def _parts(self, slot: ModelSlot, name: str) -> dict[tuple[int, str], ModuleLora]:
        f = self._adapter_forks.get((id(slot), name))
        return f.parts if f is not None else slot.adapters.resolve(self.owner, name).parts

    def _fork(self, model: str | None, name: str) -> AdapterFork:
        slot = self.state.model(model)
        f = self._adapter_forks.get((id(slot), name))
        if f is None:
            what = "a served or saved adapter, which is read-only" if isinstance(name, str) and slot.adapters.find(
                self.owner, name) is not None else "not an adapter of this model"
            raise AdapterError(f"adapter {name!r:.80} is not a fork of this inferlet ({what}): fork it first (adapter_fork)")
        return f

    # -- the calls -----------------------------------------------------------------------------
    def adapter_names(self, model: str | None) -> list[str]:
        """Names of the LoRA adapters this instance may pass as ``adapter``
        to :meth:`forward`, :meth:`generate` or :meth:`generate_stream`:
        the model's served adapters, the user's saved ones and this
        instance's forks, sorted.

        Raises:
            ValueError: the model is not served.
        """
        slot = self.state.model(model)
        forks = {n for (s, n) in self._adapter_forks if s == id(slot)}
        return sorted(set(slot.adapters.names(self.owner)) | forks)

    def adapter_info(self, model: str | None, name: str) -> list[dict[str, Any]]:
        """The modules of adapter ``name``, in ``(layer, module)`` order:
        ``{"name": "model.layers.3.self_attn.q_proj", "rank": r,
        "in_features", "out_features", "scale"}`` (its ``A`` is ``[rank,
        in_features]``, ``B`` ``[out_features, rank]``, the update ``scale *
        B (A x)``).

        Raises:
            AdapterError: no such adapter for this instance.
        """
        parts = self._parts(self.state.model(model), name)
        return [{"name": module_name(k), "rank": int(m.a.shape[0]), "in_features": int(m.a.shape[1]),
                 "out_features": int(m.b.shape[0]), "scale": float(m.scale)} for k, m in sorted(parts.items())]

    def adapter_fork(self, model: str | None, name: str, new_name: str | None) -> str:
        """A fork of adapter ``name``: the same matrices, changeable by this
        instance, named ``new_name`` (None: a fresh ``~fork-N``); returns
        its name. No matrix is copied until the fork is changed; it counts
        its bytes against the user's quota until dropped or the instance ends.

        Raises:
            AdapterError: no adapter ``name``; ``new_name`` invalid or taken.
            LimitError: past ``[limits] max_adapter_mb_per_user``, more than
                1024 forks in the instance, or past ``max_allocs_per_s``.
        """
        self._rate("alloc")
        slot = self.state.model(model)
        src = self._adapter_forks.get((id(slot), name))
        if src is not None:
            parts, version, source = src.parts, src.version, src.source
        else:
            adapter = slot.adapters.resolve(self.owner, name)
            parts, version, source = adapter.parts, adapter, adapter.source
        taken = set(self.adapter_names(model))
        if new_name is None:
            new_name = next(n for n in (f"~fork-{i}" for i in self._next_ids()) if n not in taken)
        elif check_name(new_name) in taken:
            raise AdapterError(f"an adapter named {new_name!r} exists already (choose another name)")
        if sum(1 for (s, _) in self._adapter_forks if s == id(slot)) >= MAX_FORKS_PER_INSTANCE:
            raise LimitError(f"the instance holds {MAX_FORKS_PER_INSTANCE} adapter forks, the limit: drop some first")
        nbytes = sum(4 * (m.a.numel() + m.b.numel()) for m in parts.values())
        slot.adapters.charge(self.owner, nbytes)
        self._adapter_forks[(id(slot), new_name)] = AdapterFork(slot, new_name, parts, version, source, nbytes)
        return new_name

    def _next_ids(self) -> Iterator[int]:
        return itertools.count(len(self._adapter_forks) + 1)

    def adapter_save(self, model: str | None, name: str, new_name: str) -> None:
        """Save adapter ``name`` (this instance's fork as it is now, or any
        adapter it sees) as the user's ``new_name``: usable by the user's
        later instances and over the OpenAI routes as ``BASE:new_name``,
        written to the server's data dir in PEFT's format (served again
        after a restart, loadable by ``peft``) before this returns. The fork
        stays a fork; later edits do not change the saved copy.

        Raises:
            AdapterError: no adapter ``name``; ``new_name`` invalid or one
                the user sees already.
            LimitError: past ``[limits] max_adapter_mb_per_user`` or
                ``max_allocs_per_s``.
            OSError: the server could not write it.
        """
        self._rate("alloc")
        slot = self.state.model(model)
        check_name(new_name)
        if (id(slot), new_name) in self._adapter_forks:
            raise AdapterError(f"an adapter named {new_name!r} exists already (a fork of this inferlet)")
        version = self._lora(slot, name)
        slot.adapters.save(self.owner, new_name, dataclasses.replace(version, name=new_name))

    def adapter_drop(self, model: str | None, name: str) -> None:
        """Free this instance's fork ``name`` (passes queued with it still
        run with it) and its bytes of the quota.

        Raises:
            AdapterError: ``name`` is not a fork of this instance.
        """
        f = self._fork(model, name)
        del self._adapter_forks[(id(f.slot), name)]
        f.slot.adapters.release(self.owner, f.weight_bytes)

    def adapter_delete(self, model: str | None, name: str) -> None:
        """Delete the user's saved adapter ``name`` and its files (passes
        queued with it still run with it).

        Raises:
            AdapterError: the user has no saved adapter of that name.
        """
        self.state.model(model).adapters.delete(self.owner, name)

    def adapter_weights(self, model: str | None, name: str, module: str) -> tuple[bytes, bytes]:
        """Module ``module``'s ``A`` (``[rank, in_features]``) and ``B``
        (``[out_features, rank]``) of adapter ``name``, row-major float32,
        little-endian (the scale not applied; see :meth:`adapter_info`).

        Raises:
            AdapterError: no such adapter or module.
        """
        parts = self._parts(self.state.model(model), name)
        m = parts[module_key(parts, module)]
        return _le_bytes(m.a), _le_bytes(m.b)

    def adapter_set_weights(self, model: str | None, name: str, module: str, a: bytes | None, b: bytes | None) -> None:
        """Set module ``module``'s ``A`` and/or ``B`` of this instance's fork
        ``name`` (None: keep it), row-major float32 little-endian bytes of
        the module's shapes (:meth:`adapter_weights`); later passes with the
        fork run with them (module docstring: versions).

        Raises:
            AdapterError: ``name`` is not a fork of this instance, no such
                module, a size or value (NaN, infinity) that does not fit.
        """
        f = self._fork(model, name)
        key = module_key(f.parts, module)
        cur = f.parts[key]
        new = [None if data is None else _from_le_bytes(data, tuple(t.shape), f"{module} {what}")
               for data, t, what in ((a, cur.a, "A"), (b, cur.b, "B"))]
        f.parts = with_weights(f.parts, key, new[0], new[1])
        f.version = None

    def adapter_perturb(self, model: str | None, name: str, seed: int, scale: float) -> None:
        """Add ``scale * z`` to every ``A`` and ``B`` of this instance's fork
        ``name``, ``z`` standard normal drawn from ``seed`` (MeZO's seeded
        perturbation, :func:`~tartlet.engine.models.lora_edit.perturbed`):
        the same ``seed`` always draws the same ``z`` for an adapter of the
        same modules, so ``+eps``, ``-eps`` and an update ``-lr * g`` move
        along one direction without sending it across.

        Raises:
            AdapterError: ``name`` is not a fork of this instance, ``seed``
                not in ``[0, 2**63)`` or ``scale`` not finite.
        """
        f = self._fork(model, name)
        f.parts = perturbed(f.parts, seed, scale)
        f.version = None

    def _adapters_close(self) -> None:
        """Drop every fork (the instance ended), releasing their quota."""
        for f in self._adapter_forks.values():
            f.slot.adapters.release(self.owner, f.weight_bytes)
        self._adapter_forks.clear()


def _le_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()


def _from_le_bytes(data: object, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """A float32 tensor of ``shape`` from little-endian float32 bytes.

    Raises:
        AdapterError: not bytes, or not ``4 * numel`` of them.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AdapterError(f"{what}: weights are float32 little-endian bytes, got {type(data).__name__}")
    n = 1
    for d in shape:
        n *= d
    if len(data) != 4 * n:
        raise AdapterError(f"{what}: {len(data)} bytes, expected {4 * n} (float32 of shape {list(shape)})")
    arr = np.frombuffer(bytes(data), dtype="<f4").astype(np.float32).reshape(shape)
    return torch.from_numpy(arr)

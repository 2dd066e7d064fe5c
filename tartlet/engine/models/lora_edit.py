"""Edits of a LoRA adapter's matrices: new weights for a module, and the
seeded random perturbation of zeroth-order tuning.

An adapter's matrices as a file holds them
(:attr:`~tartlet.engine.models.lora.LoraAdapter.parts`) are keyed by
``(layer, Hugging Face module name)`` and named in messages and over the
host API as PEFT names the module, ``model.layers.{layer}.{module}`` (e.g.
``model.layers.3.self_attn.q_proj``). Per module: ``A`` is ``[r,
in_features]``, ``B`` is ``[out_features, r]`` (PEFT's ``lora_A`` /
``lora_B`` weights), float32, the scale ``s`` kept apart (the update is
``s * B (A x)``).

Nothing here changes a tensor in place: every edit returns a new dict of
parts, sharing the tensors of the modules it left alone, so the adapter
built from the old dict (and every forward pass holding it) is untouched.
"""

from __future__ import annotations

import re

import torch

from ...sdk.errors import AdapterError
from .lora import ModuleLora

_MODULE_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def module_name(key: tuple[int, str]) -> str:
    """PEFT's name of module ``(layer, name)``: ``model.layers.{layer}.{name}``."""
    return f"model.layers.{key[0]}.{key[1]}"


def module_key(parts: dict[tuple[int, str], ModuleLora], name: object) -> tuple[int, str]:
    """The key of ``parts`` that ``name`` (:func:`module_name`) names.

    Raises:
        AdapterError: not a string of that form, or not a module of the
            adapter (the message lists a few that are).
    """
    m = _MODULE_RE.fullmatch(name) if isinstance(name, str) else None
    key = (int(m.group(1)), m.group(2)) if m else None
    if key is None or key not in parts:
        some = ", ".join(module_name(k) for k in list(parts)[:3])
        raise AdapterError(f"the adapter has no module {name!r} (its {len(parts)} modules are named like {some}, ...)")
    return key


def with_weights(parts: dict[tuple[int, str], ModuleLora], key: tuple[int, str], a: torch.Tensor | None = None,
                 b: torch.Tensor | None = None) -> dict[tuple[int, str], ModuleLora]:
    """``parts`` with module ``key``'s ``A`` and/or ``B`` replaced (the
    other kept; the rank and scale stay).

    Args:
        a: ``[r, in_features]``, or None: keep ``A``.
        b: ``[out_features, r]``, or None: keep ``B``.

    Raises:
        AdapterError: a shape other than the module's, or a value that is
            not finite (NaN, infinity).
    """
    old = parts[key]
    new = []
    for what, t, cur in (("A", a, old.a), ("B", b, old.b)):
        if t is None:
            new.append(cur)
            continue
        t = t.detach().to("cpu", torch.float32, copy=True).contiguous()
        if t.shape != cur.shape:
            raise AdapterError(f"module {module_name(key)}: {what} has shape {tuple(t.shape)}, the adapter's is "
                               f"{tuple(cur.shape)} (A is [r, in_features], B is [out_features, r])")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"module {module_name(key)}: {what} holds a value that is not finite")
        new.append(t)
    out = dict(parts)
    out[key] = ModuleLora(new[0], new[1], old.scale)
    return out


def perturbed(parts: dict[tuple[int, str], ModuleLora], seed: int, scale: float) -> dict[tuple[int, str], ModuleLora]:
    """``parts`` with ``scale * z`` added to every ``A`` and ``B``, ``z``
    standard normal drawn from ``seed``: MeZO's ``PerturbParameters``
    (Malladi et al., 2023, "Fine-Tuning Language Models with Just Forward
    Passes", Algorithm 1), which regenerates ``z`` from the seed instead of
    storing it, so ``perturbed(p, s, +eps)``, ``perturbed(p, s, -eps)`` and
    the update ``perturbed(p, s, -lr * g)`` use the same ``z``.

    ``z``: one ``torch.Generator`` seeded with ``seed``; for each module in
    sorted ``(layer, name)`` order, ``torch.randn`` of ``A``'s shape, then
    of ``B``'s (float32, on the CPU: the same numbers on every machine and
    device).

    Raises:
        AdapterError: ``seed`` is not an int in ``[0, 2**63)`` or ``scale``
            not a finite number.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise AdapterError(f"seed must be an int in [0, 2**63), got {seed!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise AdapterError(f"scale must be a finite number, got {scale!r}")
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(parts):
        m = parts[key]
        za = torch.randn(m.a.shape, generator=g, dtype=torch.float32)
        zb = torch.randn(m.b.shape, generator=g, dtype=torch.float32)
        out[key] = ModuleLora(m.a + float(scale) * za, m.b + float(scale) * zb, m.scale)
    return out

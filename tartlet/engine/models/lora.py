"""LoRA adapters over the (possibly quantized) projections of a model, many
per batch.

A LoRA adapter (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large
Language Models") changes a projection ``y = W x`` into

    y = W x + s * B (A x)

with ``A`` ``[r, in]``, ``B`` ``[out, r]`` and the scale ``s = alpha / r``
(PEFT's ``LoraLayer.update_layer``), or ``s = alpha / sqrt(r)`` with rsLoRA
(Kalajdzievski, 2023; PEFT ``use_rslora``). The base weight ``W`` is never
touched: it stays quantized, and the adapter's matrices are float32 (the
compute dtype on CUDA), the scale folded into ``B`` at load.

Projections here are the model's fused ones (:class:`~tartlet.engine.models.llama.Layer`):
``qkv`` = rows Q, K, V and ``gate_up`` = rows gate, up. An adapter's
per-module matrices (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``,
``up_proj``) are fused the same way: the ``A`` matrices stacked
(``[r_q + r_k + r_v, in]``) and the ``B`` matrices placed block-diagonally
(``[out_q + out_k + out_v, r_q + r_k + r_v]``; a module the adapter does not
target is a block of zero rows), so a fused projection's update is still two
small matrix products. Phi-3's fused ``qkv_proj``/``gate_up_proj`` adapters
are used as they are.

Many adapters in one batch (the Punica/S-LoRA idea: Chen et al., 2023,
"Punica: Multi-Tenant LoRA Serving"; Sheng et al., 2023, "S-LoRA: Serving
Thousands of Concurrent LoRA Adapters"): the base projection runs once over
every row of the batch, then :class:`LoraBatch` adds each adapter's update
to the rows that use it (rows gathered per adapter, two small matmuls,
scatter-added back; a contiguous run of rows needs no gather). Rows with no
adapter, and adapters no row of the batch uses, cost nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...sdk.errors import AdapterError
from .config import ModelConfig

#: The model's projections an adapter may change, by their key in a
#: :class:`~tartlet.engine.models.llama.Layer`.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass
class LoraPair:
    """The low-rank update of one projection: ``delta(x) = (x @ at) @ bt``.

    Attributes:
        at: ``A^T``, ``[in, R]`` (``R`` = the summed ranks of the fused parts).
        bt: ``(s * B)^T``, ``[R, out]``: the scale is folded in.
        blocks: where ``bt`` is block diagonal (a fused projection whose
            parts have their own ranks), ``(n0, n1, c0, c1)`` per part:
            outputs ``[n0, n1)`` use ranks ``[c0, c1)`` only, the rest of
            ``bt`` is zeros (the fused C decode step reads the blocks only);
            empty: dense.
    """

    at: torch.Tensor
    bt: torch.Tensor
    blocks: tuple[tuple[int, int, int, int], ...] = ()


@dataclass
class ModuleLora:
    """One module's LoRA matrices as a file holds them (before fusing).

    Attributes:
        a: float32 ``[r, in]``.
        b: float32 ``[out, r]``.
        scale: ``s`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def module_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[str, int, int, int]]:
    """The modules of layer ``layer`` an adapter may target, by their Hugging
    Face name (``"self_attn.q_proj"``): ``(projection key, first output
    row in the fused projection, out, in)``. Phi-3 has the fused
    ``qkv_proj``/``gate_up_proj``; every other family the separate ones.
    Sparse MoE layers have attention modules only."""
    c = config
    H, hd, nh, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q, kv = nh * hd, nkv * hd
    out: dict[str, tuple[str, int, int, int]] = {}
    if c.architecture == "phi3":
        out["self_attn.qkv_proj"] = ("qkv", 0, q + 2 * kv, H)
    else:
        out.update({"self_attn.q_proj": ("qkv", 0, q, H), "self_attn.k_proj": ("qkv", q, kv, H),
                    "self_attn.v_proj": ("qkv", q + kv, kv, H)})
    out["self_attn.o_proj"] = ("o", 0, H, q)
    if not c.is_sparse_layer(layer):
        inter = c.intermediate_size
        if c.architecture == "phi3":
            out["mlp.gate_up_proj"] = ("gate_up", 0, 2 * inter, H)
        else:
            out.update({"mlp.gate_proj": ("gate_up", 0, inter, H), "mlp.up_proj": ("gate_up", inter, inter, H)})
        out["mlp.down_proj"] = ("down", 0, H, inter)
    return out


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter, ready to apply (see the module docstring).

    Attributes:
        name: the name it is served under.
        source: the file or folder it was read from.
        key: 16 bytes naming its content (the matrices, scales and targets):
            the prefix cache keys pages computed with it by this (see
            :mod:`tartlet.engine.core.sequence`), so two adapters never share
            a page, and the same file loaded twice does.
        layers: per model layer, projection key (:data:`PROJECTIONS`) ->
            its :class:`LoraPair`; a projection the adapter leaves alone has
            no entry.
        rank: the largest ``r`` of its modules.
        modules: how many modules (``layer``, Hugging Face name) it changes.
        parts: its matrices as the file held them, per ``(layer, Hugging
            Face name)`` (float32 on the CPU, the scale not folded in): what
            :func:`~tartlet.engine.loading.adapter_writer.save_peft` writes
            and an inferlet reads and sets (:mod:`.lora_edit`). Never changed
            in place: an edited adapter is a new :class:`LoraAdapter`.
    """

    name: str
    source: Path
    key: bytes
    layers: list[dict[str, LoraPair]]
    rank: int
    modules: int
    parts: dict[tuple[int, str], ModuleLora] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of its matrices."""
        return sum(t.numel() * t.element_size() for layer in self.layers for p in layer.values() for t in (p.at, p.bt))

    @property
    def weight_bytes(self) -> int:
        """Bytes of its per-module ``A`` and ``B`` in float32 (:attr:`parts`;
        the tensors of its PEFT ``adapter_model.safetensors``): what the
        per-user adapter quota counts."""
        return sum(4 * (m.a.numel() + m.b.numel()) for m in self.parts.values())


def build_adapter(name: str, source: Path, config: ModelConfig, modules: dict[tuple[int, str], ModuleLora],
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoraAdapter:
    """Check ``modules`` against the model and fuse them into per-projection
    :class:`LoraPair` s (see the module docstring).

    Args:
        name, source: for :class:`LoraAdapter` and error messages.
        config: the base model's architecture.
        modules: ``(layer, Hugging Face module name) -> matrices``, e.g.
            ``(3, "self_attn.q_proj")``.
        dtype, device: where the fused matrices live (float32 on the CPU;
            the compute dtype on CUDA).

    Raises:
        AdapterError: a layer the model lacks, a module it has no projection
            for (or an MoE layer's MLP), or matrices of the wrong shape
            (another base model); the message names the file and the module.
    """
    if not modules:
        raise AdapterError(f"{source}: the adapter changes no module")
    h = hashlib.blake2b(digest_size=16)
    grouped: dict[tuple[int, str], list[tuple[int, int, ModuleLora]]] = {}  # (layer, proj) -> (row0, out, lora)
    for (layer, mod), lora in sorted(modules.items()):
        where = f"{source}: module model.layers.{layer}.{mod}"
        if not 0 <= layer < config.num_hidden_layers:
            raise AdapterError(f"{where}: the base model has {config.num_hidden_layers} layers (another base model?)")
        shapes = module_shapes(config, layer)
        if mod not in shapes:
            raise AdapterError(f"{where}: not a projection adapters can change in this {config.architecture} model "
                               f"(choose from {', '.join(shapes)})")
        proj, row0, out, inp = shapes[mod]
        r = lora.a.shape[0]
        if lora.a.dim() != 2 or lora.b.dim() != 2 or lora.a.shape[1] != inp or lora.b.shape != (out, r):
            raise AdapterError(f"{where}: LoRA matrices A {tuple(lora.a.shape)} and B {tuple(lora.b.shape)} do not fit "
                               f"the base projection [{out}, {inp}] (expected A [r, {inp}], B [{out}, r]: another base model?)")
        grouped.setdefault((layer, proj), []).append((row0, out, lora))
        h.update(f"{layer}.{mod}:{lora.scale!r}:{r}".encode())
        h.update(lora.a.float().contiguous().numpy().tobytes())
        h.update(lora.b.float().contiguous().numpy().tobytes())
    layers: list[dict[str, LoraPair]] = [{} for _ in range(config.num_hidden_layers)]
    for (layer, proj), parts in grouped.items():
        parts.sort(key=lambda part: part[0])  # in row order: Q, K, V; gate, up
        total_out = _projection_out(config, layer, proj)
        R = sum(lora.a.shape[0] for _, _, lora in parts)
        a = torch.cat([lora.a.float() for _, _, lora in parts])  # [R, in]
        b = torch.zeros(total_out, R, dtype=torch.float32)
        col = 0
        blocks = []
        for row0, out, lora in parts:
            r = lora.a.shape[0]
            b[row0 : row0 + out, col : col + r] = lora.b.float() * lora.scale
            blocks.append((row0, row0 + out, col, col + r))
            col += r
        layers[layer][proj] = LoraPair(a.t().contiguous().to(device, dtype), b.t().contiguous().to(device, dtype),
                                       tuple(blocks) if len(blocks) > 1 else ())
    rank = max(lora.a.shape[0] for lora in modules.values())
    own = {k: ModuleLora(_cpu32(m.a), _cpu32(m.b), float(m.scale)) for k, m in sorted(modules.items())}
    return LoraAdapter(name, source, h.digest(), layers, rank, len(modules), own)


def _cpu32(t: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy of ``t`` that owns its memory (not a view of a
    file mapping or of the caller's tensor)."""
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()


def _projection_out(config: ModelConfig, layer: int, proj: str) -> int:
    return sum(out for p, _, out, _ in module_shapes(config, layer).values() if p == proj)


class LoraBatch:
    """The adapters of one forward pass and the rows each applies to.

    Args:
        groups: ``(adapter, rows)`` per adapter used by some row: ``rows`` a
            ``slice`` (a contiguous run) or an int64 ``[n]`` tensor of rows
            of the flat batch. Rows of no group use the base model.
    """

    def __init__(self, groups: list[tuple[LoraAdapter, slice | torch.Tensor]]) -> None:
        self.groups = groups

    def to(self, device: torch.device) -> "LoraBatch":
        """The same groups with their row tensors on ``device``."""
        return LoraBatch([(a, r if isinstance(r, slice) else r.to(device, non_blocking=True)) for a, r in self.groups])

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """Add each adapter's update of projection ``proj`` of ``layer`` to
        its rows: ``y[rows] += (x[rows] @ A^T) @ (s B)^T`` (S-LoRA's
        gather, two GEMMs, scatter-add).

        Args:
            y: ``[T, out]``, the base projection's output (changed in place).
            x: ``[T, in]``, the projection's input.
        """
        for adapter, rows in self.groups:
            pair = adapter.layers[layer].get(proj)
            if pair is None:
                continue
            if isinstance(rows, slice):
                if rows.start == 0 and rows.stop == y.shape[0]:  # every row (e.g. one decode row): no views
                    y.addmm_(torch.mm(x, pair.at), pair.bt)
                else:
                    y[rows].addmm_(torch.mm(x[rows], pair.at), pair.bt)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ pair.at) @ pair.bt)


def lora_batch(adapters: list[tuple[LoraAdapter | None, int]]) -> LoraBatch | None:
    """The :class:`LoraBatch` of a flat batch whose items are, in row order,
    ``(adapter or None, number of rows)``; ``None`` when no item has one."""
    runs: dict[int, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
    row = 0
    for adapter, n in adapters:
        if adapter is not None:
            entry = runs.setdefault(id(adapter), (adapter, []))
            spans = entry[1]
            if spans and spans[-1][1] == row:
                spans[-1] = (spans[-1][0], row + n)
            else:
                spans.append((row, row + n))
        row += n
    if not runs:
        return None
    groups: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
    for adapter, spans in runs.values():
        if len(spans) == 1:
            groups.append((adapter, slice(*spans[0])))
        else:
            groups.append((adapter, torch.cat([torch.arange(lo, hi) for lo, hi in spans])))
    return LoraBatch(groups)

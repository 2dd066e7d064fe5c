"""The whole layer stack of a decode step in one C call (``decode_step.h``).

At batch 1 a decoder layer is about eleven small operations; called one by
one from Python each pays the interpreter and ctypes, and using both cores
means waking an OpenMP team per operation, which costs more than a small
projection takes. :class:`FusedDecoder` hands the layer stack of a batch of
single-token rows to ``tq_decode_layers``, which runs it in one OpenMP
parallel region with every projection split across the threads (the
threads meet at barriers instead of being woken per operation), and ends
with the final norm and LM head of the rows whose logits are wanted (when the
head is quantized too), so a batch-1 step is one C call from embedding to logits.

It serves the common shape only, and :meth:`FusedDecoder.build` returns
``None`` for anything else (the op-by-op path in :mod:`llama` runs then):
quantized weights (:class:`QuantLinear`) in all four projections of every
layer, pre-norm RMSNorm, SiLU-gated MLP, one RoPE for all layers, no QK-norm,
no sliding windows, no soft-capping (Llama, SmolLM, Mistral without a window,
Qwen2). A batch runs fused when the attention kernel takes every group:
single-token rows (decode), and prefill groups query by query within
:data:`~tartlet.engine.attention.plan.ROW_ATTENTION_MAX_SCORES` (the tail of the QKV
phase writes every row's key and value before the attention phase opens,
so a prompt's queries see its earlier tokens); on AVX-512 any number of
rows (from
``tq_set_panel_rows`` rows its projections take the panel GEMM,
``panel_gemm_avx512.h``), below AVX-512 fewer than
:data:`~tartlet.engine.models.quant_linear.DEQUANT_ROWS`, and the KV pool is
float32, float16 or int8 (``kv_int8.h`` rows).

Rows with a LoRA adapter (:class:`~tartlet.engine.models.lora.LoraBatch`)
run fused too: each projection adds their adapter's update after its base
output, as the op-by-op path does (``x @ A^T`` in the tail of the phase
that finished the projection's input, the product with ``B^T`` in the
projection's own column chunks, the rows of an adapter four at a time;
``decode_step.h``, ``lora_kernels.h``). The step reads each adapter from
copies of its matrices in :attr:`FusedDecoder.lora_dtype` (made once, kept
while the adapter lives; ``TARTLET_FUSED_LORA_DTYPE``), packed in the order
the kernels read them (:func:`~.lora_layout.lora_pack`: one contiguous run
per matrix, only the diagonal blocks of a fused projection's ``B``):
float16 by default (half the bytes a step streams: from a few adapters a
batch the step is bound by memory bandwidth; the F16C conversion is free),
``int8`` (a scale per rank: a quarter; int8 rounding, ~0.4% of a column's
largest value) or ``float32`` (the op-by-op path's values). A step passes
one adapter index per row.
``TARTLET_FUSED_LORA=0`` (or :attr:`FusedDecoder.lora`) sends batches with
adapter rows to the op-by-op path instead.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import TYPE_CHECKING, cast

import torch

from ..attention.plan import row_attention
from ..models.quant_linear import DEQUANT_ROWS, QuantLinear
from .abi import KV_KINDS
from .lora_layout import LORA_PROJECTIONS, LoraMat, LoraParts, lora_mats
from .quant_kernels import AttnGroupArgs, DecoderDesc, LayerDesc, decoder_desc

if TYPE_CHECKING:
    from ..attention.plan import GroupPlan
    from ..core.attention_probe import ProbeBuffer
    from ..core.batch import BatchInputs
    from ..models.llama import LlamaModel
    from ..models.lora import LoraAdapter, LoraBatch

_LAYER_KEYS = {"ln1", "qkv", "o", "ln2", "gate_up", "down"}

#: :attr:`FusedDecoder.lora_dtype` values: what the fused step reads adapters' matrices as.
LORA_STORAGE = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def lora_storage(at: torch.Tensor, bt: torch.Tensor, dtype: torch.dtype) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]":
    """``at`` ``[k, r]`` and ``bt`` ``[r, n]`` (float32) as the fused step
    reads them in ``dtype``: float32 as they are, float16 rounded, int8
    symmetric per rank (column ``c`` of ``at`` and row ``c`` of ``bt``, each
    by its largest magnitude / 127, round half to even) with ``scale[c]``
    the product of the two scales; returns ``(at, bt, scale or None)``."""
    if dtype == torch.float32:
        return at, bt, None
    if dtype == torch.float16:
        return at.half(), bt.half(), None
    sa, sb = _rank_scales(at, bt)
    qa = torch.round(at / sa.clamp_min(1e-30)).to(torch.int8)
    qb = torch.round(bt / sb.clamp_min(1e-30)[:, None]).to(torch.int8)
    return qa.contiguous(), qb.contiguous(), (sa * sb).float().contiguous()


def lora_stored_values(at: torch.Tensor, bt: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 values the fused step multiplies by when it reads ``at``,
    ``bt`` in ``dtype`` (:func:`lora_storage`; int8: each value times its
    rank's scale): what the op-by-op path must use to compute the same
    function (tests)."""
    if dtype == torch.int8:
        qa, qb, _ = lora_storage(at, bt, dtype)
        sa, sb = _rank_scales(at, bt)
        return qa.float() * sa, qb.float() * sb[:, None]
    sat, sbt, _ = lora_storage(at, bt, dtype)
    return sat.float(), sbt.float()


def _rank_scales(at: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return at.abs().amax(0) / 127, bt.abs().amax(1) / 127


class FusedDecoder:
    """The fused layer stack of one model (see the module docstring). Holds
    ctypes descriptors pointing into the model's weight tensors, so it must
    not outlive the model."""

    def __init__(self, model: "LlamaModel") -> None:
        self.model = model
        assert model.quant is not None  # build() checked
        self.kernels = model.quant
        c = model.config
        self._ffn = model.layers[0]["down"].in_features
        self._dims = (c.hidden_size, model.nh, model.nkv, model.hd, self._ffn, c.rms_norm_eps, model.scale)
        self._pool: tuple[int, int, torch.dtype] | None = None  # data pointers (and dtype) the layer descriptors were built for
        self._desc: DecoderDesc | None = None
        self._keep: list[object] = []
        #: False turns the fused path off (tests and benchmarks compare both)
        self.enabled = os.environ.get("TARTLET_FUSED_DECODE", "1") != "0"
        #: False sends batches with LoRA rows to the op-by-op path
        self.lora = os.environ.get("TARTLET_FUSED_LORA", "1") != "0"
        #: what the step reads adapters' matrices as (a key of LORA_STORAGE; float16: float32 where a value is
        #: past float16's range; float16 and int8 only with AVX2, else float32)
        self.lora_dtype = os.environ.get("TARTLET_FUSED_LORA_DTYPE", "float16")
        if self.lora_dtype not in LORA_STORAGE:
            raise ValueError(f"TARTLET_FUSED_LORA_DTYPE: {self.lora_dtype!r} is not one of {', '.join(LORA_STORAGE)}")
        # per adapter and storage dtype its tq_lora_mat array and the copies it points into, or None when
        # its matrices are not the step's (float32 on the CPU)
        self._lora_mats: "weakref.WeakKeyDictionary[LoraAdapter, dict[str, tuple[ctypes.Array[LoraMat], list[torch.Tensor]] | None]]" = (
            weakref.WeakKeyDictionary())
        # each layer's projections' (in, out) widths, as build() checked them
        self._lora_shapes = [{k: (lin.in_features, lin.out_features)
                              for k, lin in ((k, cast(QuantLinear, layer[k])) for k in LORA_PROJECTIONS)}  # type: ignore[literal-required]  # a projection key
                             for layer in model.layers]
        #: the step ends with the final norm and LM head too (a quantized
        #: head, no final soft-capping); else the model runs them after it
        self.has_head = isinstance(model.lm_head, QuantLinear) and c.final_logit_softcapping is None

    @classmethod
    def build(cls, model: "LlamaModel") -> "FusedDecoder | None":
        """A fused decoder for ``model``, or ``None`` when its shape is not
        the one the C step implements (see the module docstring)."""
        c = model.config
        if model.quant is None or model.dtype != torch.float32 or model.device.type != "cpu":
            return None
        if c.qk_norm or c.gemma_norms or c.attn_logit_softcapping is not None or c.hidden_act != "silu":
            return None
        if any(w is not None for w in model.windows) or c.rope_local_theta is not None:
            return None
        for layer in model.layers:
            if set(layer) != _LAYER_KEYS or not all(isinstance(layer[k], QuantLinear) for k in ("qkv", "o", "gate_up", "down")):
                return None
        return cls(model)

    def accepts(self, batch: "BatchInputs", k_cache: torch.Tensor) -> bool:
        """Whether ``batch`` can run fused: every group's attention by the
        C kernel (decode rows, and prefill groups query by query:
        :func:`~tartlet.engine.attention.plan.row_attention`), every row in a group,
        below AVX-512 fewer than ``DEQUANT_ROWS`` rows, a float32, float16
        or int8 pool; LoRA rows when :attr:`lora` is on and every adapter's
        matrices are float32 CPU ones of this model (the first call with
        an adapter makes its copies in :attr:`lora_dtype`)."""
        T = batch.input_ids.shape[0]
        # from DEQUANT_ROWS rows, below AVX-512, projections take PyTorch's GEMM (quant_linear.py)
        if not self.enabled or (T >= DEQUANT_ROWS and self.kernels.isa < 3) or k_cache.dtype not in KV_KINDS:
            return False
        if batch.lora is not None and not (self.lora and all(self._adapter_mats(a) is not None for a, _ in batch.lora.groups)):
            return False
        groups = batch.groups
        return sum(g.kv_slots.shape[0] * g.num_queries for g in groups) == T and all(row_attention(g) for g in groups)

    def _adapter_mats(self, adapter: "LoraAdapter") -> "ctypes.Array[LoraMat] | None":
        """``adapter``'s :func:`~.quant_kernels.lora_mats` array (built once
        per adapter and :attr:`lora_dtype`, over copies in that dtype), or
        ``None`` when its matrices are not float32 CPU ones of this model's
        projections (the op-by-op path runs it then)."""
        per = self._lora_mats.setdefault(adapter, {})
        if self.lora_dtype not in per:
            per[self.lora_dtype] = self._build_mats(adapter, LORA_STORAGE[self.lora_dtype])
        got = per[self.lora_dtype]
        return None if got is None else got[0]

    def _build_mats(self, adapter: "LoraAdapter", dtype: torch.dtype) -> "tuple[ctypes.Array[LoraMat], list[torch.Tensor]] | None":
        pairs = [t for layer in adapter.layers for p in layer.values() for t in (p.at, p.bt)]
        if len(adapter.layers) != len(self._lora_shapes) or any(t.dtype != torch.float32 or not t.is_cpu for t in pairs):
            return None
        if self.kernels.isa < 1 or (dtype == torch.float16 and any(float(t.abs().max()) > 65000.0 for t in pairs)):
            dtype = torch.float32  # no AVX2 conversions, or past float16's range
        scales: list[torch.Tensor] = []
        layers = []
        for layer in adapter.layers:
            d: "dict[str, LoraParts]" = {}
            for k, p in layer.items():
                at, bt, scale = lora_storage(p.at, p.bt, dtype)
                scales += [scale] if scale is not None else []
                d[k] = (at, bt, p.blocks, scale)
            layers.append(d)
        try:
            arr, packed = lora_mats(layers, self._lora_shapes)  # the packed copies the array points into
        except ValueError:
            return None
        return arr, packed + scales

    def _lora_arg(self, lora: "LoraBatch", T: int) -> "tuple[list[ctypes.Array[LoraMat]], torch.Tensor]":
        """The step's adapters and each row's index into them (-1: none)."""
        row_adapter = torch.full((T,), -1, dtype=torch.int64)
        mats = []
        for i, (adapter, rows) in enumerate(lora.groups):
            row_adapter[rows] = i
            mats.append(cast("ctypes.Array[LoraMat]", self._adapter_mats(adapter)))  # accepts() checked
        return mats, row_adapter

    def _descriptor(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> DecoderDesc:
        key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype)
        if self._pool != key:
            layers = []
            for layer, kc, vc in zip(self.model.layers, k_cache.unbind(0), v_cache.unbind(0)):
                descs = [ctypes.pointer(cast(QuantLinear, layer[k])._desc) for k in ("qkv", "o", "gate_up", "down")]  # build() checked
                layers.append(LayerDesc(layer["ln1"].data_ptr(), layer["ln2"].data_ptr(), *descs, kc.data_ptr(), vc.data_ptr()))
            m = self.model
            head = cast(QuantLinear, m.lm_head)._desc if self.has_head else None
            self._desc, arr = decoder_desc(layers, *self._dims, final_norm=m.norm, head=head, kv_dtype=k_cache.dtype)
            self._keep = [arr]
            self._pool = key
        assert self._desc is not None  # built above for this pool
        return self._desc

    def run(
        self, x: torch.Tensor, batch: "BatchInputs", cos: torch.Tensor, sin: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, groups: list[GroupPlan],
        probes: "dict[tuple[int | None, int], ProbeBuffer] | None" = None,
    ) -> torch.Tensor | None:
        """Every layer over ``x`` float32 ``[T, H]`` (updated in place), then
        (when :attr:`has_head`) the final norm and LM head of
        ``batch.output_rows``.

        Args:
            cos, sin: float32 ``[T, head_dim / 2]`` RoPE angles.
            k_cache, v_cache: the pool, ``[layers, slots, nkv, head_dim]`` float32
                or float16, or ``[layers, slots, nkv, head_dim + 4]`` int8 rows.
            groups: the model's per-group plans (:class:`~tartlet.engine.attention.plan.GroupPlan`),
                each run by the attention kernel.
            probes: the attention probe's buffers of probed groups, keyed
                ``(None, id(group))``
                (:meth:`~tartlet.engine.core.attention_probe.AttentionCapture.allocate`):
                the step copies their layers' softmax weights there.

        Returns:
            float32 logits ``[S, vocab_size]`` of ``batch.output_rows``, or
            ``None`` without :attr:`has_head` (``x`` holds the last layer's output).
        """
        args: list[AttnGroupArgs] = []
        for p in groups:
            pb = probes.get((None, id(p.group))) if probes else None
            g = (p.group.rows, p.group.row_start, p.slots, p.rows_bias)
            args.append(g if pb is None else (*g, pb.out, pb.slot))
        logits = None
        if self.has_head:
            logits = torch.empty(batch.output_rows.shape[0], self.model.lm_head.out_features, dtype=torch.float32)
        lora = None if batch.lora is None else self._lora_arg(batch.lora, x.shape[0])
        self.kernels.decode_layers(self._descriptor(k_cache, v_cache), x, cos, sin, batch.write_slots, args,
                                   torch.get_num_threads(), batch.output_rows, logits, lora)
        return logits

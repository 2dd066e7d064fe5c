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
:data:`~tartlet.engine.models.llama.ROW_ATTENTION_MAX_SCORES` (the tail of the QKV
phase writes every row's key and value before the attention phase opens,
so a prompt's queries see its earlier tokens); on AVX-512 any number of
rows (from
``tq_set_panel_rows`` rows its projections take the panel GEMM,
``panel_gemm_avx512.h``), below AVX-512 fewer than
:data:`~tartlet.engine.models.quant_linear.DEQUANT_ROWS`, and the KV pool is
float32, float16 or int8 (``kv_int8.h`` rows).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, cast

import torch

from .abi import KV_KINDS
from .quant_kernels import DecoderDesc, LayerDesc, decoder_desc
from ..models.quant_linear import DEQUANT_ROWS, QuantLinear

if TYPE_CHECKING:
    from ..core.batch import BatchInputs
    from ..models.llama import GroupPlan, LlamaModel

_LAYER_KEYS = {"ln1", "qkv", "o", "ln2", "gate_up", "down"}


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
        :func:`~tartlet.engine.models.llama.row_attention`), every row in a group,
        below AVX-512 fewer than ``DEQUANT_ROWS`` rows, a float32, float16
        or int8 pool."""
        from ..models.llama import row_attention  # llama imports this module

        T = batch.input_ids.shape[0]
        # from DEQUANT_ROWS rows, below AVX-512, projections take PyTorch's GEMM (quant_linear.py)
        if not self.enabled or (T >= DEQUANT_ROWS and self.kernels.isa < 3) or k_cache.dtype not in KV_KINDS:
            return False
        groups = batch.groups
        return sum(g.kv_slots.shape[0] * g.num_queries for g in groups) == T and all(row_attention(g) for g in groups)

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
    ) -> torch.Tensor | None:
        """Every layer over ``x`` float32 ``[T, H]`` (updated in place), then
        (when :attr:`has_head`) the final norm and LM head of
        ``batch.output_rows``.

        Args:
            cos, sin: float32 ``[T, head_dim / 2]`` RoPE angles.
            k_cache, v_cache: the pool, ``[layers, slots, nkv, head_dim]`` float32
                or float16, or ``[layers, slots, nkv, head_dim + 4]`` int8 rows.
            groups: the model's per-group plans (:class:`~tartlet.engine.models.llama.GroupPlan`),
                each run by the attention kernel.

        Returns:
            float32 logits ``[S, vocab_size]`` of ``batch.output_rows``, or
            ``None`` without :attr:`has_head` (``x`` holds the last layer's output).
        """
        args = [(p.group.rows, p.group.row_start, p.slots, p.rows_bias) for p in groups]
        logits = None
        if self.has_head:
            logits = torch.empty(batch.output_rows.shape[0], self.model.lm_head.out_features, dtype=torch.float32)
        self.kernels.decode_layers(self._descriptor(k_cache, v_cache), x, cos, sin, batch.write_slots, args,
                                   torch.get_num_threads(), batch.output_rows, logits)
        return logits

"""The decoder of every supported family, over a paged KV cache.

One decoder serves Llama (SmolLM, Llama 3.x), Mistral, Qwen2, Qwen3, Phi-3
and Gemma 2/3; :class:`~tartlet.engine.models.config.ModelConfig` says what differs.
The math follows Hugging Face ``modeling_llama.py``: RMSNorm (Zhang &
Sennrich, 2019), rotary position embeddings in the ``rotate_half`` layout (Su
et al., 2021; variants in :mod:`tartlet.engine.models.rope`), grouped-query attention
(Ainslie et al., 2023), SwiGLU MLP (Shazeer, 2020), optional QKV bias (Qwen2),
tied embeddings. Family options, each as in its HF modeling file:

* QK-norm (``modeling_qwen3.py``, ``modeling_gemma3.py``): RMSNorm over each
  query and key head (weight ``[head_dim]``) after the projection, before RoPE.
* sliding-window attention (``modeling_mistral.py``; per layer in
  ``modeling_gemma2.py``/``modeling_gemma3.py``/``modeling_qwen2.py``): a
  sliding layer's query at token index ``i`` sees only indexes ``j > i - W``
  (HF ``sliding_window_overlay``), on top of the usual mask. The scheduler
  gives each attention group the token indexes of its queries and KV columns
  (``AttentionGroup.q_index``/``kv_index``) when the model has a window;
  each pass cuts every group once per distinct window to the columns the
  window leaves (:meth:`~tartlet.engine.attention.paged_attention.Attention.window_group`), so the attention
  kernels of a sliding layer read ``O(W)`` keys per query however long the
  sequence. When every layer slides, the engine also releases the pages
  before the window (:mod:`tartlet.engine.core.sequence`); with global layers
  too (Gemma) every page stays, as those layers read them all.
* fused ``qkv_proj`` and ``gate_up_proj`` weights (``modeling_phi3.py``) are
  used as they are (the other families' Q/K/V and gate/up are fused at load).
* Gemma (``modeling_gemma2.py``, ``modeling_gemma3.py``): RMSNorm scaled by
  ``1 + w``, embedding times ``sqrt(hidden_size)`` (rounded to the compute
  dtype), norms after attention and after the MLP as well as before
  (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``), GeGLU (tanh GELU gate), attention scale
  ``query_pre_attn_scalar ** -0.5``, soft-capping ``c * tanh(x / c)`` of
  attention scores and final logits (Gemma 2), and a RoPE base of its own for
  sliding layers (Gemma 3's ``rope_local_base_freq``).
* sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE with its shared expert,
  Qwen3-MoE) on the layers ``ModelConfig.is_sparse_layer`` names: the block
  of :mod:`tartlet.engine.models.moe` (routing, batched expert dispatch).

It differs in execution only: one call runs a ragged batch of many sequences,
reads and writes K/V in the page pool, and computes logits just for the rows
asked for. Q/K/V and gate/up projections are fused into one matrix each, so a
layer costs four matrix multiplications, each a
:class:`~tartlet.engine.models.linear.Linear` (prepacked for oneDNN on CPU, residual
adds fused in) or :class:`~tartlet.engine.models.quant_linear.QuantLinear`.
"""

from __future__ import annotations

import math
from typing import Required, TypedDict, cast

import torch
import torch.nn.functional as F

from ..attention.paged_attention import Attention, AttentionPass
from ..core.batch import BatchInputs
from ..core.hidden_states import FINAL, HiddenCapture
from ..cuda import attention as cuda_attention
from ..cuda import quant_matmul as cuda_quant
from ..cuda import rms_norm as cuda_rms_norm
from ..cuda.quant_matmul import CudaQuantLinear
from ..loading import os_memory
from ..loading.quant_formats import BF16, F16, INTERLEAVED_KINDS, KIND_NAMES, QuantWeight
from .config import ModelConfig
from .linear import Linear, onednn_packing_available
from .moe import SparseMoe, build_sparse_moe
from .quant_linear import MATMUL_DTYPES, QuantLinear, embedding_rows
from .rope import Rotary, rope_inv_freq  # noqa: F401 (rope_inv_freq: re-exported)

#: A projection: float (:class:`Linear`) or quantized (:class:`QuantLinear`; on CUDA :class:`CudaQuantLinear`).
Projection = Linear | QuantLinear | CudaQuantLinear

class Layer(TypedDict, total=False):
    """One decoder layer's weights (:attr:`LlamaModel.layers`): RMSNorm
    scales and projections; the MLP is dense (``gate_up``, ``down``) or a
    sparse MoE (``moe``)."""

    ln1: Required[torch.Tensor]
    qkv: Required[Projection]
    o: Required[Projection]
    ln2: Required[torch.Tensor]
    gate_up: Projection
    down: Projection
    moe: SparseMoe
    q_norm: torch.Tensor  # QK-norm (Qwen3, Gemma 3)
    k_norm: torch.Tensor
    post_attn: torch.Tensor  # Gemma: norms after attention and MLP
    post_ff: torch.Tensor


class LlamaModel:
    """Inference-only decoder of any supported family (see the module docstring).

    Args:
        config: architecture, family options included.
        weights: Hugging Face-named tensors (``model.layers.{i}.self_attn.q_proj.weight``
            ... ``[out, in]``; see :mod:`tartlet.engine.loading.loader` for each family's
            set), as produced by :func:`tartlet.engine.loading.loader.load_model`.
            Consumed: projections are fused and the dict is not kept.
        dtype: compute dtype (float32 or bfloat16); logits are float32.
        device: where weights live and the model runs.
        gemv_copy: on CPU with prepacked weights, also keep each layer weight
            transposed for single-row (batch-1 decode) steps: faster, at the
            cost of a second copy of the layer weights (see
            :mod:`tartlet.engine.models.linear`).
        cpu_kernels: on CPU in float32, use the fused C kernels of
            :mod:`tartlet.engine.kernels.cpu_kernels` (RMSNorm, RoPE + KV write,
            paged decode attention) when they can be compiled.
        act_bits: precision activations are quantized to before they meet
            quantized weights (:class:`QuantLinear`): 8, 16, or ``"auto"``:
            16 bits into the projections fed by an RMSNorm (QKV, gate/up,
            the output head), whose norm weights scale a few channels to
            100-470x the block median, and 8 bits into the output and down
            projections (see :mod:`tartlet.engine.models.quant_linear`).
        matmul_dtype: with quantized weights, the precision of the float GEMM
            that calls of 8+ rows (prompts, decode batches) take on AVX-512
            (the panel GEMM, ``panel_gemm_avx512.h``): ``"float32"``
            (default), or ``"bfloat16"``: bfloat16-rounded activations and
            weights with float32 sums (``panel_gemm_bf16.h``; needs
            AVX512_BF16), ~1.8x faster products at 64 rows, but a row's
            result then depends on whether its batch has 8+ rows (1-7 rows
            keep the 16-bit integer kernel), so batching can change greedy
            outputs at near-ties. Projections with 8-bit activations keep
            their integer kernels at any row count. Q4/Q5/Q6/Q8 projections
            are interleaved for the integer kernel of every row count (8-bit
            or 16-bit activations; see
            :mod:`tartlet.engine.models.quant_linear`), except the 16-bit
            ones under ``"bfloat16"``, kept in the row layout for its panel.

    Quantized weights stay quantized on the CPU in float32 (:class:`QuantLinear`)
    and on CUDA with Triton in any compute dtype (:class:`CudaQuantLinear`,
    the Triton kernels of :mod:`tartlet.engine.cuda.quant_matmul`).

    Raises:
        ValueError: a missing tensor, quantized weights on the CPU not in
            float32 or on CUDA without Triton, a bad ``act_bits`` or ``matmul_dtype``, or
            ``matmul_dtype="bfloat16"`` on a CPU without AVX512_BF16.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantWeight],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        gemv_copy: bool = True,
        cpu_kernels: bool = True,
        act_bits: int | str = 16,
        matmul_dtype: str = "float32",
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def raw(name: str) -> "torch.Tensor | QuantWeight":
            try:
                return weights[name]
            except KeyError:
                raise ValueError(f"model weights lack tensor {name!r}") from None

        self.quant = None  # the quantized kernels, when any weight is quantized
        #: quantized weights kept quantized on the GPU (CudaQuantLinear), multiplied by the Triton kernels
        self.cuda_quant = self.device.type == "cuda" and cuda_quant.available() and \
            any(isinstance(t, QuantWeight) for t in weights.values())
        if any(isinstance(t, QuantWeight) for t in weights.values()) and not self.cuda_quant:
            if self.device.type != "cpu" or dtype != torch.float32:
                raise ValueError("quantized weights run on the CPU in float32 only; load them dequantized "
                                 f"for {self.device.type}/{dtype}")
            from ..kernels import quant_kernels

            self.quant = quant_kernels.load()
            if self.quant is None:
                raise ValueError("quantized weights need the quantized CPU kernels, which could not be built")

        def w(name: str) -> torch.Tensor:
            t = raw(name)
            if isinstance(t, QuantWeight) and self.cuda_quant:  # dequantized on the GPU
                q = cuda_quant.to_device(t, self.device, dtype)
                t = q.q if q.kind in (F16, BF16) else cuda_quant.dequantize(q, dtype=dtype)
            elif isinstance(t, QuantWeight):
                assert self.quant is not None  # loaded above when a weight is quantized
                t = self.quant.dequantize(t)
            return t.to(device=self.device, dtype=dtype).contiguous()

        pack = onednn_packing_available(self.device, dtype)

        def float_part(t: torch.Tensor) -> QuantWeight:
            # a float matrix beside quantized ones (e.g. an F32 tensor in a GGUF): kept as float16
            # rather than float32 in its own kernel; exact for GGUF F16 tensors
            return QuantWeight(F16, cast(tuple[int, int], tuple(t.shape)), t.to(torch.float16).contiguous(), source="F32")

        if act_bits not in (8, 16, "auto"):
            raise ValueError(f"act_bits must be 8, 16 or 'auto', got {act_bits!r}")
        if matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"matmul_dtype must be one of {', '.join(MATMUL_DTYPES)}, got {matmul_dtype!r}")
        bf16 = matmul_dtype == "bfloat16" and self.quant is not None  # the panel GEMM in bfloat16
        if bf16 and self.quant is not None and not self.quant.has_bf16:
            raise ValueError("matmul_dtype='bfloat16' needs a CPU with AVX512_BF16; this one has none")
        #: the panel GEMM's precision in use ("float32" or "bfloat16"; None without quantized weights)
        self.matmul_dtype = None if self.quant is None else ("bfloat16" if bf16 else "float32")

        def linear(*names: str, bias: torch.Tensor | None = None, copy: bool = gemv_copy, normed: bool = True) -> Projection:
            # normed: the input comes straight from an RMSNorm (see act_bits)
            parts = [raw(n) for n in names]
            if self.cuda_quant and any(isinstance(p, QuantWeight) for p in parts):
                return CudaQuantLinear([p if isinstance(p, QuantWeight) else float_part(p) for p in parts], bias,
                                       self.device, dtype)
            if self.quant is not None and any(isinstance(p, QuantWeight) for p in parts):
                quant = [p if isinstance(p, QuantWeight) else float_part(p) for p in parts]
                bits = act_bits if isinstance(act_bits, int) else (16 if normed else 8)  # act_bits: 8, 16 or "auto"
                return QuantLinear(quant, bias, self.quant, act_bits=bits,
                                   bf16=bf16 and bits == 16 and quant[0].shape[1] % 2 == 0)
            return Linear(torch.cat([w(n) for n in names]), bias, pack=pack, gemv_copy=copy)

        def norm(name: str) -> torch.Tensor:
            t = w(name)  # Gemma's RMSNorm scales by (1 + w): added once here (HF Gemma3RMSNorm, in float32)
            return (t.float() + 1.0).to(dtype) if c.gemma_norms else t

        def fused(p: str, whole: str, *parts: str, bias: torch.Tensor | None = None) -> Projection:
            # one matrix: as stored when the checkpoint fuses it (Phi-3's qkv_proj, gate_up_proj), else concatenated
            return linear(p + whole, bias=bias) if p + whole in weights else linear(*[p + x for x in parts], bias=bias)

        embed = raw("model.embed_tokens.weight")
        self.embed = embed if isinstance(embed, QuantWeight) else w("model.embed_tokens.weight")
        # Gemma: embeddings times sqrt(H), the factor rounded to the compute dtype (HF Gemma3TextScaledWordEmbedding)
        self.embed_scale = float(torch.tensor(c.hidden_size**0.5, dtype=dtype)) if c.gemma_norms else None
        # the vocabulary projection needs no GEMV copy: packed is as fast at one row
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.lm_head = linear(head, copy=False)
        if c.tie_word_embeddings and isinstance(self.lm_head, QuantLinear) and len(self.lm_head.parts) == 1 \
                and self.lm_head.parts[0].kind in INTERLEAVED_KINDS:
            self.embed = self.lm_head.parts[0]  # the head's interleaved copy serves the lookups too: one copy kept
        if self.cuda_quant and isinstance(self.embed, QuantWeight):  # on the GPU, the tied head's copy if there is one
            head_parts = self.lm_head.parts if isinstance(self.lm_head, CudaQuantLinear) else []
            if c.tie_word_embeddings and len(head_parts) == 1 and head_parts[0].kind in cuda_quant.KINDS:
                self.embed = head_parts[0]
            elif self.embed.kind in cuda_quant.KINDS:
                self.embed = cuda_quant.to_device(self.embed, self.device, dtype)
            else:
                self.embed = w("model.embed_tokens.weight")
        del embed  # (the raw one goes with the dict's entry below)
        self.norm = norm("model.norm.weight")
        # Each loaded tensor is dropped from ``weights`` once its layer is built
        # (the dict is consumed: cleared at the end), so that converted copies
        # (fused, interleaved) replace the loaded ones as they are made instead
        # of piling up beside them: a 4.2 GB Q4_K_M file peaked at 9.7 GB.
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            weights.pop(name, None)
        self.layers: list[Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            bias = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"]) if c.attention_bias else None
            layer = Layer(
                ln1=norm(p + "input_layernorm.weight"),
                qkv=fused(p, "self_attn.qkv_proj.weight", *[f"self_attn.{x}_proj.weight" for x in "qkv"], bias=bias),
                o=linear(p + "self_attn.o_proj.weight", normed=False),
                ln2=norm(p + ("pre_feedforward_layernorm.weight" if c.gemma_norms else "post_attention_layernorm.weight")),
            )
            if c.is_sparse_layer(i):
                layer["moe"] = build_sparse_moe(c, p, weights, linear, w, lambda g: self.act(g))
            else:
                layer.update({"gate_up": fused(p, "mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
                              "down": linear(p + "mlp.down_proj.weight", normed=False)})
            if c.qk_norm:
                layer.update({"q_norm": norm(p + "self_attn.q_norm.weight"), "k_norm": norm(p + "self_attn.k_norm.weight")})
            if c.gemma_norms:
                layer.update({"post_attn": norm(p + "post_attention_layernorm.weight"),
                              "post_ff": norm(p + "post_feedforward_layernorm.weight")})
            self.layers.append(layer)
            for name in [n for n in weights if n.startswith(p)]:
                del weights[name]
            os_memory.trim_heap()  # the loaded tensors' free pages back to the system
        weights.clear()
        # RoPE per layer: Gemma 3's sliding layers have their own base and no scaling
        self.rotary = Rotary(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings).to(self.device)
        self.inv_freq = self.rotary.inv_freq
        local = None
        if c.rope_local_theta is not None:
            local = Rotary(c.head_dim, c.rope_local_theta, None, c.max_position_embeddings).to(self.device)
        self.windows = [c.layer_window(i) for i in range(c.num_hidden_layers)]
        self.layer_rope = [local if (local is not None and self.windows[i] is not None) else self.rotary
                           for i in range(c.num_hidden_layers)]
        self.kernels = None
        if cpu_kernels and self.device.type == "cpu" and dtype == torch.float32:
            from ..kernels import cpu_kernels as ck

            self.kernels = ck.load()
        self.scale = 1.0 / math.sqrt(self.hd) if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5
        self.act = F.silu if c.hidden_act == "silu" else lambda g: F.gelu(g, approximate="tanh")
        #: on CUDA with Triton: RoPE + KV writes and decode groups by the Triton kernels (engine/cuda/)
        self.cuda_decode = self.device.type == "cuda" and c.attn_logit_softcapping is None and cuda_attention.available()
        #: every layer's RoPE, KV writes and attention, by the C, Triton or PyTorch path (engine/attention/)
        self.attention = Attention(self.nh, self.nkv, self.hd, self.scale, dtype, self.device, self.windows, self.layer_rope,
                                   c.attn_logit_softcapping, self.kernels, self.cuda_decode)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor of weight memory the model holds: embedding, norms,
        projections (float, packed, transposed copies, or the values, scales
        and minimums of quantized ones), biases, the head (a tied head adds
        nothing: its tensors are the embedding's)."""
        out: dict[int, torch.Tensor] = {}

        def add(t: torch.Tensor | None) -> None:
            if t is not None:
                out.setdefault(id(t), t)

        def add_any(obj: object) -> None:
            if isinstance(obj, torch.Tensor):
                add(obj)
            elif isinstance(obj, QuantWeight):
                for t in (obj.q, obj.d, obj.m):
                    add(t)
            elif isinstance(obj, (QuantLinear, CudaQuantLinear)):
                for p in obj.parts:
                    add_any(p)
                add(obj.bias)
            elif isinstance(obj, Linear):
                for t in (obj.weight, obj.packed, obj.weight_t, obj.bias):
                    add(t)
            elif isinstance(obj, SparseMoe):
                for part in obj.parts():
                    add_any(part)

        add_any(self.embed)
        add_any(self.lm_head)
        add_any(self.norm)
        for layer in self.layers:
            for v in layer.values():
                add_any(v)
        return list(out.values())

    def weight_bytes(self) -> int:
        """Bytes of weight memory the model holds (each storage counted once:
        a tied output head shares the embedding)."""
        seen: dict[int, int] = {}
        for t in self.weight_tensors():
            if t.is_mkldnn:  # a oneDNN-packed weight has no storage to look at: count its elements
                seen[id(t)] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def weight_summary(self) -> str:
        """The weight formats held, e.g. ``"Q4_1 x 120, Q8_0 x 1"``: quantized
        weight runs by source GGUF type, counted after fusing (Q/K/V of one
        format is one run; the default model's 210 Q4_1 matrices are 120), or
        the float dtype (``"float32"``)."""
        from collections import Counter

        kinds: Counter[str] = Counter()
        for lin in self._quant_linears():
            kinds.update(p.source or KIND_NAMES[p.kind] for p in lin.parts)
        if isinstance(self.embed, QuantWeight) and (not isinstance(self.lm_head, (QuantLinear, CudaQuantLinear)) or self.lm_head.parts[0].q is not self.embed.q):
            kinds[self.embed.source] += 1
        return ", ".join(f"{k} x {n}" for k, n in kinds.most_common()) or str(self.dtype).replace("torch.", "")

    def products_summary(self) -> str:
        """How the quantized projections multiply, for ``--stats``: the runs
        interleaved by 16 rows take integer products at every row count,
        the others the ``matmul_dtype`` panel GEMM from 8 rows (see
        :mod:`tartlet.engine.models.quant_linear`); "" without quantized weights."""
        if self.matmul_dtype is None:
            return ""
        runs = [p.kind for lin in self._quant_linears() for p in lin.parts]
        interleaved = sum(k in INTERLEAVED_KINDS for k in runs)
        panel = f"{self.matmul_dtype} products from 8 rows"
        if interleaved == 0:
            return panel
        if interleaved == len(runs):
            return "integer products at every row count (16-row layout)"
        return f"integer products at every row count for {interleaved} of {len(runs)} runs, {panel} for the rest"

    def _quant_linears(self) -> list[QuantLinear | CudaQuantLinear]:
        """The quantized projections: the head, every layer's, MoE experts'."""
        held = [v for layer in self.layers for v in layer.values()]
        held += [p for v in held if isinstance(v, SparseMoe) for p in v.parts()]
        return [lin for lin in [self.lm_head] + held if isinstance(lin, (QuantLinear, CudaQuantLinear))]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps)
        if self.cuda_decode and x.dim() == 2 and x.stride(1) == 1:  # the Triton kernel (cuda_rms_norm.py)
            return cuda_rms_norm.rms_norm(x, weight, self.config.rms_norm_eps)
        return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)

    def embed_rows(self, batch: BatchInputs) -> torch.Tensor:
        """The input embeddings of ``batch``'s tokens: ``[T, hidden_size]``
        in the compute dtype (Gemma's scaled by ``sqrt(hidden_size)``)."""
        if isinstance(self.embed, QuantWeight) and self.cuda_quant:
            x = cuda_quant.dequantize(self.embed, batch.input_ids, self.dtype)
        elif isinstance(self.embed, QuantWeight):
            assert self.quant is not None  # loaded with the quantized weights
            x = embedding_rows(self.quant, self.embed, batch.input_ids)
        else:
            x = self.embed.index_select(0, batch.input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x

    def keep_hidden(self, cap: HiddenCapture, i: int, x: torch.Tensor) -> None:
        """Keep what ``cap`` wants of ``x`` ``[T, H]``, the residual stream
        after layer ``i``: its rows for that layer, and after the last layer
        the final hidden states (the final norm of their rows, as the LM head
        sees them)."""
        if i in cap.rows:
            cap.keep(i, x.index_select(0, cap.rows[i]))
        if i == len(self.layers) - 1 and FINAL in cap.rows:
            cap.keep(FINAL, self._rms_norm(x.index_select(0, cap.rows[FINAL]), self.norm))

    @torch.inference_mode()
    def forward_eager(self, batch: BatchInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Run one ragged batch op by op (the model runner,
        :mod:`tartlet.engine.core.model_runner`, picks this, a CUDA graph or
        the fused C step per batch).

        Args:
            batch: flat inputs, ``T`` rows.
            k_cache, v_cache: the pool's ``[num_layers, slots, num_kv_heads,
                head_dim]`` tensors (int8 pools: ``head_dim + 4``, each row
                quantized with its scale, :mod:`tartlet.engine.core.kv_quant`);
                rows ``batch.write_slots`` are written.

        Returns:
            float32 logits ``[S, vocab_size]`` for ``batch.output_rows``
            (``S`` may be 0: no LM head runs). The hidden states
            ``batch.hidden`` asks for are stored in it as the layers pass
            (:class:`~tartlet.engine.core.hidden_states.HiddenCapture`).
        """
        x = self.embed_rows(batch)
        x = self.run_layers(x, batch, self.attention.prepare(batch, k_cache), k_cache, v_cache)
        return self.head(x, batch)

    def run_layers(self, x: torch.Tensor, batch: BatchInputs, att: AttentionPass, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        """Every layer over ``x`` ``[T, H]`` (the embeddings), op by op, with
        ``att`` (:meth:`Attention.prepare` of this batch and pool) for RoPE,
        the KV writes and attention; returns the last layer's output ``[T,
        H]``, keeping the hidden states ``batch.hidden`` asks for."""
        c = self.config
        nh, nkv, hd = self.nh, self.nkv, self.hd
        T = x.shape[0]
        hid = batch.hidden  # hidden states to keep (hidden_states.py), or None
        attn_out = torch.empty(T, nh * hd, dtype=self.dtype, device=self.device)
        lora = batch.lora

        def proj(i: int, key: str, inp: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            # the base projection over every row, then each adapter's update of its rows (lora.py)
            y = cast(Projection, self.layers[i][key])(inp, residual=residual)  # type: ignore[literal-required]  # a PROJECTIONS key
            if lora is not None:
                lora.add(y, inp, i, key)
            return y

        for i, (layer, kc, vc) in enumerate(zip(self.layers, k_cache.unbind(0), v_cache.unbind(0))):
            qkv = proj(i, "qkv", self._rms_norm(x, layer["ln1"]))
            if c.qk_norm:  # per-head RMSNorm of queries and keys, in place, before RoPE
                eps = c.rms_norm_eps
                qh = qkv[:, : nh * hd].view(T, nh, hd)
                kh = qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)
                qh.copy_(F.rms_norm(qh, (hd,), layer["q_norm"], eps))
                kh.copy_(F.rms_norm(kh, (hd,), layer["k_norm"], eps))
            q = att.rope_store(i, qkv, kc, vc)
            att.attend(i, q, kc, vc, attn_out)
            if c.gemma_norms:  # norms after attention and MLP too, before each residual add
                x = x + self._rms_norm(proj(i, "o", attn_out), layer["post_attn"])
                gate, up = proj(i, "gate_up", self._rms_norm(x, layer["ln2"])).chunk(2, dim=-1)
                x = x + self._rms_norm(proj(i, "down", self.act(gate).mul_(up)), layer["post_ff"])
            elif "moe" in layer:  # sparse MoE layer (moe.py)
                x = proj(i, "o", attn_out, residual=x)
                x = layer["moe"](self._rms_norm(x, layer["ln2"]), residual=x)
            else:
                x = proj(i, "o", attn_out, residual=x)
                gate, up = proj(i, "gate_up", self._rms_norm(x, layer["ln2"])).chunk(2, dim=-1)
                x = proj(i, "down", self.act(gate).mul_(up), residual=x)
            if hid is not None:
                self.keep_hidden(hid, i, x)
        return x

    def head(self, x: torch.Tensor, batch: BatchInputs) -> torch.Tensor:
        """Float32 logits ``[S, vocab_size]`` of ``batch.output_rows`` of the
        last layer's output ``x`` ``[T, H]``: final norm, LM head, Gemma 2's
        final soft-capping ``c * tanh(logits / c)``. ``S`` may be 0 (hidden
        states only): no LM head runs."""
        if batch.output_rows.shape[0] == 0:
            return torch.empty(0, self.lm_head.out_features, dtype=torch.float32, device=self.device)
        h = self._rms_norm(x.index_select(0, batch.output_rows), self.norm)
        logits = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

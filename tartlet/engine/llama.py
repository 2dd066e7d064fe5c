"""Llama-family decoder (Llama, SmolLM, Qwen2) over a paged KV cache.

The math follows Hugging Face ``modeling_llama.py``: RMSNorm (Zhang &
Sennrich, 2019), rotary position embeddings in the ``rotate_half`` layout (Su
et al., 2021), grouped-query attention (Ainslie et al., 2023), SwiGLU MLP
(Shazeer, 2020), optional QKV bias (Qwen2), tied embeddings. It differs in
execution only: one call runs a ragged batch of many sequences, reads and
writes K/V in the page pool, and computes logits just for the rows asked for.
Q/K/V and gate/up projections are fused into one matrix each, so a layer costs
four matrix multiplications; weights are stored transposed (``[in, out]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .batch import AttentionGroup, BatchInputs
from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, float32 ``[head_dim // 2]``.

    ``inv_freq[i] = theta ** (-2i / head_dim)``; ``rope_scaling`` of type
    ``linear`` divides them by ``factor``; type ``llama3`` applies the
    wavelength-dependent smoothing of Llama 3.1 (as in HF
    ``_compute_llama3_parameters``).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = config.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old_ctx / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv.to(torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaModel:
    """Inference-only Llama-family model.

    Args:
        config: architecture.
        weights: Hugging Face-named tensors (``model.layers.{i}.self_attn.q_proj.weight``
            ... ``[out, in]``), as produced by :func:`tartlet.engine.loader.load_model`.
            Consumed: projections are fused and the dict is not kept.
        dtype: compute dtype (float32 or bfloat16); logits are float32.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def w(name: str) -> torch.Tensor:
            try:
                return weights[name].to(device=self.device, dtype=dtype).contiguous()
            except KeyError:
                raise ValueError(f"model weights lack tensor {name!r}") from None

        def wt(*names: str) -> torch.Tensor:
            # [in, out] layout: on CPU, x @ W_t streams the weight rows in
            # order and runs ~1.4x faster than F.linear for 1-2 rows (decode);
            # larger batches run at the same speed either way.
            return torch.cat([w(n) for n in names]).t().contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        # A second, transposed copy of the output projection (vocab x H floats)
        # halves the logits time of small decode batches; big ones use lm_head.
        self.lm_head_t = self.lm_head.t().contiguous()
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"]) if c.attention_bias else None
            self.layers.append(
                dict(
                    ln1=w(p + "input_layernorm.weight"),
                    qkv=wt(*qkv),
                    qkv_bias=bias,
                    o=wt(p + "self_attn.o_proj.weight"),
                    ln2=w(p + "post_attention_layernorm.weight"),
                    gate_up=wt(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=wt(p + "mlp.down_proj.weight"),
                )
            )
        weights.clear()
        self.inv_freq = rope_inv_freq(c).to(self.device)
        self.scale = 1.0 / math.sqrt(self.hd)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _attend(self, q: torch.Tensor, out: torch.Tensor, g: AttentionGroup, kc: torch.Tensor, vc: torch.Tensor) -> None:
        B, L = g.kv_slots.shape
        Q = g.num_queries
        if g.rows is None:
            qg = q[g.row_start : g.row_start + Q].unsqueeze(0)
        else:
            qg = q.index_select(0, g.rows).view(B, Q, self.nh, self.hd)
        flat = g.kv_slots.view(-1)
        k = kc.index_select(0, flat).view(B, L, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, L, hd]
        v = vc.index_select(0, flat).view(B, L, self.nkv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2),
            k,
            v,
            attn_mask=None if g.mask is None else g.mask.unsqueeze(1),
            is_causal=g.mask is None,
            scale=self.scale,
            enable_gqa=self.nkv != self.nh,
        )
        o = o.transpose(1, 2).reshape(B * Q, self.nh * self.hd)
        if g.rows is None:
            out[g.row_start : g.row_start + Q] = o
        else:
            out.index_copy_(0, g.rows, o)

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Run one ragged batch.

        Args:
            batch: flat inputs, ``T`` rows.
            k_cache, v_cache: the pool's ``[num_layers, slots, num_kv_heads,
                head_dim]`` tensors; rows ``batch.write_slots`` are written.

        Returns:
            float32 logits ``[S, vocab_size]`` for ``batch.output_rows``.
        """
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = self.embed.index_select(0, batch.input_ids)
        freqs = batch.positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]
        T = x.shape[0]
        attn_out = torch.empty(T, nh * hd, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["ln1"])
            qkv = h @ layer["qkv"] if layer["qkv_bias"] is None else torch.addmm(layer["qkv_bias"], h, layer["qkv"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = q.view(T, nh, hd)
            k = k.view(T, nkv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = k_cache[i], v_cache[i]
            kc.index_copy_(0, batch.write_slots, k.to(kc.dtype))
            vc.index_copy_(0, batch.write_slots, v.view(T, nkv, hd).to(vc.dtype))
            for g in batch.groups:
                self._attend(q, attn_out, g, kc, vc)
            x = x + attn_out @ layer["o"]
            h = self._rms_norm(x, layer["ln2"])
            gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        h = self._rms_norm(x.index_select(0, batch.output_rows), self.norm)
        logits = h @ self.lm_head_t if h.shape[0] <= 2 else F.linear(h, self.lm_head)
        return logits.float()

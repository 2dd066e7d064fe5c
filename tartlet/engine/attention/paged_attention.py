"""Attention over the page pool, by one of three paths behind one interface.

:class:`Attention` is built once per model from its shape; each model call
asks it for an :class:`AttentionPass` over the call's batch, which prepares
what every layer shares once (RoPE tables, each group's plan and additive
mask, sliding-window cuts, the probe's buffers) and then, per layer:

* :meth:`AttentionPass.rope_store` rotates the queries and keys (RoPE, Su et
  al., 2021, ``rotate_half`` layout as Hugging Face's ``modeling_llama.py``)
  and writes keys and values into the layer's pages;
* :meth:`AttentionPass.attend` runs each attention group of the layer.

The path is chosen per pass from the model's device and dtype and the pool's
dtype, and per group from its shape:

* **C** (CPU, float32 model, a float32, float16 or int8 pool:
  :mod:`tartlet.engine.kernels.cpu_kernels`): RoPE + KV write in one kernel;
  attention row by row (decode rows, and prefill groups query by query up
  to :data:`.plan.ROW_ATTENTION_MAX_SCORES` scores per request), the rest
  by SDPA;
* **Triton** (CUDA, the pool in the compute dtype, no soft-capping:
  :mod:`tartlet.engine.cuda`): RoPE + KV write in one kernel, decode groups
  by the paged decode kernel, the rest by SDPA;
* **PyTorch**: RoPE as tensor ops, ``index_copy_`` into the pool (int8 rows
  quantized, :mod:`tartlet.engine.core.kv_quant`), SDPA over the gathered
  keys and values.

Groups whose weights are needed (Gemma 2's soft-capping, the attention
probe) take :func:`.explicit.explicit_attention` instead of SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.attention_probe import ProbeBuffer
from ..core.batch import AttentionGroup, BatchInputs
from ..core.kv_quant import from_pool, to_pool
from ..cuda import attention as cuda_attention
from ..cuda import rope as cuda_rope
from ..kernels.cpu_kernels import POOL_DTYPES, CpuKernels
from ..models.rope import Rotary
from .explicit import explicit_attention
from .plan import GroupPlan, row_attention


class Attention:
    """The attention of one model's layers (see the module docstring).

    Args:
        num_heads, num_kv_heads, head_dim: query heads, KV heads (grouped-query
            attention, Ainslie et al., 2023) and their width.
        scale: the scores' factor (``head_dim ** -0.5``, or Gemma's
            ``query_pre_attn_scalar ** -0.5``).
        dtype, device: the model's compute dtype and device.
        windows: each layer's sliding window in tokens, or None (global).
        layer_rope: each layer's RoPE angles.
        softcap: Gemma 2's attention soft-capping ``c`` (scores become ``c *
            tanh(s / c)`` before the mask), or None.
        kernels: the float32 C kernels, or None.
        cuda_decode: whether the Triton kernels run (CUDA, Triton available).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype, device: torch.device,
        windows: list[int | None], layer_rope: list[Rotary], softcap: float | None, kernels: CpuKernels | None,
        cuda_decode: bool,
    ) -> None:
        self.nh, self.nkv, self.hd = num_heads, num_kv_heads, head_dim
        self.scale, self.dtype, self.device = scale, dtype, device
        self.windows, self.layer_rope, self.softcap = windows, layer_rope, softcap
        self.kernels, self.cuda_decode = kernels, cuda_decode

    def prepare(self, batch: BatchInputs, k_cache: torch.Tensor) -> "AttentionPass":
        """What the layers of one call over ``batch`` share.

        Args:
            batch: the call's inputs (``T`` rows, its attention groups).
            k_cache: the pool's keys ``[num_layers, slots, num_kv_heads,
                head_dim]`` (``head_dim + 4`` for int8): its dtype picks the
                C path or the PyTorch one on the CPU.

        Raises:
            ValueError: a sliding-window model's group lacks its token
                indexes (``AttentionGroup.q_index``/``kv_index``).
        """
        return AttentionPass(self, batch, k_cache)

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, Q, L]`` (True = may attend) as a float ``[B, 1, Q, L]``
        additive mask in the model's dtype (0 or -inf): SDPA would otherwise
        convert it in every layer."""
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf")).unsqueeze(1)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[T, heads, head_dim]`` in the
        ``rotate_half`` layout: ``x * cos + rotate_half(x) * sin``, with
        ``rotate_half(x) = cat(-x2, x1)`` written as a roll of the halves
        times ``sin`` with its first half negated (``sin`` arrives so)."""
        return torch.addcmul(x * cos, x.roll(self.hd // 2, -1), sin)

    def window_group(self, g: AttentionGroup, window: int) -> AttentionGroup:
        """Group ``g`` as a sliding layer of ``window`` tokens sees it: its
        mask narrowed to ``kv_index > q_index - window`` (HF
        ``sliding_window_overlay``), and its KV columns cut to those some
        query of their row still sees, so attention costs ``O(window)``
        per query instead of ``O(L)`` (kept columns in their order, rows
        padded to the longest with masked columns): ``kv_slots`` and
        ``kv_index`` become ``[B, L']``, ``mask`` ``[B, Q, L']`` with ``L'
        <= L``, or ``None`` when ``Q == 1`` and every column is visible.
        Returns ``g`` itself when no key of the group is that far back.

        Raises:
            ValueError: ``g`` lacks ``q_index``/``kv_index``.
        """
        if g.q_index is None or g.kv_index is None:
            raise ValueError("a sliding-window model needs the token indexes of each attention group")
        if int((g.q_index.amax(1) - g.kv_index.amin(1)).max()) < window:
            return g
        qi, ki = g.q_index[:, :, None], g.kv_index[:, None, :]
        base = (ki <= qi) if g.mask is None else g.mask
        mask = base & (ki > qi - window)
        keep = mask.any(1)  # [B, L]: columns some query of the row sees
        B, L = g.kv_slots.shape
        width = int(keep.sum(1).max())
        kv_slots, kv_index = g.kv_slots, g.kv_index
        if width < L:
            cols = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)[:, :width]  # kept columns first
            kv_slots, kv_index = kv_slots.gather(1, cols), kv_index.gather(1, cols)
            mask = mask.gather(2, cols[:, None, :].expand(B, g.num_queries, width))
        visible = None if g.num_queries == 1 and bool(mask.all()) else mask
        return AttentionGroup(g.rows, g.row_start, g.num_queries, kv_slots.contiguous(), visible, g.q_index, kv_index, g.probe)

    def sdpa(
        self, q: torch.Tensor, out: torch.Tensor, g: AttentionGroup, bias: torch.Tensor | None, kc: torch.Tensor, vc: torch.Tensor,
        probe: torch.Tensor | None = None,
    ) -> None:
        """Attention of one group's queries over its KV slots by PyTorch,
        written into its rows of ``out`` ``[T, heads * head_dim]``: SDPA, or
        the explicit weights (:func:`.explicit.explicit_attention`) with
        soft-capping or a probe. ``bias`` is the group's mask as an additive
        ``[B, 1, Q, L]`` float mask (0 or -inf); ``probe`` (float32 ``[B,
        heads, L]``) receives the weights reduced over each request's
        queries (``g.probe``)."""
        B, L = g.kv_slots.shape
        Q = g.num_queries
        nh, nkv, hd = self.nh, self.nkv, self.hd
        if g.rows is None:
            qg = q[g.row_start : g.row_start + B * Q].view(B, Q, nh, hd)
        else:
            qg = q.index_select(0, g.rows).view(B, Q, nh, hd)
        flat = g.kv_slots.view(-1)
        # [B, nkv, L, hd]; int8 rows are dequantized here (kv_quant.py)
        k = from_pool(kc.index_select(0, flat), self.dtype).view(B, L, nkv, hd).transpose(1, 2)
        v = from_pool(vc.index_select(0, flat), self.dtype).view(B, L, nkv, hd).transpose(1, 2)
        if self.softcap is None and probe is None:
            o = F.scaled_dot_product_attention(
                qg.transpose(1, 2), k, v, attn_mask=bias, is_causal=bias is None and Q > 1, scale=self.scale, enable_gqa=nkv != nh,
            )
        else:  # Gemma 2: scores soft-capped before the mask (HF eager_attention_forward of modeling_gemma2.py); the probe
            o = explicit_attention(qg.transpose(1, 2), k, v, bias, self.scale, self.softcap, probe, g.probe or "sum")
        o = o.transpose(1, 2).reshape(B * Q, nh * hd)
        if g.rows is None:
            out[g.row_start : g.row_start + B * Q] = o
        else:
            out.index_copy_(0, g.rows, o)


class AttentionPass:
    """One model call's attention (see :meth:`Attention.prepare`).

    Attributes:
        kern: the C kernels when this pass takes the C path, else None.
        triton: whether this pass takes the Triton path.
        ropes: per distinct :class:`~tartlet.engine.models.rope.Rotary`,
            its ``(cos, sin)`` for the batch's positions: ``[T, head_dim /
            2]`` for the kernels, ``[T, 1, head_dim]`` (``sin``'s first half
            negated) for PyTorch.
        plans: per distinct window (None: global layers), the
            :class:`~.plan.GroupPlan` of every group of the batch, in
            ``batch.groups`` order (sliding layers' groups cut to their
            window).
        probes: the attention probe's buffers by ``(window, id(group))``
            (:mod:`tartlet.engine.core.attention_probe`), empty without one.
    """

    def __init__(self, att: Attention, batch: BatchInputs, k_cache: torch.Tensor) -> None:
        self.att = att
        self.write_slots = batch.write_slots
        # the C kernels read and write float32, float16 and int8 pages (kv_quant.py); a bfloat16 pool takes the PyTorch path
        self.kern = att.kernels if k_cache.dtype in POOL_DTYPES else None
        # on CUDA the Triton kernels (RoPE + KV write, decode attention) run when the pool holds the compute dtype
        self.triton = att.cuda_decode and k_cache.dtype == att.dtype
        self.ropes: dict[Rotary, tuple[torch.Tensor, torch.Tensor]] = {}
        for rot in dict.fromkeys(att.layer_rope):
            cos, sin = rot.cos_sin(batch.positions)
            if self.kern is None and not self.triton:  # [T, 1, hd], sin's first half negated (see Attention.rope)
                cos, sin = cos.repeat(1, 2).to(att.dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(att.dtype)[:, None, :]
            self.ropes[rot] = (cos, sin)  # else [T, hd / 2] for the kernels
        # once per pass, not per layer: additive masks (as [B, L] rows for the C kernel); sliding layers get their own
        self.plans: dict[int | None, list[GroupPlan]] = {}
        if None in att.windows:
            self.plans[None] = [self._plan(g) for g in batch.groups]
        for win in {w for w in att.windows if w is not None}:  # groups cut to the window's columns
            self.plans[win] = [self._plan(att.window_group(g, win)) for g in batch.groups]
        # Triton decode groups: rows, lengths and [B, L] mask, per group object; a probed group: explicit weights
        self._cuda = {}
        if self.triton:
            self._cuda = {id(p.group): cuda_attention.decode_plan(p.group) for ps in self.plans.values() for p in ps
                          if p.group.num_queries == 1 and p.group.probe is None}
        self.probes: dict[tuple[int | None, int], ProbeBuffer] = (
            {} if batch.probe is None else batch.probe.allocate(self.plans, att.windows, att.nh, att.device))

    def _plan(self, g: AttentionGroup) -> GroupPlan:
        """Group ``g``'s plan: its additive mask, and whether (and with which
        rows) the C kernel runs it."""
        att = self.att
        bias = None if g.mask is None else att.additive(g.mask)
        B, L = g.kv_slots.shape
        Q = g.num_queries
        by_kernel = self.kern is not None and att.softcap is None and row_attention(g)  # the C kernel does not soft-cap
        if not by_kernel or Q == 1:
            rows_bias = None if bias is None or not by_kernel else bias.view(B, L)
            return GroupPlan(g, bias, by_kernel, g.kv_slots, rows_bias)
        # a prefill group query by query: row b * Q + i is query i of request b
        if bias is None:  # plain causal over exactly L == Q fresh tokens
            rows_bias = torch.full((Q, L), float("-inf"), dtype=att.dtype).triu_(1).repeat(B, 1)
        else:
            rows_bias = bias.reshape(B * Q, L).contiguous()
        return GroupPlan(g, bias, True, g.kv_slots.repeat_interleave(Q, 0), rows_bias)

    def rope_store(self, i: int, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s RoPE and KV write.

        Args:
            i: the layer.
            qkv: the fused projection's output ``[T, (nh + 2 nkv) * hd]``
                (queries, keys, values), after any QK-norm.
            kc, vc: the layer's pool pages ``[slots, nkv, hd]`` (int8:
                ``hd + 4``); rows ``batch.write_slots`` are written.

        Returns:
            The rotated queries ``[T, nh, hd]`` (a view or a new tensor).
        """
        att = self.att
        nh, nkv, hd = att.nh, att.nkv, att.hd
        cos, sin = self.ropes[att.layer_rope[i]]
        if self.triton:
            return cuda_rope.rope_qkv_store(qkv, cos, sin, kc, vc, self.write_slots, nh, nkv, hd)
        if self.kern is not None:
            return self.kern.rope_qkv_store(qkv, cos, sin, kc, vc, self.write_slots, nh, nkv, hd)
        T = qkv.shape[0]
        qk = att.rope(qkv[:, : (nh + nkv) * hd].view(T, nh + nkv, hd), cos, sin)  # queries and keys at once
        kc.index_copy_(0, self.write_slots, to_pool(qk[:, nh:], kc.dtype))
        vc.index_copy_(0, self.write_slots, to_pool(qkv[:, (nh + nkv) * hd :].view(T, nkv, hd), vc.dtype))
        return qk[:, :nh]

    def attend(self, i: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, out: torch.Tensor) -> None:
        """Layer ``i``'s attention: every group's queries of ``q`` ``[T, nh,
        hd]`` over its KV slots of ``kc``/``vc``, written into its rows of
        ``out`` ``[T, nh * hd]`` (and the probe's buffer of the layer, for
        probed groups)."""
        att = self.att
        win = att.windows[i]
        for plan in self.plans[win]:
            g = plan.group
            pb = self.probes.get((win, id(g))) if self.probes else None
            pr = None if pb is None else pb.at(i)  # this layer's probe buffer of the group
            if plan.by_kernel and self.kern is not None:  # by_kernel: kern is not None
                self.kern.paged_decode_attention(q, kc, vc, plan.slots, plan.rows_bias, g.rows, g.row_start, out, att.scale, pr)
            elif id(g) in self._cuda:
                rows, lens, mask2d = self._cuda[id(g)]
                cuda_attention.paged_decode_attention(q, kc, vc, g.kv_slots, lens, mask2d, rows, out, att.scale)
            else:
                att.sdpa(q, out, g, plan.bias, kc, vc, pr)

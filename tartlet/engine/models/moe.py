"""The sparse mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE).

One block replaces a decoder layer's MLP on the layers
:meth:`~tartlet.engine.models.config.ModelConfig.is_sparse_layer` names. For each
input row ``x`` (``[H]``, after the layer's ``post_attention_layernorm``):

1. router logits ``r = W_r x`` (``W_r``: ``[E, H]``, HF ``mlp.gate``), ``p =
   softmax(r)`` in float32;
2. the ``k`` largest ``p_e`` (``torch.topk``) are the row's experts; with
   ``norm_topk_prob`` their weights are divided by their sum, else they stay
   the raw softmax probabilities;
3. ``y = sum_e p_e * down_e(act(gate_e x) * up_e x)`` over those experts
   (each expert a SwiGLU MLP of width ``moe_intermediate_size``);
4. with a shared expert (Qwen2-MoE): ``y += sigmoid(w_s . x) *
   shared(x)``, ``shared`` a SwiGLU MLP of width
   ``shared_expert_intermediate_size`` and ``w_s`` ``[1, H]``
   (HF ``mlp.shared_expert_gate``).

Sources, transformers 5.x: ``modeling_mixtral.py`` (``MixtralTopKRouter``:
softmax, top-k, always renormalised; ``MixtralExperts``),
``modeling_qwen2_moe.py`` (``Qwen2MoeTopKRouter`` renormalises only with
``norm_topk_prob``, default False; ``Qwen2MoeSparseMoeBlock``: shared expert
with a sigmoid gate) and ``modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``,
same rule as Qwen2-MoE, no shared expert). llama.cpp's graphs
(``build_moe_ffn`` in ``src/models/{llama,qwen2moe,qwen3moe}.cpp``) agree,
with weights renormalised for ``llama`` (Mixtral) and ``qwen3moe`` and not
for ``qwen2moe``.

Dispatch is batched: the batch's ``T * k`` (row, expert) pairs are sorted by
expert, and each expert that received rows runs once over all of them (one
fused gate/up and one down projection), its weighted output added back into
those rows with ``index_add_``. An expert no row chose costs nothing.
Projections are :class:`~tartlet.engine.models.linear.Linear` (float) or
:class:`~tartlet.engine.models.quant_linear.QuantLinear` (quantized GGUF experts,
each over its own rows of the file's 3-D expert tensor: no float copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from .config import ModelConfig

if TYPE_CHECKING:
    from ..loading.quant_formats import QuantWeight

Projection = Callable[..., torch.Tensor]


class SparseMoe:
    """One layer's sparse MoE block, ready to run.

    Args:
        router: ``[E, H]`` router weight in the compute dtype (HF ``mlp.gate.weight``).
        experts: per expert ``(gate_up, down)``: ``gate_up`` maps ``[n, H]`` to
            ``[n, 2 I]`` (gate rows first, then up), ``down`` ``[n, I]`` to
            ``[n, H]``; each a :class:`Linear` or :class:`QuantLinear`.
        top_k: experts per row (HF ``num_experts_per_tok``).
        norm_topk_prob: renormalise the ``top_k`` weights to sum to 1.
        act: the gate activation (``F.silu`` for every MoE family here).
        shared: ``(gate_up, down, gate)`` of the shared expert, ``gate`` its
            ``[1, H]`` sigmoid-gate weight, or ``None``.

    Raises:
        ValueError: ``top_k`` not in ``[1, E]``, or the router has not ``E`` rows.
    """

    def __init__(
        self,
        router: torch.Tensor,
        experts: list[tuple[Projection, Projection]],
        top_k: int,
        norm_topk_prob: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
        shared: tuple[Projection, Projection, torch.Tensor] | None = None,
    ) -> None:
        if router.dim() != 2 or router.shape[0] != len(experts):
            raise ValueError(f"router of shape {tuple(router.shape)} does not route to {len(experts)} experts")
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"top_k must be in [1, {len(experts)}], got {top_k}")
        self.router = router
        self.experts = experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = act
        self.shared = shared

    @property
    def num_experts(self) -> int:
        """``E``."""
        return len(self.experts)

    def parts(self) -> Iterator[object]:
        """Every weight object held (router, projections, shared gate), for memory reports."""
        yield self.router
        for gate_up, down in self.experts:
            yield gate_up
            yield down
        if self.shared is not None:
            yield from self.shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts of each row and their weights.

        Args:
            x: ``[T, H]`` in the compute dtype.

        Returns:
            ``(weights, experts)``: float32 ``[T, k]`` and int64 ``[T, k]``,
            experts in decreasing probability (``torch.topk`` order).
        """
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for ``x``, plus ``residual`` when given.

        Args:
            x: ``[T, H]`` (normalised hidden states), compute dtype, rows contiguous.
            residual: optional ``[T, H]`` added to the result.

        Returns:
            ``[T, H]``, a new tensor.
        """
        T = x.shape[0]
        weights, chosen = self.route(x)
        flat = chosen.view(-1)  # pair j = row j // k, its (j % k)-th choice
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pair_weights = weights.view(-1).to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):  # experts in increasing index, as HF's MixtralExperts loop
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            rows = torch.div(pairs, self.top_k, rounding_mode="floor")
            gate_up, down = self.experts[e]
            h = x if n == T else x.index_select(0, rows)  # every row (in order: the sort is stable)
            gate, up = gate_up(h).chunk(2, dim=-1)
            y = down(self.act(gate).mul_(up))
            out.index_add_(0, rows, y.mul_(pair_weights.index_select(0, pairs).unsqueeze(1)))
        if self.shared is not None:
            gate_up, down, shared_gate = self.shared
            gate, up = gate_up(x).chunk(2, dim=-1)
            s = down(self.act(gate).mul_(up))
            out.add_(s.mul_(torch.sigmoid(F.linear(x, shared_gate))))
        return out if residual is None else out.add_(residual)


def build_sparse_moe(
    config: ModelConfig,
    prefix: str,
    weights: dict[str, torch.Tensor | QuantWeight],
    linear: Callable[..., Projection],
    dense: Callable[[str], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> SparseMoe:
    """Build the MoE block of one layer from Hugging Face-named weights.

    Args:
        config: the model (``num_experts``, ``num_experts_per_tok``,
            ``norm_topk_prob``, ``shared_expert_intermediate_size``).
        prefix: the layer's name prefix, ``"model.layers.{i}."``.
        weights: the loader's dict (see :mod:`tartlet.engine.loading.loader`):
            ``mlp.gate.weight`` ``[E, H]``, ``mlp.experts.{j}.{gate,up,down}_proj.weight``
            and, with a shared expert, ``mlp.shared_expert.{gate,up,down}_proj.weight``
            and ``mlp.shared_expert_gate.weight`` ``[1, H]``. The layer's
            entries are removed as they are built, so a file's expert tensor
            is released layer by layer.
        linear: ``linear(*names, copy=...)`` -> one projection over the
            named matrices stacked along outputs (the model's own builder).
        dense: ``dense(name)`` -> the named tensor as a float tensor of the
            compute dtype (quantized ones dequantized).
        act: the gate activation.

    Raises:
        ValueError: a weight is missing (named in the message).
    """
    p = prefix + "mlp."

    def take(*names: str) -> None:
        for n in names:
            weights.pop(n, None)

    experts = []
    for j in range(config.num_experts):
        e = f"{p}experts.{j}."
        # no GEMV copy: experts are most of an MoE model's weights, and a second copy would double them
        experts.append((linear(e + "gate_proj.weight", e + "up_proj.weight", copy=False),
                        linear(e + "down_proj.weight", copy=False)))
        take(e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight")
    router = dense(p + "gate.weight")
    take(p + "gate.weight")
    shared = None
    if config.shared_expert_intermediate_size:
        s = p + "shared_expert."
        shared = (linear(s + "gate_proj.weight", s + "up_proj.weight"), linear(s + "down_proj.weight"),
                  dense(p + "shared_expert_gate.weight").reshape(1, -1))
        take(s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight", p + "shared_expert_gate.weight")
    return SparseMoe(router, experts, config.num_experts_per_tok, config.norm_topk_prob, act, shared)

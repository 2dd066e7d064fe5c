"""Rotary position embeddings (Su et al., 2021, "RoFormer") and their context-extension variants.

A :class:`Rotary` turns token positions into the per-token angles' ``cos``
and ``sin`` that the decoder applies in Hugging Face's ``rotate_half``
layout. The frequencies follow ``transformers/modeling_rope_utils.py``
(``ROPE_INIT_FUNCTIONS``) for every ``rope_type`` we accept:

* ``default``: ``inv_freq[i] = theta ** (-2i / d)``.
* ``linear`` (Chen et al., 2023, position interpolation): ``inv_freq / factor``.
* ``llama3``: Llama 3.1's wavelength-dependent smoothing
  (``_compute_llama3_parameters``).
* ``yarn`` (Peng et al., 2023, arXiv:2309.00071): interpolated and
  extrapolated frequencies blended by a linear ramp over the dimensions, and
  ``cos``/``sin`` scaled by the attention factor ``0.1 ln(factor) + 1``
  (``_compute_yarn_parameters``).
* ``longrope`` (alias ``su``; Ding et al., 2024, LongRoPE; Phi-3): per-dimension
  ``short_factor`` or ``long_factor`` divide the frequencies and ``cos``/``sin``
  are scaled by ``sqrt(1 + ln(factor) / ln(original_max))``
  (``_compute_longrope_parameters``).
* ``dynamic`` (dynamic NTK): ``theta`` grows with the sequence length once it
  passes ``max_position_embeddings`` (``_compute_dynamic_ntk_parameters``).
* ``freq_factors`` (ours, from GGUF files): ``inv_freq / freq_factors[i]``,
  llama.cpp's ``rope_freqs`` tensor (how its converter stores ``llama3``
  scaling; ``ggml_rope_ext``'s ``freq_factors``).

Where transformers picks frequencies per forward call from the largest
position in the batch (``longrope``, ``dynamic``; see its
``dynamic_rope_update``), we pick them per token from that token's own
position, as vLLM does: the same result as transformers for every position
below the original context length, and batch-independent beyond it (where
transformers' own result depends on what else is in the batch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su", "dynamic", "freq_factors")


def _base_inv_freq(theta: float, d: int) -> torch.Tensor:
    """``theta ** (-2i / d)`` for ``i < d / 2``, float64 ``[d / 2]``."""
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def _llama3(inv: torch.Tensor, sc: dict[str, Any]) -> torch.Tensor:
    factor = float(sc["factor"])
    low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wl = 2 * math.pi / inv
    scaled = torch.where(wl > low_wl, inv / factor, inv)
    smooth = (old_ctx / wl - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wl >= high_wl) & (wl <= low_wl)
    return torch.where(is_mid, mid, scaled)


def _yarn(theta: float, d: int, sc: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = int(sc.get("original_max_position_embeddings") or max_pos)
    factor = sc.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = sc.get("attention_factor")
    if attn is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra = _base_inv_freq(theta, d)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return extra / factor * (1 - keep) + extra * keep, float(attn)


class Rotary:
    """The RoPE angles of one rotary configuration.

    Args:
        head_dim: rotated width ``d`` (the whole head).
        theta: base frequency.
        scaling: Hugging Face ``rope_scaling`` / ``rope_parameters`` dict
            (``rope_type`` or ``type``; ``factor`` ...), or ``None``.
        max_position_embeddings: the model's context length (``yarn`` and
            ``longrope`` derive ``factor`` from it when absent; ``dynamic``
            starts scaling past it).

    Raises:
        ValueError: a ``rope_type`` not in :data:`SUPPORTED_ROPE_TYPES`, or a
            ``longrope`` without its factor lists.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int):
        d = head_dim
        sc = dict(scaling or {})
        kind = sc.get("rope_type", sc.get("type", "default"))
        self.kind = kind
        self.attention_factor = 1.0  # multiplies cos and sin (yarn, longrope)
        self.long_inv_freq: torch.Tensor | None = None  # longrope: frequencies from `threshold` on
        self.threshold = 0  # first position that uses long_inv_freq (longrope) or a grown theta (dynamic)
        self.theta, self.d, self.max_pos = float(theta), d, int(max_position_embeddings)
        inv = _base_inv_freq(theta, d)
        if kind == "default":
            pass
        elif kind == "linear":
            inv = inv / float(sc["factor"])
        elif kind == "llama3":
            inv = _llama3(inv, sc)
        elif kind == "yarn":
            inv, self.attention_factor = _yarn(theta, d, sc, self.max_pos)
        elif kind in ("longrope", "su"):
            orig = int(sc.get("original_max_position_embeddings") or self.max_pos)
            try:
                short = torch.tensor(sc["short_factor"], dtype=torch.float64)
                long = torch.tensor(sc["long_factor"], dtype=torch.float64)
            except KeyError as e:
                raise ValueError(f"longrope scaling lacks {e.args[0]!r}") from None
            if short.shape != inv.shape or long.shape != inv.shape:
                raise ValueError(f"longrope factors have {short.numel()}/{long.numel()} entries, expected {inv.numel()}")
            factor = sc.get("factor")
            factor = float(factor) if factor is not None else self.max_pos / orig
            attn = sc.get("attention_factor")
            if attn is None:
                attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
            self.attention_factor = float(attn)
            self.long_inv_freq = (inv / long).to(torch.float32)
            self.threshold = orig
            inv = inv / short
        elif kind == "freq_factors":
            ff = torch.tensor(sc["freq_factors"], dtype=torch.float64)
            if ff.shape != inv.shape:
                raise ValueError(f"rope_freqs has {ff.numel()} entries, expected {inv.numel()}")
            inv = inv / ff
        elif kind == "dynamic":
            self.factor = float(sc["factor"])
            self.threshold = self.max_pos
        else:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        self.inv_freq = inv.to(torch.float32)
        #: CPU cos and sin tables of positions [0, 2^k) (see cos_sin), or None
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device) -> "Rotary":
        """Move the frequency tables to ``device``; returns ``self``."""
        self.inv_freq = self.inv_freq.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        return self

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` int64 ``[T]`` -> angles float32 ``[T, d / 2]``
        (``position * inv_freq``, each token's frequencies per its position)."""
        p = positions.to(torch.float32)[:, None]
        if self.long_inv_freq is not None:  # longrope: short factors below the original context, long from it on
            far = (positions >= self.threshold)[:, None]
            return p * torch.where(far, self.long_inv_freq[None, :], self.inv_freq[None, :])
        if self.kind == "dynamic" and bool((positions >= self.threshold).any()):
            # theta' = theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2)), L = position + 1 (at least max_pos)
            L = (positions.to(torch.float64) + 1).clamp(min=self.max_pos)[:, None]
            theta = self.theta * (self.factor * L / self.max_pos - (self.factor - 1)) ** (self.d / (self.d - 2))
            exps = torch.arange(0, self.d, 2, dtype=torch.float64, device=positions.device) / self.d
            return (p.double() / theta**exps).to(torch.float32)
        return p * self.inv_freq[None, :]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` float32 ``[T, d / 2]`` of each token's angles,
        times the attention factor (yarn, longrope; 1 otherwise).

        On CPU, where a position's angles depend on it alone (every kind
        but ``dynamic``), rows of tables computed once for positions ``[0,
        2^k)`` (grown on demand): the same values bit for bit (the same
        elementwise ops on each position), two lookups instead of five ops
        a decode step."""
        if positions.is_cpu and self.kind != "dynamic" and positions.numel():
            tab = self._tables
            try:
                if tab is not None:
                    return tab[0].index_select(0, positions), tab[1].index_select(0, positions)
            except IndexError:  # a position past the tables: grow them below
                pass
            n = 1 << max(10, int(positions.max()).bit_length())
            self._tables = self._cos_sin(torch.arange(n))
            return self._tables[0].index_select(0, positions), self._tables[1].index_select(0, positions)
        return self._cos_sin(positions)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.angles(positions)
        cos, sin = a.cos(), a.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def rope_inv_freq(config: Any) -> torch.Tensor:
    """Inverse RoPE frequencies of ``config`` (a :class:`~tartlet.engine.models.config.ModelConfig`),
    float32 ``[head_dim // 2]`` (for ``longrope``: the short factors').

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    return Rotary(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings).inv_freq

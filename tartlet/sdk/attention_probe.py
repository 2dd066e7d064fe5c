"""The attention-score probe of a forward pass: which KV positions the
model's attention reads.

Put an :class:`AttentionProbe` (or :func:`tartlet.forward.attention_scores`)
in the ``outputs`` of :meth:`Context.forward`; its result, at the same
place in the returned list, is an :class:`AttentionScores`: per requested
layer, the attention mass each of the context's positions received from
this pass's queries. The engine takes the weights from the attention it
computes anyway (the C attention kernels, the fused decode step, or an
explicit ``softmax(q k^T)`` in place of SDPA for the other groups): no
second pass, and nothing for the passes that do not ask.

For query ``i`` of the pass (every input token, pending tokens included),
query head ``h`` and KV position ``j``, the weight is ``a[i, h, j] =
softmax_j(q_ih . k_hj / sqrt(d) + mask_ij)`` (Vaswani et al., 2017, eq. 1;
grouped-query heads read their KV head's keys, Ainslie et al., 2023), so
``sum_j a[i, h, j] = 1``. The probe reports ``sum_{i, h} a[i, h, j]``
(``reduce="sum"``: the cumulative score H2O keeps, Zhang et al., 2023) or
``max_{i, h} a[i, h, j]`` (``"max"``), with ``h`` over the query heads of
one KV head when ``per_kv_head``. Read-outs this gives eviction policies:
H2O adds each decode step's ``sum`` scores; SnapKV (Li et al., 2024)
probes a pass over the prompt's last window of tokens (a second
``forward`` after the rest was flushed) and pools the result; TOVA
(Oren et al., 2024) takes the current step's scores.

Positions are the context's token indexes ``0 .. seq_len - 1`` after the
pass (``ctx.tokens``; not RoPE positions). A position the pass's queries
cannot see weighs 0: hidden by ``mask_token_range`` or a custom
``attention`` mask, in a dropped page, past a query (causality), or out
of a sliding-window layer's window. With ``per="page"``, page ``p`` is
positions ``[p * page_size, (p + 1) * page_size)`` of this context (the
last page may be partial), reduced with ``reduce``. Pages shared with a fork
or a snapshot appear like any other: the scores are this context's queries'
only. A pass with a probe is never served from the prefix cache (every
input token is computed, so that every query counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SamplingError

#: ``AttentionProbe.reduce`` values.
PROBE_REDUCES = ("sum", "max")
#: ``AttentionProbe.per`` values.
PROBE_UNITS = ("token", "page")


@dataclass
class AttentionProbe:
    """Ask a forward pass for its attention scores (see the module docstring).

    Attributes:
        layers: decoder layers to report, 0-based (negative: from the end),
            in the order wanted; None: every layer.
        reduce: ``"sum"`` (attention mass) or ``"max"`` over the pass's
            queries and query heads, and over a page's positions.
        per: ``"token"`` (one value per position) or ``"page"``.
        per_kv_head: one row per KV head instead of one for all heads.
    """

    layers: list[int] | None = None
    reduce: str = "sum"
    per: str = "token"
    per_kv_head: bool = False


def check_probe(probe: AttentionProbe) -> None:
    """Check what can be checked of ``probe`` without the model: its class,
    ``reduce``, ``per``, ``per_kv_head``, and ``layers`` being None or a
    non-empty list of ints (the WASM guest binding runs this before the
    host call, so both runtimes raise the same errors).

    Raises:
        SamplingError: (a ``ValueError``) naming the field.
    """
    if not isinstance(probe, AttentionProbe):
        raise SamplingError(f"an attention probe is a tartlet.forward.AttentionProbe, got {type(probe).__name__}")
    if not isinstance(probe.reduce, str) or probe.reduce not in PROBE_REDUCES:
        raise SamplingError(f"attention probe reduce must be one of {', '.join(PROBE_REDUCES)}, got {probe.reduce!r}")
    if not isinstance(probe.per, str) or probe.per not in PROBE_UNITS:
        raise SamplingError(f"attention probe per must be one of {', '.join(PROBE_UNITS)}, got {probe.per!r}")
    if not isinstance(probe.per_kv_head, bool):
        raise SamplingError(f"attention probe per_kv_head must be a bool, got {probe.per_kv_head!r}")
    layers = probe.layers
    if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)) or not layers
                               or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
        raise SamplingError(f"attention probe layers must be a non-empty list of ints or None (all), got {layers!r}")


def probe_record(probe: AttentionProbe, make: Any) -> Any:
    """``probe`` checked (:func:`check_probe`) and lowered to the WIT record
    ``attention-probe`` by ``make`` (its class in a component's bindings).

    Raises:
        SamplingError: as :func:`check_probe`, or a layer past a WIT ``s32``.
    """
    check_probe(probe)
    layers = None if probe.layers is None else list(probe.layers)
    for x in layers or []:
        if not -(1 << 31) <= x < 1 << 31:
            raise SamplingError(f"attention probe layer {x!r} is outside the model's layers")
    return make(layers, probe.reduce, probe.per, probe.per_kv_head)


def scores_from_record(a: Any) -> "AttentionScores":
    """The WIT record ``attention-scores`` (per layer, its ``kv_heads`` rows
    one after the other) as :class:`AttentionScores`."""
    n = len(a.scores[0]) // a.kv_heads if a.scores else 0
    rows = [[list(flat[h * n : (h + 1) * n]) for h in range(a.kv_heads)] for flat in a.scores]
    return AttentionScores(list(a.layers), a.reduce, a.per, a.kv_heads, rows)


def probe_layers(probe: AttentionProbe, num_layers: int) -> tuple[int, ...]:
    """The layers ``probe`` asks for as indexes in ``[0, num_layers)``, after
    checking every field (:func:`check_probe`).

    Raises:
        SamplingError: (a ``ValueError``) as :func:`check_probe`; a layer
            outside ``[-num_layers, num_layers)``, or one named twice.
    """
    check_probe(probe)
    if probe.layers is None:
        return tuple(range(num_layers))
    out: list[int] = []
    for layer in probe.layers:
        if not -num_layers <= layer < num_layers:
            raise SamplingError(f"attention probe layer {layer!r} is outside the model's {num_layers} layers "
                                f"(0..{num_layers - 1}, or -{num_layers}..-1 from the end)")
        if layer % num_layers in out:
            raise SamplingError(f"attention probe layer {layer} is named twice")
        out.append(layer % num_layers)
    return tuple(out)


class AttentionScores:
    """What an :class:`AttentionProbe` returns.

    Attributes:
        layers: the reported layers (0-based), in the probe's order.
        reduce, per: as asked.
        kv_heads: rows per layer: the model's KV heads with ``per_kv_head``,
            else 1.
        scores: ``scores[i][h][j]``: layer ``layers[i]``, row ``h``, position
            (or page) ``j``; float32 values. The host may hand the values
            over as any object whose ``tolist()`` gives these nested lists (a
            ``memoryview`` of float32): they become lists on first use, on
            the reader's thread, not the engine's.
    """

    def __init__(self, layers: list[int], reduce: str, per: str, kv_heads: int, scores: Any) -> None:
        self.layers, self.reduce, self.per, self.kv_heads = layers, reduce, per, kv_heads
        self._scores = scores

    @property
    def scores(self) -> list[list[list[float]]]:
        if not isinstance(self._scores, list):
            self._scores = self._scores.tolist()
        out: list[list[list[float]]] = self._scores
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttentionScores) and (self.layers, self.reduce, self.per, self.kv_heads, self.scores) == (
            other.layers, other.reduce, other.per, other.kv_heads, other.scores)

    def __repr__(self) -> str:
        return (f"AttentionScores(layers={self.layers}, reduce={self.reduce!r}, per={self.per!r}, "
                f"kv_heads={self.kv_heads}, positions={len(self)})")

    def __len__(self) -> int:
        """Positions (or pages) reported."""
        return len(self.scores[0][0]) if self.scores and self.scores[0] else 0

    def _combine(self, rows: list[list[float]]) -> list[float]:
        if self.reduce == "sum":
            return [sum(col) for col in zip(*rows)]
        return [max(col) for col in zip(*rows)]

    def layer(self, layer: int) -> list[float]:
        """Layer ``layer``'s value per position (or page), its KV-head rows
        combined with ``reduce``.

        Raises:
            KeyError: ``layer`` was not probed.
        """
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not probed (probed: {self.layers})")
        return self._combine(self.scores[self.layers.index(layer)])

    def total(self) -> list[float]:
        """Every reported layer and row combined with ``reduce``: one value
        per position (or page), e.g. the score an eviction policy ranks by."""
        return self._combine([row for rows in self.scores for row in rows])

"""Hidden-state read-outs of a forward pass (the ``hidden`` output slot).

A ``hidden`` slot asks for the residual stream at one input token instead
of anything computed from its logits: the *final* hidden state (after the
model's final norm: the input of the LM head, what Hugging Face's
``output_hidden_states`` returns last) or the output of one decoder layer
(HF ``hidden_states[layer + 1]``; 0-based, so layer ``num_layers - 1`` is the
last layer's output before the final norm).

The scheduler gives each batch item the chunk-relative rows and layers of
its hidden slots (:attr:`~tartlet.engine.core.batch.BatchItem.hidden_index`,
kept out of the logits rows); :func:`~tartlet.engine.core.batch.build_batch`
gathers them into one :class:`HiddenCapture` per batch; the model copies the
rows asked for as it passes each layer (nothing else is computed: no second
pass, and a batch without hidden slots carries no capture at all), and the
model runner hands each slot its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...sdk.errors import SamplingError

#: the capture key of the final hidden state (after the final norm)
FINAL = None


@dataclass(frozen=True)
class HiddenSpec:
    """A hidden-state read-out at a slot's input token.

    Attributes:
        layer: the decoder layer whose output is read, in ``[0,
            num_layers)`` (already normalised: see :func:`layer_index`), or
            ``None``: the final hidden state after the model's final norm.
    """

    layer: int | None = None


def layer_index(layer: object, num_layers: int) -> int | None:
    """``layer`` as a capture key: ``None`` stays ``None`` (the final hidden
    state), a negative int counts from the end (``-1``: the last layer's
    output, before the final norm).

    Raises:
        SamplingError: ``layer`` is not an int or ``None``, or outside
            ``[-num_layers, num_layers)``.
    """
    if layer is None:
        return None
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise SamplingError(f"hidden-state layer must be an int or None (the final hidden state), got {layer!r}")
    if not -num_layers <= layer < num_layers:
        raise SamplingError(
            f"hidden-state layer {layer} is outside the model's {num_layers} layers "
            f"(0..{num_layers - 1}, or -{num_layers}..-1 from the end; None: the final hidden state)"
        )
    return layer % num_layers


@dataclass
class HiddenCapture:
    """The hidden states one model call must keep.

    Attributes:
        rows: per capture key (a layer index, or :data:`FINAL`), int64
            ``[n]`` rows of the flat batch to copy.
        order: for every hidden slot of the batch in slot order, its
            ``(key, position in rows[key])``.
        out: filled by the model: per key, float32 ``[n, hidden_size]``
            (on the model's device).
    """

    rows: dict[int | None, torch.Tensor]
    order: list[tuple[int | None, int]]
    out: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, wanted: list[tuple[int, int | None]]) -> "HiddenCapture":
        """From ``(flat row, key)`` pairs in slot order."""
        by_key: dict[int | None, list[int]] = {}
        order = []
        for row, key in wanted:
            rows = by_key.setdefault(key, [])
            order.append((key, len(rows)))
            rows.append(row)
        return cls({k: torch.tensor(v, dtype=torch.long) for k, v in by_key.items()}, order)

    def layers(self) -> set[int]:
        """The decoder layers read (the final hidden state excluded)."""
        return {k for k in self.rows if k is not None}

    def to(self, device: torch.device) -> "HiddenCapture":
        """The same capture with its row tensors on ``device``."""
        return HiddenCapture({k: v.to(device, non_blocking=True) for k, v in self.rows.items()}, self.order)

    def keep(self, key: int | None, rows: torch.Tensor) -> None:
        """Store ``rows`` ``[n, H]`` (the rows ``self.rows[key]`` of the
        residual stream after that layer, or for :data:`FINAL` after the
        final norm) as float32."""
        self.out[key] = rows.float()

    def results(self) -> list[list[float]]:
        """Each hidden slot's vector (``hidden_size`` floats), in slot order.

        Raises:
            RuntimeError: the model did not fill a key (a path that cannot
                capture ran the batch: a bug).
        """
        missing = [k for k in self.rows if k not in self.out]
        if missing:
            raise RuntimeError(f"the model did not capture hidden states of layers {missing}")
        host = {k: v.cpu() for k, v in self.out.items()}
        return [host[k][j].tolist() for k, j in self.order]

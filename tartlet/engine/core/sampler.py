"""Samplers and probes, run on the engine side on a batch of logits.

A forward pass asks for outputs at chosen input positions ("slots"). Each slot
carries either a :class:`SamplerSpec` (returns one token id) or a
:class:`ProbeSpec` (returns a distribution, raw logits, log-probabilities of
given tokens, or the entropy). All greedy slots of a batch are one ``argmax``;
the others are handled row by row on a short candidate list.

Formulas: temperature scaling ``softmax(logits / T)``; top-k keeps the k most
likely tokens; top-p ("nucleus", Holtzman et al., 2020) keeps the smallest set
whose probability reaches p; min-p (Nguyen et al., 2024) keeps tokens with
probability >= ``min_p * p_max``; then locally typical sampling and XTC
(:mod:`.sampling_filters`). Filters apply in that order, as in HF
``transformers`` logits processors (XTC, which HF lacks, last). The DRY
repetition penalty (:mod:`.dry`) changes a slot's logits before anything
else, greedy slots included; it needs the context's tokens, which
:meth:`SlotSampler.run` takes per slot. Multinomial draws use the exponential-race
trick ``argmax(p_i / E_i)``, ``E_i ~ Exp(1)``, which samples exactly
proportionally to ``p`` with a per-slot seeded generator.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from ...sdk.errors import SamplingError
from ...sdk.sampler import validate_filters
from ...sdk.sampler import validate_sampler as _sdk_validate
from . import sampling_filters
from .dry import DryParams, dry_penalties
from .hidden_states import HiddenSpec

#: Candidates examined before falling back to a full sort for top-p.
_TOP_P_CANDIDATES = 512


@dataclass(frozen=True)
class SamplerSpec:
    """How to pick one token from a slot's logits.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 scales the logits.
        top_k: keep the ``top_k`` most likely tokens (``None``: no limit).
        top_p: nucleus threshold in (0, 1]; 1 disables it.
        min_p: relative probability floor in [0, 1]; 0 disables it.
        seed: seed of this draw; equal seeds give equal draws whatever else
            is in the batch. ``None`` draws from the engine's generator.
        typical_p: locally typical mass in (0, 1]; 1 disables it.
        xtc_probability, xtc_threshold: XTC's chance of acting per draw in
            [0, 1] (0 disables it) and its probability threshold in [0, 1].
        dry: the DRY repetition penalty, or None (off).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry: DryParams | None = None

    def __post_init__(self) -> None:
        validate_sampler(self.temperature, self.top_k, self.top_p, self.min_p)
        validate_filters(self.typical_p, self.xtc_probability, self.xtc_threshold)


def validate_sampler(temperature: float, top_k: int | None, top_p: float, min_p: float) -> None:
    """Raise :class:`SamplingError` naming the first out-of-range parameter
    (the rules of :func:`tartlet.sdk.sampler.validate_sampler`)."""
    _sdk_validate(temperature, top_k, top_p, min_p)  # raises SamplingError


PROBE_KINDS = ("distribution", "logits", "logprobs", "entropy")


@dataclass(frozen=True)
class ProbeSpec:
    """A read-out of a slot's next-token distribution.

    Kinds and results:
        ``distribution``: the ``k`` most likely tokens of
            ``softmax(logits / temperature)`` as ``(ids, probs)``, descending.
        ``logits``: the raw float32 logits, a list of ``vocab_size`` floats.
        ``logprobs``: ``log_softmax(logits)`` at ``token_ids``, a list of floats.
        ``entropy``: ``-sum p log p`` in nats of ``softmax(logits)``, a float.
    """

    kind: str
    k: int = 1
    token_ids: tuple[int, ...] = field(default_factory=tuple)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in PROBE_KINDS:
            raise SamplingError(f"unknown probe kind {self.kind!r} (known: {', '.join(PROBE_KINDS)})")
        if self.kind == "distribution" and (not isinstance(self.k, int) or self.k < 1):
            raise SamplingError(f"distribution probe needs k >= 1, got {self.k!r}")
        if self.kind == "distribution" and not self.temperature > 0:
            raise SamplingError(f"distribution probe needs temperature > 0, got {self.temperature!r}")


@dataclass
class OutputSlot:
    """One requested output of a forward pass.

    Attributes:
        index: input token (0-based within the request) whose logits are used.
        spec: sampler or probe; or a hidden-state read-out (:mod:`.hidden_states`),
            which the model runner answers from the residual stream (it never
            reaches :class:`SlotSampler`).
        allowed: bool ``[vocab_size]`` logit mask (True = allowed), or None.
        check: for a slot with a mask, a test of one token id (True =
            allowed), or None. For a greedy slot, or a draw at a temperature
            with no top-k, top-p or min-p (:func:`checkable`), the sampler
            first picks from the unmasked logits and, when ``check`` passes
            the token, never reads ``allowed``; else it picks again from the
            masked logits. Greedy: the argmax over the allowed tokens is the
            overall argmax whenever that one is allowed (ties included: both
            take the lowest id). A draw: accepting an allowed draw from the
            softmax ``p`` gives token ``t`` with probability ``p(t)``, and a
            rejected one falls back to the masked softmax ``p(t) / p(A)``,
            so ``t`` comes out with ``p(t) + (1 - p(A)) p(t) / p(A) = p(t) /
            p(A)``, the masked distribution exactly (a seeded fallback
            reuses the first draw's exponential noise: the race's winner
            among the allowed tokens is independent of whether a forbidden
            one won overall). With top-k/p or min-p the filters would see
            the unmasked distribution, so those slots read ``allowed``
            first. A mask that is costly to compute (a grammar's) is then
            computed only for the steps whose pick it forbids.
        prefetch: for a slot whose ``allowed`` is computed on demand, a
            call that starts computing it in the background, or None. When
            several such slots of a batch need their masks, the sampler
            calls it for all but the first before reading any, so they are
            computed in parallel while the first is computed on the
            sampler's thread (one mask, the common case at batch 1, costs
            no thread handoff).
    """

    index: int
    spec: SamplerSpec | ProbeSpec | HiddenSpec
    allowed: torch.Tensor | None = None
    check: Callable[[int], bool] | None = None
    prefetch: Callable[[], None] | None = None


def _xtc_seed(seed: int) -> int:
    """The seed of XTC's coin for a draw seeded ``seed``: a stream apart
    from the draw's own (splitmix64's constant added)."""
    return (seed + 0xBF58476D1CE4E5B9) % 2**63


def _greedy(s: OutputSlot) -> bool:
    return isinstance(s.spec, SamplerSpec) and s.spec.temperature == 0


def checkable(spec: SamplerSpec | ProbeSpec | HiddenSpec) -> bool:
    """Whether a slot with this spec may pick before reading its mask (see
    :attr:`OutputSlot.check`): greedy, or a plain temperature draw."""
    return isinstance(spec, SamplerSpec) and (
        spec.temperature == 0 or (spec.top_k is None and spec.top_p >= 1 and spec.min_p == 0
                                  and spec.typical_p >= 1 and spec.xtc_probability == 0)
    )


class SlotSampler:
    """Applies the slots of one batch to its logits."""

    def __init__(self, vocab_size: int, argmax_rows: Callable[[torch.Tensor], list[int]] | None = None,
                 argmax_masked: Callable[[torch.Tensor, torch.Tensor], int] | None = None) -> None:
        """``argmax_rows``: ``x.argmax(-1).tolist()`` of float32 logits
        ``[S, V]`` (e.g. :meth:`CpuKernels.argmax_rows`, ~10x faster than
        PyTorch's reduction on CPU); None: PyTorch's. ``argmax_masked``:
        the first maximum of a float32 row ``[V]`` over a bool mask ``[V]``,
        -1 when nothing is allowed (:meth:`CpuKernels.argmax_masked`), for
        greedy slots with a mask on CPU: no masked copy of the logits (on
        this 2-core CPU PyTorch's clone, ``any`` and ``masked_fill_`` of a
        49,152-token row took ~0.35 ms); None: PyTorch's."""
        self.vocab_size = vocab_size
        self._argmax_rows = argmax_rows
        self._argmax_masked = argmax_masked
        self._rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def run(self, logits: torch.Tensor, slots: list[OutputSlot],
            history: Callable[[OutputSlot], list[int]] | None = None) -> list[object]:
        """Results of ``slots`` given float32 ``logits`` ``[S, V]`` (row i
        for slot i). A slot that fails yields its :class:`SamplingError`
        instead of a result, so one bad request does not fail the batch.
        ``history(slot)``: the token ids of the slot's context up to and
        including its input token, read for slots with a DRY penalty only
        (such a slot without ``history`` raises ``ValueError``)."""
        out: list[object] = [None] * len(slots)
        dry = [i for i, s in enumerate(slots) if isinstance(s.spec, SamplerSpec) and s.spec.dry is not None]
        if dry:
            if history is None:
                raise ValueError("DRY slots need the context's tokens (history)")
            logits = self._apply_dry(logits, slots, dry, history)
        checked = [i for i, s in enumerate(slots) if s.check is not None and checkable(s.spec)]
        if checked:
            greedy_checked = [i for i in checked if _greedy(slots[i])]
            rows = logits if len(greedy_checked) == len(slots) else logits[greedy_checked]
            picks = dict(zip(greedy_checked, self.argmax(rows))) if greedy_checked else {}
            for i in checked:
                check = slots[i].check
                assert check is not None  # checked
                try:
                    t = picks[i] if i in picks else self._sample(logits[i].cpu(), cast(SamplerSpec, slots[i].spec))
                    ok = check(t)
                except Exception:  # a failing check only costs the mask: the slot is masked as before
                    ok = False
                if ok:
                    out[i] = t
        starts = [p for i, s in enumerate(slots) if out[i] is None and (p := s.prefetch) is not None]
        for start in starts[1:]:
            start()  # masks computed in parallel with the first one's, read next
        masks = {i: m for i, s in enumerate(slots) if out[i] is None and (m := s.allowed) is not None}  # read once
        fast = self._argmax_masked
        if fast is not None:  # greedy under a mask on CPU: the kernel, no masked copy
            for i, allowed in list(masks.items()):
                row = logits[i]
                if (_greedy(slots[i]) and row.is_cpu and row.dtype is torch.float32 and row.is_contiguous()
                        and allowed.dtype is torch.bool and allowed.is_cpu and allowed.is_contiguous()
                        and allowed.shape == row.shape):
                    t = fast(row, allowed)
                    out[i] = t if t >= 0 else SamplingError("the logit mask allows no token")
                    del masks[i]
        if masks:
            logits = logits.clone()
            for i, allowed in masks.items():
                if not bool(allowed.any()):
                    out[i] = SamplingError("the logit mask allows no token")
                    continue
                logits[i].masked_fill_(~allowed.to(logits.device), float("-inf"))
        greedy = [i for i, s in enumerate(slots) if out[i] is None and _greedy(s)]
        if greedy:
            for i, t in zip(greedy, self.argmax(logits if len(greedy) == len(slots) else logits[greedy])):
                out[i] = t
        rest = [i for i in range(len(slots)) if out[i] is None]
        if not rest:
            return out
        # per-row draws and probes run on the host (one copy of their rows
        # from a GPU): a seeded draw is the same on every device
        host = logits.index_select(0, torch.tensor(rest, device=logits.device)).cpu() if logits.device.type != "cpu" else None
        for j, i in enumerate(rest):
            row = logits[i] if host is None else host[j]
            spec = slots[i].spec
            try:
                out[i] = self._sample(row, spec) if isinstance(spec, SamplerSpec) else self._probe(row, cast(ProbeSpec, spec))
            except SamplingError as e:
                out[i] = e
        return out

    def _apply_dry(self, logits: torch.Tensor, slots: list[OutputSlot], rows: list[int],
                   history: Callable[[OutputSlot], list[int]]) -> torch.Tensor:
        """``logits`` with each DRY slot's penalties subtracted (a copy when
        any applies; the model's tensor is left as it is)."""
        out = logits
        for i in rows:
            spec = cast(SamplerSpec, slots[i].spec)
            assert spec.dry is not None  # rows are the DRY slots
            pen = dry_penalties(history(slots[i]), spec.dry)
            if not pen:
                continue
            if out is logits:
                out = logits.clone()
            ids = torch.tensor(list(pen), device=out.device)
            out[i, ids] -= torch.tensor(list(pen.values()), dtype=out.dtype, device=out.device)
        return out

    def argmax(self, rows: torch.Tensor) -> list[int]:
        """``rows.argmax(-1).tolist()`` (the C kernel where it applies)."""
        argmax = self._argmax_rows
        if argmax is not None and rows.dtype is torch.float32 and rows.is_cpu and rows.stride(-1) == 1:
            return argmax(rows)
        return cast(list[int], rows.argmax(dim=-1).tolist())

    def _sample(self, logits: torch.Tensor, s: SamplerSpec) -> int:
        p, ids = self.candidates(logits, s)
        if s.xtc_probability > 0:
            coin = torch.Generator().manual_seed(_xtc_seed(s.seed)) if s.seed is not None else self._rng
            p, ids = sampling_filters.xtc(p, torch.arange(len(p)) if ids is None else ids, s.xtc_probability,
                                          s.xtc_threshold, coin)
        gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else self._rng
        e = torch.empty_like(p).exponential_(generator=gen)
        j = int((p / e).argmax())
        return j if ids is None else int(ids[j])

    def candidates(self, logits: torch.Tensor, s: SamplerSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens a draw with ``s`` (temperature > 0) chooses among,
        after temperature, top-k, top-p, min-p and typical-p (XTC, random,
        comes after, in the draw): their probabilities under
        ``softmax(logits / T)`` (float32, not renormalised) and their ids
        (int64), or ``(probabilities of the whole vocabulary, None)`` when
        no filter applies. ``logits``: float32 ``[V]`` on the CPU."""
        probs = torch.softmax(logits / s.temperature, dim=-1)
        if s.top_k is not None or s.top_p < 1:
            k = min(self.vocab_size, s.top_k or _TOP_P_CANDIDATES)
            p, ids = probs.topk(k)
            if s.top_p < 1:
                csum = p.cumsum(0)
                if s.top_k is None and csum[-1] < s.top_p:
                    p, ids = probs.sort(descending=True)
                    csum = p.cumsum(0)
                # keep tokens whose preceding mass is below top_p (always the first)
                keep = int((csum - p < s.top_p).sum())
                p, ids = p[:keep], ids[:keep]
        else:
            p, ids = probs, None
        if s.min_p > 0:
            above = p >= s.min_p * p.max()
            p = p[above]
            ids = above.nonzero().squeeze(1) if ids is None else ids[above]
        if s.typical_p < 1:
            p, ids = sampling_filters.typical(p, torch.arange(len(p)) if ids is None else ids, s.typical_p)
        return p, ids

    def _probe(self, logits: torch.Tensor, s: ProbeSpec) -> object:
        if s.kind == "distribution":
            probs = torch.softmax(logits / s.temperature, dim=-1)
            p, ids = probs.topk(min(s.k, self.vocab_size))
            return ids.tolist(), p.tolist()
        if s.kind == "logits":
            return logits.tolist()
        logp = torch.log_softmax(logits, dim=-1)
        if s.kind == "logprobs":
            bad = [t for t in s.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise SamplingError(f"logprobs probe: token ids {bad[:5]} outside [0, {self.vocab_size})")
            return logp[list(s.token_ids)].tolist()
        p = logp.exp()
        return float(-(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum())

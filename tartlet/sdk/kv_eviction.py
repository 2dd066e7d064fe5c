"""KV-cache eviction policies under a token budget, driven by the
attention-score probe (:mod:`tartlet.attention_probe`).

A policy holds at most ``budget`` tokens of a context's KV cache visible
to attention: after its prefill and after every decode step it hides the
tokens it evicts with :meth:`Context.mask_token_range` (token granularity)
and frees every full page whose tokens are all hidden with
:meth:`Context.drop_masked_pages`. RoPE positions are kept as they are
(nothing is re-indexed). Four methods:

- :class:`SinkWindow` (``"window"``): StreamingLLM (Xiao et al., ICLR 2024,
  "Efficient Streaming Language Models with Attention Sinks"): the first
  ``sink`` tokens and the most recent ``budget - sink``. No probe.
- :class:`H2O` (``"h2o"``): Zhang et al., NeurIPS 2023, "H2O: Heavy-Hitter
  Oracle for Efficient Generative Inference of Large Language Models": the
  ``recent`` most recent tokens plus the ``budget - recent`` "heavy
  hitters" with the largest cumulative attention (the probe's ``sum``
  scores of the prompt's queries, then of every decode step, added up).
  The paper splits the budget evenly (e.g. 10% heavy + 10% recent), the
  default here (``recent = budget // 2``). Each step over budget evicts the
  non-recent token with the lowest cumulative score (``score="mean"``: the
  cumulative score over the queries that saw the token, which removes the
  sum's bias to early tokens; Ren & Zhu, 2024, RoCo).
- :class:`SnapKV` (``"snapkv"``): Li et al., 2024, "SnapKV: LLM Knows What
  You Are Looking for Before Generation": the prompt but its last
  ``window`` tokens is prefilled, then the window in a second pass with the
  probe; the window's attention to the earlier positions is pooled along
  the positions (1-D ``max`` or ``avg`` pooling, stride 1, ``kernel_size``
  odd, padding ``kernel_size // 2``: ``F.max_pool1d`` / ``F.avg_pool1d`` of
  the reference code ``snapkv_utils.py``) and the top ``budget - window``
  positions are kept with the window (each head's votes pooled, then
  combined, as the reference pools per head). Defaults: window 32, kernel 7, max
  pooling (the reference repository's LongBench configuration; its code's
  defaults are kernel 5, ``avgpool``). The paper compresses the prompt
  only; to hold the budget through decoding as well, each step over budget
  here evicts the remaining prompt token with the lowest pooled score, and
  once none is left the oldest generated token (decode passes carry no
  probe).
- :class:`TOVA` (``"tova"``): Oren et al., 2024, "Transformers are
  Multi-State RNNs": once over budget, each step evicts the token with the
  lowest attention from the current query (the prompt's last token for
  the prompt: a second pass over it with the probe). The paper averages
  the heads of each layer and lets each layer keep its own tokens; a mask
  here is shared by every layer, so the score is averaged over the heads
  of ``layers`` (default: all layers; ``layers=[-1]``: the last only).

H2O, SnapKV and TOVA select per token for all layers and heads at once
(the papers select per layer or per head), again because a mask hides a
token from every layer and head; ``heads="max"`` ranks a token by the head
that needs it most instead of the sum over heads (Ada-KV's selection across
heads, see :class:`_Scored`), and ``sink`` keeps the first tokens whatever
their scores (StreamingLLM's attention sinks), and ``chunk`` > 1 keeps or
evicts runs of ``chunk`` positions (ChunkKV, Liu et al., 2025; aligned to
pages when ``chunk`` is the page size: :mod:`tartlet.sdk.kv_chunks`).
Defaults are the papers' (``heads="sum"``, ``sink=0``, ``score="sum"``,
``chunk=1``).

Memory accounting: KV memory is held in pages of ``page_size`` tokens, so
the bytes held are the pages held, not the tokens kept: a page is released
only when every one of its tokens is evicted and it is full (the
partly filled last page is never released). :meth:`EvictionPolicy.pages_held`
counts the pages the context still holds (``ctx.stats()["live_pages"]`` for a
context only this policy masks); the bytes are that times
``layers x 2 x kv_heads x head_dim x dtype bytes x page_size``. With a
scattered eviction pattern (H2O, SnapKV, TOVA) pages stay held while any
of their tokens is kept, so they hold more pages than ``budget / page_size``;
the sliding window frees pages as fast as it evicts, and so do the others
with ``chunk`` equal to the page size (whole pages evicted).

Usage::

    policy = kv_eviction.make_policy("h2o", budget=256)
    ctx.user(prompt); ctx.begin_assistant()
    async for tok in policy.generate(ctx, Sampler.greedy(), max_tokens=128):
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from . import forward as fwd
from .attention_probe import AttentionProbe, AttentionScores
from .context import Context
from .forward import OutputSlot
from .kv_chunks import lowest_chunks
from .sampler import Sampler

#: Method names :func:`make_policy` accepts.
METHODS = ("window", "h2o", "snapkv", "tova")
#: ``SnapKV.pooling`` values.
POOLINGS = ("max", "avg")
#: ``heads`` values of H2O, SnapKV and TOVA: how per-head scores combine into one per token.
HEADS = ("sum", "max")
#: ``H2O.score`` values.
H2O_SCORES = ("sum", "mean")


def _int_arg(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def _layers_arg(layers: Any) -> list[int] | None:
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise ValueError(f"layers must be a non-empty list of ints or None (all layers), got {layers!r}")
    return list(layers)


def pool1d(scores: Sequence[float], kernel_size: int, pooling: str = "max") -> list[float]:
    """SnapKV's smoothing of per-position scores: 1-D pooling with stride 1
    and ``kernel_size // 2`` padding on both sides, so the output has
    ``len(scores)`` values (``kernel_size`` odd). ``"max"`` pads with
    ``-inf`` (``torch.nn.functional.max_pool1d``); ``"avg"`` pads with 0
    and divides by ``kernel_size`` (``avg_pool1d`` with its default
    ``count_include_pad=True``), as SnapKV's ``snapkv_utils.py`` calls them.

    Args:
        scores: floats, one per position.
        kernel_size: odd int >= 1.
        pooling: ``"max"`` or ``"avg"``.

    Raises:
        ValueError: ``kernel_size`` not an odd int >= 1, or ``pooling`` unknown.
    """
    k = _int_arg("kernel_size", kernel_size, 1)
    if k % 2 == 0:
        raise ValueError(f"kernel_size must be odd (the pooled scores keep one value per position), got {k}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    h, n = k // 2, len(scores)
    if pooling == "max":
        return [max(scores[max(0, i - h) : i + h + 1]) for i in range(n)]
    return [sum(scores[max(0, i - h) : i + h + 1]) / k for i in range(n)]


class EvictionPolicy:
    """Base of the policies: bookkeeping of the kept tokens and pages of
    one context, the prefill and decode-step drivers, and the eviction
    itself (mask, then drop the pages left empty).

    One policy object serves one context, from its prefill on; tokens that
    were already in the KV cache before :meth:`prefill` count as kept
    (and as evictable). Do not mask that context's tokens by other means
    while the policy runs: the policy's counts would no longer match.

    Attributes:
        budget: most tokens kept visible in the KV cache between passes.
        evicted: tokens evicted so far.
        dropped_pages: pages released so far (``drop_masked_pages``).
        peak_pages: the most pages held after any pass.
    """

    method = ""
    chunk = 1  # positions per eviction unit (kv_chunks); 1: single tokens

    def __init__(self, budget: int) -> None:
        self.budget = _int_arg("budget", budget, 1)
        self.evicted = 0
        self.dropped_pages = 0
        self.peak_pages = 0
        self._kept = bytearray()       # per position of the context: 1 = in the KV cache and visible
        self._page_kept: list[int] = []  # per page: kept tokens
        self._page_gone: list[bool] = []  # per page: released
        self._ps = 0
        self._ctx: Context | None = None

    # -- state -----------------------------------------------------------------------
    @property
    def kept_tokens(self) -> int:
        """Tokens of the KV cache still visible (at most ``budget`` between passes)."""
        return len(self._kept) - self.evicted

    def kept_positions(self) -> list[int]:
        """The kept positions (context token indexes), ascending."""
        return [j for j, k in enumerate(self._kept) if k]

    def pages_held(self) -> int:
        """Pages of the context not released: every page holding a kept
        token, the partly filled last page, and full pages whose tokens are
        all evicted but which were not dropped yet (none between passes)."""
        return sum(1 for gone in self._page_gone if not gone)

    def probe(self) -> AttentionProbe | None:
        """The probe each decode step carries (None: none)."""
        return None

    def _bind(self, ctx: Context) -> None:
        if self._ctx is None:
            self._ctx, self._ps = ctx, ctx.page_size
        elif self._ctx is not ctx:
            raise ValueError("an eviction policy serves one context: make a new policy for another context")

    def _grow(self, n: int) -> None:
        """Count the positions up to ``n`` (the KV length after a pass) as kept."""
        ps = self._ps
        for j in range(len(self._kept), n):
            if j // ps == len(self._page_kept):
                self._page_kept.append(0)
                self._page_gone.append(False)
            self._page_kept[j // ps] += 1
        self._kept.extend(b"\x01" * (n - len(self._kept)))

    async def _evict(self, ctx: Context, positions: Sequence[int]) -> None:
        """Hide ``positions`` (kept ones) and release the full pages left
        without a kept token."""
        pos = sorted(set(positions))
        if not pos:
            return
        ps = self._ps
        for j in pos:
            if not self._kept[j]:
                raise ValueError(f"position {j} is not kept")  # a policy bug, not a caller's
            self._kept[j] = 0
            self._page_kept[j // ps] -= 1
        self.evicted += len(pos)
        start = prev = pos[0]
        for j in pos[1:] + [-1]:  # one mask call per run of consecutive positions
            if j != prev + 1:
                ctx.mask_token_range(start, prev + 1)
                start = j
            prev = j
        full = len(self._kept) // ps
        empty = [p for p in range(full) if self._page_kept[p] == 0 and not self._page_gone[p]]
        if empty:
            self.dropped_pages += await ctx.drop_masked_pages()
            for p in empty:
                self._page_gone[p] = True

    def _note_pages(self) -> None:
        self.peak_pages = max(self.peak_pages, self.pages_held())

    # -- passes ------------------------------------------------------------------------
    async def _pass(self, ctx: Context, outputs: Sequence[OutputSlot], probe: AttentionProbe | None,
                    split: int = 0) -> tuple[list[Any], AttentionScores | None]:
        """Run the pending tokens: with ``split`` > 0, all but the last
        ``split`` first (flushed, no probe) and those last ones in a second
        pass with ``probe``; ``outputs`` (index 0) read the last token."""
        pending = ctx._take_pending()
        if not pending:
            raise ValueError("prefill needs pending tokens (fill the prompt first)")
        tail = pending
        if 0 < split < len(pending):
            ctx._set_pending(pending[:-split])
            tail = pending[-split:]
            try:
                await ctx.flush()
            except BaseException:
                ctx._restore_pending(tail)
                raise
        slots: list[Any] = [replace(o, index=len(tail) - 1) for o in outputs]
        if probe is not None:
            slots.append(probe)
        try:
            res = await ctx.forward(tail, outputs=slots)
        except BaseException:
            ctx._restore_pending(tail)
            raise
        if probe is None:
            return res, None
        return res[:-1], res[-1]

    async def prefill(self, ctx: Context, outputs: Sequence[OutputSlot] = ()) -> list[Any]:
        """Run the context's pending tokens (the prompt) through the model
        and evict down to ``budget``.

        Args:
            ctx: the context; its pending tokens are the prompt.
            outputs: slots (:mod:`tartlet.forward`, ``index`` 0) read at the
                prompt's last token, e.g. ``forward.sample(0, sampler)``.

        Returns:
            One result per slot of ``outputs``.

        Raises:
            ValueError: no pending tokens, a slot whose index is not 0, or
                this policy already serves another context.
        """
        self._bind(ctx)
        for o in outputs:
            if not isinstance(o, OutputSlot) or o.index != 0:
                raise ValueError(f"prefill outputs are OutputSlots at index 0 (the prompt's last token), got {o!r}")
        if len(self._kept) < ctx.kv_len:
            self._grow(ctx.kv_len)
        res = await self._prefill(ctx, list(outputs))
        self._note_pages()
        return res

    async def step(self, ctx: Context, token: int, outputs: Sequence[OutputSlot] = ()) -> list[Any]:
        """One decode pass over ``token`` (with this policy's probe), then
        evict down to ``budget``.

        Args:
            ctx: the context (after :meth:`prefill`), with no pending tokens.
            token: the input token id.
            outputs: slots at index 0 (e.g. ``forward.sample(0, sampler,
                step=i)``, ``forward.logprobs(0, [next_id])``).

        Returns:
            One result per slot of ``outputs``.

        Raises:
            ValueError: the context has pending tokens, or is not this
                policy's.
        """
        if self._ctx is not ctx:
            raise ValueError("step needs the context this policy prefilled")
        if ctx.pending:
            raise ValueError("step takes the context with no pending tokens (the token is the input)")
        probe = self.probe()
        res = await ctx.forward([token], outputs=[*outputs, *([probe] if probe is not None else [])])
        scores = res.pop() if probe is not None else None
        self._grow(ctx.kv_len)
        await self._decoded(ctx, scores)
        self._note_pages()
        return res

    async def generate(self, ctx: Context, sampler: Sampler | None = None, *, max_tokens: int = 256,
                       eos: bool = True) -> AsyncIterator[int]:
        """Prefill the pending prompt, then decode, yielding each token.

        The last yielded token is left pending (as :meth:`Context.generate`
        leaves it). Seeded samplers use step ``i`` for the ``i``-th token.

        Raises:
            ValueError: ``max_tokens`` < 1, or as :meth:`prefill`.
        """
        sampler = sampler or Sampler.greedy()
        max_tokens = _int_arg("max_tokens", max_tokens, 1)
        (tok,) = await self.prefill(ctx, [fwd.sample(0, sampler, step=0)])
        stops = set(ctx.model.eos_token_ids) if eos else set()
        for i in range(1, max_tokens + 1):
            yield tok
            if i == max_tokens or tok in stops:
                break
            (tok,) = await self.step(ctx, tok, [fwd.sample(0, sampler, step=i)])
        ctx.fill_tokens([tok])

    # -- what the methods define ------------------------------------------------------
    async def _prefill(self, ctx: Context, outputs: list[OutputSlot]) -> list[Any]:
        raise NotImplementedError

    async def _decoded(self, ctx: Context, scores: AttentionScores | None) -> None:
        raise NotImplementedError

    def _lowest(self, score: Sequence[float], candidates: Sequence[int], n: int) -> list[int]:
        """The ``n`` candidates with the lowest ``score`` (ties: earlier
        first), by chunks of :attr:`chunk` positions (:func:`lowest_chunks`)."""
        return lowest_chunks(score, self._kept, candidates, n, self.chunk)


class SinkWindow(EvictionPolicy):
    """StreamingLLM (Xiao et al., 2024): keep the first ``sink`` tokens
    (attention sinks) and the last ``budget - sink``; no probe.

    Raises:
        ValueError: ``budget`` < 1, or ``sink`` not in ``[0, budget)``.
    """

    method = "window"

    def __init__(self, budget: int, *, sink: int = 4) -> None:
        super().__init__(budget)
        self.sink = _int_arg("sink", sink, 0)
        if self.sink >= self.budget:
            raise ValueError(f"sink must be less than budget ({self.budget}), got {sink}")

    async def _prefill(self, ctx: Context, outputs: list[OutputSlot]) -> list[Any]:
        res, _ = await self._pass(ctx, outputs, None)
        self._grow(ctx.kv_len)
        await self._decoded(ctx, None)
        return res

    async def _decoded(self, ctx: Context, scores: AttentionScores | None) -> None:
        over = self.kept_tokens - self.budget
        if over > 0:
            old = [j for j in range(self.sink, len(self._kept)) if self._kept[j]][:over]
            await self._evict(ctx, old)


class _Scored(EvictionPolicy):
    """Base of the probe-driven policies (H2O, TOVA, SnapKV): the ``sink``
    first positions they never evict and how the probe's rows combine into
    one score per token (``heads``).

    ``heads="sum"`` adds the scores of every probed layer and head (the
    papers' per-head scores summed: the same ranking as their mean).
    ``heads="max"`` takes, per token, the largest score any (layer, KV head)
    row gives it: with one token set for all heads, top-``k`` by this max is
    the deduplicated top-``k`` of all heads' scores flattened together, the
    selection Ada-KV makes across the heads of a layer (Feng et al., 2024,
    "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"),
    so a token one head needs is not outvoted by heads that ignore it. A KV
    head's row sums its query heads' scores (grouped-query attention: the
    ranking of the group's mean). Every row carries
    the same mass (each query's softmax sums to 1), so normalising rows or
    layers before combining them would change nothing.

    ``chunk`` (int >= 1, positions): evict whole chunks of ``chunk``
    positions aligned to position 0, ranked by the sum of their kept
    tokens' combined scores; the budget stays exact in tokens, the last
    chunk taken partly (its lowest tokens); sinks and the recent or
    observation window stay token-level (:mod:`tartlet.sdk.kv_chunks`).
    """

    def __init__(self, budget: int, *, sink: int, heads: str, layers: list[int] | None, chunk: int = 1) -> None:
        super().__init__(budget)
        self.chunk = _int_arg("chunk", chunk, 1)
        self.sink = _int_arg("sink", sink, 0)
        if self.sink >= self.budget:
            raise ValueError(f"sink must be less than budget ({self.budget}), got {sink}")
        if heads not in HEADS:
            raise ValueError(f"heads must be one of {', '.join(HEADS)}, got {heads!r}")
        self.heads = heads
        self.layers = _layers_arg(layers)

    def probe(self) -> AttentionProbe | None:
        return fwd.attention_scores(self.layers, per_kv_head=self.heads == "max")

    def _rows(self, scores: AttentionScores) -> list[list[float]]:
        """The rows :meth:`_combine` combines: one (every layer and head
        summed) for ``"sum"``, one per probed layer and KV head for ``"max"``."""
        return [scores.total()] if self.heads == "sum" else [row for rows in scores.scores for row in rows]

    def _combine(self, rows: Sequence[Sequence[float]]) -> list[float]:
        if len(rows) == 1:
            return list(rows[0])
        if self.heads == "sum":
            return [sum(col) for col in zip(*rows)]
        return [max(col) for col in zip(*rows)]


class H2O(_Scored):
    """H2O (Zhang et al., 2023): ``recent`` latest tokens plus the
    ``budget - recent`` heavy hitters by cumulative attention (over
    ``layers`` and heads, combined as ``heads`` says, and every query since
    the prompt), never evicting the first ``sink`` tokens.

    ``score="sum"`` ranks by the cumulative attention itself (the paper).
    It favours early tokens: token ``j`` collects mass from the ``n - j``
    queries after it, so a token of the prompt's start outranks an equally
    attended later one (Ren & Zhu, 2024, "On the Efficacy of Eviction Policy
    for Key-Value Constrained Generative Language Model Inference",
    arXiv:2402.06262, whose RoCo policy ranks by the mean instead; Gu et al.,
    2025, "AhaKV", arXiv:2506.03762, prove the bias). ``score="mean"``
    divides it by the number of queries that saw the token (:meth:`seen`).

    Attributes:
        cumulative: per position, the attention received so far (``heads``
            combined; with ``"max"``, the max over rows of each row's sum).

    Raises:
        ValueError: ``budget`` < 1, ``recent`` not in ``[0, budget]``,
            ``sink + recent`` over ``budget``, ``score`` or ``heads``
            unknown, ``layers`` malformed, ``chunk`` < 1.
    """

    method = "h2o"

    def __init__(self, budget: int, *, recent: int | None = None, sink: int = 0, score: str = "sum",
                 heads: str = "sum", layers: list[int] | None = None, chunk: int = 1) -> None:
        super().__init__(budget, sink=sink, heads=heads, layers=layers, chunk=chunk)
        self.recent = self.budget // 2 if recent is None else _int_arg("recent", recent, 0)
        if self.recent > self.budget:
            raise ValueError(f"recent must be at most budget ({self.budget}), got {recent}")
        if self.sink + self.recent > self.budget:
            raise ValueError(f"sink + recent must be at most budget ({self.budget}), got {self.sink} + {self.recent}")
        if score not in H2O_SCORES:
            raise ValueError(f"score must be one of {', '.join(H2O_SCORES)}, got {score!r}")
        self.score = score
        self._acc: list[list[float]] = []  # per row (see _rows), per position: attention received so far
        self._first = -1                    # the first position whose every query was probed

    @property
    def cumulative(self) -> list[float]:
        return self._combine(self._acc) if self._acc else []

    def seen(self, j: int) -> int:
        """Probed queries that attended position ``j`` (its own included):
        every query from position ``max(j, first)`` on, ``first`` being the
        KV length before this policy's prefill."""
        return len(self._kept) - max(j, self._first)

    def ranking(self) -> list[float]:
        """Per position, the score evictions rank by (lowest first):
        :attr:`cumulative`, divided by :meth:`seen` with ``score="mean"``."""
        cum = self.cumulative
        if self.score == "sum":
            return cum
        return [c / self.seen(j) for j, c in enumerate(cum)]

    def _add(self, scores: AttentionScores) -> None:
        rows = self._rows(scores)
        if not self._acc:
            self._acc = [[] for _ in rows]
        for acc, row in zip(self._acc, rows):
            acc.extend([0.0] * (len(row) - len(acc)))
            for j, v in enumerate(row):
                acc[j] += v

    async def _prefill(self, ctx: Context, outputs: list[OutputSlot]) -> list[Any]:
        if self._first < 0:
            self._first = len(self._kept)
        res, scores = await self._pass(ctx, outputs, self.probe())
        self._grow(ctx.kv_len)
        await self._decoded(ctx, scores)
        return res

    async def _decoded(self, ctx: Context, scores: AttentionScores | None) -> None:
        if scores is not None:
            self._add(scores)
        over = self.kept_tokens - self.budget
        if over > 0:
            old = [j for j in range(self.sink, len(self._kept) - self.recent) if self._kept[j]]
            await self._evict(ctx, self._lowest(self.ranking(), old, over))


class TOVA(_Scored):
    """TOVA (Oren et al., 2024): over budget, evict the tokens the current
    query attends to least (heads of ``layers`` combined as ``heads`` says;
    default every layer, summed), never the first ``sink``; the prompt's
    scores are its last token's.

    Raises:
        ValueError: ``budget`` < 1, ``sink`` not in ``[0, budget)``,
            ``heads`` unknown, ``layers`` malformed, ``chunk`` < 1.
    """

    method = "tova"

    def __init__(self, budget: int, *, sink: int = 0, heads: str = "sum", layers: list[int] | None = None,
                 chunk: int = 1) -> None:
        super().__init__(budget, sink=sink, heads=heads, layers=layers, chunk=chunk)

    async def _prefill(self, ctx: Context, outputs: list[OutputSlot]) -> list[Any]:
        over = self.kept_tokens + len(ctx.pending) > self.budget
        res, scores = await self._pass(ctx, outputs, self.probe() if over else None, split=1 if over else 0)
        self._grow(ctx.kv_len)
        await self._decoded(ctx, scores)
        return res

    async def _decoded(self, ctx: Context, scores: AttentionScores | None) -> None:
        over = self.kept_tokens - self.budget
        if over > 0 and scores is not None:
            old = [j for j in self.kept_positions() if j >= self.sink]
            await self._evict(ctx, self._lowest(self._combine(self._rows(scores)), old, over))


class SnapKV(_Scored):
    """SnapKV (Li et al., 2024): the prompt's last ``window`` tokens vote
    (probe ``sum`` over the window's queries, per layer of ``layers`` and
    KV head), each row's votes are pooled (:func:`pool1d`, as the reference
    pools each head's) and the rows combined as ``heads`` says; the top
    ``budget - window - sink`` earlier positions are kept with the window
    and the first ``sink``. Decode steps over budget evict the lowest-voted
    prompt tokens first, then the oldest. With ``chunk`` > 1 the votes
    rank chunks (the sum of their kept positions' votes; ChunkKV's
    selection from the same observation window).

    Raises:
        ValueError: ``budget`` < 1, ``window`` not in ``[1, budget]``,
            ``sink + window`` over ``budget``, ``kernel_size`` not odd,
            ``pooling`` or ``heads`` unknown, ``layers`` malformed,
            ``chunk`` < 1.
    """

    method = "snapkv"

    def __init__(self, budget: int, *, window: int | None = None, kernel_size: int = 7, pooling: str = "max",
                 sink: int = 0, heads: str = "sum", layers: list[int] | None = None, chunk: int = 1) -> None:
        super().__init__(budget, sink=sink, heads=heads, layers=layers, chunk=chunk)
        self.window = min(32, self.budget - self.sink) if window is None else _int_arg("window", window, 1)
        if self.window > self.budget:
            raise ValueError(f"window must be at most budget ({self.budget}), got {window}")
        if self.sink + self.window > self.budget:
            raise ValueError(f"sink + window must be at most budget ({self.budget}), got {self.sink} + {self.window}")
        pool1d([], kernel_size, pooling)  # checks both
        self.kernel_size, self.pooling = kernel_size, pooling
        self.votes: list[float] = []   # pooled score per prompt position before the window
        self._order: list[int] = []     # prompt positions still kept (sinks aside), the next to evict last

    def probe(self) -> AttentionProbe | None:
        return None  # decode passes carry none: the votes are the observation window's

    async def _prefill(self, ctx: Context, outputs: list[OutputSlot]) -> list[Any]:
        over = self.kept_tokens + len(ctx.pending) > self.budget
        window_probe = fwd.attention_scores(self.layers, per_kv_head=True)  # rows pooled apart, as the reference's heads
        res, scores = await self._pass(ctx, outputs, window_probe if over else None,
                                       split=self.window if over else 0)
        self._grow(ctx.kv_len)
        if scores is not None:
            prefix = max(0, len(self._kept) - self.window)
            rows = [row for rows in scores.scores for row in rows]
            if self.heads == "sum":
                self.votes = [sum(col) for col in zip(*(pool1d(r[:prefix], self.kernel_size, self.pooling)
                                                         for r in rows))]
            else:
                self.votes = self._combine([pool1d(r[:prefix], self.kernel_size, self.pooling) for r in rows])
            kept = [j for j in range(self.sink, prefix) if self._kept[j]]
            self._order = sorted(kept, key=lambda j: (self.votes[j], j), reverse=True)
        await self._decoded(ctx, None)
        return res

    async def _decoded(self, ctx: Context, scores: AttentionScores | None) -> None:
        over = self.kept_tokens - self.budget
        if over <= 0:
            return
        if self.chunk > 1:
            gone = self._lowest(self.votes, self._order, min(over, len(self._order)))
            taken = set(gone)
            self._order = [j for j in self._order if j not in taken]
        else:
            gone = self._order[len(self._order) - min(over, len(self._order)):]
            del self._order[len(self._order) - len(gone):]
        rest, taken = over - len(gone), set(gone)
        old = [j for j in range(self.sink, len(self._kept)) if self._kept[j] and j not in taken][:rest] \
            if rest > 0 else []
        await self._evict(ctx, gone + old)


def make_policy(method: str, budget: int, **options: Any) -> EvictionPolicy:
    """The policy named ``method`` (:data:`METHODS`) with a KV budget of
    ``budget`` tokens and its keyword ``options`` (window: ``sink``; h2o:
    ``recent``, ``score``; snapkv: ``window``, ``kernel_size``, ``pooling``;
    h2o, snapkv, tova: ``sink``, ``heads``, ``layers``, ``chunk``).

    Raises:
        ValueError: an unknown method, an option the method does not take,
            or a bad value (naming it).
    """
    classes: dict[str, type[EvictionPolicy]] = {"window": SinkWindow, "h2o": H2O, "snapkv": SnapKV, "tova": TOVA}
    if method not in classes:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    try:
        return classes[method](budget, **options)
    except TypeError as e:  # an option this method does not take
        raise ValueError(f"method {method!r} takes no option among {sorted(options)}: {e}") from None

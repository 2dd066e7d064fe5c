"""A float64 reference for the attention-score probe, computed
independently of the engine's attention code: the queries the op-by-op
path computed (recorded as they leave its RoPE), the keys as the page pool
holds them (float16 widened, int8 rows dequantized exactly in float64),
and ``softmax(q . k * scale)`` over the keys each query may see, built from
the sequence's own state (causality, hidden tokens, dropped pages, a
sliding window). Used by tests/engine/test_attention_probe.py and tests/sdk/test_attention_probe_api.py.
"""

from __future__ import annotations

import torch

from tartlet.engine.core.attention_probe import AttentionProbeSpec
from tartlet.engine.core.kv_quant import SCALE_BYTES
from tartlet.engine.core.requests import ForwardRequest
from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

#: Relative error allowed between the probe and the float64 reference.
RTOL = 1e-5


def spec(engine, layers=None, reduce="sum", per="token", per_kv_head=False) -> AttentionProbeSpec:
    n = engine.config.num_hidden_layers
    return AttentionProbeSpec(tuple(range(n)) if layers is None else tuple(layers), reduce, per, per_kv_head)


class QueryRecorder:
    """Records the queries ``[T, nh, hd]`` of every layer the op-by-op path
    computes (the C RoPE + KV write, or PyTorch's RoPE), in call order: a
    pass over ``n`` layers adds ``n`` entries."""

    def __init__(self, model, monkeypatch) -> None:
        self.calls: list[torch.Tensor] = []
        kern = model.kernels
        if kern is not None:
            inner = kern.rope_qkv_store

            def rope_store(*a, **k):
                q = inner(*a, **k)
                self.calls.append(q.detach().clone())
                return q

            monkeypatch.setattr(kern, "rope_qkv_store", rope_store)
        rope, nh = model.attention.rope, model.nh

        def torch_rope(x, cos, sin):
            out = rope(x, cos, sin)
            if x.shape[1] > nh:  # the query and key heads together (forward_eager)
                self.calls.append(out[:, :nh].detach().clone())
            return out

        monkeypatch.setattr(model.attention, "rope", torch_rope)

    def take(self, n_layers: int) -> list[torch.Tensor]:
        """The last pass's queries, per layer."""
        assert len(self.calls) >= n_layers, f"recorded {len(self.calls)} layer calls, want {n_layers}"
        out = self.calls[-n_layers:]
        self.calls.clear()
        return out


def pool_keys(pool, layer: int, seq, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 keys ``[n, nkv, hd]`` of the sequence's first ``n`` tokens as
    the pool holds them (zeros in dropped pages), and which are live."""
    ps = pool.page_size
    live = torch.tensor([seq.pages[j // ps] is not None for j in range(n)])
    slots = torch.tensor([seq.pages[j // ps] * ps + j % ps for j in range(n) if live[j]], dtype=torch.long)
    k = pool.k[layer].index_select(0, slots)
    if k.dtype == torch.int8:  # quants times the row's float32 scale, exactly in float64
        hd = k.shape[-1] - SCALE_BYTES
        d = k[..., hd:].contiguous().view(torch.float32).double()
        k = k[..., :hd].double() * d
    k = k.double()
    out = torch.zeros(n, *k.shape[1:], dtype=torch.float64)
    out[live] = k
    return out, live


def weights(engine, seq, layer: int, q: torch.Tensor, q_index: list[int], n: int, window: int | None = None) -> torch.Tensor:
    """Float64 softmax weights ``[Q, nh, n]`` of queries ``q`` ``[Q, nh, hd]``
    (tokens ``q_index`` of ``seq``) over its first ``n`` tokens."""
    m = engine.model
    k, live = pool_keys(engine.pool, layer, seq, n)
    kr = k.repeat_interleave(m.nh // m.nkv, 1)
    s = torch.einsum("qhd,nhd->qhn", q.double(), kr) * m.scale
    j = torch.arange(n)[None, :]
    i = torch.tensor(q_index)[:, None]
    hidden = torch.tensor(list(seq.masked[:n]), dtype=torch.bool)[None, :]
    vis = ((j <= i) & live[None, :] & ~hidden) | (j == i)
    if window is not None:
        vis &= j > i - window
    return torch.softmax(s.masked_fill(~vis[:, None, :], float("-inf")), -1)


def expected(per_layer: list[torch.Tensor], sp: AttentionProbeSpec, nkv: int, page_size: int) -> torch.Tensor:
    """What the probe ``sp`` reports from per-layer weights ``[Q, nh, n]``:
    ``[layers, rows, n or pages]`` float64."""
    w = torch.stack(per_layer)
    n_l, Q, nh, n = w.shape
    rows = nkv if sp.per_kv_head else 1
    w = w.view(n_l, Q, rows, nh // rows, n)
    out = w.sum((1, 3)) if sp.reduce == "sum" else w.amax((1, 3))
    if sp.per == "page":
        pages = -(-n // page_size)
        pad = torch.zeros(n_l, rows, pages * page_size, dtype=out.dtype)
        pad[..., :n] = out
        blocks = pad.view(n_l, rows, pages, page_size)
        out = blocks.sum(-1) if sp.reduce == "sum" else blocks.amax(-1)
    return out


def assert_matches(scores, want: torch.Tensor, rtol: float = RTOL) -> float:
    """The probe's ``AttentionScores`` equal ``want`` within ``rtol``
    relative, and exactly 0 where ``want`` is 0; returns the worst error."""
    got = torch.tensor(scores.scores, dtype=torch.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    zero = want == 0
    assert bool((got[zero] == 0).all()), "a position no query may see has a nonzero score"
    rel = ((got - want).abs() / want.abs().where(~zero, torch.ones(()))).max()
    assert float(rel) <= rtol, f"relative error {float(rel):.3g} > {rtol}"
    return float(rel)


def probe_request(seq, tokens: list[int], sp: AttentionProbeSpec | None) -> ForwardRequest:
    """A pass asking for the last token's logits and, with ``sp``, the probe."""
    return ForwardRequest(seq, list(tokens), outputs=[OutputSlot(len(tokens) - 1, ProbeSpec("logits"))], probe=sp)


def run(engine, seq, tokens: list[int], sp: AttentionProbeSpec | None = None) -> list:
    """One pass; ``[logits]`` or ``[logits, scores]``."""
    return engine.scheduler.submit(probe_request(seq, tokens, sp)).result(timeout=300)


def together(engine, reqs: list[ForwardRequest]) -> list[list]:
    """``reqs`` submitted from the scheduler thread in one command, so they
    share one model call (asserted), in order; their results."""
    sch = engine.scheduler
    calls = sch.stats.model_calls
    futs = sch.command(lambda: [sch.submit(r) for r in reqs]).result(timeout=60)
    out = [f.result(timeout=300) for f in futs]
    assert sch.stats.model_calls == calls + 1, "the requests did not share one model call"
    return out

"""The attention-score probe (issue 36 part 1) against a float64 reference
(tests/probe_reference.py: the engine's queries, the pool's keys, softmax
in float64 over the keys each query may see) on the default model: every
attention path (the C kernel for decode rows and short prefills, the fused
decode step, the explicit PyTorch path that replaces SDPA for long
prefills and where no C kernel runs), float32, float16 and int8 pools,
batched with other contexts, after a fork, after a prefix-cache hit,
hidden and dropped positions, per page, and a sliding-window model.
"""

from __future__ import annotations

import pytest
import torch

from probe_reference import RTOL, QueryRecorder, assert_matches, expected, probe_request, run, spec, together, weights
from tartlet.engine.core.batch import BatchItem, build_batch
from tartlet.engine.kernels.quant_kernels import decoder_desc

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"


def ids(engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer.encode(text)


def free(engine, *seqs) -> None:
    for s in seqs:
        engine.scheduler.command(s.free).result(timeout=30)


def check_pass(engine, rec, seq, res, sp, q_index) -> float:
    """``res`` (``[logits, scores]`` of the pass just run) equals the
    reference built from the recorded queries (each layer's sliding window
    applied); the worst relative error."""
    qs = rec.take(engine.config.num_hidden_layers)  # the pass's only request: its rows are all the rows
    wins = engine.model.windows
    per_layer = [weights(engine, seq, layer, qs[layer], q_index, len(seq), wins[layer]) for layer in sp.layers]
    want = expected(per_layer, sp, engine.config.num_key_value_heads, engine.pool.page_size)
    return assert_matches(res[-1], want)


def test_prefill_and_decode_equal_the_float64_reference(engine, monkeypatch):
    """Float32 model, C kernel rows (prefill query by query, decode):
    every layer, summed over queries and heads; each layer's mass is the
    number of queries times heads (each query's weights sum to 1)."""
    rec = QueryRecorder(engine.model, monkeypatch)
    seq = engine.new_sequence()
    try:
        toks = ids(engine)
        sp = spec(engine)
        res = run(engine, seq, toks, sp)
        check_pass(engine, rec, seq, res, sp, list(range(len(toks))))
        nh = engine.model.nh
        for row in res[1].scores:
            assert sum(row[0]) == pytest.approx(len(toks) * nh, rel=1e-6)
        tok = int(torch.tensor(res[0]).argmax())
        for _ in range(3):
            res = run(engine, seq, [tok], sp)
            check_pass(engine, rec, seq, res, sp, [len(seq) - 1])
            tok = int(torch.tensor(res[0]).argmax())
    finally:
        free(engine, seq)


@pytest.mark.parametrize("reduce,per_kv_head", [("max", False), ("max", True), ("sum", True)])
def test_max_and_per_kv_head(engine, monkeypatch, reduce, per_kv_head):
    rec = QueryRecorder(engine.model, monkeypatch)
    seq = engine.new_sequence()
    try:
        sp = spec(engine, layers=[0, 7, 29], reduce=reduce, per_kv_head=per_kv_head)
        res = run(engine, seq, ids(engine), sp)
        check_pass(engine, rec, seq, res, sp, list(range(len(seq))))
        assert res[1].layers == [0, 7, 29] and res[1].kv_heads == (engine.config.num_key_value_heads if per_kv_head else 1)
        res = run(engine, seq, [42], sp)
        check_pass(engine, rec, seq, res, sp, [len(seq) - 1])
    finally:
        free(engine, seq)


def test_per_page_is_the_per_token_result_pooled(engine):
    """Two forks run the same decode pass, one probing per token, one per
    page: each page's value is its tokens' sum (or max)."""
    seq = engine.new_sequence()
    try:
        run(engine, seq, ids(engine) * 3)
        ps = engine.pool.page_size
        for reduce in ("sum", "max"):
            a, b = (engine.scheduler.command(seq.fork).result(30) for _ in range(2))
            tok, page = together(engine, [probe_request(a, [7], spec(engine, reduce=reduce)),
                                          probe_request(b, [7], spec(engine, reduce=reduce, per="page"))])
            assert tok[0] == page[0]  # the same logits
            t = torch.tensor(tok[1].scores, dtype=torch.float64)
            n = t.shape[-1]
            pages = -(-n // ps)
            assert page[1].per == "page" and len(page[1]) == pages
            pad = torch.zeros(*t.shape[:2], pages * ps, dtype=torch.float64)
            pad[..., :n] = t
            blocks = pad.view(*t.shape[:2], pages, ps)
            want = blocks.sum(-1) if reduce == "sum" else blocks.amax(-1)
            assert torch.allclose(torch.tensor(page[1].scores, dtype=torch.float64), want, rtol=1e-6, atol=0)
            free(engine, a, b)
    finally:
        free(engine, seq)


@pytest.mark.parametrize("pool", ["quant_engine", "f16_engine", "q8_engine"])
def test_float16_and_int8_pools_op_by_op(request, pool, monkeypatch):
    """The C kernels over float32, float16 and int8 pages (the reference
    reads the keys as stored: widened, or dequantized in float64)."""
    eng = request.getfixturevalue(pool)
    monkeypatch.setattr(eng.runner.fused, "enabled", False)
    rec = QueryRecorder(eng.model, monkeypatch)
    seq = eng.new_sequence()
    try:
        sp = spec(eng)
        res = run(eng, seq, ids(eng), sp)
        check_pass(eng, rec, seq, res, sp, list(range(len(seq))))
        for tok in (5, 9):
            res = run(eng, seq, [tok], sp)
            check_pass(eng, rec, seq, res, sp, [len(seq) - 1])
    finally:
        free(eng, seq)


def fused_layer_by_layer(engine, seq, tok: int, layers: list[int]) -> list[float]:
    """One decode step of ``seq`` op by op (queries and each layer's input
    recorded), then the fused step (``tq_decode_layers``) run alone on each
    layer of ``layers`` from that layer's input, with the probe: its weights
    against the float64 reference of the same queries (the step's RMSNorm,
    QKV projection and RoPE are the op-by-op kernels'). Worst errors."""
    m = engine.model
    f = engine.runner.fused
    qs: list[torch.Tensor] = []
    xs: list[torch.Tensor] = []
    ln1 = {id(layer["ln1"]): i for i, layer in enumerate(m.layers)}
    kern, rms = m.kernels, m.kernels.rms_norm
    rope = kern.rope_qkv_store

    def step():
        start = len(seq)
        slots = seq.reserve([tok], [start], custom_attention=False)
        sp = spec(engine)
        batch = build_batch([BatchItem(seq, [tok], start, slots, [0], None, probe=sp)])
        kern.rms_norm = lambda x, w, eps: (xs.append(x.clone()) if id(w) in ln1 else None, rms(x, w, eps))[1]
        kern.rope_qkv_store = lambda *a: (lambda q: (qs.append(q.clone()), q)[1])(rope(*a))
        f.enabled = False
        try:
            engine.runner.forward(batch)
        finally:
            f.enabled = True
            del kern.rms_norm, kern.rope_qkv_store
        g = batch.groups[0]
        desc = f._descriptor(engine.pool.k, engine.pool.v)
        cos, sin = m.rotary.cos_sin(batch.positions)
        errs = []
        for i in layers:
            one, keep = decoder_desc([desc.layers[i]], *f._dims, kv_dtype=engine.pool.k.dtype)
            buf = torch.empty(1, 1, m.nh, g.kv_slots.shape[1])
            args = [(None, 0, g.kv_slots.contiguous(), None, buf, torch.zeros(1, dtype=torch.long))]
            x = xs[i].clone()
            m.quant.decode_layers(one, x, cos, sin, batch.write_slots, args, torch.get_num_threads())
            want = weights(engine, seq, i, qs[i], [start], len(seq))[0]
            got = buf[0, 0].double()
            errs.append(float(((got - want).abs() / want.where(want > 0, torch.ones(()))).max()))
            assert bool((got[want == 0] == 0).all())
            del keep
        seq.commit_full_pages()
        return errs

    return engine.scheduler.command(step).result(timeout=120)


@pytest.mark.parametrize("pool", ["quant_engine", "q8_engine"])
def test_fused_decode_step(request, pool, monkeypatch):
    """The fused step's probe: each layer run by the step from the op-by-op
    input equals the float64 reference (1e-5); a whole fused step's layer 0
    too (its queries are the op-by-op path's: the paths differ first in
    layer 0's SiLU); its other layers' queries are not observable and differ
    from the op-by-op ones by that rounding (float32 pages: scores within
    2e-3 of the reference built from the op-by-op queries)."""
    eng = request.getfixturevalue(pool)
    seq = eng.new_sequence()
    try:
        run(eng, seq, ids(eng))
        errs = fused_layer_by_layer(eng, seq, 11, [0, 1, 9, 20, 29])
        assert max(errs) <= RTOL, errs
        rec = QueryRecorder(eng.model, monkeypatch)
        a, b = (eng.scheduler.command(seq.fork).result(30) for _ in range(2))
        sp = spec(eng)
        fused = run(eng, a, [13], sp)  # fused (the engine's choice for a decode row)
        assert not rec.calls, "the decode step did not run fused"
        monkeypatch.setattr(eng.runner.fused, "enabled", False)
        ref = run(eng, b, [13], sp)
        assert len(ref[1]) == len(fused[1])
        qs = rec.take(eng.config.num_hidden_layers)  # the op-by-op queries, over the fused pass's keys
        want = expected([weights(eng, a, i, qs[i], [len(a) - 1], len(a)) for i in sp.layers], sp, eng.model.nkv, 16)
        assert_matches(type(fused[1])([0], "sum", "token", 1, fused[1].scores[:1]), want[:1])
        if eng.pool.k.dtype != torch.int8:  # layers >= 1: the queries differ by the SiLU rounding (int8 pages
            assert_matches(fused[1], want, rtol=2e-3)  # re-quantize that difference in the new token's rows: ~5%)
        free(eng, a, b)
    finally:
        free(eng, seq)


@pytest.mark.parametrize("fused", [True, False])
def test_batched_with_other_contexts(quant_engine, monkeypatch, fused):
    """One model call with a probed context among others: the others'
    logits are bit for bit those of the same call without the probe, and so
    are the probed context's own (the C kernels only copy weights out); its
    scores equal the reference (op by op) and cover only its positions."""
    eng = quant_engine
    monkeypatch.setattr(eng.runner.fused, "enabled", fused)
    rec = QueryRecorder(eng.model, monkeypatch)
    texts = [PROMPT, "Once upon a time", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14"]
    base = [eng.new_sequence() for _ in texts]
    try:
        for s, t in zip(base, texts):
            run(eng, s, ids(eng, t))
        for step in range(2):
            runs = []
            for probed in (True, False):
                seqs = [eng.scheduler.command(s.fork).result(30) for s in base]
                reqs = [probe_request(s, [17 + step], spec(eng, [0, 5, 29]) if (probed and i == 1) else None)
                        for i, s in enumerate(seqs)]
                rec.calls.clear()
                runs.append((seqs, together(eng, reqs), list(rec.calls)))
            (seqs, with_probe, calls), (others, without, _) = runs
            for a, b in zip(with_probe, without):
                assert a[0] == b[0]  # logits, bit for bit
            assert len(with_probe[1]) == 2 and all(len(r) == 1 for i, r in enumerate(with_probe) if i != 1)
            assert len(with_probe[1][1]) == len(seqs[1])
            if not fused:  # the queries of row 1 (rows: one per context, in order)
                sp = spec(eng, [0, 5, 29])
                per_layer = [weights(eng, seqs[1], i, calls[i][1:2], [len(seqs[1]) - 1], len(seqs[1])) for i in sp.layers]
                assert_matches(with_probe[1][1], expected(per_layer, sp, eng.model.nkv, 16))
            free(eng, *seqs, *others)
    finally:
        free(eng, *base)


def test_fork_copy_on_write_pages(engine, monkeypatch):
    """A parent and its fork decode different tokens in one call: the fork
    shares the full pages and copied the tail page; each context's scores
    are its own queries' over its own positions."""
    rec = QueryRecorder(engine.model, monkeypatch)
    parent = engine.new_sequence()
    try:
        run(engine, parent, ids(engine)[:21])  # a partly filled second page
        child = engine.scheduler.command(parent.fork).result(30)
        sp = spec(engine)
        rec.calls.clear()
        res = together(engine, [probe_request(parent, [100], sp), probe_request(child, [200], sp)])
        n_layers = engine.config.num_hidden_layers
        qs = rec.take(n_layers)
        assert parent.pages[0] == child.pages[0] and parent.pages[1] != child.pages[1]
        for b, (s, r) in enumerate(zip((parent, child), res)):
            per_layer = [weights(engine, s, i, qs[i][b : b + 1], [len(s) - 1], len(s)) for i in range(n_layers)]
            assert_matches(r[1], expected(per_layer, sp, engine.model.nkv, 16))
        free(engine, child)
    finally:
        free(engine, parent)


def test_prefix_cache_hit(engine, monkeypatch):
    """A context whose prompt came from the prefix cache reports scores
    over the cached pages too; a probed prompt is computed whole (never
    served from the cache), so every query counts."""
    rec = QueryRecorder(engine.model, monkeypatch)
    toks = ids(engine) * 2
    first, second, third = (engine.new_sequence() for _ in range(3))
    try:
        run(engine, first, toks)
        stats = engine.scheduler.stats
        reused = stats.prefix_tokens_reused
        run(engine, second, toks)
        assert stats.prefix_tokens_reused - reused >= 32  # two full pages attached, not computed
        assert second.pages[:2] == first.pages[:2]
        sp = spec(engine)
        res = run(engine, second, [300], sp)
        check_pass(engine, rec, second, res, sp, [len(second) - 1])
        reused = stats.prefix_tokens_reused
        res = run(engine, third, toks, sp)
        assert stats.prefix_tokens_reused == reused
        check_pass(engine, rec, third, res, sp, list(range(len(toks))))
    finally:
        free(engine, first, second, third)


def test_hidden_and_dropped_positions_weigh_zero(engine, monkeypatch):
    rec = QueryRecorder(engine.model, monkeypatch)
    seq = engine.new_sequence()
    try:
        run(engine, seq, ids(engine) * 3)
        engine.scheduler.command(lambda: seq.mask_range(3, 40, True), seq).result(30)
        assert engine.scheduler.command(seq.drop_masked_pages, seq).result(30) == 1  # page 1 (16..31)
        sp = spec(engine)
        res = run(engine, seq, [55], sp)
        check_pass(engine, rec, seq, res, sp, [len(seq) - 1])
        for row in res[1].scores:
            assert all(x == 0.0 for x in row[0][3:40]) and row[0][0] > 0 and row[0][40] > 0
    finally:
        free(engine, seq)


def test_long_prefill_takes_the_explicit_path_across_chunks(engine, monkeypatch):
    """A prompt past the C kernel's 128 x 128 scores runs the explicit
    softmax path (not SDPA), in two chunks of ``max_batch_tokens``: the
    scores add up over the chunks."""
    rec = QueryRecorder(engine.model, monkeypatch)
    seq = engine.new_sequence()
    toks = (ids(engine) * 30)[:700]
    try:
        calls = engine.scheduler.stats.model_calls
        res = run(engine, seq, toks, spec(engine, [0, 15, 29]))
        assert engine.scheduler.stats.model_calls == calls + 2
        n_layers = engine.config.num_hidden_layers
        qs = rec.calls
        assert len(qs) == 2 * n_layers
        chunks = [(qs[i], qs[n_layers + i]) for i in range(n_layers)]
        sp = spec(engine, [0, 15, 29])
        split = 512
        per_layer = []
        for i in sp.layers:
            a = weights(engine, seq, i, chunks[i][0], list(range(split)), len(toks))
            b = weights(engine, seq, i, chunks[i][1], list(range(split, len(toks))), len(toks))
            per_layer.append(torch.cat([a, b]))
        assert_matches(res[1], expected(per_layer, sp, engine.model.nkv, 16))
    finally:
        free(engine, seq)


def test_the_pytorch_path(engine, monkeypatch):
    """Without the C kernels (bfloat16 pools, CUDA) every group takes the
    explicit path, decode rows included (on CUDA instead of the Triton kernel).
    A prompt of its own: after the module's earlier tests its prompt's pages
    can come from the prefix cache, keys computed by the C path (whose SiLU
    differs from PyTorch's by ~1e-7) meeting this path's queries: 1.2e-5
    from the reference, over RTOL, once the C softmax's summation changed
    (alone, or on a fresh prompt: 3.5e-6)."""
    monkeypatch.setattr(engine.model, "kernels", None)
    monkeypatch.setattr(engine.model.attention, "kernels", None)
    rec = QueryRecorder(engine.model, monkeypatch)
    seq = engine.new_sequence()
    try:
        sp = spec(engine, reduce="max", per_kv_head=True)
        res = run(engine, seq, ids(engine, "Without the kernels, " + PROMPT), sp)
        check_pass(engine, rec, seq, res, sp, list(range(len(seq))))
        res = run(engine, seq, [77], sp)
        check_pass(engine, rec, seq, res, sp, [len(seq) - 1])
    finally:
        free(engine, seq)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_models(tokenizer, tmp_path_factory, monkeypatch, family):
    """Random-weight models with sliding-window layers (tests/engine/test_sliding_window_kv.py's: window 8,
    pages of 4): Mistral (every layer slides: pages before the window are
    released) and Gemma 3 (sliding and global layers). A sliding layer's
    scores cover its window only, the columns it reads cut to the window
    (``Attention.window_group``) mapped back to positions."""
    sw = pytest.importorskip("test_sliding_window_kv")
    path = tmp_path_factory.mktemp(f"{family}-probe")
    if family == "mistral":
        sw.make_model("MistralConfig", dict(sliding_window=sw.W), tokenizer, path)
    else:
        sw.make_model("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=sw.W,
                                               layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                      tokenizer, path)
    r = sw.Runner(path)
    eng = r.eng
    try:
        rec = QueryRecorder(eng.model, monkeypatch)
        toks = sw.ids_for(30, 3, eng.config.vocab_size)
        seq = eng.new_sequence()
        sp = spec(eng)
        res = run(eng, seq, toks[:6], sp)
        check_pass(eng, rec, seq, res, sp, list(range(6)))
        for n in range(6, 30):
            res = run(eng, seq, [toks[n]], sp)
            check_pass(eng, rec, seq, res, sp, [n])
        sliding = [i for i, w in enumerate(eng.model.windows) if w is not None]
        for i in sliding:  # the last query (token 29) sees tokens 22..29 only
            row = res[1].scores[i][0]
            assert all(x == 0 for x in row[:22]) and all(x > 0 for x in row[22:])
        if family == "mistral":
            assert seq.window_dropped > 0
        else:
            assert all(x > 0 for x in res[1].scores[1][0])  # the global layer sees everything
    finally:
        r.close()


def test_fused_prefill_rows(quant_engine, monkeypatch):
    """A short prompt runs fused too, query by query (the kernel's prefill
    rows): its layer 0 equals the reference built from the op-by-op queries
    of the same prompt (layer 0's queries and keys are the same bits on both
    paths), every query counted."""
    eng = quant_engine
    rec = QueryRecorder(eng.model, monkeypatch)
    a, b = eng.new_sequence(), eng.new_sequence()
    try:
        toks = ids(eng)
        sp = spec(eng, [0, 29])
        fused = run(eng, a, toks, sp)
        assert not rec.calls, "the prompt did not run fused"
        monkeypatch.setattr(eng.runner.fused, "enabled", False)
        run(eng, b, toks, sp)
        q0 = rec.take(eng.config.num_hidden_layers)[0]
        want = expected([weights(eng, a, 0, q0, list(range(len(toks))), len(toks))], spec(eng, [0]), eng.model.nkv, 16)
        assert_matches(type(fused[1])([0], "sum", "token", 1, fused[1].scores[:1]), want)
        assert sum(fused[1].scores[1][0]) == pytest.approx(len(toks) * eng.model.nh, rel=1e-5)
    finally:
        free(eng, a, b)

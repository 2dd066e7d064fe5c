"""The CUDA engine path (issue 15): Triton paged decode attention, fused
RoPE + KV write and RMSNorm, CUDA graphs of decode steps, sampling with GPU logits.

Engine tests need a CUDA GPU and skip without one (CI has none; they ran
on the device machine, see docs/benchmarks.md "GPU"). The kernel test also
runs on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, with
Triton installed), where float16 stands in for bfloat16 (the interpreter
has no bfloat16). The model is a small random-weight Llama (and a Qwen2
with QKV biases) built with transformers, whose float32 logits on the
same GPU are the reference.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the CUDA path needs Triton")
transformers = pytest.importorskip("transformers")

from tartlet.engine.cuda.attention import paged_decode_attention  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs a CUDA GPU or TRITON_INTERPRET=1")]  # fmt: skip


def reference_attention(q, kc, vc, slots, lens, mask, rows, scale) -> torch.Tensor:
    """Single-query attention of each request in float32, head by head."""
    T, nh, hd = q.shape
    rep = nh // kc.shape[1]
    out = torch.zeros(T, nh * hd, dtype=torch.float32, device=q.device)
    for b in range(slots.shape[0]):
        cols = torch.arange(int(lens[b]), device=q.device)
        if mask is not None:
            cols = cols[mask[b, : len(cols)]]
        if len(cols) == 0:
            continue
        k = kc[slots[b, cols]].float().repeat_interleave(rep, 1)  # [n, nh, hd]
        v = vc[slots[b, cols]].float().repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[rows[b]].float(), k) * scale
        out[rows[b]] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).reshape(-1)
    return out


KERNEL_CASES = [  # dtype, heads, KV heads, head_dim, requests, slots per request
    (torch.float32, 4, 2, 16, 3, 70),
    (torch.float32, 6, 6, 80, 2, 5),
    (torch.float32, 32, 8, 128, 1, 300),
    (torch.bfloat16 if HAS_CUDA else torch.float16, 8, 2, 64, 4, 130),
    (torch.bfloat16 if HAS_CUDA else torch.float16, 32, 8, 128, 3, 1000),
]


@pytest.mark.parametrize("dtype,nh,nkv,hd,B,L", KERNEL_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_decode_kernel_matches_reference(dtype, nh, nkv, hd, B, L, masked):
    """Random pool rows, lengths (one request empty) and holes: the kernel's
    output equals float32 softmax attention within the dtype's rounding."""
    torch.manual_seed(0)
    dev, S, T = KERNEL_DEVICE, 4096, B + 2
    kc = torch.randn(S, nkv, hd, device=dev).to(dtype)
    vc = torch.randn(S, nkv, hd, device=dev).to(dtype)
    q = torch.randn(T, (nh + 2 * nkv) * hd, device=dev).to(dtype)[:, : nh * hd].view(T, nh, hd)  # a strided view, as in the model
    slots = torch.randint(0, S, (B, L), device=dev)
    lens = torch.randint(0, L + 1, (B,), device=dev).to(torch.int32)
    lens[0] = L
    if B > 1:
        lens[1] = 0
    mask = (torch.rand(B, L, device=dev) > 0.3) if masked else None
    rows = torch.randperm(T, device=dev)[:B].to(torch.int32)
    out = torch.zeros(T, nh * hd, dtype=dtype, device=dev)
    paged_decode_attention(q, kc, vc, slots, lens, mask, rows, out, 1 / math.sqrt(hd))
    want = reference_attention(q, kc, vc, slots, lens, mask, rows, 1 / math.sqrt(hd))
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - want).abs().max()) <= tol
    if B > 1:
        assert not out[rows[1].long()].any(), "a request with no slot gets zeros"


@pytest.mark.parametrize("dtype,nh,nkv,hd,T", [(torch.float32, 4, 2, 16, 5), (torch.float32, 6, 6, 80, 3),
                                                (torch.bfloat16 if HAS_CUDA else torch.float16, 32, 8, 128, 7)])
def test_rope_kv_kernel_matches_reference(dtype, nh, nkv, hd, T):
    """The fused RoPE + KV write equals rotate_half RoPE in float32 (queries
    rotated in place, keys and values in their pool rows, other rows untouched)."""
    from tartlet.engine.cuda.rope import rope_qkv_store

    torch.manual_seed(0)
    dev, S = KERNEL_DEVICE, 64
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, device=dev).to(dtype)
    ref = qkv.float().clone()
    ang = torch.rand(T, hd // 2, device=dev) * 6
    cos, sin = ang.cos(), ang.sin()
    kc, vc = torch.zeros(S, nkv, hd, device=dev, dtype=dtype), torch.zeros(S, nkv, hd, device=dev, dtype=dtype)
    slots = torch.randperm(S, device=dev)[:T]
    q = rope_qkv_store(qkv, cos, sin, kc, vc, slots, nh, nkv, hd)

    def rot(x):  # [T, heads, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    heads = ref.view(T, nh + 2 * nkv, hd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((q.float() - rot(heads[:, :nh])).abs().max()) <= tol
    assert float((kc[slots].float() - rot(heads[:, nh : nh + nkv])).abs().max()) <= tol
    assert float((vc[slots].float() - heads[:, nh + nkv :]).abs().max()) <= tol
    rest = torch.ones(S, dtype=torch.bool, device=dev)
    rest[slots] = False
    assert not kc[rest].any() and not vc[rest].any()


@pytest.mark.parametrize("dtype,T,H", [(torch.float32, 3, 64), (torch.float32, 2, 100),
                                       (torch.bfloat16 if HAS_CUDA else torch.float16, 5, 4096)])
def test_rms_norm_kernel_matches_torch(dtype, T, H):
    from tartlet.engine.cuda.rms_norm import rms_norm

    torch.manual_seed(0)
    x = (torch.randn(T, H + 8, device=KERNEL_DEVICE) * 3).to(dtype)[:, :H]  # rows with a stride, as slices are
    w = torch.randn(H, device=KERNEL_DEVICE).to(dtype)
    want = torch.nn.functional.rms_norm(x.float(), (H,), w.float(), 1e-5)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and float((got.float() - want).abs().max()) <= (1e-5 if dtype == torch.float32 else 3e-2) * float(want.abs().max())


def test_decode_kernel_rejects_bad_shapes():
    dev = KERNEL_DEVICE
    kc = torch.zeros(64, 2, 16, device=dev)
    q = torch.zeros(2, 4, 16, device=dev)
    slots, lens, rows = torch.zeros(2, 8, dtype=torch.long, device=dev), torch.zeros(2, dtype=torch.int32, device=dev), torch.zeros(2, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="do not match"):
        paged_decode_attention(torch.zeros(2, 3, 16, device=dev), kc, kc, slots, lens, None, rows, torch.zeros(2, 48, device=dev), 1.0)
    with pytest.raises(ValueError, match="cover"):
        paged_decode_attention(q, kc, kc, slots, lens[:1], None, rows, torch.zeros(2, 64, device=dev), 1.0)
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_attention(q, kc, kc, slots, lens, None, rows, torch.zeros(2, 63, device=dev), 1.0)


# -- the engine on CUDA --------------------------------------------------------

VOCAB = 512
DIMS = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.05)  # fmt: skip
FAMILIES = {"llama": ("LlamaConfig", dict(head_dim=32)), "qwen2": ("Qwen2Config", dict())}


def make_folder(family: str, root):
    """A random-weight model saved as a Hugging Face folder with a word-level
    tokenizer of ``VOCAB`` tokens; returns ``(path, transformers model)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**DIMS, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / family
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
    return path, model.to("cuda")


def engine(path, dtype: str, graphs: bool = True, kv_cache_mb: int = 64):
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.loading.loader import load_model

    cfg = EngineConfig(model=str(path), device="cuda", dtype=dtype, kv_cache_mb=kv_cache_mb, cuda_graphs=graphs)
    loaded = load_model(path, dtype=cfg.torch_dtype())
    return Engine(cfg, loaded.config, loaded.weights, loaded.tokenizer)


def logits_run(eng, prompt: list[int], steps: list[int]) -> torch.Tensor:
    """Logits at every prompt position, then after each of ``steps`` fed one at a time."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

    seq = eng.new_sequence()
    rows = eng.scheduler.submit(ForwardRequest(seq, prompt, outputs=[OutputSlot(i, ProbeSpec("logits")) for i in range(len(prompt))])).result(60)
    for t in steps:
        rows += eng.scheduler.submit(ForwardRequest(seq, [t], outputs=[OutputSlot(0, ProbeSpec("logits"))])).result(60)
    eng.scheduler.command(seq.free, seq).result(60)
    return torch.tensor(rows)


def greedy(eng, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens for each prompt, all decoded together (one batch a step)."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    seqs = [eng.new_sequence() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]
    for _ in range(n):
        futs = [eng.scheduler.submit(ForwardRequest(s, toks, outputs=[OutputSlot(len(toks) - 1, SamplerSpec(temperature=0.0))]))
                for s, toks in zip(seqs, pending)]  # fmt: skip
        for i, f in enumerate(futs):
            tok = int(f.result(60)[0])
            out[i].append(tok)
            pending[i] = [tok]
    for s in seqs:
        eng.scheduler.command(s.free, s).result(60)
    return out


@needs_cuda
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_matches_transformers(family, dtype, tmp_path):
    """A 40-token prompt and 24 decode steps on the GPU (decode through the
    CUDA graphs): logits within the dtype's tolerance of transformers'
    float32 logits on the same GPU, and no page left in use."""
    path, ref = make_folder(family, tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (64,), generator=g).tolist()
    prompt, steps = ids[:40], ids[40:]
    with torch.no_grad():
        want = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    eng = engine(path, dtype)
    try:
        got = logits_run(eng, prompt, steps)
        assert eng.runner.graphs is not None and eng.runner.graphs.replays >= len(steps)
        assert eng.pool.stats().used == 0
    finally:
        eng.close()
    diff, scale = float((got - want[: got.shape[0]]).abs().max()), float(want.abs().max())
    print(f"{family} {dtype}: max abs logit diff {diff:.3e} (largest logit {scale:.2f})")
    assert got.shape == (64, VOCAB)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"{family} {dtype}: top-1 equal at {agree:.1%} of positions")
    assert diff <= (1e-4 if dtype == "float32" else 4e-2) * scale
    if dtype == "float32":
        assert agree == 1.0


@needs_cuda
def test_graphs_match_op_by_op(tmp_path):
    """The same steps replayed from CUDA graphs (padded to a bucket) and
    launched op by op give the same logits, for one request and for five
    of different lengths in one batch."""
    path, _ = make_folder("llama", tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 33, 100, 250, 300)]
    got = {}
    for graphs in (True, False):
        eng = engine(path, "float32", graphs=graphs)
        try:
            got[graphs] = (greedy(eng, prompts[:1], 12), greedy(eng, prompts, 12))
            if graphs:
                assert eng.runner.graphs is not None and eng.runner.graphs.captures >= 2
        finally:
            eng.close()
    assert got[True] == got[False]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_greedy_equals_alone_on_cuda(dtype, tmp_path):
    """Batching never changes greedy outputs (float32); in bfloat16 the
    batch size changes cuBLAS's kernels and so the rounding, which can
    flip a near tie of a random model: the agreement is reported."""
    path, _ = make_folder("qwen2", tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 64, 130, 9, 40, 77, 3)]
    eng = engine(path, dtype)
    try:
        alone = [greedy(eng, [p], 24)[0] for p in prompts]
        together = greedy(eng, prompts, 24)
        assert eng.pool.stats().used == 0
    finally:
        eng.close()
    same = sum(a == b for x, y in zip(alone, together) for a, b in zip(x, y)) / (24 * len(prompts))
    print(f"{dtype}: batched greedy tokens equal to alone: {same:.1%}")
    if dtype == "float32":
        assert together == alone


@needs_cuda
def test_sampling_and_masks_with_gpu_logits(tmp_path):
    """Seeded sampling, top-k/top-p and logit masks work on GPU logits and a
    seeded draw equals the CPU engine's choice from the same logits."""
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec, SlotSampler

    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB, device="cuda") * 3
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[5, 9, 11]] = True
    slots = [OutputSlot(0, SamplerSpec(temperature=0.8, top_p=0.9, seed=7)),
             OutputSlot(1, SamplerSpec(temperature=0.0), allowed),
             OutputSlot(2, SamplerSpec(temperature=1.0, top_k=5, seed=11))]  # fmt: skip
    s = SlotSampler(VOCAB)
    on_gpu = s.run(logits, slots)
    on_cpu = s.run(logits.cpu(), slots)
    assert on_gpu == on_cpu
    assert on_gpu[1] in (5, 9, 11)


@needs_cuda
def test_overlap_scheduling_matches_the_synchronous_loop_on_cuda(tmp_path):
    """Greedy token chains of different lengths, concurrently, on the GPU
    (decode steps from CUDA graphs) with overlap scheduling and without:
    the same tokens and sequence lengths, steps run ahead, no page left."""
    from test_overlap import chain

    path, _ = make_folder("llama", tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 40, 17, 130, 64, 9)]
    lengths = [3, 20, 33, 8, 25, 40]
    got = {}
    for overlap in (True, False):
        eng = engine(path, "float32")
        eng.scheduler.overlap = overlap
        try:
            subs = [chain(eng, p, lambda n, t, m=m: n < m) for p, m in zip(prompts, lengths)]
            for f, _, _ in subs:
                f.result(120)
            got[overlap] = [(list(toks), len(seq)) for _, toks, seq in subs]
            for _, _, seq in subs:
                eng.scheduler.command(seq.free, seq).result(60)
            assert eng.pool.stats().used == 0
            st = eng.scheduler.stats
            assert (st.lookaheads > sum(lengths) // 2) == overlap and st.lookaheads_dropped <= st.lookaheads
            assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
        finally:
            eng.close()
    assert got[True] == got[False]

"""The default model run quantized (how ``tartlet run`` and ``serve`` load a
GGUF) against the float32 reference path on the same file.

The quantized engine multiplies the Q4_1/Q8_0 blocks directly, with
activations quantized to 16-bit blocks; the reference dequantizes every
weight to float32 (checked against transformers in ``test_logits.py``).

The quantized engine keeps keys and values in float16 pages (``kv_dtype``
``auto`` with quantized weights), the reference in float32 ones.
Tolerances: logits of magnitude ~38 differ by at most ``LOGIT_ATOL`` (0.044
measured: 0.009-0.013 of it the kernels, measured with float32 pages, the
rest the float16 pages; ~2x room); greedy tokens agree on at least 95% of
256 teacher-forced decode positions (the issue's bar; 100% measured with
either page dtype).
"""

from __future__ import annotations

import pytest
import torch

from harness import inline_program, run_ok
from test_logits import PROBE, as_tensor
from tiny_gguf import write_tiny_llama

LOGIT_ATOL = 0.1

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old in two sentences.",
    "List the first five prime numbers.",
    "Translate 'good morning' into Spanish and German.",
]

TEACHER_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than any scribe. Before his invention, books were copied by hand, which made them "
    "rare and expensive, and most people never owned one. Within fifty years presses had spread to more than two "
    "hundred cities across Europe, and millions of books had been printed. The new technology changed religion, "
    "science and politics: pamphlets carried arguments to readers who had never been reached before, scholars "
    "could compare identical copies of the same text, and vernacular languages gained a written standard. "
    "Historians still debate how quickly literacy rose, but few doubt that the press reshaped the flow of ideas, "
    "and that its effects compare with those of the internet in our own time. In East Asia the story began "
    "earlier: woodblock printing was used in China by the seventh century, and Bi Sheng made movable type from "
    "baked clay around 1040. Korean printers cast bronze type in the thirteenth century, and the Jikji, printed "
    "in 1377, is the oldest surviving book made with movable metal type. Yet the thousands of characters in "
    "Chinese writing made movable type less practical there than in Europe, where an alphabet of a few dozen "
    "letters could be set and reset quickly by a trained compositor."
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return inline_program(tmp_path_factory.mktemp("qlogits"), PROBE, "logits_probe")


def chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def test_weights_stay_quantized_and_small(quant_engine, gguf_path):
    """Every projection is quantized (no float copy kept) and resident weight
    memory is within 1.2x of the file size."""
    from tartlet.engine.loading.quant_formats import Q4, Q4I, Q8, Q8I, QuantWeight
    from tartlet.engine.models.quant_linear import QuantLinear

    m = quant_engine.model
    il = m.quant.isa == 3  # interleaved by 16 rows for the AVX-512 VNNI kernel
    q4 = Q4I if il else Q4
    assert isinstance(m.embed, QuantWeight) and m.embed.kind == (Q8I if il else Q8) and m.embed.source == "Q8_0"
    assert isinstance(m.lm_head, QuantLinear) and m.lm_head.parts[0].q is m.embed.q, "tied head shares the embedding"
    for layer in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = layer[name]
            assert isinstance(lin, QuantLinear) and [p.kind for p in lin.parts] == [q4], name
    weight_bytes = m.weight_bytes()
    size = gguf_path.stat().st_size
    print(f"resident weights {weight_bytes / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB GGUF ({weight_bytes / size:.3f}x)")
    assert weight_bytes <= 1.2 * size


@pytest.mark.parametrize("text", PROMPTS)
async def test_logits_close_to_float_path(runtime, quant_runtime, probe, engine, text):
    ids = chat_ids(engine, text)
    ref = as_tensor((await run_ok(runtime, probe, {"ids": ids, "mode": "prefill"}))["logits"])
    got = as_tensor((await run_ok(quant_runtime, probe, {"ids": ids, "mode": "prefill"}))["logits"])
    diff = float((got - ref).abs().max())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"{text[:30]!r}: {len(ids)} positions, max abs logit diff {diff:.3f} (largest {float(ref.abs().max()):.1f}), "
          f"top-1 agreement {agree:.3f}")
    assert diff <= LOGIT_ATOL
    assert int(got[-1].argmax()) == int(ref[-1].argmax()), "the first generated token differs"


@pytest.mark.slow  # 256 single-token passes on two engines
async def test_teacher_forced_top1_agreement(runtime, quant_runtime, probe, engine):
    """256 decode positions, each token fed through the paged KV cache one pass at a time."""
    ids = chat_ids(engine, "Tell me about the printing press.") + engine.tokenizer.encode(TEACHER_TEXT)
    split = len(ids) - 256
    assert split > 10
    ref = as_tensor((await run_ok(runtime, probe, {"ids": ids, "mode": "prefill"}))["logits"])[split - 1 : -1]
    got = as_tensor((await run_ok(quant_runtime, probe, {"ids": ids[:-1], "mode": "decode", "split": split}))["logits"])
    assert got.shape == ref.shape == (256, engine.config.vocab_size)
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"top-1 agreement over 256 teacher-forced decode positions: {agree:.4f}, "
          f"max abs logit diff {float((got - ref).abs().max()):.3f}")
    assert agree >= 0.95


async def test_readme_prompt_says_paris(quant_runtime):
    res = await run_ok(quant_runtime, "text-completion", {"prompt": "What is the capital of France?", "max_tokens": 16})
    assert "Paris" in res["text"], res["text"]


@pytest.mark.slow  # 8 prompts solo, then together
async def test_batching_never_changes_greedy_outputs(quant_runtime, quant_engine):
    from test_batching import PROMPTS as BATCH_PROMPTS
    from test_batching import solo_then_together

    solo, together = await solo_then_together(quant_runtime, quant_engine)
    for p, a, b in zip(BATCH_PROMPTS, solo, together):
        assert b["tokens"] == a["tokens"], f"{p!r}: concurrent run differs from the solo run"


@pytest.mark.parametrize(
    "mix",
    [
        {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"},  # like Q4_K_M
        {"attn_q": "Q5_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "ffn_up": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_down": "Q8_0", "output": "F16", "token_embd": "BF16"},
        {"attn_q": "F32", "output": "Q8_0"},
    ],
    ids=["q4_k_m", "every-format", "f32-matrices"],
)
def test_gguf_type_mixes_match_float_path(tmp_path, mix):
    """Random-weight Llama GGUFs mixing the formats (including fused Q/K/V and
    gate/up of different formats, and un-permuted Q/K rows) give the float
    path's logits. Bound: 0.5% of the largest logit (measured up to 0.22% with
    random K-quant weights, whose sub-block scale and minimum products are
    stored as float16: see :mod:`tartlet.engine.loading.quant_formats`)."""
    from test_loader import engine_logits

    path = write_tiny_llama(tmp_path / "tiny.gguf", mix)
    ids = list(range(3, 40))
    want = engine_logits(path, "float32", ids, split=20)
    got = engine_logits(path, "auto", ids, split=20)
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    print(f"{mix}: max abs logit diff {diff:.2e} (largest {scale:.2f})")
    assert diff <= 5e-3 * scale


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    import gguf
    import numpy as np

    from tartlet.engine.loading.loader import ModelLoadError, load_model

    path = write_tiny_llama(tmp_path / "tiny.gguf", {})
    # rewrite the file with one tensor declared as Q8_1 (no dequantizer, no kernel)
    reader = gguf.GGUFReader(path)
    out = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.name == "blk.1.ffn_up.weight":
            size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]
            raw = np.zeros((shape[0], shape[1] // 32 * size), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        elif t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape[0], -1), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for quantized in (True, False):
        with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*Q8_1"):
            load_model(out, quantized=quantized)


@pytest.mark.slow  # two engines loaded, prefill + decode on each
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_16bit_kv_cache(gguf_path, engine, kv_dtype):
    """A bfloat16 or float16 page pool holds twice the tokens in the same
    budget and changes the logits by rounding only (prefill, then decode
    through pages; measured on logits of ~38: bfloat16 0.24-0.32, float16,
    whose pages the C kernels and the fused step read, 0.04; bound 0.75)."""
    from tartlet.engine.core.engine import EngineConfig
    from test_loader import engine_logits

    c = engine.config
    f32, half = EngineConfig(kv_cache_mb=8, kv_dtype="float32"), EngineConfig(kv_cache_mb=8, kv_dtype=kv_dtype)
    assert half.torch_kv_dtype() == getattr(torch, kv_dtype) and f32.torch_kv_dtype() == torch.float32
    auto = EngineConfig()  # float16 pages for quantized weights, the compute dtype for float ones
    assert auto.torch_kv_dtype(quantized=True) == torch.float16 and auto.torch_kv_dtype() == torch.float32
    from tartlet.engine.core.kv_cache import PagePool

    per = [PagePool.bytes_per_page(16, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cfg.torch_kv_dtype()) for cfg in (f32, half)]
    assert per[0] == 2 * per[1]
    ids = chat_ids(engine, "What is the capital of France? Answer in one sentence.")
    want = engine_logits(gguf_path, "auto", ids, split=20, kv_dtype="float32")
    got = engine_logits(gguf_path, "auto", ids, split=20, kv_dtype=kv_dtype)
    diff = float((got - want).abs().max())
    print(f"{kv_dtype} vs float32 KV pages: max abs logit diff {diff:.3f}")
    assert diff <= 0.75
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    with pytest.raises(ValueError, match="unknown kv_dtype 'int3'"):
        EngineConfig(kv_dtype="int3").torch_kv_dtype()


@pytest.mark.slow  # three engines loaded
def test_mixed_activation_precision(gguf_path, engine):
    """``act_bits="auto"``: 16-bit blocks into the projections fed by an
    RMSNorm, 8-bit into the output and down projections. Greedy tokens of
    the README prompt's answer agree with the float32 path (the 8-bit
    blocks in every projection flip them) wherever the float32 path's top
    two logits are further apart than the bound on how far a logit may
    move; logits move by rounding only (~1.0 measured on logits of ~38,
    bound 2.5). Two of the 12 positions are near-ties (0.08 and 0.31
    apart), where that rounding may pick either token."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from test_loader import engine_logits

    eng = Engine.load(EngineConfig(model=str(gguf_path), act_bits="auto", kv_cache_mb=8))
    try:
        bits = {k: {layer[k].act_bits for layer in eng.model.layers} for k in ("qkv", "o", "gate_up", "down")}
        assert bits == {"qkv": {16}, "o": {8}, "gate_up": {16}, "down": {8}}
        assert eng.model.lm_head.act_bits == 16
    finally:
        eng.close()
    ids = chat_ids(engine, "What is the capital of France?")
    ids += engine.tokenizer.encode(" The capital of France is Paris.")
    want = engine_logits(gguf_path, "float32", ids, split=len(ids) - 12)
    got = engine_logits(gguf_path, "auto", ids, split=len(ids) - 12, act_bits="auto")
    diff = float((got - want).abs().max())
    print(f"act_bits auto vs float32: max abs logit diff {diff:.3f}")
    assert diff <= 2.5
    top2 = want[-12:].topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2.5
    assert int(clear.sum()) >= 10
    assert torch.equal(got[-12:].argmax(-1)[clear], want[-12:].argmax(-1)[clear])
    with pytest.raises(ValueError, match="act_bits must be 8, 16 or 'auto'"):
        engine_logits(gguf_path, "auto", ids[:3], split=2, act_bits=4)


@pytest.mark.slow  # two engines loaded, a 321-token prefill on each
def test_bfloat16_matmul_close_to_float_path(gguf_path, engine):
    """``matmul_dtype="bfloat16"``: the calls of 8+ rows (here one prefill of
    the printing-press text, 321 positions, all through the bfloat16 panel
    GEMM) against the float32 reference path on the same file: top-1 equal
    on 99.7% of the positions measured (bound 98%), max abs logit diff
    0.44 on logits of ~38 (bound 1.0; the float32 panel: 1.5e-4), and the
    argmax over the README answer equals the float32 path's. A bad value,
    or bfloat16 on a CPU without AVX512_BF16, is a clear error."""
    from tartlet.engine.kernels import quant_kernels
    from test_loader import engine_logits

    kern = quant_kernels.load()
    ids = chat_ids(engine, "Tell me about the printing press.") + engine.tokenizer.encode(TEACHER_TEXT)
    if kern is None or not kern.has_bf16:
        with pytest.raises(ValueError, match="needs a CPU with AVX512_BF16"):
            engine_logits(gguf_path, "auto", ids[:3], split=3, matmul_dtype="bfloat16")
        return
    want = engine_logits(gguf_path, "float32", ids, split=len(ids), kv_cache_mb=64)
    got = engine_logits(gguf_path, "auto", ids, split=len(ids), kv_cache_mb=64, matmul_dtype="bfloat16")
    diff = float((got - want).abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"bfloat16 panel vs float32 path: {len(ids)} positions, max abs logit diff {diff:.3f}, top-1 agreement {agree:.4f}")
    assert agree >= 0.98
    assert diff <= 1.0
    answer = chat_ids(engine, "What is the capital of France?") + engine.tokenizer.encode(" The capital of France is Paris.")
    want = engine_logits(gguf_path, "float32", answer, split=len(answer))
    got = engine_logits(gguf_path, "auto", answer, split=len(answer), matmul_dtype="bfloat16")
    assert torch.equal(got[-12:].argmax(-1), want[-12:].argmax(-1))
    with pytest.raises(ValueError, match="matmul_dtype must be one of float32, bfloat16, got 'float16'"):
        engine_logits(gguf_path, "auto", ids[:3], split=3, matmul_dtype="float16")

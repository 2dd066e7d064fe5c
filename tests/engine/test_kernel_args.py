"""The ctypes kernel wrappers refuse a tensor of the wrong shape, dtype,
layout or device with a ValueError naming the argument and both shapes,
instead of handing C a pointer it would read or write out of bounds; and a
failed scratch allocation in C surfaces as MemoryError."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tartlet.engine.kernels import c_build, cpu_kernels, quant_kernels
from tartlet.engine.loading.quant_formats import quantize

NH, NKV, HD, S = 6, 2, 64, 512


@pytest.fixture(scope="module")
def ck():
    if not c_build.find_compiler():
        pytest.skip("no C compiler on this machine")
    k = cpu_kernels.load()
    assert k is not None
    return k


@pytest.fixture(scope="module")
def qk():
    if not c_build.find_compiler():
        pytest.skip("no C compiler on this machine")
    k = quant_kernels.load()
    assert k is not None
    return k


def good_rope(T=3):
    return dict(qkv=torch.randn(T, (NH + 2 * NKV) * HD), cos=torch.randn(T, HD // 2), sin=torch.randn(T, HD // 2),
                k_pool=torch.zeros(S, NKV, HD), v_pool=torch.zeros(S, NKV, HD), write_slots=torch.arange(T),
                nh=NH, nkv=NKV, hd=HD)


def good_attn(B=2, L=5, T=4):
    return dict(q=torch.randn(T, NH, HD), k_pool=torch.zeros(S, NKV, HD), v_pool=torch.zeros(S, NKV, HD),
                slots=torch.arange(B * L).view(B, L), bias=torch.zeros(B, L), rows=torch.tensor([3, 0]), row_start=0,
                out=torch.zeros(T, NH * HD), scale=0.125)


def test_good_arguments_pass(ck):
    ck.rms_norm(torch.randn(3, 2 * 64)[:, :64], torch.randn(64), 1e-5)  # strided rows are fine
    ck.rope_qkv_store(**good_rope())
    ck.paged_decode_attention(**good_attn())
    ck.paged_decode_attention(**{**good_attn(), "rows": None, "row_start": 2, "bias": None})
    q8 = dict(k_pool=torch.zeros(S, NKV, HD + 4, dtype=torch.int8), v_pool=torch.zeros(S, NKV, HD + 4, dtype=torch.int8))
    ck.rope_qkv_store(**{**good_rope(), **q8})
    ck.paged_decode_attention(**{**good_attn(), **q8})


@pytest.mark.parametrize("x,w,match", [
    (torch.randn(3, 64).t(), torch.randn(3), r"x must be a columns contiguous float32 CPU tensor of shape \[T, H\], got a float32 CPU tensor of shape \[64, 3\] \(strides \[1, 64\]\)"),
    (torch.randn(3, 64, dtype=torch.float64), torch.randn(64), "x must be .* float32 .* got a float64"),
    (torch.randn(64), torch.randn(64), r"x must be .* shape \[T, H\], got .* shape \[64\]"),
    (torch.randn(3, 64), torch.randn(63), r"weight must be a contiguous float32 CPU tensor of shape \[64\], got .* shape \[63\]"),
    (torch.randn(3, 64), torch.randn(64, dtype=torch.float16), "weight must be .* got a float16"),
    (torch.randn(3, 64), torch.randn(128)[::2], r"weight must be a contiguous .*strides \[2\]"),
])
def test_rms_norm_refuses(ck, x, w, match):
    with pytest.raises(ValueError, match=f"rms_norm: {match}"):
        ck.rms_norm(x, w, 1e-5)


@pytest.mark.parametrize("change,match", [
    ({"qkv": torch.randn(3, 100)}, r"qkv must be .* shape \[T, \(nh \+ 2 nkv\) hd = 640\], got .* shape \[3, 100\]"),
    ({"qkv": torch.randn(640, 3).t()}, r"qkv must be a contiguous .*strides \[1, 3\]"),
    ({"cos": torch.randn(2, HD // 2)}, r"cos must be .* shape \[3, 32\], got .* shape \[2, 32\]"),
    ({"sin": torch.randn(3, HD)}, r"sin must be .* shape \[3, 32\], got .* shape \[3, 64\]"),
    ({"k_pool": torch.zeros(S, NKV + 1, HD)},
     r"k_pool must be .* shape \[slots, 2, 64 \(float32, float16\) or 68 \(int8\)\], got .* \[512, 3, 64\]"),
    ({"k_pool": torch.zeros(S, NKV, HD, dtype=torch.bfloat16)}, "k_pool must be .* float32, float16 or int8 .* got a bfloat16"),
    ({"k_pool": torch.zeros(S, NKV, HD, dtype=torch.float16)}, r"v_pool must be a contiguous float16 CPU tensor .* got a float32"),
    ({"v_pool": torch.zeros(S, NKV, HD + 4, dtype=torch.int8)}, r"v_pool must be a contiguous float32 CPU tensor of shape \[512, 2, 64\], got a int8"),
    ({"v_pool": torch.zeros(S - 1, NKV, HD)}, r"v_pool must be .* \[512, 2, 64\], got .* \[511, 2, 64\]"),
    ({"write_slots": torch.arange(3, dtype=torch.int32)}, r"write_slots must be a contiguous int64 CPU tensor of shape \[3\], got a int32"),
    ({"write_slots": torch.arange(4)}, r"write_slots must be .* \[3\], got .* \[4\]"),
    ({"hd": 63, "qkv": torch.randn(3, 10 * 63)}, "hd must be even, got 63"),
])
def test_rope_qkv_store_refuses(ck, change, match):
    args = {**good_rope(), **change}
    before = args["k_pool"].clone()
    with pytest.raises(ValueError, match=f"rope_qkv_store: {match}"):
        ck.rope_qkv_store(**args)
    assert torch.equal(args["k_pool"], before)


@pytest.mark.parametrize("change,match", [
    ({"q": torch.randn(4, HD, NH).transpose(1, 2)}, r"q must be a rows of contiguous heads float32 .* \[T, nh, hd\], got .* \[4, 6, 64\]"),
    ({"q": torch.randn(4, NH * HD)}, r"q must be .* got .* shape \[4, 384\]"),
    ({"k_pool": torch.zeros(S, 4, HD), "v_pool": torch.zeros(S, 4, HD)}, r"k_pool must be .* \[slots, a divisor of nh = 6, 64\], got .* \[512, 4, 64\]"),
    ({"k_pool": torch.zeros(S, NKV, 32)}, r"k_pool must be .* \[slots, 2, 64 \(float32, float16\) or 68 \(int8\)\], got .* \[512, 2, 32\]"),
    ({"slots": torch.arange(10)}, r"slots must be a contiguous int64 .* \[B, L\], got .* \[10\]"),
    ({"slots": torch.arange(10, dtype=torch.int32).view(2, 5)}, "slots must be .* int64 .* got a int32"),
    ({"bias": torch.zeros(2, 6)}, r"bias must be .* \[2, 5\], got .* \[2, 6\]"),
    ({"bias": torch.zeros(2, 5, dtype=torch.bool)}, "bias must be .* float32 .* got a bool"),
    ({"rows": torch.tensor([1, 2, 3])}, r"rows must be a contiguous int64 CPU tensor of shape \[2\], got .* \[3\]"),
    ({"rows": None, "row_start": 3}, "rows 3..4 are outside q's 4 rows"),
    ({"out": torch.zeros(4, NH * HD + 1)}, r"out must be .* \[4, 384\], got .* \[4, 385\]"),
    ({"out": torch.zeros(NH * HD, 4).t()}, r"out must be a contiguous .*strides \[1, 4\]"),
])
def test_paged_decode_attention_refuses(ck, change, match):
    args = {**good_attn(), **change}
    with pytest.raises(ValueError, match=f"paged_decode_attention: {match}"):
        ck.paged_decode_attention(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_refused(ck):
    with pytest.raises(ValueError, match=r"rms_norm: x must be .* CPU tensor .* got a float32 CUDA tensor"):
        ck.rms_norm(torch.randn(3, 64, device="cuda"), torch.randn(64), 1e-5)


@pytest.fixture(scope="module")
def weight():
    return quantize(torch.randn(16, 64), "q8_0")  # N = 16, K = 64


def test_quant_good_arguments_pass(qk, weight):
    x = torch.randn(3, 64)
    qa, fa = qk.quantize(x, 16)
    out = torch.empty(3, 16)
    qk.matmul(weight, qa, fa, out, torch.zeros(16), torch.zeros(3, 16))
    desc = qk.linear_desc([weight], None, 16)
    qk.linear(desc, x, out, torch.zeros(3, 16))
    qk.dequantize(weight, torch.tensor([0, 5]))


def test_quant_wrappers_refuse(qk, weight):
    x, out = torch.randn(3, 64), torch.empty(3, 16)
    qa, fa = qk.quantize(x, 8)
    desc = qk.linear_desc([weight], None, 16)
    cases = [
        (lambda: qk.quantize(torch.randn(3, 48)), r"quantize: x must be .* \[M, K \(a multiple of 32\)\], got .* \[3, 48\]"),
        (lambda: qk.quantize(torch.randn(64, 3).t()), r"quantize: x must be a rows contiguous .*strides \[1, 3\]"),
        (lambda: qk.matmul(weight, qa[:, :32], fa, out), r"matmul: qa must be .* int8 or int16 .* \[M, 64\], got .* \[3, 32\]"),
        (lambda: qk.matmul(weight, qa, fa[:2], out), r"matmul: fa must be .* \[3, 4, 2\], got .* \[2, 4, 2\]"),
        (lambda: qk.matmul(weight, qa, fa, torch.empty(3, 15)), r"matmul: out must be .* \[3, 16\], got .* \[3, 15\]"),
        (lambda: qk.matmul(weight, qa, fa, out, torch.zeros(15)), r"matmul: bias must be .* \[16\], got .* \[15\]"),
        (lambda: qk.matmul(weight, qa, fa, out, None, torch.zeros(3, 16, dtype=torch.float64)), "matmul: residual must be .* got a float64"),
        (lambda: qk.linear(desc, torch.randn(3, 32), out), r"linear: x must be .* \[M, 64\], got .* \[3, 32\]"),
        (lambda: qk.linear(desc, x, torch.empty(2, 16)), r"linear: out must be a contiguous .* \[3, 16\], got .* \[2, 16\]"),
        (lambda: qk.linear(desc, x, torch.empty(3, 32)[:, :16]), r"linear: out must be a contiguous .*strides \[32, 1\]"),
        (lambda: qk.linear(desc, x, out, torch.zeros(3, 17)), r"linear: residual must be .* \[3, 16\], got .* \[3, 17\]"),
        (lambda: qk.dequantize(weight, torch.tensor([[0, 1]])), r"dequantize: rows must be .* int64 .* \[R\], got .* \[1, 2\]"),
        (lambda: qk.dequantize(weight, torch.tensor([0, 1], dtype=torch.int32)), "dequantize: rows must be .* got a int32"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_failed_scratch_allocation_is_memory_error(ck, tmp_path):
    """malloc's result is checked: under an address-space limit too small for
    the attention's score buffer, the call raises MemoryError and leaves its
    output untouched (a child process, so the limit binds only there)."""
    script = textwrap.dedent("""
        import resource, torch
        torch.set_num_threads(1)
        from tartlet.engine.kernels import cpu_kernels
        k = cpu_kernels.load()
        nh, nkv, hd, L = 64, 1, 2, 1 << 21  # scratch: L * nh floats = 512 MiB
        q, kp = torch.randn(1, nh, hd), torch.randn(4, nkv, hd)
        slots = torch.zeros(1, L, dtype=torch.int64)
        out = torch.full((1, nh * hd), 7.0)
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), resource.RLIM_INFINITY))
        try:
            k.paged_decode_attention(q, kp, kp, slots, None, None, 0, out, 0.5)
        except MemoryError as e:
            assert bool((out == 7.0).all()), "output written although the kernel failed"
            print("MemoryError:", e)
        else:
            print("no error")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MemoryError: paged_decode_attention: cannot allocate the attention scores of 2097152 positions" in proc.stdout

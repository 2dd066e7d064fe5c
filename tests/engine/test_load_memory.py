"""Loading a GGUF model fast and without transient copies: the C repacker and
interleaver (``repack.h``) against their numpy references bit for bit, the
file's pages leaving the resident set as tensors are converted
(``os_memory``), converted weights born on huge pages (``huge_pages.empty``),
and the model consuming the loaded tensors layer by layer."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from tartlet.engine.kernels.quant_kernels import REPACK_TYPES
from tartlet.engine.loading import huge_pages, os_memory
from tartlet.engine.loading.quant_formats import INTERLEAVED, QuantWeight, from_gguf, interleave
from test_quant_kernels import random_gguf

LINUX = Path("/proc/self/smaps").is_file()


def same(a: QuantWeight, b: QuantWeight) -> bool:
    """Equal kinds, shapes and bytes (scales compared as bits: NaN == NaN)."""
    def bits(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous().view(torch.int16)

    return (a.kind, a.shape) == (b.kind, b.shape) and torch.equal(a.q, b.q) and torch.equal(bits(a.d), bits(b.d)) and (
        (a.m is None and b.m is None) or (a.m is not None and b.m is not None and torch.equal(bits(a.m), bits(b.m))))


@pytest.mark.parametrize("type_name", sorted(REPACK_TYPES))
def test_c_repack_equals_numpy(kern, type_name):
    """``repack_gguf`` gives ``from_gguf``'s bytes: realistic blocks, and
    blocks of random bytes (scales that are NaN, infinite, subnormal; K-quant
    products rounded to float16), one row and odd row counts."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]  # weights a block
    for n, k, seed in ((48, 2 * block, 1), (1, block, 2), (33, 4 * block, 3)):
        raw = random_gguf(type_name, n, k, seed=seed)
        assert same(kern.repack_gguf(raw, type_name, n, k), from_gguf(raw, type_name, n, k)), (n, k)
        noise = np.random.default_rng(seed).integers(0, 256, raw.size, dtype=np.uint8)
        with np.errstate(all="ignore"):  # numpy warns about the NaN and infinite scales
            want = from_gguf(noise, type_name, n, k)
        assert same(kern.repack_gguf(noise, type_name, n, k), want), ("random bytes", n, k)


def test_c_repack_refuses_bad_input(kern):
    raw = random_gguf("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="does not hold a \\[4, 512\\] matrix"):
        kern.repack_gguf(raw, "Q4_K", 4, 512)
    with pytest.raises(ValueError, match="width divisible by 256, got 96"):
        kern.repack_gguf(raw, "Q4_K", 4, 96)
    with pytest.raises(ValueError, match="GGUF type F16 is not repacked in C"):
        kern.repack_gguf(raw, "F16", 4, 256)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q5_K", "Q6_K"])
def test_c_interleave_equals_numpy(kern, type_name):
    """``QuantKernels.interleave`` of parts equals ``interleave`` of their
    stack (parts of 16k rows written in place, others stacked first)."""
    k = 512
    for rows in ((32, 16, 48), (8, 24), (16,)):
        parts = [from_gguf(random_gguf(type_name, n, k, seed=n), type_name, n, k) for n in rows]
        got = kern.interleave(parts)
        assert got.kind == INTERLEAVED[parts[0].kind]
        assert same(got, interleave(QuantWeight.cat(parts))), rows


def test_c_interleave_refuses_what_it_cannot_hold(kern):
    q4 = from_gguf(random_gguf("Q4_0", 16, 64), "Q4_0", 16, 64)
    q8 = from_gguf(random_gguf("Q8_0", 16, 64), "Q8_0", 16, 64)
    with pytest.raises(ValueError, match="one kind and width"):
        kern.interleave([q4, q8])
    with pytest.raises(ValueError, match="with 24 rows"):
        kern.interleave([from_gguf(random_gguf("Q4_0", 24, 64), "Q4_0", 24, 64)])


def mapping_rss_kib(addr: int) -> int:
    """Rss (KiB) of the mapping of this process that holds address ``addr`` (``man 5 proc``: smaps)."""
    text = Path("/proc/self/smaps").read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^Rss:\s+(\d+) kB", text, re.M | re.S):
        if int(m.group(1), 16) <= addr < int(m.group(2), 16):
            return int(m.group(3))
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_drop_mapped_pages_leaves_the_rss_and_keeps_the_data(tmp_path):
    """A converted tensor's file pages leave the process's RSS; reading the
    array again faults them back in with the same bytes; pages shared with
    the bytes around the array are kept."""
    data = np.random.default_rng(0).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    m = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(m.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page mapped in
    before = mapping_rss_kib(m.ctypes.data)
    view = m[100 : 100 + 32 * mmap.PAGESIZE]  # unaligned: 31 whole pages inside it
    assert os_memory.drop_mapped_pages(view)
    after = mapping_rss_kib(m.ctypes.data)
    assert before - after == 31 * mmap.PAGESIZE // 1024, (before, after)
    assert np.array_equal(view, data[100 : 100 + 32 * mmap.PAGESIZE])
    assert not os_memory.drop_mapped_pages(m[:10]), "no whole page inside"
    anon = data.copy()  # anonymous memory: MADV_DONTNEED would zero it, so it is refused
    assert not os_memory.drop_mapped_pages(anon) and np.array_equal(anon, data)
    cow = np.memmap(path, dtype=np.uint8, mode="c")
    assert not os_memory.drop_mapped_pages(cow[: 8 * mmap.PAGESIZE]), "copy-on-write mapping"
    assert isinstance(os_memory.trim_heap(), bool)


@pytest.mark.skipif(not LINUX or huge_pages.thp_mode() not in ("madvise", "always"), reason="needs transparent huge pages")
def test_new_weights_are_advised_huge_pages():
    """Inside ``for_new_weights`` a large ``empty`` buffer's whole 2 MiB
    pages carry the huge-page advice (VmFlags ``hg``) before it is written."""
    def flags(addr: int) -> list[str]:
        text = Path("/proc/self/smaps").read_text()
        for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) .*?^VmFlags: ([^\n]*)", text, re.M | re.S):
            if int(m.group(1), 16) <= addr < int(m.group(2), 16):
                return m.group(3).split()
        raise AssertionError(f"no mapping holds {addr:#x}")

    with huge_pages.for_new_weights():
        t = huge_pages.empty((16 << 20,), torch.uint8)
    inside = -(-t.data_ptr() // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    assert "hg" in flags(inside)
    t.fill_(7)
    assert int(t[-1]) == 7
    with huge_pages.for_new_weights(False):
        assert huge_pages.empty((3, 5), torch.float16).shape == (3, 5)


def test_model_consumes_the_loaded_weights_layer_by_layer(tmp_path):
    """Building the model drops each layer's loaded tensors once the layer
    is built (their converted copies replace them instead of piling up):
    when a tensor of layer i is read, none of layer i - 1 is left."""
    from tartlet.engine.loading.gguf_loader import load_gguf
    from tartlet.engine.models.llama import LlamaModel
    from tiny_gguf import LAYERS, write_tiny_llama

    loaded = load_gguf(write_tiny_llama(tmp_path / "m.gguf", {"attn_v": "Q6_K", "ffn_down": "Q8_0"}), quantized=True)
    seen: list[tuple[int, set[int]]] = []

    class Watched(dict):
        def __getitem__(self, name):
            if name.startswith("model.layers."):
                live = {int(n.split(".")[2]) for n in self if n.startswith("model.layers.")}
                seen.append((int(name.split(".")[2]), live))
            return super().__getitem__(name)

    weights = Watched(loaded.weights)
    LlamaModel(loaded.config, weights)
    assert not weights, "the dict is consumed"
    assert {i for i, _ in seen} == set(range(LAYERS))
    assert all(min(live) == i for i, live in seen), seen

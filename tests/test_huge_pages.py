"""Weights on transparent huge pages (tartlet.engine.huge_pages)."""

from __future__ import annotations

import pytest
import torch

from tartlet.engine import huge_pages
from tartlet.engine.huge_pages import HUGE_PAGE as H

needs_thp = pytest.mark.skipif(huge_pages.thp_mode() not in ("madvise", "always"),
                               reason="transparent huge pages are off on this machine (or it is not Linux)")


def vmas() -> list[tuple[int, int, int]]:
    """(start, end, AnonHugePages bytes) of this process's mappings."""
    out: list[tuple[int, int, int]] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            p = line.split()
            if "-" in p[0] and ":" not in p[0]:
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                out.append((lo, hi, 0))
            elif p[0] == "AnonHugePages:":
                out[-1] = (out[-1][0], out[-1][1], int(p[1]) * 1024)
    return out


def huge_fraction(tensors: list[torch.Tensor]) -> float:
    """Fraction of the whole 2 MiB pages inside the tensors' bytes that lie in
    a mapping made entirely of huge pages (madvise splits the mappings at
    the advised ranges, so an advised and collapsed range is such a mapping)."""
    maps = vmas()
    total = on = 0
    for t in tensors:
        if t.is_mkldnn:  # oneDNN-packed: no address to look at
            continue
        a = t.data_ptr()
        for page in range(-(-a // H) * H, (a + t.numel() * t.element_size()) // H * H, H):
            total += 1
            on += any(lo <= page < hi and huge == hi - lo for lo, hi, huge in maps)
    return on / max(total, 1)


def test_anonymous_mappings_keeps_private_writable_anonymous_ones():
    text = "\n".join([
        "55d0c2a00000-55d0c2e00000 rw-p 00000000 00:00 0                          [heap]",
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 ",
        "7f0000400000-7f0000600000 r--p 00000000 00:00 0 ",  # read-only
        "7f0000600000-7f0000800000 rw-s 00000000 00:01 42                         /dev/shm/x",  # shared, a file
        "7f0000800000-7f0000a00000 rw-p 00001000 08:01 1234                       /usr/lib/libc.so.6",  # a file
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]",
    ])
    assert huge_pages.anonymous_mappings(text) == [(0x55D0C2A00000, 0x55D0C2E00000), (0x7F0000000000, 0x7F0000400000)]


def test_huge_ranges_widen_clip_and_merge():
    base = 100 * H
    maps = [(base + 4096, base + 6 * H + 8192), (base + 10 * H, base + 12 * H)]
    spans = [
        (base + 4096 + 10, base + H + 5),  # widened to [base, base + 2H), clipped to whole pages in the mapping
        (base + H + 100, base + 2 * H + 1),  # overlaps the first once widened: merged
        (base + 5 * H + 7, base + 6 * H + 100),  # its end page crosses the mapping's end: dropped to [5H, 6H)
        (base + 10 * H + 1, base + 10 * H + 2),  # one byte: its whole page
        (base + 8 * H, base + 9 * H),  # in no mapping: dropped
        (base + 11 * H, base + 11 * H),  # empty: dropped
    ]
    assert huge_pages.huge_ranges(spans, maps) == [
        (base + H, base + 3 * H), (base + 5 * H, base + 6 * H), (base + 10 * H, base + 11 * H)]


@needs_thp
def test_advise_collapses_a_tensor_and_keeps_its_bytes():
    t = torch.arange(3 * H // 2, dtype=torch.int32)  # 6 MiB, its own anonymous mapping
    want = t.clone()
    done = huge_pages.advise([t])
    assert done >= 2 * H  # at least the whole 2 MiB pages inside it
    assert torch.equal(t, want)
    assert huge_fraction([t]) == 1.0


def test_advise_of_nothing_on_the_cpu_is_nothing():
    assert huge_pages.advise([]) == 0
    assert huge_pages.advise([torch.empty(0)]) == 0


@needs_thp
def test_engine_moves_its_weights_onto_huge_pages(quant_engine):
    """The default model as users run it (quantized weights): the engine
    starts the move when it loads (a background thread); once it ends, the
    whole 2 MiB pages inside the weights are huge pages (a few may stay
    small where the kernel finds no free huge page)."""
    assert quant_engine.huge_pages_thread is not None
    quant_engine.huge_pages_thread.join(120)
    assert not quant_engine.huge_pages_thread.is_alive()
    assert huge_fraction(quant_engine.model.weight_tensors()) > 0.9

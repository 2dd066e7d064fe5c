"""Weights on transparent huge pages (tartlet.engine.loading.huge_pages)."""

from __future__ import annotations

import mmap

import pytest
import torch

from tartlet.engine.loading import huge_pages
from tartlet.engine.loading.huge_pages import HUGE_PAGE as H

needs_thp = pytest.mark.skipif(huge_pages.thp_mode() not in ("madvise", "always"),
                               reason="transparent huge pages are off on this machine (or it is not Linux)")


def whole_pages(tensors: list[torch.Tensor]) -> set[int]:
    """The 2 MiB pages lying wholly inside the tensors' bytes."""
    out: set[int] = set()
    for t in tensors:
        if not t.is_mkldnn:  # oneDNN-packed: no address to look at
            a = t.data_ptr()
            out.update(range(-(-a // H) * H, (a + t.numel() * t.element_size()) // H * H, H))
    return out


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
    maps = [(base + 4096, base + 6 * H + 8192), (base + 10 * H, base + 12 * H), (base + 12 * H, base + 14 * H),
            (base + 20 * H, base + 21 * H + 4096), (base + 21 * H + 4096, base + 24 * H)]
    spans = [
        (base + 4096 + 10, base + H + 5),  # widened to [base, base + 2H), clipped to whole pages in the mapping
        (base + H + 100, base + 2 * H + 1),  # overlaps the first once widened: merged
        (base + 5 * H + 7, base + 6 * H + 100),  # its end page crosses the mapping's end: dropped to [5H, 6H)
        (base + 10 * H + 1, base + 10 * H + 2),  # one byte: its whole page
        (base + 8 * H, base + 9 * H),  # in no mapping: dropped
        (base + 11 * H, base + 11 * H),  # empty: dropped
        (base + 13 * H - 5, base + 13 * H + 5),  # in the third mapping
        (base + 20 * H + 1, base + 23 * H + 1),  # crosses an unaligned end: the page around it dropped
    ]
    assert huge_pages.huge_ranges(spans, maps) == [
        (base + H, base + 3 * H), (base + 5 * H, base + 6 * H), (base + 10 * H, base + 11 * H),
        (base + 12 * H, base + 14 * H), (base + 20 * H, base + 21 * H), (base + 22 * H, base + 24 * H)]


def test_huge_ranges_follow_a_span_across_mappings():
    """Earlier advice splits a heap mapping at 2 MiB boundaries: a span
    crossing them is covered in every piece, the pieces merged."""
    base = 300 * H
    maps = [(base, base + 2 * H), (base + 2 * H, base + 4 * H), (base + 4 * H, base + 9 * H)]
    assert huge_pages.huge_ranges([(base + H + 3, base + 7 * H + 3)], maps) == [(base + H, base + 8 * H)]


@needs_thp
def test_advise_collapses_a_tensor_and_keeps_its_bytes():
    """MADV_COLLAPSE succeeds only when the whole range is then backed by
    huge pages (``man 2 madvise``), so the bytes advise reports are huge."""
    buf = mmap.mmap(-1, 6 * H, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # its own mapping, whatever the heap holds
    t = torch.frombuffer(buf, dtype=torch.int32)
    t.copy_(torch.arange(t.numel(), dtype=torch.int32))
    done = huge_pages.advise([t])
    assert done >= len(whole_pages([t])) * H >= 5 * H  # 12 MiB: at least five whole 2 MiB pages inside
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.int32))
    del t
    buf.close()


def test_advise_of_nothing_on_the_cpu_is_nothing():
    assert huge_pages.advise([]) == 0
    assert huge_pages.advise([torch.empty(0)]) == 0


@needs_thp
def test_engine_moves_its_weights_onto_huge_pages(quant_engine):
    """The default model as users run it (quantized weights): the engine
    starts the move when it loads (a background thread); once it ends, the
    collapsed ranges cover the 2 MiB pages inside the weights (a few may
    stay small where the kernel finds no free huge page)."""
    mover = quant_engine.huge_pages_thread
    assert mover is not None
    mover.join(120)
    assert not mover.is_alive()
    assert mover.collapsed >= 0.9 * len(whole_pages(quant_engine.model.weight_tensors())) * H > 0

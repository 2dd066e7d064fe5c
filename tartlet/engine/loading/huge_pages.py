"""Back the model's weights with transparent huge pages (Linux).

A batch-1 decode step streams every weight from memory once. With 4 KiB
pages that is one page-table walk per 4 KiB (the TLBs hold a few thousand
entries; the default model's weights are ~23,000 pages), and the hardware
prefetchers, which work on physical addresses, stop at every page boundary
and must find the stream again. With 2 MiB pages neither happens.

Linux gives anonymous memory 2 MiB pages either everywhere (transparent
huge pages ``always``) or only where the process asks (``madvise``, the
default of Debian and many distributions): ``madvise(MADV_HUGEPAGE)`` on a
range makes future faults there take huge pages, and
``madvise(MADV_COLLAPSE)`` (Linux >= 6.1) turns the pages already there
into huge pages at once, copying them (``man 2 madvise``). The weights are
already written when the model is built, so :func:`advise` does both on
every 2 MiB-aligned range that holds weight bytes, within the anonymous
mapping around them (a weight tensor of 1 MiB shares its 2 MiB with its
neighbours in the allocator's heap; their contents are unchanged, only
their backing). Best effort: elsewhere, or when the kernel refuses, the
pages stay as they are and :func:`advise` reports 0 bytes. Collapsing
needs free 2 MiB pages, which the kernel may first have to compact: ~0.5 s
for the default model's ~140 MiB of ranges on the project's VM, so the
engine runs it on a background thread (:class:`Mover`)
while it starts serving; readers of the weights meanwhile see the same
bytes.

Measured on the project's 2-core Zen 4 VM (docs/benchmarks.md, "On a Zen 4
VM: huge pages for the weights, ..."): the batch-1 decode step 1.02-1.07x
faster than on 4 KiB pages.

Collapsing copies every byte: ~13 s of background work for a 7B model's
4.6 GiB, while it serves. So the converted weights are born on huge pages
where they can be: inside :func:`for_new_weights` (``Engine.load`` wraps the
load in it), :func:`empty` advises ``MADV_HUGEPAGE`` on a new buffer before
anything writes it, so its first writes fault in 2 MiB pages and the
:class:`Mover` later finds little left to collapse (~2 s for the 7B).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from . import os_memory

log = logging.getLogger(__name__)

#: The huge page size this module aligns to (x86-64 and arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20
#: ``madvise`` advice values (``<asm-generic/mman-common.h>``).
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def anonymous_mappings(maps_text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the private, writable, anonymous mappings (no file
    behind them: heaps, ``mmap(MAP_ANONYMOUS)``) of a ``/proc/<pid>/maps``
    text (format: ``man 5 proc``)."""
    out = []
    for line in maps_text.splitlines():
        f = line.split()
        if len(f) < 5 or not f[1].startswith("rw") or f[1][3] != "p" or f[4] != "0":
            continue
        if len(f) > 5 and not f[5].startswith("[heap"):  # named: a file, or [stack], [vvar]...
            continue
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        out.append((lo, hi))
    return out


def huge_ranges(spans: Iterable[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned ranges to advise for byte spans ``[start, end)``:
    each span cut at the ends of the mappings it crosses (earlier advice
    splits one mapping into several), each piece widened to whole huge
    pages and clipped to its mapping (a huge page cannot cross a mapping's
    ends, so there it narrows to the whole huge pages inside), overlapping
    ranges merged, sorted; bytes outside every mapping are dropped."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        for vlo, vhi in mappings:
            a, b = max(start, vlo), min(end, vhi)
            if a >= b:
                continue
            lo = max(a // HUGE_PAGE * HUGE_PAGE, -(-vlo // HUGE_PAGE) * HUGE_PAGE)
            hi = min(-(-b // HUGE_PAGE) * HUGE_PAGE, vhi // HUGE_PAGE * HUGE_PAGE)
            if lo < hi:
                out.append((lo, hi))
    out.sort()
    merged: list[tuple[int, int]] = []
    for lo, hi in out:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def thp_mode() -> str | None:
    """The system's transparent huge page mode (``always``, ``madvise`` or
    ``never``), or None where there is none (not Linux, no THP)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def advise(tensors: Iterable[torch.Tensor]) -> int:
    """Ask for huge pages under the CPU ``tensors``' bytes (see the module
    docstring); returns the bytes of the ranges the kernel collapsed into
    huge pages (0 where it cannot: not Linux, THP ``never``, a kernel
    before 6.1, or memory too fragmented). Never raises."""
    libc = os_memory.libc()
    if libc is None or thp_mode() in (None, "never"):
        return 0
    try:
        mappings = anonymous_mappings(Path("/proc/self/maps").read_text())
    except OSError:
        return 0
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in tensors if t.device.type == "cpu" and not t.is_mkldnn and t.numel() > 0]
    done = 0
    for lo, hi in huge_ranges(spans, mappings):
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) != 0:
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE) == 0:
            done += hi - lo
        else:
            log.debug("MADV_COLLAPSE of %d bytes: errno %d", hi - lo, ctypes.get_errno())
    return done


_for_new_weights = contextvars.ContextVar("tartlet_huge_pages_for_new_weights", default=False)


@contextlib.contextmanager
def for_new_weights(enabled: bool = True) -> Iterator[None]:
    """Within, :func:`empty` allocates on huge pages (when ``enabled``)."""
    token = _for_new_weights.set(enabled)
    try:
        yield
    finally:
        _for_new_weights.reset(token)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU; inside
    :func:`for_new_weights`, with ``MADV_HUGEPAGE`` advised on the whole
    2 MiB pages inside its bytes before anything touches them (best effort,
    as :func:`advise`: nothing where THP is ``never`` or off Linux)."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes < 2 * HUGE_PAGE or not _for_new_weights.get():
        return t
    libc = os_memory.libc()
    if libc is not None and thp_mode() in ("madvise", "always"):
        lo = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        hi = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE)
    return t


class Mover(threading.Thread):
    """:func:`advise` on a daemon thread: started at once; it holds the
    tensors until done (so they outlive it), then logs and keeps in
    :attr:`collapsed` the bytes the kernel collapsed (0 until then)."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__(name="tartlet-huge-pages", daemon=True)
        self._tensors: list[torch.Tensor] = list(tensors)
        self.collapsed = 0
        self.start()

    def run(self) -> None:
        self.collapsed = advise(self._tensors)
        self._tensors = []
        log.info("weights on huge pages: %.0f MiB", self.collapsed / 2**20)

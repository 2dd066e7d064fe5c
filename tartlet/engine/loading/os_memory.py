"""Giving memory back to the operating system while a model loads (Linux).

Two things keep a loading process's resident set (RSS) far above what the
model finally holds:

- The GGUF file is memory-mapped (``gguf.GGUFReader``). Each tensor's pages,
  once read to convert it, stay mapped until the whole file is closed: they
  are clean page cache that the kernel could drop, but they count in the
  process's RSS (``VmRSS``, ``ru_maxrss``), so reading a 4.2 GB file peaked
  with 4.2 GB of file pages beside the converted weights.
  :func:`drop_mapped_pages` unmaps a tensor's pages from the process once it
  is converted (``madvise(MADV_DONTNEED)``: on a file mapping the data stays
  in the page cache, and a later read faults it back in from there).
- The converted tensors replace the loaded ones layer by layer, so glibc's
  heap keeps free chunks between them. :func:`trim_heap` returns the free
  pages of every arena (``malloc_trim(0)``, which since glibc 2.8 also
  releases whole free pages inside the heap, ``man 3 malloc_trim``).

Both are best effort: elsewhere (not Linux, not glibc) they do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys

import numpy as np

#: ``madvise`` advice (``<asm-generic/mman-common.h>``).
MADV_DONTNEED = 4


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (errno kept for ``ctypes.get_errno``), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def read_only_file_view(a: np.ndarray) -> bool:
    """Whether ``a`` views a ``np.memmap`` opened read-only (``mode="r"``):
    its pages are the file's, never written, so dropping them loses nothing."""
    base: object = a
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap):
            return base.mode == "r"
        base = base.base
    return False


def drop_mapped_pages(a: np.ndarray) -> bool:
    """Unmap from this process the whole pages inside the bytes of ``a``, a
    view of a read-only file mapping (a ``gguf.ReaderTensor``'s ``data``),
    so they leave its RSS; the array stays valid (a read faults its pages
    back in from the page cache). Only pages wholly inside ``a`` are
    dropped, so neighbouring tensors keep theirs. Anything but a view of a
    read-only ``np.memmap`` is left alone (on anonymous or copy-on-write
    memory ``MADV_DONTNEED`` would discard the contents). Returns whether
    pages were dropped (False off Linux)."""
    lib = libc()
    if lib is None or a.nbytes == 0 or not a.flags.c_contiguous or not read_only_file_view(a):
        return False
    page = mmap.PAGESIZE
    start = a.ctypes.data
    lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    if hi <= lo:
        return False
    return bool(lib.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0)


def trim_heap() -> bool:
    """``malloc_trim(0)``: give the heap's free pages back to the system;
    whether glibc released any (False where there is no glibc)."""
    lib = libc()
    trim = getattr(lib, "malloc_trim", None) if lib is not None else None
    if trim is None:
        return False
    return bool(trim(ctypes.c_size_t(0)))

"""The paged KV cache: a fixed pool of pages, refcounts and the prefix cache.

Layout. Keys and values of every layer live in two preallocated tensors of
shape ``[num_layers, num_pages * page_size, num_kv_heads, head_dim]``; the KV
of token slot ``s`` of page ``p`` sits at row ``p * page_size + s``. An int8
pool (``kv_dtype = "int8"``) has a last dimension of ``head_dim + 4``: each
row's quants then its float32 scale (:mod:`tartlet.engine.core.kv_quant`), so
copying, saving or sharing a row carries its scale along. Pages hold
``page_size`` tokens (default 16), as in vLLM's PagedAttention (Kwon et al.,
SOSP '23).

Life of a page. A page is *free*, *private* (refcount >= 1, being filled by
exactly one sequence), *committed* (full, immutable, content-addressed and
possibly shared by many sequences) or *cached* (committed with refcount 0:
reusable by a later prefix match, evicted least-recently-used when the pool
runs out of free pages). Each page also has a *generation*, bumped whenever
it is allocated or made writable in place, so a full page whose generation
has not moved since its KV was written still holds that KV
(:meth:`PagePool.generations`).

Content addressing. A committed page's key is ``blake2b(prev_key || token ids)``
where ``prev_key`` is the key of the page before it (the empty key for the
first page), followed by the keys of the LoRA adapters its tokens were
computed with, if any (their KV differs from the base model's). Since each
key names a whole prefix, the key map is a prefix trie whose edges are
page-sized token blocks (the scheme of vLLM's automatic prefix caching). Only pages computed the default way (causal attention, positions
equal to token indexes, nothing masked) are registered, because only then does
the KV depend on the tokens alone.

Thread safety: every method takes the pool's lock; the scheduler thread and
host calls may use the pool concurrently.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...sdk.errors import KvCacheFullError
from .kv_quant import row_width

EMPTY_KEY = b""


def page_key(prev_key: bytes, tokens: list[int] | tuple[int, ...], adapters: bytes = b"") -> bytes:
    """Content key of a full page: 16-byte BLAKE2b of the previous page's key
    followed by the page's token ids as little-endian int32, then
    ``adapters``: which LoRA adapters computed the page's tokens (empty for
    the base model; see :meth:`Sequence.page_adapters
    <tartlet.engine.core.sequence.Sequence.page_adapters>`), so pages of
    different adapters never share a key."""
    h = hashlib.blake2b(prev_key, digest_size=16)
    h.update(array("i", tokens).tobytes())
    if adapters:
        h.update(adapters)
    return h.digest()


@dataclass
class KvStats:
    """Page counts of a pool. ``used`` pages are referenced by a sequence or a
    snapshot; ``cached`` pages are unreferenced but reusable; ``free`` pages
    hold nothing."""

    total: int
    free: int
    cached: int
    used: int
    page_size: int


class PagePool:
    """Fixed pool of KV pages shared by every sequence of one model.

    Args:
        num_pages: pages in the pool (at least 1).
        page_size: tokens per page.
        num_layers, num_kv_heads, head_dim: model geometry.
        dtype: element type of the KV tensors: float32, bfloat16, float16,
            or int8 (rows quantized with a float32 scale each, see
            :mod:`tartlet.engine.core.kv_quant`).
        device: torch device of the KV tensors.

    Attributes:
        k, v: tensors ``[num_layers, num_pages * page_size, num_kv_heads,
            head_dim]`` of ``dtype`` (int8: ``head_dim + 4``, see above).
        head_dim: values per row (without an int8 row's scale bytes).
        window: when every layer of the model slides with window ``W``,
            ``W`` (set by the scheduler from
            :meth:`~tartlet.engine.models.config.ModelConfig.uniform_window`):
            sequences release pages that fall wholly before it (see
            :mod:`tartlet.engine.core.sequence`); ``None`` otherwise.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        shape = (num_layers, num_pages * page_size, num_kv_heads, row_width(head_dim, dtype))
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window: int | None = None
        self.lock = threading.RLock()
        self._refcount = [0] * num_pages
        self._key: list[bytes | None] = [None] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        #: per page, bumped whenever its rows may be written anew (see :meth:`generations`)
        self._gen = [0] * num_pages

    def nbytes(self) -> int:
        """Bytes reserved for keys and values (pages are only resident once written)."""
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_page(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one page across all layers (int8: the
        quants plus a 4-byte scale per token and KV head)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * page_size * num_layers * num_kv_heads * row_width(head_dim, dtype) * elem

    # -- allocation ---------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` private pages (refcount 1), evicting cached pages LRU
        first when no free page is left.

        Raises:
            KvCacheFullError: fewer than ``n`` free or cached pages exist; no
                page is taken in that case.
        """
        with self.lock:
            self.ensure_available(n)
            pages = []
            for _ in range(n):
                if self._free:
                    p = self._free.pop()
                else:
                    p, _ = self._lru.popitem(last=False)
                    del self._by_key[self._key[p]]  # type: ignore[arg-type]  # a cached page has a key
                    self._key[p] = None
                self._refcount[p] = 1
                self._gen[p] += 1
                pages.append(p)
            return pages

    def reserve_scratch(self) -> int:
        """Take the pool's last page out of use for good and return it: a
        page no sequence owns, which padded rows of a CUDA-graph decode
        step write to (:mod:`tartlet.engine.cuda.graphs`). ``num_pages``
        counts one page fewer afterwards.

        Raises:
            RuntimeError: a page has been handed out already, or the pool
                has a single page.
        """
        with self.lock:
            last = self.num_pages - 1
            if last < 1 or len(self._free) != self.num_pages:
                raise RuntimeError("a scratch page is reserved in a fresh pool of at least 2 pages")
            self._free.remove(last)
            self.num_pages = last
            return last

    def ensure_available(self, n: int) -> None:
        """Raise :class:`KvCacheFullError` unless ``n`` pages can be allocated."""
        with self.lock:
            if n > len(self._free) + len(self._lru):
                raise KvCacheFullError(
                    f"KV cache is full: need {n} page(s) of {self.page_size} tokens, "
                    f"{len(self._free)} free and {len(self._lru)} reclaimable of {self.num_pages}"
                )

    def available(self) -> int:
        """Pages that :meth:`allocate` can still hand out (free + cached)."""
        with self.lock:
            return len(self._free) + len(self._lru)

    def retain(self, page: int) -> None:
        """Add a reference to a page that is in use or cached."""
        with self.lock:
            if self._refcount[page] == 0:
                if page not in self._lru:
                    raise AssertionError(f"retain of free page {page}")
                del self._lru[page]
            self._refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop a reference. A committed page whose count reaches zero stays
        cached for prefix reuse; a private one becomes free."""
        with self.lock:
            rc = self._refcount[page]
            if rc <= 0:
                raise AssertionError(f"release of unreferenced page {page}")
            self._refcount[page] = rc - 1
            if rc == 1:
                if self._key[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    def refcount(self, page: int) -> int:
        with self.lock:
            return self._refcount[page]

    def is_private(self, page: int) -> bool:
        """Held by one page table only and not in the prefix cache (writable in place)."""
        with self.lock:
            return self._refcount[page] == 1 and self._key[page] is None

    def generations(self, pages: list[int]) -> list[int]:
        """Each page's generation: a counter bumped whenever the page is
        allocated or made writable in place (:meth:`make_private` on its only
        holder), so while a page's generation is unchanged its rows hold
        what they held when it was read (the snapshot store reuses the file
        of a page it wrote before by its ``(page, generation)``)."""
        with self.lock:
            return [self._gen[p] for p in pages]

    def is_committed(self, page: int) -> bool:
        with self.lock:
            return self._key[page] is not None

    # -- content addressing -------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        """Return the committed page with this content key, retained for the
        caller, or ``None``."""
        with self.lock:
            p = self._by_key.get(key)
            if p is not None:
                self.retain(p)
            return p

    def commit(self, page: int, key: bytes) -> int:
        """Register a full private page under its content key.

        Returns the page the caller should keep: ``page`` itself, or an
        identical page committed earlier by another sequence, in which case
        the caller's reference moves to that page and ``page`` is released.
        """
        with self.lock:
            existing = self._by_key.get(key)
            if existing is not None and existing != page:
                self.retain(existing)
                self.release(page)
                return existing
            self._by_key[key] = page
            self._key[page] = key
            return page

    def make_private(self, page: int, n_tokens: int) -> int:
        """Return a page the caller may write into, holding the first
        ``n_tokens`` of ``page``: ``page`` itself when the caller is its only
        user and it is not committed, else a fresh copy (copy-on-write; the
        caller's reference to ``page`` is released).

        Raises:
            KvCacheFullError: a copy is needed and no page is available.
        """
        with self.lock:
            if self._refcount[page] == 1 and self._key[page] is None:
                self._gen[page] += 1  # written in place from now on
                return page
            (dst,) = self.allocate(1)
            self.copy_tokens(page, dst, n_tokens)
            self.release(page)
            return dst

    def copy_tokens(self, src: int, dst: int, n_tokens: int) -> None:
        """Copy the KV of the first ``n_tokens`` slots of page ``src`` into
        page ``dst`` for every layer (int8 rows with their scales)."""
        ps = self.page_size
        s, d = src * ps, dst * ps
        self.k[:, d : d + n_tokens].copy_(self.k[:, s : s + n_tokens])
        self.v[:, d : d + n_tokens].copy_(self.v[:, s : s + n_tokens])

    def evict_all_cached(self) -> int:
        """Free every cached (unreferenced) page; returns how many."""
        with self.lock:
            n = len(self._lru)
            while self._lru:
                p, _ = self._lru.popitem(last=False)
                del self._by_key[self._key[p]]  # type: ignore[arg-type]  # a cached page has a key
                self._key[p] = None
                self._free.append(p)
            return n

    def stats(self) -> KvStats:
        with self.lock:
            free, cached = len(self._free), len(self._lru)
            return KvStats(self.num_pages, free, cached, self.num_pages - free - cached, self.page_size)

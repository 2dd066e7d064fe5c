"""The paged KV cache as a specification: PagePool and Sequence on a tiny pool.

No model is needed: a pool of 8 pages of 4 tokens, one layer, one KV head of
dimension 2. KV data is written by hand where a test checks copies.
"""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.core.kv_cache import EMPTY_KEY, KvCacheFullError, PagePool, page_key
from tartlet.engine.core.sequence import Sequence

PS = 4


@pytest.fixture
def pool() -> PagePool:
    return PagePool(num_pages=8, page_size=PS, num_layers=1, num_kv_heads=1, head_dim=2)


def no_leaks(pool: PagePool) -> None:
    st = pool.stats()
    assert st.used == 0, f"{st.used} pages still referenced"
    assert st.free + st.cached == st.total == 8
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))


def fill(seq: Sequence, tokens: list[int]) -> list[int]:
    """Append ``tokens`` the default way (as a forward pass would), write
    recognisable KV (k = token id, v = -token id) into their slots, commit
    full pages; returns the slots."""
    start = len(seq)
    slots = seq.reserve(tokens, list(range(start, start + len(tokens))), custom_attention=False)
    for s, t in zip(slots, tokens):
        seq.pool.k[:, s] = float(t)
        seq.pool.v[:, s] = -float(t)
    seq.commit_full_pages()
    return slots


def kv_of(seq: Sequence, i: int) -> tuple[float, float]:
    ps = seq.page_size
    row = seq.pages[i // ps] * ps + i % ps
    return float(seq.pool.k[0, row, 0, 0]), float(seq.pool.v[0, row, 0, 0])


# -- PagePool ------------------------------------------------------------------


def test_geometry_and_initial_state(pool):
    assert pool.k.shape == pool.v.shape == (1, 8 * PS, 1, 2)
    st = pool.stats()
    assert (st.total, st.free, st.cached, st.used, st.page_size) == (8, 8, 0, 0, PS)
    assert PagePool.bytes_per_page(16, 30, 3, 64, torch.float32) == 2 * 16 * 30 * 3 * 64 * 4


def test_invalid_pool_size():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(num_pages=0, page_size=4, num_layers=1, num_kv_heads=1, head_dim=2)


def test_allocate_release_refcount(pool):
    a, b = pool.allocate(2)
    assert a != b
    assert pool.refcount(a) == pool.refcount(b) == 1
    assert pool.stats().used == 2 and pool.stats().free == 6
    pool.retain(a)
    assert pool.refcount(a) == 2
    pool.release(a)
    assert pool.refcount(a) == 1 and pool.stats().used == 2
    pool.release(a)
    pool.release(b)
    assert pool.refcount(a) == 0
    with pytest.raises(AssertionError, match="unreferenced"):
        pool.release(a)
    with pytest.raises(AssertionError, match="free page"):
        pool.retain(a)
    no_leaks(pool)


def test_full_pool_raises_and_takes_nothing(pool):
    held = pool.allocate(6)
    with pytest.raises(KvCacheFullError) as e:
        pool.allocate(3)
    msg = str(e.value)
    assert "need 3 page(s) of 4 tokens" in msg and "2 free" in msg and "of 8" in msg
    assert pool.stats().free == 2 and pool.stats().used == 6  # nothing was taken
    more = pool.allocate(2)
    with pytest.raises(KvCacheFullError, match="KV cache is full"):
        pool.allocate(1)
    for p in held + more:
        pool.release(p)
    no_leaks(pool)


def test_commit_and_lookup_content_addressing(pool):
    k1 = page_key(EMPTY_KEY, [1, 2, 3, 4])
    k2 = page_key(k1, [5, 6, 7, 8])
    assert len(k1) == 16 and k1 == page_key(EMPTY_KEY, (1, 2, 3, 4))
    # the same block after a different prefix is a different page
    assert page_key(page_key(EMPTY_KEY, [9, 9, 9, 9]), [5, 6, 7, 8]) != k2
    assert page_key(EMPTY_KEY, [5, 6, 7, 8]) != k2

    (p,) = pool.allocate(1)
    assert pool.commit(p, k1) == p and pool.is_committed(p)
    assert pool.lookup(k2) is None
    assert pool.lookup(k1) == p and pool.refcount(p) == 2  # lookup retains
    pool.release(p)
    pool.release(p)
    st = pool.stats()
    assert (st.cached, st.used) == (1, 0)  # unreferenced but reusable
    assert pool.lookup(k1) == p and pool.stats().cached == 0  # revived from the cache
    # committing an identical page adopts the existing one and frees the duplicate
    (q,) = pool.allocate(1)
    assert pool.commit(q, k1) == p
    assert pool.refcount(p) == 2 and pool.refcount(q) == 0
    pool.release(p)
    pool.release(p)
    assert pool.evict_all_cached() == 1
    assert pool.lookup(k1) is None
    no_leaks(pool)


def test_lru_eviction_never_takes_referenced_pages(pool):
    keys = [page_key(EMPTY_KEY, [i] * PS) for i in range(4)]
    pages = pool.allocate(4)
    for p, k in zip(pages, keys):
        pool.commit(p, k)
    # pages[3] stays referenced; release 0, 1, 2 in the order 1, 0, 2 (LRU order)
    for i in (1, 0, 2):
        pool.release(pages[i])
    assert pool.stats().cached == 3 and pool.stats().free == 4
    # touching pages[1] again makes it most recently used
    assert pool.lookup(keys[1]) == pages[1]
    pool.release(pages[1])  # LRU order now: 0, 2, 1
    fresh = pool.allocate(4)  # uses the free pages first
    assert not set(fresh) & set(pages)
    assert pool.stats().cached == 3
    (e1,) = pool.allocate(1)  # evicts the least recently used: pages[0]
    assert e1 == pages[0] and pool.lookup(keys[0]) is None
    (e2,) = pool.allocate(1)
    assert e2 == pages[2] and pool.lookup(keys[2]) is None
    assert pool.lookup(keys[1]) == pages[1]  # still cached, now referenced
    with pytest.raises(KvCacheFullError):
        pool.allocate(1)  # only referenced pages remain: none is evicted
    assert pool.refcount(pages[3]) == 1 and pool.lookup(keys[3]) == pages[3]
    for p in fresh + [e1, e2, pages[1], pages[3], pages[3]]:
        pool.release(p)
    pool.evict_all_cached()
    no_leaks(pool)


# -- Sequence ---------------------------------------------------------------------


def test_reserve_slots_and_commit(pool):
    seq = Sequence(pool)
    slots = fill(seq, list(range(10)))
    assert len(seq) == 10 and len(seq.pages) == 3
    ps = PS
    assert slots == [seq.pages[i // ps] * ps + i % ps for i in range(10)]
    assert [pool.is_committed(p) for p in seq.pages] == [True, True, False]
    assert seq.keys == [page_key(EMPTY_KEY, [0, 1, 2, 3]), page_key(page_key(EMPTY_KEY, [0, 1, 2, 3]), [4, 5, 6, 7])]
    assert [kv_of(seq, i) for i in range(10)] == [(float(t), -float(t)) for t in range(10)]
    seq.free()
    assert pool.stats().cached == 2 and pool.stats().used == 0
    pool.evict_all_cached()
    no_leaks(pool)


def test_prefix_match_reuses_committed_pages(pool):
    a = Sequence(pool)
    fill(a, list(range(10)))
    b = Sequence(pool)
    # tokens 0..7 are two committed pages; the match stops at the limit and at whole pages
    assert b.match_prefix(list(range(10)), limit=10) == 8
    assert b.pages == a.pages[:2] and all(pool.refcount(p) == 2 for p in a.pages[:2])
    c = Sequence(pool)
    assert c.match_prefix(list(range(10)), limit=7) == 4  # never more than the limit
    d = Sequence(pool)
    assert d.match_prefix([9] + list(range(1, 10)), limit=10) == 0  # different first page
    for s in (a, b, c, d):
        s.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_sequence_full_error_leaves_it_unchanged(pool):
    seq = Sequence(pool)
    fill(seq, list(range(6)))
    other = pool.allocate(5)
    used = pool.stats().used
    with pytest.raises(KvCacheFullError, match="need 2 page"):
        seq.reserve(list(range(100, 110)), list(range(6, 16)), custom_attention=False)
    assert len(seq) == 6 and len(seq.pages) == 2 and pool.stats().used == used
    for p in other:
        pool.release(p)
    seq.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_fork_shares_full_pages_and_copies_tail(pool):
    parent = Sequence(pool)
    fill(parent, list(range(10)))  # 2 full pages + 2 tokens in the tail
    child = parent.fork()
    assert child.tokens == parent.tokens and child.keys == parent.keys
    assert child.pages[:2] == parent.pages[:2]
    assert all(pool.refcount(p) == 2 for p in parent.pages[:2])
    assert child.pages[2] != parent.pages[2] and pool.refcount(child.pages[2]) == 1
    assert [kv_of(child, i) for i in (8, 9)] == [kv_of(parent, i) for i in (8, 9)] == [(8.0, -8.0), (9.0, -9.0)]
    assert pool.stats().used == 4
    # writing into either tail does not touch the other
    fill(child, [77])
    fill(parent, [55])
    assert kv_of(child, 10) == (77.0, -77.0) and kv_of(parent, 10) == (55.0, -55.0)
    assert kv_of(child, 9) == kv_of(parent, 9) == (9.0, -9.0)
    # a page-aligned fork copies nothing
    aligned = Sequence(pool)
    fill(aligned, list(range(8)))
    used = pool.stats().used
    f2 = aligned.fork()
    assert pool.stats().used == used and f2.pages == aligned.pages
    for s in (parent, child, aligned, f2):
        s.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_fork_without_room_fails_cleanly(pool):
    parent = Sequence(pool)
    fill(parent, list(range(6)))
    other = pool.allocate(pool.available())
    with pytest.raises(KvCacheFullError):
        parent.fork()
    assert pool.refcount(parent.pages[0]) == 1  # no reference leaked
    for p in other:
        pool.release(p)
    parent.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_copy_on_write_after_truncate_into_shared_page(pool):
    a = Sequence(pool)
    fill(a, list(range(8)))
    b = a.fork()  # shares both full pages
    shared = b.pages[1]
    b.truncate(6)  # the tail is now the shared, committed page 1
    assert b.pages[1] == shared and len(b.keys) == 1
    fill(b, [60, 61])  # writing slots 6, 7 must not touch a's page
    assert b.pages[1] != shared
    assert pool.refcount(shared) == 1
    assert [kv_of(a, i) for i in range(8)] == [(float(t), -float(t)) for t in range(8)]
    assert [kv_of(b, i) for i in range(8)] == [(float(t), -float(t)) for t in range(6)] + [(60.0, -60.0), (61.0, -61.0)]
    # the copied page became a new committed page with its own key
    assert pool.is_committed(b.pages[1]) and b.keys[1] != a.keys[1]
    a.free()
    b.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_truncate_releases_pages(pool):
    seq = Sequence(pool)
    fill(seq, list(range(10)))
    seq.truncate(4)
    assert len(seq.pages) == 1 and len(seq.keys) == 1 and seq.tokens == [0, 1, 2, 3]
    assert pool.stats().used == 1 and pool.stats().cached == 1  # page 1 was committed
    with pytest.raises(ValueError, match="truncate to 11"):
        seq.truncate(11)
    seq.truncate(0)
    assert seq.pages == [] and len(seq) == 0
    seq.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_mask_range_and_drop_masked_pages(pool):
    seq = Sequence(pool)
    fill(seq, list(range(14)))  # pages 0..2 full, page 3 holds 2 tokens
    seq.mask_range(0, 6, True)  # page 0 fully masked, page 1 half
    assert not seq.pure
    seq.mask_range(12, 14, True)  # the partial tail: never dropped
    before = list(seq.pages)
    assert seq.drop_masked_pages() == 1
    assert seq.pages[0] is None and seq.pages[1:] == before[1:]
    assert seq.live_pages() == 3 and len(seq) == 14
    assert pool.refcount(before[0]) == 0
    assert seq.drop_masked_pages() == 0  # idempotent
    seq.mask_range(4, 8, True)
    assert seq.drop_masked_pages() == 1 and seq.pages[1] is None
    with pytest.raises(ValueError, match="mask range"):
        seq.mask_range(3, 20, True)
    # a masked sequence commits nothing new
    fill(seq, [14, 15])
    assert len(seq.keys) == 3
    seq.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_free_is_idempotent(pool):
    seq = Sequence(pool)
    fill(seq, list(range(5)))
    f = seq.fork()
    seq.free("gone")
    seq.free()
    assert seq.freed and seq.error == "gone" and seq.pages == []
    assert pool.stats().used == 2  # the fork still holds its pages
    f.free()
    f.free()
    pool.evict_all_cached()
    no_leaks(pool)


def test_no_leaks_after_a_mixed_workload(pool):
    seqs = []
    a = Sequence(pool)
    fill(a, list(range(9)))
    seqs.append(a)
    for _ in range(3):
        f = a.fork()
        fill(f, [100 + len(seqs)])
        seqs.append(f)
    b = Sequence(pool)
    n = b.match_prefix(list(range(9)), limit=9)
    fill(b, list(range(n, 9)))
    seqs.append(b)
    seqs[1].truncate(3)
    seqs[2].mask_range(0, 4, True)
    seqs[2].drop_masked_pages()
    for s in seqs:
        s.free()
    st = pool.stats()
    assert st.used == 0 and st.free + st.cached == 8
    pool.evict_all_cached()
    no_leaks(pool)


def test_generation_moves_whenever_a_page_may_be_written_anew(pool):
    """The snapshot store names a page's file by ``(page, generation)``: the
    generation moves on allocation and when the only holder writes a page
    in place, never while others share it."""
    a = Sequence(pool)
    fill(a, [1, 2, 3, 4, 5, 6])  # one full page, one partly filled
    full, tail = a.pages
    g = pool.generations([full, tail])
    b = a.fork()  # shares the full page, copies the tail
    fill(b, [7])
    assert pool.generations([full]) == g[:1]  # shared and full: never written
    fill(a, [8])  # a's own tail, written in place
    assert pool.generations([tail])[0] > g[1]
    a.truncate(2)  # the full page, still shared with b: a's next write copies it
    fill(a, [9])
    assert a.pages[0] != full and pool.generations([full]) == g[:1]
    b.free()
    a.free()
    (again,) = pool.allocate(1)
    assert pool.generations([again])[0] > 0
    pool.release(again)

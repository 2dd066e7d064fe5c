"""KV page accounting and quotas at the sequence level (no model needed):
distinct pages per account, nested instance/user/snapshot accounts, and a
quota checked at every allocation (reserve, fork, prefix attach, take)."""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.core.kv_accounting import KvQuotaError, PageAccount
from tartlet.engine.core.kv_cache import PagePool
from tartlet.engine.core.sequence import Sequence
from tartlet.host.kv_quotas import KvAccounts, KvLimits

PS = 4


def pool(n: int = 64) -> PagePool:
    return PagePool(n, PS, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def filled(p: PagePool, acc: PageAccount | None, n: int) -> Sequence:
    s = Sequence(p, acc)
    s.reserve(list(range(n)), list(range(n)), custom_attention=False)
    s.commit_full_pages()
    return s


def test_account_counts_distinct_pages_and_nests():
    p = pool()
    user = PageAccount("user", 100)
    a, b = PageAccount("a", 100, user), PageAccount("b", 100, user)
    s = filled(p, a, 10)  # 3 pages, the last partly filled
    assert (a.pages, user.pages) == (3, 3)
    f = s.fork()  # same account: shares 2 full pages, copies the tail
    assert (a.pages, user.pages) == (4, 4)
    g = Sequence(p, b)
    s.fork_into(g)  # another instance of the same user: shared pages count once for the user
    assert (a.pages, b.pages, user.pages) == (4, 3, 5)
    f.free()
    g.free()
    assert (a.pages, b.pages, user.pages) == (3, 0, 3)
    s.truncate(4)
    assert (a.pages, user.pages) == (1, 1)
    s.free()
    assert (a.pages, user.pages) == (0, 0) and p.stats().used == 0


def test_quota_is_checked_at_reserve_and_fork_and_changes_nothing():
    p = pool()
    acc = PageAccount("instance 'x'", 4, setting="limits.max_pages_per_instance")
    s = filled(p, acc, 10)  # 3 pages
    used = p.stats().used
    with pytest.raises(KvQuotaError, match=r"instance 'x' holds 3 page\(s\) and needs 2 more, over its page limit of 4 \(limits.max_pages_per_instance\)"):
        s.reserve(list(range(8)), list(range(10, 18)), custom_attention=False)
    assert len(s) == 10 and p.stats().used == used
    f = s.fork()  # the tail copy is the 4th page
    assert acc.pages == 4
    child = Sequence(p, acc)
    with pytest.raises(KvQuotaError):
        s.fork_into(child)
    assert child.pages == [] and p.stats().used == used + 1
    f.free()
    s.fork_into(child)  # room again
    assert acc.pages == 4


def test_fork_storm_of_a_full_page_context_costs_no_pages():
    p = pool()
    acc = PageAccount("i", 2)
    s = filled(p, acc, 8)  # exactly 2 full pages: forks share everything
    forks = [s.fork() for _ in range(100)]
    assert acc.pages == 2 and p.stats().used == 2
    for f in forks:
        f.free()


def test_prefix_attach_stops_at_the_quota():
    p = pool()
    other = filled(p, PageAccount("other"), 16)  # 4 committed pages in the prefix cache
    acc = PageAccount("i", 2)
    s = Sequence(p, acc)
    assert s.match_prefix(list(range(16)), 16) == 8  # only 2 pages attached
    assert acc.pages == 2
    s.free()
    other.free()
    assert acc.pages == 0


def test_transfer_moves_pages_between_accounts():
    p = pool()
    user = PageAccount("user", 10)
    snaps, inst = PageAccount("snaps", 10, user), PageAccount("inst", 2, user)
    s = filled(p, snaps, 10)
    dst = Sequence(p, inst)
    with pytest.raises(KvQuotaError):
        s.transfer_into(dst)  # 3 pages do not fit the instance's 2
    assert snaps.pages == 3 and dst.pages == [] and not s.freed
    inst.limit = 3
    s.transfer_into(dst)
    assert (snaps.pages, inst.pages, user.pages) == (0, 3, 3) and s.freed and len(dst) == 10
    dst.free()
    assert user.pages == 0 and p.stats().used == 0


def test_precheck_counts_queued_calls():
    acc = PageAccount("i", 3, PageAccount("u", 100))
    acc.pend(3)
    with pytest.raises(KvQuotaError, match="3 more queued"):
        acc.precheck(1)
    acc.pend(-3)
    acc.precheck(3)


def test_user_quota_from_pool_fraction():
    acc = KvAccounts(KvLimits(pool_fraction_per_user=0.5, max_pages_per_user=100), num_pages=64)
    assert acc.user("alice").limit == 32 and "pool_fraction_per_user" in acc.user("alice").setting
    assert acc.snapshots("alice").parent is acc.user("alice")
    acc.set_limits(KvLimits(max_pages_per_user=10))
    assert acc.user("alice").limit == 10 and acc.user("alice").setting == "limits.max_pages_per_user"

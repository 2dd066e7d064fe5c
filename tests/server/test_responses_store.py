"""The stored responses of ``/v1/responses`` (:class:`ResponseStore`): per
user, bounded by ``max_per_user`` (oldest first), expiring, and pruned
from an index of ids, so a ``put`` reads no record, across a restart too."""

from __future__ import annotations

import json
import time

from tartlet.server.responses_store import ResponseStore, snapshot_name


def rec(i: int, created: float) -> dict:
    return {"id": f"resp_{i:032x}", "created": created, "messages": [{"role": "user", "content": "x" * 10}]}


def test_put_keeps_the_newest_per_user_and_drops_their_snapshots(tmp_path):
    dropped: list[tuple[str, str]] = []
    store = ResponseStore(tmp_path, ttl_s=3600, max_per_user=3, drop_snapshot=lambda u, n: dropped.append((u, n)))
    now = time.time()
    for i in range(5):
        store.put("alice", rec(i, now + i))
    store.put("bob", rec(9, now))
    alive = [i for i in range(5) if store.get("alice", rec(i, 0)["id"]) is not None]
    assert alive == [2, 3, 4]
    assert dropped == [("alice", snapshot_name(rec(0, 0)["id"])), ("alice", snapshot_name(rec(1, 0)["id"]))]
    assert store.get("bob", rec(9, 0)["id"]) is not None and store.get("alice", rec(9, 0)["id"]) is None


def test_put_reads_no_record_and_a_restarted_store_knows_the_old_ones(tmp_path, monkeypatch):
    store = ResponseStore(tmp_path, ttl_s=3600, max_per_user=2, drop_snapshot=lambda u, n: None)
    now = time.time()
    store.put("alice", rec(0, now))
    store.put("alice", rec(1, now + 1))
    # a restart: a new store reads the user's files once, at its first put
    again = ResponseStore(tmp_path, ttl_s=3600, max_per_user=2, drop_snapshot=lambda u, n: None)
    reads = []
    real = json.loads
    monkeypatch.setattr("tartlet.server.responses_store.json.loads", lambda s: reads.append(1) or real(s))
    again.put("alice", rec(2, now + 2))
    assert len(reads) == 3  # the user's files, the new one included, once
    reads.clear()
    again.put("alice", rec(3, now + 3))
    assert reads == []  # later puts read nothing
    assert [i for i in range(4) if again.get("alice", rec(i, 0)["id"]) is not None] == [2, 3]


def test_expired_records_go_at_the_next_put(tmp_path):
    dropped: list[str] = []
    store = ResponseStore(tmp_path, ttl_s=0.05, max_per_user=10, drop_snapshot=lambda u, n: dropped.append(n))
    store.put("alice", rec(0, time.time()))
    time.sleep(0.1)
    store.put("alice", rec(1, time.time() + 100))  # created later: lives past the ttl
    assert dropped == [snapshot_name(rec(0, 0)["id"])]
    assert store.get("alice", rec(1, 0)["id"]) is not None

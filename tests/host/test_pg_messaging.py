"""Inferlet messaging shared by replicas on a real PostgreSQL
(tartlet.host.pg_messaging): two PgMessageBus on one database stand for two
server replicas."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait

import psycopg
import pytest

from tartlet.host.messaging import Message
from tartlet.host.pg_messaging import PgMessageBus
from tartlet.sdk.errors import LimitError, MessagingError

pytestmark = pytest.mark.slow

T = 5  # seconds a cross-replica delivery may take (it takes milliseconds)


@pytest.fixture
def db_url(postgres) -> str:
    return postgres.new_database()


@pytest.fixture
def make_bus(db_url) -> Iterator:
    made: list[PgMessageBus] = []

    def make(**kw) -> PgMessageBus:
        bus = PgMessageBus(db_url, **kw)
        made.append(bus)
        return bus

    yield make
    for bus in made:
        bus.close()


@pytest.fixture
def pair(make_bus) -> tuple[PgMessageBus, PgMessageBus]:
    return make_bus(), make_bus()


def rows(url: str, table: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(f"SELECT count(*) FROM {table}").fetchone()  # type: ignore[arg-type]
        assert row is not None
        return int(row[0])


def until(cond, timeout: float = T) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_push_on_one_replica_pull_on_the_other(pair):
    a, b = pair
    a.push("alice", "q", "hello")
    a.push("alice", "q", b"\x00\xffbytes")
    a.push("alice", "q", "")
    got = [b.pull("alice", "q").result(T) for _ in range(3)]
    assert got == ["hello", b"\x00\xffbytes", ""]
    assert isinstance(got[1], bytes) and isinstance(got[0], str)
    assert a.usage("alice") == {"bytes": 0, "topics": 0}


def test_a_waiting_puller_is_woken_by_a_push_elsewhere(pair):
    a, b = pair
    waiting = b.pull("alice", "q")
    time.sleep(0.1)
    assert not waiting.done()
    assert a.usage("alice")["topics"] == 1  # the waiting puller gives the topic state, seen from the other replica
    a.push("alice", "q", "wake")
    assert waiting.result(T) == "wake"
    until(lambda: a.usage("alice") == {"bytes": 0, "topics": 0})


def test_fifo_across_replicas(pair):
    a, b = pair
    for i in range(50):
        (a if i % 2 else b).push("u", "q", str(i))
    assert [b.pull("u", "q").result(T) for _ in range(50)] == [str(i) for i in range(50)]


def test_each_message_reaches_exactly_one_puller(pair):
    a, b = pair
    n = 60
    waiting = [bus.pull("u", "q") for _ in range(n // 4) for bus in (a, b)]  # 30 pullers wait, half on each replica

    def pusher(bus: PgMessageBus, tag: str) -> None:
        for i in range(n // 2):
            bus.push("u", "q", f"{tag}{i}")

    threads = [threading.Thread(target=pusher, args=(a, "a")), threading.Thread(target=pusher, args=(b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pulled: list[Future[Message]] = []
    lock = threading.Lock()

    def puller(bus: PgMessageBus) -> None:  # the rest are claimed by pullers racing on both replicas
        for _ in range(n // 4):
            f = bus.pull("u", "q")
            with lock:
                pulled.append(f)

    threads = [threading.Thread(target=puller, args=(bus,)) for bus in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done, not_done = wait(waiting + pulled, timeout=T)
    assert not not_done
    got = [f.result() for f in waiting + pulled]
    assert sorted(got) == sorted([f"a{i}" for i in range(n // 2)] + [f"b{i}" for i in range(n // 2)])
    time.sleep(0.2)
    assert not b.pull("u", "q").done()  # nothing left over, nothing delivered twice


def test_a_cancelled_pull_loses_nothing(pair, db_url):
    a, b = pair
    gone = b.pull("u", "q")
    b.cancel_pull(gone)  # its instance ended
    a.push("u", "q", "kept")
    time.sleep(0.2)
    assert gone.cancelled() and rows(db_url, "tartlet_msg_queue") == 1
    cancelled_elsewhere = b.pull("u", "q2")
    cancelled_elsewhere.cancel()  # cancelled without cancel_pull: skipped when a message comes
    a.push("u", "q2", "also kept")
    time.sleep(0.2)
    assert a.pull("u", "q").result(T) == "kept" and b.pull("u", "q2").result(T) == "also kept"


def test_broadcast_reaches_subscriptions_on_every_replica(pair, db_url):
    a, b = pair
    sa, sb1, sb2 = a.subscribe("u", "news"), b.subscribe("u", "news"), b.subscribe("u", "news")
    assert len({sa, sb1, sb2}) == 3  # subscription ids are unique across replicas
    pending = b.next(sb2)  # waiting before the send
    assert a.broadcast("u", "news", "x") == 3
    assert a.next(sa).result(0) == "x"  # the sender's replica has it on return
    assert b.next(sb1).result(T) == "x" and pending.result(T) == "x"
    assert b.broadcast("u", "news", b"\x01bin") == 3
    assert [a.next(sa).result(T), b.next(sb1).result(T), b.next(sb2).result(T)] == [b"\x01bin"] * 3
    late = a.subscribe("u", "news")  # opened after those sends: gets none of them
    assert not a.next(late).done()
    until(lambda: rows(db_url, "tartlet_msg_broadcasts") == 0)  # delivered rows are cleaned up
    assert b.broadcast("other", "news", "y") == 0  # users are separate
    b.unsubscribe(sb1)
    assert a.broadcast("u", "news", "z") == 3  # sa, sb2, late
    with pytest.raises(MessagingError):
        b.next(sb1)
    with pytest.raises(MessagingError):
        a.next(sb2)  # a subscription is read on the replica that opened it


def test_users_are_isolated(pair):
    a, b = pair
    a.push("alice", "q", "alice's")
    bobs = b.pull("bob", "q")
    time.sleep(0.2)
    assert not bobs.done()
    assert b.usage("bob") == {"bytes": 0, "topics": 1} and b.usage("alice") == {"bytes": 7, "topics": 1}
    assert b.pull("alice", "q").result(T) == "alice's"


def test_limits_hold_across_replicas(make_bus):
    a, b = make_bus(max_user_bytes=10, max_user_topics=3), make_bus(max_user_bytes=10, max_user_topics=3)
    a.push("alice", "q", "12345")
    with pytest.raises(LimitError, match="max_messaging_bytes_per_user"):
        b.push("alice", "q", "123456")  # 5 + 6 > 10, counted over both replicas
    b.push("bob", "q", "123456")  # another user's budget
    sa, sb = a.subscribe("alice", "t"), b.subscribe("alice", "t")
    with pytest.raises(LimitError, match="max_messaging_bytes_per_user"):
        a.broadcast("alice", "t", "abc")  # two copies of 3 on top of 5
    assert a.usage("alice") == b.usage("alice") == {"bytes": 5, "topics": 2}
    b.pull("alice", "w")  # a puller waiting on one replica gives "w" state for both
    with pytest.raises(LimitError, match="max_topics_per_user"):
        a.subscribe("alice", "fourth")
    with pytest.raises(LimitError, match="max_topics_per_user"):
        a.push("alice", "fifth", "x")
    assert a.pull("alice", "q").result(T) == "12345"
    a.unsubscribe(sa)
    b.unsubscribe(sb)
    assert a.usage("alice") == {"bytes": 0, "topics": 1}
    a.subscribe("alice", "fourth")


def test_the_in_process_limit_scenario_on_one_pg_bus(make_bus):
    """tests/server/test_server_hardening.py's bus scenario, unchanged, on one PgMessageBus."""
    bus = make_bus(max_user_bytes=10, max_user_topics=3)
    bus.push("alice", "q", "12345")
    s1, s2 = bus.subscribe("alice", "t"), bus.subscribe("alice", "t")
    with pytest.raises(LimitError, match="max_messaging_bytes_per_user"):
        bus.broadcast("alice", "t", "abc")
    assert bus.usage("alice") == {"bytes": 5, "topics": 2}
    assert bus.broadcast("bob", "t", "abc") == 0 and bus.usage("bob") == {"bytes": 0, "topics": 0}
    pending = bus.next(s1)  # a waiting subscriber takes its copy at once: only s2's is held
    assert bus.broadcast("alice", "t", "abc") == 2 and pending.result(0) == "abc"
    assert bus.usage("alice")["bytes"] == 8
    bus.unsubscribe(s2)
    assert bus.usage("alice")["bytes"] == 5
    bus.pull("alice", "w")
    with pytest.raises(LimitError, match="max_topics_per_user"):
        bus.subscribe("alice", "fourth")
    assert bus.pull("alice", "q").result(0) == "12345"
    assert bus.usage("alice") == {"bytes": 0, "topics": 2}
    bus.unsubscribe(s1)
    bus.subscribe("alice", "fourth")


def test_remote_subscription_bytes_count_until_read(pair):
    a, b = pair
    sb = b.subscribe("u", "t")
    assert a.broadcast("u", "t", "abcd") == 1
    until(lambda: a.usage("u")["bytes"] == 4)  # held in b's mailbox, seen from a
    assert b.next(sb).result(T) == "abcd"
    assert a.usage("u")["bytes"] == 0


def test_validation_errors(pair):
    a, _ = pair
    for topic, msg in [("", "m"), ("t", 5), ("t", "x" * (2**20 + 1)), ("x" * 257, "m"), ("nul\x00", "m")]:
        with pytest.raises(MessagingError):
            a.push("alice", topic, msg)
    with pytest.raises(MessagingError):
        a.next(12345)
    a.push("alice", "big", "é" * (2**19))  # 1 MiB of UTF-8: the largest message, far over a NOTIFY payload
    assert a.pull("alice", "big").result(T) == "é" * (2**19)


def test_close_fails_waiters_and_frees_its_state(make_bus):
    a, b = make_bus(), make_bus()
    pulling = a.pull("u", "q")
    sid = a.subscribe("u", "t")
    nexting = a.next(sid)
    b.subscribe("u", "t")
    a.close()
    for fut in (pulling, nexting):
        with pytest.raises(MessagingError, match="closed"):
            fut.result(T)
    with pytest.raises(MessagingError, match="closed"):
        a.push("u", "q", "x")
    a.close()  # idempotent
    assert not a._thread.is_alive()
    assert b.broadcast("u", "t", "x") == 1  # a's subscription is gone from the database
    b.push("u", "q", "for b")  # a's puller is gone: the message waits for b
    assert b.pull("u", "q").result(T) == "for b"


def test_a_crashed_replica_is_forgotten(make_bus):
    a = make_bus(heartbeat_s=0.1, stale_s=0.5)
    crashed = make_bus(heartbeat_s=0.1, stale_s=0.5)
    crashed.subscribe("u", "t")
    crashed.pull("u", "q")
    assert a.broadcast("u", "t", "x") == 1 and a.usage("u")["topics"] == 2
    crashed._stop.set()  # its listener (and heartbeat) stops, as if the process died
    crashed._thread.join()
    until(lambda: a.broadcast("u", "t", "x") == 0)
    assert a.usage("u") == {"bytes": 0, "topics": 0}

"""The buffer between a host-side generation and its inferlet
(:class:`tartlet.host.token_stream.TokenStream`): tokens pushed before or
after the inferlet asks, errors after the tokens before them, closing while
passes run, and a waiter cancelled meanwhile losing nothing."""

from __future__ import annotations

import threading

import pytest

from tartlet.host.token_stream import TokenStream


def test_tokens_pushed_before_next_come_at_once():
    s = TokenStream()
    s.push(1)
    s.push(2)
    assert s.next().result(timeout=1) == [1, 2]
    fut = s.next()
    assert not fut.done()
    s.push(3)
    assert fut.result(timeout=1) == [3]


def test_end_after_tokens_then_empty():
    s = TokenStream()
    s.push(5)
    s.end(None)
    assert s.next().result(timeout=1) == [5]
    assert s.next().result(timeout=1) == []
    assert s.next().result(timeout=1) == []


def test_a_waiter_gets_the_end():
    s = TokenStream()
    fut = s.next()
    s.end(None)
    assert fut.result(timeout=1) == []


def test_error_comes_after_the_tokens_before_it_once():
    s = TokenStream()
    s.push(7)
    s.end(ValueError("pass failed"))
    assert s.next().result(timeout=1) == [7]
    with pytest.raises(ValueError, match="pass failed"):
        s.next().result(timeout=1)
    assert s.next().result(timeout=1) == []


def test_a_counted_next_waits_for_its_count_and_leaves_the_rest():
    """``next(count)``: resolved once ``count`` tokens are there, with those
    only (the rest stays for the next call); fewer at the end."""
    s = TokenStream()
    fut = s.next(3)
    s.push(1)
    s.push(2)
    assert not fut.done()
    s.push(3)
    assert fut.result(timeout=1) == [1, 2, 3]
    for t in (4, 5, 6):
        s.push(t)
    assert s.next(2).result(timeout=1) == [4, 5]
    fut = s.next(4)
    s.end(None)
    assert fut.result(timeout=1) == [6]
    assert s.next(4).result(timeout=1) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="count"):
            TokenStream().next(bad)


def test_one_next_at_a_time():
    s = TokenStream()
    s.next()
    with pytest.raises(ValueError, match="still pending"):
        s.next()


def test_close_waits_for_the_pass_in_flight_and_returns_what_was_not_taken():
    s = TokenStream()
    s.push(1)
    assert s.next().result(timeout=1) == [1]
    waiter = s.next()
    s.push(2)  # taken by the waiter
    assert waiter.result(timeout=1) == [2]
    s.push(3)
    closed = s.close()
    assert s.stopping and not closed.done()  # a pass may still be in flight
    s.push(4)  # its token
    s.end(None)
    assert closed.result(timeout=1) == [3, 4]
    assert s.close().result(timeout=1) == []  # idempotent
    with pytest.raises(ValueError, match="closed"):
        s.next()


def test_close_resolves_a_pending_next_and_after_the_end_returns_the_rest():
    s = TokenStream()
    waiter = s.next()
    closed = s.close()
    assert waiter.result(timeout=1) == []
    s.end(RuntimeError("ignored once closing"))
    assert closed.result(timeout=1) == []
    t = TokenStream()
    t.push(9)
    t.end(None)
    assert t.close().result(timeout=1) == [9]


def test_the_end_after_a_cancelled_close_raises_nothing():
    # the inferlet was aborted while it awaited stream_close: the scheduler's
    # end of the generation must not fail on the cancelled future (it did,
    # as an InvalidStateError traceback in the server log)
    s = TokenStream()
    s.push(1)
    closed = s.close()
    assert closed.cancel()
    s.end(None)
    assert closed.cancelled()


def test_a_cancelled_waiter_loses_no_token():
    s = TokenStream()
    fut = s.next()
    assert fut.cancel()
    s.push(4)
    assert s.next().result(timeout=1) == [4]


def test_tokens_from_another_thread_arrive_in_order():
    s = TokenStream()
    n = 2000

    def produce() -> None:
        for i in range(n):
            s.push(i)
        s.end(None)

    t = threading.Thread(target=produce)
    t.start()
    got: list[int] = []
    while True:
        chunk = s.next().result(timeout=5)
        if not chunk:
            break
        got += chunk
    t.join()
    assert got == list(range(n))

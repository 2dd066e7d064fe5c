"""Handing work to the event loop: ``service.post`` (a session message to the
server's loop, from the loop's own thread or another) and the SDK's
``_binding.wait`` (awaiting a host future, resolved or not)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from tartlet.sdk import _binding
from tartlet.server.service import post


@contextlib.contextmanager
def counting_threadsafe(loop: asyncio.AbstractEventLoop) -> Iterator[list[int]]:
    """Count ``loop.call_soon_threadsafe`` calls (writes to its self-pipe)
    made inside the block; the count is the yielded list's one element."""
    count = [0]
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        del loop.call_soon_threadsafe


async def test_post_keeps_order_and_skips_the_self_pipe_on_the_loop_thread() -> None:
    loop = asyncio.get_running_loop()
    with counting_threadsafe(loop) as threadsafe:
        seen: list[str] = []
        post(loop, seen.append, "a")  # the loop's thread: call_soon
        t = threading.Thread(target=post, args=(loop, seen.append, "b"))  # another thread: call_soon_threadsafe
        t.start()
        t.join()
        post(loop, seen.append, "c")
        assert seen == []  # nothing runs before the loop gets control
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen == ["a", "b", "c"]  # one FIFO whichever way they came
        assert threadsafe[0] == 1


async def test_wait_reads_a_resolved_future_and_awaits_a_pending_one() -> None:
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(7)
    assert await _binding.wait(done) == 7

    failed: concurrent.futures.Future[int] = concurrent.futures.Future()
    failed.set_exception(ValueError("bad pass"))
    with pytest.raises(ValueError, match="bad pass"):
        await _binding.wait(failed)

    cancelled: concurrent.futures.Future[int] = concurrent.futures.Future()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):  # as awaiting it through wrap_future raises
        await _binding.wait(cancelled)

    pending: concurrent.futures.Future[int] = concurrent.futures.Future()
    threading.Timer(0.01, pending.set_result, args=(9,)).start()
    assert await _binding.wait(pending) == 9


async def test_wait_on_a_resolved_future_still_yields_to_the_loop() -> None:
    """Another task gets to run while one reads a resolved future, as when
    it awaited the wrapped future."""
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    task = asyncio.ensure_future(other())
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(1)
    await _binding.wait(done)
    assert ran == ["other"]
    await task


async def test_wait_wakes_the_loop_once_for_futures_resolved_together() -> None:
    """Futures resolved on another thread in one go (a scheduler step's
    token streams) settle through one ``call_soon_threadsafe``, in the
    order they were resolved, each with its own result or error."""
    loop = asyncio.get_running_loop()
    futs: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in range(8)]
    order: list[int] = []

    async def one(i: int) -> int | str:
        v: int | str
        try:
            v = await _binding.wait(futs[i])
        except ValueError as e:
            v = str(e)
        order.append(i)
        return v

    tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
    await asyncio.sleep(0)  # every task waits now
    with counting_threadsafe(loop) as threadsafe:
        def resolve_all() -> None:
            for i, f in enumerate(futs):
                if i == 3:
                    f.set_exception(ValueError("bad pass"))
                else:
                    f.set_result(10 * i)

        t = threading.Thread(target=resolve_all)
        t.start()
        t.join()
        got = await asyncio.gather(*tasks)
    assert got == [0, 10, 20, "bad pass", 40, 50, 60, 70]
    assert order == list(range(8))
    assert threadsafe[0] == 1


async def test_hold_wakeups_wakes_the_loop_once_when_the_block_ends() -> None:
    """Futures resolved one by one inside ``hold_wakeups`` (a scheduler
    step handing out its tokens) while the loop is free: no wait is woken
    before the block ends, then one ``call_soon_threadsafe`` settles them
    all; a nested block joins the outer one."""
    loop = asyncio.get_running_loop()
    futs: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in range(4)]
    tasks = [asyncio.ensure_future(_binding.wait(f)) for f in futs]
    await asyncio.sleep(0)  # every task waits now
    settled_inside: list[int] = []

    def step() -> None:
        with _binding.hold_wakeups():
            for i, f in enumerate(futs):
                with _binding.hold_wakeups():
                    f.set_result(i)
                time.sleep(0.02)  # the loop is free: unheld, it would drain each one
            settled_inside.append(sum(t.done() for t in tasks))

    with counting_threadsafe(loop) as threadsafe:
        t = threading.Thread(target=step)
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.005)
        assert await asyncio.gather(*tasks) == [0, 1, 2, 3]
    t.join()
    assert settled_inside == [0]
    assert threadsafe[0] == 1
    # outside a block, a future resolved while the loop is free wakes it at once
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    threading.Timer(0.01, fut.set_result, args=(5,)).start()
    assert await _binding.wait(fut) == 5


def test_gc_for_serving_freezes_what_is_loaded_and_collects_young_objects_less_often() -> None:
    import gc

    from tartlet.host.state import gc_for_serving

    before = gc.get_threshold()
    try:
        frozen = gc_for_serving(young=5_000)
        assert frozen > 1000  # the modules, pytest, torch
        # a frozen object freed since (another thread's, a frame's) leaves the permanent generation
        assert abs(gc.get_freeze_count() - frozen) <= frozen // 100
        assert len(gc.get_objects()) < frozen  # full collections walk only what came since
        assert gc.get_threshold() == (5_000, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0


async def test_cancelling_a_wait_cancels_the_host_future() -> None:
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    task = asyncio.ensure_future(_binding.wait(fut))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()  # as with wrap_future: the host drops the waiter
    fut2: concurrent.futures.Future[int] = concurrent.futures.Future()
    task2 = asyncio.ensure_future(_binding.wait(fut2))
    await asyncio.sleep(0)
    threading.Thread(target=fut2.cancel).start()  # the host cancels: the wait raises CancelledError
    with pytest.raises(asyncio.CancelledError):
        await task2


def test_a_finished_loop_is_not_kept_alive_by_its_waker() -> None:
    import gc
    import weakref

    loop = asyncio.new_event_loop()
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()
    timer = threading.Timer(0.01, fut.set_result, args=(3,))
    timer.start()
    assert loop.run_until_complete(_binding.wait(fut)) == 3
    loop.close()
    timer.join()  # its thread holds fut (and so the loop's future) until it ends
    ref = weakref.ref(loop)
    del loop, fut, timer  # (the host future's callbacks hold the loop's future, as wrap_future's do)
    gc.collect()
    assert ref() is None

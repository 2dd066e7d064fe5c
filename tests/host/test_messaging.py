"""Messaging between inferlets (queue and broadcast topics), in-process on
the shared engine; the server test drives the same through `tartlet serve`."""

from __future__ import annotations

import asyncio

import pytest

from harness import inline_program, run
from tartlet.host.messaging import MessageBus, MessagingError
from tartlet.runtime.instance import Status


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.slow)])
def any_bus(request):
    """The in-process bus, and the PostgreSQL one (tartlet.host.pg_messaging,
    more in tests/host/test_pg_messaging.py) on a fresh database."""
    if request.param == "memory":
        yield MessageBus()
        return
    from tartlet.host.pg_messaging import PgMessageBus

    bus = PgMessageBus(request.getfixturevalue("postgres").new_database())
    yield bus
    bus.close()


def test_bus_queue_broadcast_and_scoping(any_bus):
    bus = any_bus
    bus.push("alice", "q", "1")
    bus.push("alice", "q", "2")
    assert bus.pull("alice", "q").result(0) == "1" and bus.pull("alice", "q").result(0) == "2"
    waiting = bus.pull("alice", "q")
    bus.push("bob", "q", "bob's")  # other users' topics are separate
    assert not waiting.done()
    bus.push("alice", "q", "3")
    assert waiting.result(0) == "3"
    s1, s2 = bus.subscribe("alice", "t"), bus.subscribe("alice", "t")
    assert bus.broadcast("alice", "t", "x") == 2 and bus.broadcast("bob", "t", "y") == 0
    assert bus.next(s1).result(0) == "x" and bus.next(s2).result(0) == "x"
    pending = bus.next(s1)
    bus.unsubscribe(s1)
    with pytest.raises(EOFError):
        pending.result(0)
    with pytest.raises(MessagingError):
        bus.next(s1)
    for topic, msg in [("", "m"), ("t", 5), ("t", "x" * (2**20 + 1))]:
        with pytest.raises(MessagingError):
            bus.push("alice", topic, msg)


async def test_inferlets_exchange_messages(runtime, tmp_path):
    pinger = inline_program(tmp_path, """
        from tartlet.sdk import messaging
        async def main(args):
            with messaging.subscribe("pong") as sub:
                messaging.push("ping", "hello")
                return await sub.next()
    """, "pinger")
    ponger = inline_program(tmp_path, """
        from tartlet.sdk import messaging
        async def main(args):
            msg = await messaging.pull("ping")
            return messaging.broadcast("pong", msg.upper())
    """, "ponger")
    a, b = await asyncio.gather(run(runtime, pinger), run(runtime, ponger))
    assert a.status is Status.FINISHED and a.result == "HELLO"
    assert b.status is Status.FINISHED and b.result == 1


async def test_an_ended_instance_drops_its_subscriptions_and_pulls(runtime, tmp_path, host_state):
    waiter = inline_program(tmp_path, """
        from tartlet.sdk import messaging
        async def main(args):
            messaging.subscribe("never")
            await messaging.pull("nothing-here")
    """, "waiter")
    inst = runtime.launch(waiter, {})
    await asyncio.sleep(0.05)
    assert host_state.bus.counts()["subscriptions"] >= 1
    inst.abort()
    await inst.wait()
    assert inst.status is Status.ABORTED
    assert host_state.bus.broadcast("", "never", "x") == 0
    host_state.bus.push("", "nothing-here", "kept")  # not swallowed by the dead puller
    assert host_state.bus.pull("", "nothing-here").result(0) == "kept"

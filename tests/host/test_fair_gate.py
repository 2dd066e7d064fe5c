"""Per-user queues in front of the scheduler (issue 40: one user's 80
decoding sequences put 80 rows in every round beside another user's 8, and
the small user's latency grew with the big user's load)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from tartlet.engine.core.requests import ForwardRequest
from tartlet.host.fair_gate import FairGate


class FakeSeq:
    pass


class FakeScheduler:
    """Records what reaches the scheduler, in order; resolves nothing."""

    def __init__(self) -> None:
        self.got: list[Any] = []  # ForwardRequests and command fns

    def submit(self, req: ForwardRequest) -> Future[list[object]]:
        self.got.append(req)
        return req.future

    def command(self, fn, *touches) -> Future[Any]:
        fut: Future[Any] = Future()
        self.got.append((fn, fut))
        return fut

    def passes(self, user: str) -> list[ForwardRequest]:
        return [r for r in self.got if isinstance(r, ForwardRequest) and r.user == user]


def req(user: str, seq: Any = None) -> ForwardRequest:
    return ForwardRequest(seq or FakeSeq(), [1], user=user)


def finish(r: ForwardRequest) -> None:
    r.future.set_result([0])


@pytest.fixture()
def gate() -> FairGate:
    return FairGate(FakeScheduler(), min_share=4)  # type: ignore[arg-type]


def test_a_user_alone_is_never_held(gate):
    for _ in range(50):
        gate.submit(req("evil"))
    assert len(gate.scheduler.passes("evil")) == 50 and gate.held("evil") == 0


def test_a_big_user_is_held_to_the_small_users_level_and_the_small_one_never(gate):
    good = [gate.submit(req("good")) for _ in range(2)]
    assert good
    evil = [req("evil") for _ in range(20)]
    for r in evil:
        gate.submit(r)
    # at most max(min_share, good's 2) of evil's passes in the scheduler; the rest wait here
    assert len(gate.scheduler.passes("evil")) == 4 and gate.held("evil") == 16
    for _ in range(10):
        gate.submit(req("good"))
    assert len(gate.scheduler.passes("good")) == 12 and gate.held("good") == 0
    # as evil's passes end, its next ones go, up to good's demand (12), in order
    finish(evil[0])
    sent = gate.scheduler.passes("evil")
    assert len(sent) == 13 and sent == evil[:13] and gate.inflight("evil") == 12
    for r in evil[1:13]:
        finish(r)
    assert gate.scheduler.passes("evil") == evil and gate.held("evil") == 0


def test_a_command_waits_behind_the_held_passes_of_its_sequence(gate):
    gate.submit(req("good"))
    evil = [req("evil") for _ in range(5)]
    for r in evil:
        gate.submit(r)
    held_seq = evil[4].seq
    assert evil[4] not in gate.scheduler.got
    ran: list[str] = []
    fut = gate.command(lambda: ran.append("truncate"), held_seq)  # must not overtake the held pass
    other = gate.command(lambda: None, FakeSeq())  # a sequence with nothing held: straight through
    assert gate.scheduler.got[-1][1] is other
    later = req("evil", held_seq)
    gate.submit(later)  # behind the command
    finish(evil[0])
    got = gate.scheduler.got
    i = got.index(evil[4])
    assert callable(got[i + 1][0]) and len(got) == i + 2  # the pass, then the command; evil is at its cap
    finish(evil[1])
    assert got[i + 2] is later
    inner = got[i + 1][1]
    inner.set_result(None)
    assert fut.result(0) is None  # the held command's future follows the scheduler's


def test_users_of_equal_demand_are_not_held(gate):
    for _ in range(10):
        gate.submit(req("a"))
        gate.submit(req("b"))
    assert gate.held("a") == 0 and gate.held("b") == 0


def test_an_idle_user_stops_counting_after_its_active_time(gate, monkeypatch):
    from tartlet.host import fair_gate

    clock = [100.0]
    monkeypatch.setattr(fair_gate.time, "monotonic", lambda: clock[0])
    g = req("good")
    gate.submit(g)
    finish(g)  # good's demand is 0 now, its peak (1) still counts for ACTIVE_S
    evil = [req("evil") for _ in range(6)]
    for r in evil[:5]:
        gate.submit(r)
    assert gate.held("evil") == 1
    clock[0] += gate.active_s + 0.1
    finish(evil[0])  # good is gone: nothing holds evil
    gate.submit(evil[5])
    assert gate.held("evil") == 0 and len(gate.scheduler.passes("evil")) == 6


def test_bad_passes_raise_at_once(gate):
    bad = ForwardRequest(FakeSeq(), [], user="u")
    with pytest.raises(ValueError):
        gate.submit(bad)
    assert gate.scheduler.got == []


def test_two_users_generate_on_the_real_engine_with_the_gate_at_work(host_state, runtime):
    """The big user is held (some of its passes wait in the gate) and every
    generation of both users still completes with the same greedy tokens as
    alone."""
    from tartlet.host.api import HostApi
    from tartlet.sdk.forward import OutputSlot as SdkSlot

    slot = host_state.models[host_state.default_model]
    good, evil = HostApi(host_state, owner="good", runtime=runtime), HostApi(host_state, owner="evil", runtime=runtime)
    prompt = slot.engine.tokenizer.encode("The capital of France is")

    def gen(api: HostApi) -> Future[list[int]]:
        h = api.context_new(None)
        return api.generate(h, list(prompt), SdkSlot(0), None, 0, 8, [])

    alone = gen(good).result(120)
    held_before = slot.gate.held_total
    good_futs = [gen(good)]
    evil_futs = [gen(evil) for _ in range(16)]
    good_futs += [gen(good)]
    assert [f.result(120) for f in good_futs] == [alone, alone]
    assert [f.result(120) for f in evil_futs] == [alone] * 16
    assert slot.gate.held_total - held_before >= 16 - 2 * max(4, 2)
    good.close(), evil.close()

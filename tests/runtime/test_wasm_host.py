"""The WASM host's future table (tartlet/runtime/wasm_host.py), without a
component: wait-any and future-take block until a future completes, time
out, and wake at once when the instance is stopped (abort, limits)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from wasmtime import WasmtimeError

from tartlet.runtime.wasm_host import InstanceHost, _future_take


def _host() -> InstanceHost:
    return InstanceHost(api=None)  # type: ignore[arg-type]  # the table never calls the API


def _later(seconds: float, fn: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()))
    t.start()
    return t


def test_wait_any_returns_the_future_that_completes() -> None:
    h = _host()
    a, b = Future(), Future()
    ha, hb = h.add_future("count", a), h.add_future("count", b)
    t = _later(0.05, lambda: b.set_result(3))
    assert h.wait_any([ha, hb], None) == hb
    t.join()
    assert h.wait_any([ha], 10_000_000) == 0  # 10 ms timeout, nothing done


def test_a_signal_from_another_future_does_not_end_the_wait() -> None:
    h = _host()
    a, b = Future(), Future()
    ha, _ = h.add_future("count", a), h.add_future("count", b)
    b.set_result(1)  # leaves the wake-up signal set
    t = _later(0.05, lambda: a.set_result(2))
    assert h.wait_any([ha], None) == ha
    t.join()


def test_future_take_blocks_until_the_value_is_ready() -> None:
    h = _host()
    f: Future[int] = Future()
    handle = h.add_future("count", f)
    t = _later(0.05, lambda: f.set_result(7))
    v = _future_take(h, handle)
    t.join()
    assert (v.tag, v.payload) == ("count", 7)
    assert handle not in h.futures


@pytest.mark.parametrize("take", [False, True])
def test_stop_wakes_a_blocked_wait(take: bool) -> None:
    h = _host()
    handle = h.add_future("count", Future())
    t = _later(0.05, lambda: h.stop("aborted"))
    t0 = time.monotonic()
    with pytest.raises(WasmtimeError, match="aborted"):
        _future_take(h, handle) if take else h.wait_any([handle], None)
    t.join()
    assert time.monotonic() - t0 < 5

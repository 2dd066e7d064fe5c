"""The instance table (issue 40: a soak's server slowed down and grew with
every launch, because ended instances were kept for 10 minutes whatever
their number, and each launch scanned them all): running instances are
indexed, ended ones are bounded by age, per owner and in all."""

from __future__ import annotations

import asyncio
import time

from harness import inline_program
from tartlet.runtime.instance_table import InstanceTable


class Fake:
    """What the table reads of an instance: id, owner, finished_at."""

    def __init__(self, iid: str, owner: str = "u") -> None:
        self.id, self.owner, self.finished_at = iid, owner, None


def end(t: InstanceTable, inst: Fake, at: float) -> None:
    inst.finished_at = at
    t.ended(inst)  # type: ignore[arg-type]


def test_running_ones_are_indexed_and_ended_ones_leave_the_index():
    t = InstanceTable()
    a, b, c = Fake("a", "x"), Fake("b", "y"), Fake("c", "x")
    for i in (a, b, c):
        t[i.id] = i  # type: ignore[assignment]
    assert [i.id for i in t.running()] == ["a", "b", "c"]
    assert [i.id for i in t.running("x")] == ["a", "c"]
    end(t, a, 1e12)
    assert [i.id for i in t.running("x")] == ["c"] and t.running_count() == 2
    assert t["a"] is a  # still listed
    del t["b"]
    assert t.running_count() == 1 and "b" not in t
    assert t.pop("c") is c and t.running_count() == 0 and t.pop("zz", None) is None


def test_ended_instances_go_after_the_window_oldest_first():
    dropped: list[str] = []
    t = InstanceTable(retain_s=10)
    t.on_drop = dropped.append
    insts = [Fake(f"i{k}") for k in range(3)]
    base = time.time()
    for k, i in enumerate(insts):
        t[i.id] = i  # type: ignore[assignment]
        end(t, i, base + k)
    t.prune(now=base + 10.5)  # i0 ended 10.5 s before
    assert dropped == ["i0"] and list(t) == ["i1", "i2"]
    t.prune(now=base + 100)
    assert dropped == ["i0", "i1", "i2"] and not t


def test_ended_instances_are_bounded_per_owner_and_in_all():
    dropped: list[str] = []
    t = InstanceTable(retain_s=1e9, max_ended=5, max_ended_per_owner=3)
    t.on_drop = dropped.append
    for k in range(5):
        i = Fake(f"x{k}", "x")
        t[i.id] = i  # type: ignore[assignment]
        end(t, i, 1e12)
    assert dropped == ["x0", "x1"] and list(t) == ["x2", "x3", "x4"]
    live = Fake("live", "y")
    t[live.id] = live  # type: ignore[assignment]
    for k in range(3):
        i = Fake(f"y{k}", "y")
        t[i.id] = i  # type: ignore[assignment]
        end(t, i, 1e12)
    # 6 ended in all > 5: the oldest (x2) goes; the running one is never dropped
    assert dropped == ["x0", "x1", "x2"] and "live" in t and t.running_count() == 1
    assert sorted(t) == ["live", "x3", "x4", "y0", "y1", "y2"]


async def test_a_runtime_keeps_the_bounds_on_real_instances(host_state, tmp_path):
    from tartlet.runtime.native import NativeRuntime

    prog = inline_program(tmp_path, "async def main(args):\n    return args['k']\n")
    rt = NativeRuntime(host_state, instances=InstanceTable(max_ended_per_owner=4))
    insts = [rt.launch(prog, {"k": k}, owner="me") for k in range(10)]
    assert len(rt.running("me")) == 10
    await asyncio.gather(*(i.wait() for i in insts))
    assert [i.result for i in insts] == list(range(10))
    assert rt.running() == [] and list(rt.instances) == [i.id for i in insts[-4:]]

"""WIT ``resource`` handles vs ``u32`` handles: the cost of one host call.

Issue 16 asked whether the contract's handles (context, matcher, future,
...) should become WIT resources and to keep the faster form. This builds a
small component (componentize-py, the SDK's toolchain) against a WIT
interface that offers the same host function three ways, and times each
from inside the guest, on Tartlet's wasmtime engine (its configuration and
its host-call patches, :mod:`tartlet.runtime.wasm_fastcall`):

* ``u32``: ``len-h(handle: u32)``, today's contract (a host table lookup);
* ``method``: ``ctx.len()``, a method of a host ``resource ctx``;
* ``borrow``: ``len-r(c: borrow<ctx>)``, a function taking the resource;

and the lifetime calls: ``new-h`` + ``free-h`` vs the resource's
constructor + drop (the host destructor runs on drop). Each host function
does the same work (a dict lookup); a resource's host side turns its
``ResourceAny`` into the ``rep`` with ``to_host(store).rep``.

Rows are the median of ``--rounds`` rounds, each ``--calls`` calls per
kind, the kinds alternating within a round (order reversed every other
round). Run: ``python benchmarks/bench_wit_resources.py`` (builds the
component once into a temporary folder: ~20 s).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import report

WIT = """
package bench:res@0.1.0;

interface api {
  record call-error { code: u32, message: string }
  new-h: func() -> result<u32, call-error>;
  free-h: func(handle: u32) -> result<_, call-error>;
  len-h: func(handle: u32) -> result<u32, call-error>;
  resource ctx {
    constructor();
    len: func() -> result<u32, call-error>;
  }
  len-r: func(c: borrow<ctx>) -> result<u32, call-error>;
}

world bench {
  import api;
  /// ns per call of each kind, for round r: kinds in order, reversed when r is odd
  export run: func(calls: u32, r: u32) -> list<u64>;
}
"""

GUEST = '''
import time
import wit_world
from wit_world.imports import api


def _lifetime_u32():
    api.free_h(api.new_h())


def _lifetime_resource():
    with api.Ctx():
        pass


class WitWorld(wit_world.WitWorld):
    def run(self, calls, r):
        h = api.new_h()
        c = api.Ctx()
        kinds = [lambda: api.len_h(h), c.len, lambda: api.len_r(c), _lifetime_u32, _lifetime_resource]
        order = list(range(len(kinds)))
        if r % 2:
            order.reverse()
        out = [0] * len(kinds)
        for k in order:
            fn = kinds[k]
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            out[k] = (time.perf_counter_ns() - t0) // calls
        api.free_h(h)
        c.__exit__(None, None, None)
        return out
'''

KINDS = ["u32 handle: len-h(h)", "resource method: ctx.len()", "borrow<ctx> argument: len-r(c)",
         "u32 lifetime: new-h + free-h", "resource lifetime: constructor + drop"]
CTX_TYPE = 1


def build(folder: Path) -> Path:
    (folder / "wit").mkdir()
    (folder / "wit" / "bench.wit").write_text(WIT)
    (folder / "app").mkdir()
    (folder / "app" / "app.py").write_text(textwrap.dedent(GUEST))
    out = folder / "bench.wasm"
    subprocess.run([sys.executable, "-c",
                    "import sys, componentize_py; sys.argv[0] = 'componentize-py'; componentize_py.script()",
                    "-d", str(folder / "wit"), "-w", "bench", "componentize", "-p", str(folder / "app"), "app",
                    "-o", str(out)], check=True, capture_output=True)
    return out


def host_linker(engine: Any, contexts: dict[int, list[int]]) -> Any:
    from wasmtime.component import Linker, ResourceHost, ResourceType

    linker = Linker(engine)
    linker.add_wasip2()
    counter = [0]

    def new() -> int:
        counter[0] += 1
        contexts[counter[0]] = [1, 2, 3]
        return counter[0]

    def free(_store: Any, h: int) -> None:
        del contexts[h]

    def dtor(_store: Any, rep: int) -> None:
        del contexts[rep]

    with linker.root() as root, root.add_instance("bench:res/api@0.1.0") as api:
        api.add_func("new-h", lambda _store: new())
        api.add_func("free-h", free)
        api.add_func("len-h", lambda _store, h: len(contexts[h]))
        api.add_resource("ctx", ResourceType.host(CTX_TYPE), dtor)
        api.add_func("[constructor]ctx", lambda _store: ResourceHost.own(new(), CTX_TYPE))
        # a borrow converts to its rep once per call (a second to_host of the same borrow fails)
        api.add_func("[method]ctx.len", lambda store, c: len(contexts[c.to_host(store).rep]))
        api.add_func("len-r", lambda store, c: len(contexts[c.to_host(store).rep]))
    return linker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()

    from wasmtime import Store, WasiConfig
    from wasmtime.component import Component

    from tartlet.runtime.wasm_engine import shared_engine

    wasm = shared_engine()  # Tartlet's engine: its Config and its host-call patches
    contexts: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        component = Component.from_file(wasm.engine, str(build(Path(tmp))))
    linker = host_linker(wasm.engine, contexts)
    rounds = []
    for r in range(args.rounds):
        store = Store(wasm.engine)
        store.set_epoch_deadline(1 << 40)
        store.set_wasi(WasiConfig())
        run = linker.instantiate(store, component).get_func(store, "run")
        rounds.append(run(store, args.calls, r))
        run.post_return(store)
    assert not contexts, f"{len(contexts)} host contexts left: a destructor did not run"
    med = [statistics.median(r[k] for r in rounds) / 1000 for k in range(len(KINDS))]
    rows = [[KINDS[k], med[k], med[k] / med[0 if k < 3 else 3]] for k in range(len(KINDS))]
    report(f"Host call from a component, µs per call (median of {args.rounds} rounds x {args.calls} calls)",
           ["call", "µs", "vs u32"], rows,
           {"calls": args.calls, "rounds": args.rounds,
            "us_per_call": {KINDS[k]: round(med[k], 3) for k in range(len(KINDS))},
            "resource_over_u32_us": round(statistics.median([med[1], med[2]]) - med[0], 3)})


if __name__ == "__main__":
    main()

"""One worker process of the code sandbox (:mod:`tartlet.host.code_sandbox`).

Run by the host as ``python -I code_worker.py RUNNER.cwasm RUNNER.wasm``
(isolated: no working directory or ``PYTHONPATH`` on its path; it imports
only the standard library and wasmtime). It loads the runner component once,
then answers requests, one at a time, on its standard input and output:
each message is a 4-byte big-endian length and that many bytes of UTF-8
JSON. The first message it writes is ``{"ready": true}`` (or
``{"ready": false, "error": ...}``); then for each request

    {"code", "setup", "time_limit_s", "memory_mb", "max_output_bytes"}

it writes one result (the keys of ``SandboxResult``, and ``exiting``: the
worker ends after this answer). Every request runs in
a new wasmtime ``Store`` and component instance, with the memory cap and an
epoch deadline (CPU-bound code is trapped there), on a thread of its own.
When the time limit passes and the guest has not returned (it is blocked in
a host call, e.g. ``time.sleep``, where epoch deadlines do not fire), the
worker writes a ``timeout`` result with the output so far and exits at once:
the blocked guest dies with the process, and the host starts a new worker.
The host also kills a worker that does not answer in time, or whose run was
cancelled.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import threading
import time
from typing import Any, BinaryIO

#: Seconds per epoch tick (the resolution of the in-guest time limit).
TICK_S = 0.01
#: Slack after the time limit before a guest that has not returned is
#: abandoned (the epoch trap of a looping guest comes first), seconds.
ABANDON_AFTER_S = 0.25


def read_message(stream: BinaryIO) -> Any:
    """The next message of ``stream``, or None at its end."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def encode_message(obj: Any) -> bytes:
    """``obj`` as one message (length prefix and JSON)."""
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _load(cwasm: str, wasm: str) -> tuple[Any, Any, Any]:
    from wasmtime import Config, Engine
    from wasmtime.component import Component, Linker

    cfg = Config()
    cfg.epoch_interruption = True
    engine = Engine(cfg)
    try:
        component = Component.deserialize_file(engine, cwasm)
    except Exception:  # stale or missing: compile (slower, same result)
        with open(wasm, "rb") as f:
            component = Component(engine, f.read())
    linker = Linker(engine)
    linker.add_wasip2()

    def tick() -> None:
        while True:
            time.sleep(TICK_S)
            engine.increment_epoch()

    threading.Thread(target=tick, name="tartlet-code-epoch", daemon=True).start()
    return engine, linker, component


class _Capture:
    """The guest's stdout and stderr, kept up to ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.out = bytearray()
        self.received = 0  # every byte the guest wrote, kept or not
        self.lock = threading.Lock()

    def __call__(self, data: bytes) -> None:  # on wasmtime's threads
        with self.lock:
            self.received += len(data)
            room = self.cap - len(self.out)
            if room > 0:
                self.out.extend(data[:room])

    def text(self) -> str:
        with self.lock:
            return bytes(self.out).decode("utf-8", "replace")


def _guest_call(engine: Any, linker: Any, component: Any, req: dict[str, Any], cap: _Capture, box: dict[str, Any]) -> None:
    """Run one request's snippet; fills ``box`` with ``status``, ``error``
    and ``written`` (bytes the guest says it wrote, None when unknown)."""
    from wasmtime import Store, WasiConfig, WasmtimeError
    from wasmtime.component import Variant

    memory_mb, time_limit_s = int(req["memory_mb"]), float(req["time_limit_s"])
    wasi = WasiConfig()  # no args, env, preopens or network
    wasi.stdout_custom = cap
    wasi.stderr_custom = cap
    store = Store(engine)
    store.set_wasi(wasi)
    store.set_limits(memory_size=memory_mb << 20)
    store.set_epoch_deadline(max(1, math.ceil(time_limit_s / TICK_S)))
    status, error, written = "ok", None, None
    try:
        instance = linker.instantiate(store, component)
        r = instance.get_func(store, "run")(store, req["setup"], req["code"])
        if isinstance(r, Variant) and r.tag == "err":
            status, error = "error", str(r.payload)
        elif r is not None and not (isinstance(r, Variant) and r.tag == "ok"):
            status, error = "error", str(r)
        if status == "error" and error is not None and error.rstrip().splitlines()[-1].startswith("MemoryError"):
            status, error = "memory", f"{error}\n(the sandbox's memory limit is {memory_mb} MiB)"
        written_fn = instance.get_func(store, "written")
        if written_fn is not None:
            written = int(written_fn(store))
    except WasmtimeError as e:
        text = str(e)
        if "interrupt" in text:
            status, error = "timeout", timeout_error(time_limit_s)
        elif "memory" in text or "unreachable" in text:  # CPython aborts when even MemoryError cannot be made
            status, error = "memory", f"MemoryError: the code ran out of memory (the sandbox's limit is {memory_mb} MiB) and was stopped"
        else:
            lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
            status, error = "crashed", f"the sandbox crashed: {lines[-1] if lines else 'wasm trap'}"
    finally:
        store.close()  # now, while its WASI callbacks live
    box.update(status=status, error=error, written=written)


def timeout_error(time_limit_s: float) -> str:
    """The ``error`` of a run stopped at its time limit."""
    return f"TimeoutError: the code ran past its time limit of {time_limit_s:g} s and was stopped"


def run_request(engine: Any, linker: Any, component: Any, req: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The result of one request and whether the guest was abandoned (still
    blocked: the process must end)."""
    cap = _Capture(int(req["max_output_bytes"]))
    box: dict[str, Any] = {}
    t0 = time.monotonic()
    thread = threading.Thread(target=_guest_call, args=(engine, linker, component, req, cap, box), daemon=True)
    thread.start()
    thread.join(float(req["time_limit_s"]) + ABANDON_AFTER_S)
    elapsed_ms = int((time.monotonic() - t0) * 1000)
    abandoned = thread.is_alive()
    if abandoned:
        box = {"status": "timeout", "error": timeout_error(float(req["time_limit_s"])), "written": None}
    with cap.lock:
        lost = cap.received > len(cap.out) or (box["written"] is not None and box["written"] > cap.received)
    result = {
        "status": box["status"], "stdout": cap.text(), "error": box["error"], "truncated": lost,
        "elapsed_ms": elapsed_ms, "exiting": abandoned,
    }  # fmt: skip
    return result, abandoned


def main(argv: list[str]) -> int:
    stdin = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # the protocol's channel; fd 1 itself goes to /dev/null:
    devnull = os.open(os.devnull, os.O_WRONLY)  # wasmtime-py prints to stdout on a failed output callback
    os.dup2(devnull, 1)
    try:
        engine, linker, component = _load(argv[1], argv[2])
    except Exception as e:
        out.write(encode_message({"ready": False, "error": f"{type(e).__name__}: {e}"}))
        out.flush()
        return 1
    out.write(encode_message({"ready": True}))
    out.flush()
    while True:
        req = read_message(stdin)
        if req is None:
            return 0
        result, abandoned = run_request(engine, linker, component, req)
        out.write(encode_message(result))
        out.flush()
        if abandoned:
            os._exit(0)  # the guest's thread is blocked in wasmtime: end it with the process


if __name__ == "__main__":
    sys.exit(main(sys.argv))

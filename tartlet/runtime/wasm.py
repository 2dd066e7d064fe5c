"""The WASM runtime: sandboxed inferlets as WebAssembly components.

Each instance gets its own wasmtime ``Store`` and its own thread. The
component sees the host only through the WIT imports of ``wit/`` (served by
:mod:`.wasm_host`, which calls :class:`~tartlet.host.api.HostApi`) and a
WASI p2 environment with no preopened directories (except an optional
per-instance scratch directory mounted at ``/scratch``), no sockets, no
environment variables and no arguments.

Limits per instance:

- memory: a cap on its linear memory (``Store.set_limits``); an allocation
  past it fails inside the guest (``MemoryError``).
- CPU time: the instance thread's CPU time (``time.thread_time``), checked
  at every epoch tick (one engine-wide ticker thread, 10 ms) by an epoch
  deadline callback, which traps the guest when the limit is passed or the
  instance was aborted. Blocking in the host (waiting for the model) costs
  no CPU time.
- CPU share per user: at the same ticks the thread's CPU time since the
  last tick is charged to its owner's budget (``max_cpu_per_user`` cores
  for all of the user's instances together, :class:`~.reservations.CpuShares`);
  a thread over it sleeps until the budget refills, so one user's
  compute-bound guests cannot take the CPU the model and other users need.
- wall time: as in the native runtime (``time_limit_s``).

The thread's end is surfaced to asyncio, so a WASM instance is an ordinary
:class:`~tartlet.runtime.instance.Instance` (status, result, error,
``abort``, ``wait``). However it ends (return, error, trap, limit, abort)
the host frees all its contexts and its futures, and the store is dropped.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, cast

from wasmtime import Store, WasiConfig, WasmtimeError
from wasmtime import _ffi as ffi
from wasmtime.component import Linker, Variant

from ..host.session import Session
from ..host.state import HostState
from ..sdk.errors import ProgramError
from . import builder
from .base import BaseRuntime
from .instance import Instance, Status
from .program import Program, find_program
from .reservations import CpuShares, UserReservations
from .stdio import InstanceStdio
from .wasm_engine import TICK_S, WasmEngine, WasmLoadError, shared_engine
from .wasm_host import PACKAGE, VERSION, InstanceHost, add_host_imports

log = logging.getLogger(__name__)

_EPOCH_CB = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t),
)  # fmt: skip
_EPOCH_FIN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_OUTPUT_TAIL = 16384  # bytes of guest stdout/stderr kept per instance


@dataclass
class WasmLimits:
    """Sandbox limits of one instance.

    Attributes:
        memory_mb: cap on the component's linear memory, MiB (the Python
            guest starts at about 14 MiB).
        cpu_time_s: CPU-time limit of the instance thread, seconds (None:
            none).
        scratch: give the instance an empty private directory at
            ``/scratch`` (deleted when it ends).
    """

    memory_mb: int = 512
    cpu_time_s: float | None = 60.0
    scratch: bool = False


class WasmInstanceError(RuntimeError):
    """Raised when a component cannot be instantiated (refused at launch)."""


class WasmRuntime(BaseRuntime):
    """Launches WASM components (``.wasm`` files, or inferlet folders built
    on the fly) with the same Instance model, limits and children as the
    native runtime (:class:`~.base.BaseRuntime`); children of a component
    run as components too.

    Args:
        state: the host's engines and registries.
        time_limit_s: default wall-time limit per instance (None: none).
        limits: default sandbox limits.
        engine: the wasmtime engine (default: the process's shared one).
        max_memory_mb_per_user: linear memory, MiB, one user's running
            instances may reserve together: each reserves its memory cap
            (``limits.memory_mb``) at launch, until it ends; a launch past it
            raises ``LimitError`` (None: unbounded).
        max_cpu_per_user: CPU-seconds per second one user's running
            instances may use together (None: unbounded); past it their
            threads sleep at the next epoch tick until the budget refills.
        **kw: ``max_pages``, ``max_instances_per_user``, ``program_dirs``,
            ``instances``, as for :class:`~.base.BaseRuntime`.
    """

    kind = "wasm"

    def __init__(
        self,
        state: HostState,
        time_limit_s: float | None = None,
        limits: WasmLimits | None = None,
        engine: WasmEngine | None = None,
        max_memory_mb_per_user: int | None = None,
        max_cpu_per_user: float | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(state, time_limit_s, **kw)
        self.limits = limits or WasmLimits()
        self.memory = UserReservations(max_memory_mb_per_user, "[limits] max_sandbox_memory_mb_per_user", "MiB")
        self.cpu = CpuShares(max_cpu_per_user)
        self.wasm = engine or shared_engine()
        self.linker = Linker(self.wasm.engine)
        self.linker.add_wasip2()
        add_host_imports(self.linker)

    # -- programs ------------------------------------------------------------------
    @staticmethod
    def resolve(target: Program | Path | str, search: list[Path] | None = None) -> tuple[Program, Path]:
        """The program and component file for ``target``: a ``.wasm`` file
        as is; an inferlet folder, file, bundled name or Program built with
        :func:`tartlet.runtime.builder.build` (cached).

        Raises:
            ProgramError: unknown inferlet; BuildError: the build failed.
        """
        if isinstance(target, Program):
            if target.entry.suffix == ".wasm":  # a component already
                return target, target.entry
            return target, builder.build(target)
        p = Path(target).expanduser()
        if p.suffix == ".wasm":
            if not p.is_file():
                raise ProgramError(f"no component at {p}")
            return Program(p.stem, p.parent, p, {}), p
        program = find_program(str(target), search)
        return program, builder.build(program)

    def prepare(self, program: Program) -> Program:
        """Build ``program`` (cached) and compile its component (cached), on
        the calling thread: seconds the first time, milliseconds after.
        Returns the program with its built component as ``entry``, which
        :meth:`launch` runs as is (no second look for a build).

        Raises:
            ProgramError, BuildError, WasmLoadError: as :meth:`launch`.
        """
        prog, path = self.resolve(program)
        self.wasm.load(path)
        return prog if prog.entry == path else replace(prog, entry=path)

    # -- launching --------------------------------------------------------------------
    def launch(
        self,
        program: Program | Path | str,
        args: dict[str, Any] | None = None,
        session: Session | None = None,
        owner: str = "",
        time_limit_s: float | None = None,
        limits: WasmLimits | None = None,
    ) -> Instance:
        """Start a component on its own thread (call from the event loop).

        Raises:
            WasmLoadError: the file is not a valid component.
            WasmInstanceError: it does not fit the ``inferlet`` world, or
                its initial memory exceeds the memory cap.
            ProgramError, BuildError: an inferlet folder that cannot be built.
            LimitError: ``owner`` already runs ``max_instances_per_user``, or
                its instances' memory caps would pass ``max_memory_mb_per_user``.
            TypeError: ``args`` is not a dict.
        """
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise TypeError(f"inferlet args must be a JSON object, got {type(args).__name__}")
        args_json = json.dumps(args)
        self.check_user_cap(owner)
        prog, path = self.resolve(program)
        component = self.wasm.load(path)
        lim = limits or self.limits
        self.memory.reserve(owner, lim.memory_mb)  # released when the instance ends (_run) or fails to start
        try:
            return self._start(prog, path, component, args, args_json, session, owner, time_limit_s, lim)
        except BaseException:
            self.memory.release(owner, lim.memory_mb)
            raise

    def _start(
        self, prog: Program, path: Path, component: Any, args: dict[str, Any], args_json: str, session: Session | None,
        owner: str, time_limit_s: float | None, lim: WasmLimits,
    ) -> Instance:  # fmt: skip
        session = session or Session()
        inst = self.new_instance(prog, args, session, owner)
        host = InstanceHost(inst.api)
        output = bytearray()
        scratch = Path(tempfile.mkdtemp(prefix=f"tartlet-scratch-{inst.id}-")) if lim.scratch else None
        store = self._store(lim, output, scratch, inst.stdio)
        try:
            instance = self.linker.instantiate(store, component)
            run = instance.get_func(store, "run")
            if run is None:
                raise WasmInstanceError(f"component {path.name} exports no `run` function (not a tartlet inferlet)")
        except WasmtimeError as e:
            store.close()  # now, while its WASI callbacks live (see _Run.release)
            _drop_scratch(scratch)
            raise WasmInstanceError(f"cannot instantiate {path.name}: {_first_line(e)}{_contract_hint(str(e))}") from None
        except BaseException:
            store.close()
            _drop_scratch(scratch)
            raise
        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        ctx = _Run(inst, host, store, run, args_json, lim, output, scratch, self.cpu)
        ctx.release_memory = _once(lambda: self.memory.release(owner, lim.memory_mb))
        self.loop = asyncio.get_running_loop()
        inst.task = self.loop.create_task(self._run(ctx, limit), name=f"inferlet-wasm-{inst.id}")
        inst.task.add_done_callback(lambda _t: ctx.release_memory())  # also when cancelled before it ran
        self.instances[inst.id] = inst
        return inst

    def _store(self, lim: WasmLimits, output: bytearray, scratch: Path | None, stdio: InstanceStdio | None = None) -> Store:
        store = Store(self.wasm.engine)
        wasi = WasiConfig()  # no args, no env, no preopens, no network
        lock = threading.Lock()

        def capture(stream: str) -> Callable[[bytes], None]:
            def take(data: bytes) -> None:  # called on wasmtime's worker threads
                with lock:
                    output.extend(data)
                    if len(output) > 2 * _OUTPUT_TAIL:
                        del output[:-_OUTPUT_TAIL]
                if stdio is not None:  # the server log, and the client when it asked (bounded there)
                    stdio.write(stream, data)

            return take

        wasi.stdout_custom = capture("stdout")
        wasi.stderr_custom = capture("stderr")
        if scratch is not None:
            wasi.preopen_dir(str(scratch), "/scratch")
        store.set_wasi(wasi)
        store.set_limits(memory_size=lim.memory_mb << 20)
        store.set_epoch_deadline(int(10 / TICK_S))  # instantiation; the instance thread re-arms it
        return store

    async def _run(self, ctx: "_Run", limit: float | None) -> None:
        inst, host = ctx.inst, ctx.host
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[str, Any]] = loop.create_future()

        def finished(outcome: tuple[str, Any]) -> None:
            if not done.done():
                done.set_result(outcome)

        thread = threading.Thread(
            target=ctx.thread_main, args=(lambda o: loop.call_soon_threadsafe(finished, o),),
            name=f"tartlet-wasm-{inst.id}", daemon=True,
        )  # fmt: skip
        try:
            thread.start()
            try:
                outcome = await (asyncio.wait_for(asyncio.shield(done), limit) if limit else asyncio.shield(done))
            except asyncio.CancelledError:
                host.stop(inst.error or "aborted")
                await done
                inst.status = Status.ABORTED
                inst.error = inst.error or "aborted"
                return
            except TimeoutError:
                host.stop(f"time limit of {limit:g} s exceeded")
                outcome = await done
            self._settle(ctx, outcome)
        finally:
            host.close()
            inst.api.close_io()
            inst.api.close()
            inst.session.close()
            ctx.release()
            ctx.release_memory()
            inst.stdio.flush()
            self.finished(inst)

    def _settle(self, ctx: "_Run", outcome: tuple[str, Any]) -> None:
        inst, host = ctx.inst, ctx.host
        kind, value = outcome
        if kind == "ok" and isinstance(value, Variant) and value.tag == "ok":
            try:
                inst.result = json.loads(cast(str, value.payload))  # result<string, string>: ok is JSON text
                inst.status = Status.FINISHED
                return
            except (TypeError, ValueError, RecursionError) as e:  # RecursionError: a result nested too deeply
                kind, value = "error", e
        inst.status = Status.FAILED
        if host.stop_reason is not None:
            inst.error = host.stop_reason
        elif kind == "ok" and isinstance(value, Variant):  # main raised: "Class: msg\ntraceback"
            text = str(value.payload)
            inst.error, _, inst.traceback = text.partition("\n")
            if inst.error.startswith("MemoryError"):
                inst.error = f"MemoryError: out of memory (the instance's memory cap is {ctx.limits.memory_mb} MiB)"
        else:
            inst.error = _trap_message(value)
        tail = ctx.output_tail()
        if tail:
            inst.traceback = ((inst.traceback or "") + "\n--- guest output ---\n" + tail).lstrip("\n")
        log.debug("wasm inferlet %s failed: %s", inst.id, inst.error)


class _Run:
    """One running component: its store, thread body and clean-up."""

    def __init__(
        self, inst: Instance, host: InstanceHost, store: Store, run: Any, args_json: str,
        limits: WasmLimits, output: bytearray, scratch: Path | None, cpu: CpuShares | None = None,
    ) -> None:  # fmt: skip
        self.cpu = cpu
        self.inst, self.host, self.store, self.run = inst, host, store, run
        self.args_json, self.limits, self.output, self.scratch = args_json, limits, output, scratch
        self._keep: tuple[object, ...] = ()  # the epoch callbacks, alive as long as the store
        self.release_memory: Callable[[], None] = lambda: None  # gives back the owner's memory reservation (once)

    def thread_main(self, report: Any) -> None:
        host = self.host
        host.bind()
        try:
            self._arm_epoch()
            outcome: tuple[str, Any] = ("ok", self.run(self.store, self.args_json))
        except WasmtimeError as e:
            outcome = ("trap", e)
        except BaseException as e:  # a host-side bug surfaced by wasmtime-py
            outcome = ("trap", e)
        finally:
            host.unbind()
            # drop the store here, not on the event loop: unmapping a linear
            # memory of hundreds of MiB takes the kernel milliseconds
            self.release()
        report(outcome)

    def _arm_epoch(self) -> None:
        """Check CPU time and abort at every epoch tick, on this thread."""
        host, cpu_limit, shares, owner = self.host, self.limits.cpu_time_s, self.cpu, self.inst.owner
        start = time.thread_time()
        last = [start]

        def on_deadline(_ctx: Any, _data: Any, delta: Any, kind: Any) -> int:
            used = time.thread_time()
            if host.stop_reason is None and cpu_limit is not None and used - start > cpu_limit:
                host.stop(f"CPU time limit of {cpu_limit:g} s exceeded")
            if shares is not None and host.stop_reason is None:
                nap = shares.charge(owner, used - last[0])
                if nap > 0:  # the owner's instances are over their CPU share: wait for it (an abort waits <= 50 ms)
                    time.sleep(min(nap, 0.05))
                last[0] = time.thread_time()
            if host.stop_reason is not None:
                err = ffi.wasmtime_error_new(ctypes.create_string_buffer(f"tartlet: {host.stop_reason}".encode()))
                return ctypes.cast(err, ctypes.c_void_p).value or 0
            delta[0] = 1
            kind[0] = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE
            return 0

        cb, fin = _EPOCH_CB(on_deadline), _EPOCH_FIN(lambda _d: None)
        self._keep = (cb, fin)
        ffi.wasmtime_store_epoch_deadline_callback(self.store.ptr(), cb, None, fin)
        self.store.set_epoch_deadline(1)

    def output_tail(self) -> str:
        return bytes(self.output[-_OUTPUT_TAIL:]).decode("utf-8", "replace").strip()

    def release(self) -> None:
        """Delete the store now, on this thread, while the callbacks it holds
        (the epoch deadline's, WASI output capture) are still alive. Left to
        the garbage collector, a reference cycle holding the store and those
        ctypes callbacks can free the callbacks first, and the store's
        deletion then calls freed code (seen in CI: a segfault in
        ``wasmtime_store_delete`` during a collection)."""
        self.run = None
        store, self.store = self.store, None  # type: ignore[assignment]
        if store is not None:
            store.close()
        self._keep = ()
        _drop_scratch(self.scratch)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` that runs on the first call only (any thread)."""
    lock, done = threading.Lock(), [False]

    def call() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        fn()

    return call


def _drop_scratch(scratch: Path | None) -> None:
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _contract_hint(message: str) -> str:
    """A hint for a component built against another version of the WIT
    contract (its imports name ``tartlet:inferlet/...@OTHER``), else ""."""
    m = re.search(r"`" + re.escape(PACKAGE) + r"/[a-z-]+@([0-9.]+)`", message)
    if m is None or m[1] == VERSION:
        return ""
    return (f" (it was built against the WIT contract {PACKAGE}@{m[1]}; this host serves @{VERSION}: "
            "rebuild it from its source with `tartlet build`)")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _trap_message(e: Any) -> str:
    """A readable reason for a trap (wasmtime puts the cause last)."""
    if not isinstance(e, WasmtimeError):
        return f"{type(e).__name__}: {e}"
    text = str(e)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if "interrupt" in last:
        return "the instance was interrupted (CPU time limit)"
    if "exit status" in text:
        status = last.split("exit status")[-1].strip(" :")
        return f"the inferlet exited with status {status}"
    if "unreachable" in text:
        return "the inferlet crashed (wasm trap: unreachable; an uncaught fault in the guest runtime)"
    return f"wasm trap: {last or _first_line(e)}"


__all__ = ["TICK_S", "WasmInstanceError", "WasmLimits", "WasmLoadError", "WasmRuntime"]

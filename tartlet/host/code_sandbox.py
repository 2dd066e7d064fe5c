"""Running untrusted Python code in a WebAssembly sandbox (``code-run``).

An agent that lets the model write code (``inferlets/codeact-agent``) needs
somewhere to run it that is not the server's own Python. This host service
runs each snippet in a fresh instance of one small WebAssembly component
(:mod:`.code_runner`: CPython with a runner that ``exec``\\ s the code inside
the guest), in a worker process of its own (:mod:`.code_worker`). Every
call gets

- a new wasmtime ``Store`` and component instance (pre-initialised, ~10 ms):
  no state survives between calls, nothing is shared with other calls;
- WASI with no preopened directories, no sockets, no environment and no
  arguments: ``open()`` of any path and every socket fail inside the guest
  with ``OSError``/``PermissionError``, which the snippet sees as usual;
- a cap on its linear memory (``Store.set_limits``): an allocation past it
  raises ``MemoryError`` in the guest (or traps it when CPython cannot even
  raise);
- a wall-time limit that holds whatever the guest does: a loop is trapped by
  an epoch deadline at the limit; a guest blocked in the host (``time.sleep``,
  ``select``: epoch deadlines fire only while WASM code runs) is abandoned
  by its worker process, which then exits; a worker that does not answer
  within :data:`KILL_GRACE_S` after the limit is killed;
- stdout and stderr captured up to ``max_output_bytes``; ``truncated`` is
  True whenever output was lost (over the cap, or dropped on the way).

Workers: ``workers`` processes, started on first use and again after one
was killed or abandoned a run. A user's runs wait in the user's own queue;
a free worker takes the next run of the next user in turn (round robin)
who has fewer than ``max_running_per_user`` runs executing, so one user
cannot hold every worker while another waits. Cancelling a run's future
(the host does when the calling instance ends) drops it when queued and
kills its worker process when running: the worker is free again at once.
"""

from __future__ import annotations

import collections
import json
import math
import os
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from ..sdk.errors import LimitError
from .code_runner import CodeSandboxError, compiled_runner
from .code_worker import encode_message, timeout_error

#: Smallest memory cap a call may ask for, MiB (CPython starts at about 14 MiB).
MIN_MEMORY_MB = 24
#: Longest snippet (or setup code) accepted, characters.
MAX_CODE_CHARS = 1 << 20
#: Seconds after a run's time limit before its worker process is killed
#: (the worker itself answers at the limit; this covers a worker that hangs).
KILL_GRACE_S = 2.0
#: Longest a worker process may take to start, seconds.
START_TIMEOUT_S = 60.0
_POLL_S = 0.05
_WORKER = Path(__file__).with_name("code_worker.py")
_WORKER_ENV = ("PATH", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "SYSTEMROOT", "TMPDIR")  # nothing else reaches a worker

__all__ = ["MIN_MEMORY_MB", "CodeSandbox", "CodeSandboxError", "SandboxResult"]


class SandboxResult(TypedDict):
    """The result of :meth:`CodeSandbox.run` (see there)."""

    status: str  # ok | error | timeout | memory | crashed
    stdout: str
    error: str | None
    truncated: bool
    elapsed_ms: int


@dataclass(eq=False)
class _Job:
    owner: str
    request: dict[str, Any]
    future: Future[SandboxResult]


class _Worker:
    """One worker process (started when needed), spoken to by one thread."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = bytearray()

    def _start(self) -> None:
        wasm, cwasm = compiled_runner()
        proc = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER), str(cwasm), str(wasm)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
            env={k: v for k, v in os.environ.items() if k in _WORKER_ENV},
        )  # fmt: skip
        self.proc, self._buf = proc, bytearray()
        ready = self._read(time.monotonic() + START_TIMEOUT_S, None)
        if not isinstance(ready, dict) or not ready.get("ready"):
            self.kill()
            why = ready.get("error") if isinstance(ready, dict) else "it did not start in time or exited"
            raise CodeSandboxError(f"the code sandbox's worker process failed to start: {why}")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()

    def _read(self, deadline: float, future: Future[SandboxResult] | None) -> Any:
        """The worker's next message; None when it ended, ``deadline``
        (monotonic) passed or ``future`` was cancelled."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buf) >= 4:
                (size,) = struct.unpack(">I", self._buf[:4])
                if len(self._buf) >= 4 + size:
                    body = bytes(self._buf[4 : 4 + size])
                    del self._buf[: 4 + size]
                    return json.loads(body)
            if future is not None and future.cancelled():
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], min(_POLL_S, left))
            if readable:
                data = os.read(fd, 1 << 16)
                if not data:
                    return None
                self._buf.extend(data)

    def run(self, job: _Job) -> SandboxResult | None:
        """Run ``job`` in the worker; None when the job was cancelled (the
        worker was killed). Raises CodeSandboxError when no worker starts."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        req = job.request
        t0 = time.monotonic()
        try:
            self.proc.stdin.write(encode_message(req))
            self.proc.stdin.flush()
        except OSError:  # it died in between
            self.kill()
            return _crashed(0)
        result = self._read(t0 + req["time_limit_s"] + KILL_GRACE_S, job.future)
        if isinstance(result, dict):
            if result.get("exiting"):  # it abandoned a blocked guest and exits now
                self.kill()
            return {
                "status": result["status"], "stdout": result["stdout"], "error": result["error"],
                "truncated": result["truncated"], "elapsed_ms": result["elapsed_ms"],
            }  # fmt: skip
        elapsed = int((time.monotonic() - t0) * 1000)
        cancelled = job.future.cancelled()
        ended = self.proc.poll() is not None
        self.kill()
        if cancelled:
            return None
        if ended:
            return _crashed(elapsed)
        return {"status": "timeout", "stdout": "", "error": timeout_error(req["time_limit_s"]), "truncated": True, "elapsed_ms": elapsed}


def _crashed(elapsed_ms: int) -> SandboxResult:
    return {"status": "crashed", "stdout": "", "error": "the sandbox crashed: its worker process ended unexpectedly",
            "truncated": False, "elapsed_ms": elapsed_ms}  # fmt: skip


class CodeSandbox:
    """Runs Python snippets in fresh WebAssembly instances, with limits.

    Args:
        max_time_s: largest (and default) wall-time limit per call, seconds.
        max_memory_mb: largest memory cap per call, MiB.
        default_memory_mb: memory cap when the call names none, MiB.
        max_output_bytes: stdout + stderr kept per call, bytes.
        workers: worker processes, i.e. calls running at once (more wait;
            the time limit starts when a call starts running).
        max_pending_per_user: calls of one user queued or running at once
            (more raise ``LimitError``), so one user cannot fill the queue.
        max_running_per_user: calls of one user running at once (the
            user's share of the workers; its other calls wait their turn).

    Raises:
        ValueError: a limit out of range.
    """

    def __init__(
        self, max_time_s: float = 10.0, max_memory_mb: int = 256, default_memory_mb: int = 64,
        max_output_bytes: int = 65536, workers: int = 2, max_pending_per_user: int = 8, max_running_per_user: int = 1,
    ) -> None:  # fmt: skip
        if not (max_time_s > 0 and math.isfinite(max_time_s)):
            raise ValueError(f"max_time_s must be a positive number of seconds, got {max_time_s!r}")
        if not MIN_MEMORY_MB <= default_memory_mb <= max_memory_mb:
            raise ValueError(f"need {MIN_MEMORY_MB} <= default_memory_mb <= max_memory_mb, got {default_memory_mb}, {max_memory_mb}")
        if min(max_output_bytes, workers, max_pending_per_user, max_running_per_user) < 1:
            raise ValueError("max_output_bytes, workers, max_pending_per_user and max_running_per_user must be >= 1")
        self.max_time_s, self.max_memory_mb, self.default_memory_mb = float(max_time_s), int(max_memory_mb), int(default_memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.max_pending_per_user = int(max_pending_per_user)
        self.max_running_per_user = int(max_running_per_user)
        self.workers = int(workers)
        self._cond = threading.Condition()
        self._pending: dict[str, int] = {}  # owner -> calls queued or running
        self._running: dict[str, int] = {}  # owner -> calls running
        self._queues: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()  # turn order
        self._threads: list[threading.Thread] = []
        self._active: set[_Job] = set()  # jobs running now
        self._closed = False

    def prepare(self) -> None:
        """Build and compile the runner now (else the first call does).

        Raises:
            CodeSandboxError: componentize-py is missing or the build failed.
        """
        compiled_runner()

    # -- calls ------------------------------------------------------------------------
    def check(self, code: Any, setup: Any = "", time_limit_s: Any = None, memory_mb: Any = None) -> tuple[str, str, float, int]:
        """Validate a call's arguments; returns them with defaults applied.

        Raises:
            ValueError: non-string or oversized code; a time limit outside
                ``(0, max_time_s]`` or a memory cap outside
                ``[MIN_MEMORY_MB, max_memory_mb]`` (the message names the bound).
        """
        for v, what in ((code, "code"), (setup, "setup")):
            if not isinstance(v, str):
                raise ValueError(f"{what} must be a string of Python source, got {type(v).__name__}")
            if len(v) > MAX_CODE_CHARS:
                raise ValueError(f"{what} is {len(v)} characters; at most {MAX_CODE_CHARS} are run")
        if time_limit_s is None:
            time_limit_s = self.max_time_s
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s <= self.max_time_s:
            raise ValueError(f"time_limit_s must be in (0, {self.max_time_s:g}] seconds (this host's limit), got {time_limit_s!r}")
        if memory_mb is None:
            memory_mb = self.default_memory_mb
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not MIN_MEMORY_MB <= memory_mb <= self.max_memory_mb:
            raise ValueError(f"memory_mb must be an int in [{MIN_MEMORY_MB}, {self.max_memory_mb}] MiB (this host's limit), got {memory_mb!r}")
        return code, setup, float(time_limit_s), memory_mb

    def run(
        self, code: str, setup: str = "", time_limit_s: float | None = None, memory_mb: int | None = None, owner: str = "",
    ) -> Future[SandboxResult]:  # fmt: skip
        """Run ``setup`` (output discarded) then ``code`` in a fresh sandbox,
        for user ``owner``. Cancelling the future stops the call: a queued
        one is dropped, a running one's worker process is killed.

        Returns:
            A future of ``{"status", "stdout", "error", "truncated",
            "elapsed_ms"}``: ``status`` is ``ok``, ``error`` (the code
            raised; ``error`` holds its traceback), ``timeout`` (stopped at
            the time limit, seconds of wall time, whatever it was doing),
            ``memory`` (``MemoryError`` or a trap at the memory cap, MiB) or
            ``crashed`` (any other trap, or the worker process died);
            ``stdout`` is stdout and stderr as text, at most
            ``max_output_bytes`` bytes; ``truncated`` whether any output was
            lost; ``elapsed_ms`` the wall time, milliseconds. The future
            fails with :class:`CodeSandboxError` only when the sandbox cannot
            be set up (no runner, a worker that does not start).

        Raises:
            ValueError: bad arguments (see :meth:`check`).
            LimitError: ``owner`` already has ``max_pending_per_user``
                calls queued or running.
            RuntimeError: the sandbox was closed.
        """
        code, setup, limit, memory = self.check(code, setup, time_limit_s, memory_mb)
        request = {"code": code, "setup": setup, "time_limit_s": limit, "memory_mb": memory, "max_output_bytes": self.max_output_bytes}
        fut: Future[SandboxResult] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the code sandbox is closed")
            n = self._pending.get(owner, 0)
            if n >= self.max_pending_per_user:
                raise LimitError(
                    f"user {owner or '(local)'!r} already has {n} code runs queued or running, "
                    f"the limit ([code] max_pending_per_user)"
                )
            self._pending[owner] = n + 1
            self._queues.setdefault(owner, collections.deque()).append(_Job(owner, request, fut))
            while len(self._threads) < self.workers:
                worker = _Worker()
                t = threading.Thread(target=self._serve, args=(worker,), name=f"tartlet-code-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify_all()
        fut.add_done_callback(lambda _f: self._done(owner))
        return fut

    def running(self, owner: str) -> int:
        """Calls of ``owner`` executing now."""
        with self._cond:
            return self._running.get(owner, 0)

    def _done(self, owner: str) -> None:
        with self._cond:
            n = self._pending.get(owner, 1) - 1
            if n > 0:
                self._pending[owner] = n
            else:
                self._pending.pop(owner, None)

    def _next(self) -> _Job | None:
        """The next job to run (round robin over users under their share);
        None once closed. Called with the condition held."""
        while not self._closed:
            for owner, queue in list(self._queues.items()):
                while queue and queue[0].future.cancelled():
                    queue.popleft()
                if not queue:
                    del self._queues[owner]
                    continue
                if self._running.get(owner, 0) >= self.max_running_per_user:
                    continue
                job = queue.popleft()
                self._queues.move_to_end(owner)  # the next user goes first next time
                if not queue:
                    del self._queues[owner]
                self._running[owner] = self._running.get(owner, 0) + 1
                return job
            self._cond.wait()
        return None

    def _serve(self, worker: _Worker) -> None:
        while True:
            with self._cond:
                job = self._next()
                if job is not None:
                    self._active.add(job)
            if job is None:
                worker.kill()
                return
            try:
                result = worker.run(job)
                if result is not None:
                    _settle(job.future, result)
            except BaseException as e:  # CodeSandboxError, or a bug: the caller learns of it
                worker.kill()
                _settle(job.future, e if isinstance(e, CodeSandboxError) else CodeSandboxError(f"{type(e).__name__}: {e}"))
            finally:
                with self._cond:
                    self._active.discard(job)
                    n = self._running.get(job.owner, 1) - 1
                    if n > 0:
                        self._running[job.owner] = n
                    else:
                        self._running.pop(job.owner, None)
                    self._cond.notify_all()

    def close(self) -> None:
        """Stop taking calls: queued ones are cancelled, running ones stopped
        (their worker processes killed, within a fraction of a second)."""
        with self._cond:
            self._closed = True
            jobs = [job for q in self._queues.values() for job in q] + list(self._active)
            self._queues.clear()
            self._cond.notify_all()
        for job in jobs:
            job.future.cancel()


def _settle(fut: Future[SandboxResult], outcome: SandboxResult | BaseException) -> None:
    """Give ``fut`` its outcome unless it was cancelled meanwhile."""
    try:
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
    except InvalidStateError:
        pass

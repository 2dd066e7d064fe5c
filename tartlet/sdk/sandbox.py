"""Run model-written Python in the host's WebAssembly sandbox.

::

    from tartlet import sandbox

    r = await sandbox.run_python("print(sum(range(101)))", time_limit_s=2, memory_mb=64)
    r.ok, r.stdout, r.error        # True, "5050\\n", None
    ctx.fill(r.feedback())         # what the model reads back

Each call runs in a fresh sandbox on the host (``code-run``; see
``tartlet/host/code_sandbox.py``): CPython compiled to WebAssembly, no files,
no sockets, no subprocesses, a wall-time limit and a memory cap. Nothing
survives between calls; pass earlier code as ``setup`` (run first, its
output discarded) to build on it. A snippet that loops forever, sleeps or
blocks past its limit, allocates too much, or reaches for files or the
network ends with a clear error in the result (``timeout`` at the wall-time
limit whatever it was doing: the host runs it in a worker process it can
drop), never an exception in the inferlet and never harm to the server. A
run still going when its inferlet ends is stopped. Output past the host's
cap comes back cut, with ``truncated`` set.
The same calls work natively and in WASM builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _binding

#: What ``status`` may be.
STATUSES = ("ok", "error", "timeout", "memory", "crashed")


@dataclass
class CodeResult:
    """How a run ended.

    Attributes:
        status: ``ok``; ``error`` (the code raised: ``error`` is its
            traceback); ``timeout`` (stopped at the time limit); ``memory``
            (``MemoryError`` at the memory cap); ``crashed`` (another trap).
        stdout: what the code printed (stdout, then stderr), up to the
            host's output cap; a final expression statement's ``repr`` is
            printed, as in a REPL.
        error: the error text (None when ``ok``).
        truncated: output past the host's cap was dropped.
        elapsed_ms: wall time of the run, milliseconds.
    """

    status: str
    stdout: str
    error: str | None
    truncated: bool
    elapsed_ms: int

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def feedback(self, max_chars: int = 2000) -> str:
        """The text to show the model: the output, then the error, cut to
        ``max_chars`` (the end of a long error is kept: it names the cause),
        or ``(no output)``."""
        out = self.stdout.rstrip("\n")
        if self.truncated:
            out += "\n... (output truncated)"
        parts = [p for p in (out, self.error) if p]
        text = "\n".join(parts) if parts else "(no output)"
        if len(text) > max_chars:
            text = "..." + text[-(max_chars - 3):] if self.error else text[: max_chars - 3] + "..."
        return text


async def run_python(code: str, *, setup: str = "", time_limit_s: float | None = None, memory_mb: int | None = None) -> CodeResult:
    """Run ``code`` in a fresh sandbox after ``setup`` (same namespace,
    setup's output discarded).

    Args:
        code: Python source.
        setup: Python source run first, e.g. the earlier steps of an agent.
        time_limit_s: wall-time limit of the whole run, seconds (default
            and maximum: the host's, 10 s unless configured otherwise).
        memory_mb: memory cap, MiB (default 64, at least 24, at most the
            host's maximum, 256 unless configured otherwise).

    Raises:
        ValueError: ``code``/``setup`` not a string, or limits outside the
            host's bounds.
        RuntimeError: running code is disabled on this host.
        LimitError: this user already has the host's maximum of runs queued
            or running (``[code] max_pending_per_user``).
    """
    if not isinstance(code, str) or not isinstance(setup, str):
        raise ValueError("code and setup must be strings of Python source")
    r = await _binding.wait(_binding.host().code_run(code, setup, time_limit_s, memory_mb))
    return CodeResult(r["status"], r["stdout"], r["error"], bool(r["truncated"]), int(r["elapsed_ms"]))


__all__ = ["STATUSES", "CodeResult", "run_python"]

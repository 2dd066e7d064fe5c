"""Standard output and error of inferlet instances (``print()``), native and
sandboxed alike.

Each instance has an :class:`InstanceStdio`: the text it writes is split
into lines, and each line goes to the server log (logger
``tartlet.inferlet``, INFO, ``user=U instance=I stdout: LINE``) and, when the
launch asked for it, to a ``sink`` (the server hands it to the client as
``log`` messages). Both are bounded per instance by :data:`MAX_LOG_BYTES`;
past it one ``[output truncated ...]`` line is written and the rest dropped.
A line longer than :data:`MAX_LINE_CHARS` is cut in pieces.

Sandboxed (WASM) instances write through WASI's stdout/stderr callbacks
(:mod:`tartlet.runtime.wasm`). Native instances run in the server process,
where ``print`` writes to ``sys.stdout``: :func:`install` wraps
``sys.stdout``/``sys.stderr`` once in a proxy that sends what the current
asyncio task of an instance writes (a context variable, set by
:func:`bind`) to that instance, and everything else to the stream it
wrapped.
"""

from __future__ import annotations

import codecs
import contextvars
import logging
import sys
import threading
from typing import Any, Callable

log = logging.getLogger("tartlet.inferlet")

#: Bytes of output (UTF-8) one instance may log; more is dropped.
MAX_LOG_BYTES = 256 * 1024
#: Longest logged line, characters; longer lines are cut in pieces.
MAX_LINE_CHARS = 4096

#: ``sink(stream, line)``: ``stream`` is ``"stdout"`` or ``"stderr"``, ``line`` without its newline.
Sink = Callable[[str, str], None]


class InstanceStdio:
    """The output streams of one instance (thread-safe: WASM instances
    write from their own thread).

    Args:
        instance_id: the instance's id (in every log line).
        owner: the launching user (in every log line).
        limit: bytes logged at most (:data:`MAX_LOG_BYTES`).
    """

    def __init__(self, instance_id: str, owner: str = "", limit: int = MAX_LOG_BYTES) -> None:
        self.instance_id, self.owner, self.limit = instance_id, owner, limit
        #: where lines go besides the server log (set by the server for launches with ``logs``)
        self.sink: Sink | None = None
        self.used = 0
        self.truncated = False
        self._lock = threading.Lock()
        self._partial: dict[str, str] = {"stdout": "", "stderr": ""}
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in self._partial}

    def write(self, stream: str, data: str | bytes) -> None:
        """Take what the instance wrote to ``stream`` (``"stdout"`` or
        ``"stderr"``); complete lines are emitted at once, a partial line
        waits for its newline or :meth:`flush`."""
        with self._lock:
            text = self._decoders[stream].decode(data) if isinstance(data, bytes) else data
            buf = self._partial[stream] + text
            *lines, rest = buf.split("\n")
            while len(rest) > MAX_LINE_CHARS:
                lines.append(rest[:MAX_LINE_CHARS])
                rest = rest[MAX_LINE_CHARS:]
            self._partial[stream] = rest
            out = [self._take(piece) for line in lines for piece in _pieces(line)]
        self._emit(stream, out)

    def flush(self) -> None:
        """Emit partial lines (the instance ended)."""
        with self._lock:
            pending = {s: self._partial[s] + self._decoders[s].decode(b"", final=True) for s in self._partial}
            self._partial = {s: "" for s in self._partial}
            outs = {s: [self._take(t)] for s, t in pending.items() if t}
        for stream, out in outs.items():
            self._emit(stream, out)

    def _take(self, line: str) -> str | None:
        """``line`` if the budget holds it, else None (the first refusal
        returns the truncation note instead)."""
        n = len(line.encode("utf-8", "replace")) + 1
        if self.used + n <= self.limit:
            self.used += n
            return line
        if self.truncated:
            return None
        self.truncated = True
        return f"[output truncated: more than {self.limit} bytes]"

    def _emit(self, stream: str, lines: list[str | None]) -> None:
        token = _current.set(None)  # a log handler writing to sys.stderr must not come back here
        try:
            self._emit_lines(stream, lines)
        finally:
            _current.reset(token)

    def _emit_lines(self, stream: str, lines: list[str | None]) -> None:
        for line in lines:
            if line is None:
                continue
            log.info("user=%s instance=%s %s: %s", self.owner or "-", self.instance_id, stream, line)
            sink = self.sink
            if sink is not None:
                try:
                    sink(stream, line)
                except Exception:  # a full client backlog: the line is in the server log
                    log.debug("log line of %s not delivered", self.instance_id, exc_info=True)


def _pieces(line: str) -> list[str]:
    return [line[i:i + MAX_LINE_CHARS] for i in range(0, len(line), MAX_LINE_CHARS)] or [""]


_current: contextvars.ContextVar[InstanceStdio | None] = contextvars.ContextVar("tartlet_stdio", default=None)


def bind(stdio: InstanceStdio) -> contextvars.Token[InstanceStdio | None]:
    """Send what the current context (a native instance's task, and the
    tasks it starts) prints to ``stdio``; :func:`install` first."""
    return _current.set(stdio)


class _Redirect:
    """``sys.stdout``/``sys.stderr``: an instance's writes to its stdio,
    the rest to the wrapped stream."""

    def __init__(self, stream: str, wrapped: Any) -> None:
        self._stream, self._wrapped = stream, wrapped

    def write(self, s: str) -> int:
        stdio = _current.get()
        if stdio is None:
            return int(self._wrapped.write(s) or 0)
        stdio.write(self._stream, s)
        return len(s)

    def flush(self) -> None:
        if _current.get() is None:
            self._wrapped.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, buffer, isatty, ...
        return getattr(self._wrapped, name)


def install() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (again when something, e.g. a
    test runner, replaced them since)."""
    if not isinstance(sys.stdout, _Redirect):
        sys.stdout = _Redirect("stdout", sys.stdout)
    if not isinstance(sys.stderr, _Redirect):
        sys.stderr = _Redirect("stderr", sys.stderr)

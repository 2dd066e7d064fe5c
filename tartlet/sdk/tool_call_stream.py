"""The incremental tool-call parser (:class:`ToolCallStream`): generated text
in any pieces in, content and call deltas (id and name, then argument
pieces) out, the same events however the text is split."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .tool_calls import ToolCall, _call_from

if TYPE_CHECKING:
    from .tool_formats import ToolFormat


# -- streaming parse ------------------------------------------------------------------
def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_WS = " \t\r\n"


_NAME = re.compile(r'"([A-Za-z0-9_-]{1,64})"')


_NAME_PREFIX = re.compile(r'"[A-Za-z0-9_-]{0,64}')


#: a call object's start when its arguments can be streamed: ``{"name": "f", "arguments": {``
_HEADER: tuple[tuple[str, ...] | None, ...] = (("{",), ('"name"',), (":",), None, (",",), ('"arguments"', '"parameters"'), (":",), ("{",))


_V11_HEAD = re.compile(r"[ \t\r\n]*([A-Za-z0-9_-]*)")


_V11_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _header(buf: str, final: bool) -> tuple[str, str, int]:
    """Whether ``buf`` starts with a call object whose name comes first
    and whose arguments are an object: ``("yes", name, index of the
    arguments' "{")``, ``("wait", "", 0)`` (undecided; never when
    ``final``) or ``("no", "", 0)``."""
    i, name = 0, ""
    for alts in _HEADER:
        i = _skip_ws(buf, i)
        if i == len(buf):
            return ("no" if final else "wait"), "", 0
        if alts is None:
            m = _NAME.match(buf, i)
            if m is None:
                partial = _NAME_PREFIX.match(buf, i)
                return ("wait" if not final and partial is not None and partial.end() == len(buf) else "no"), "", 0
            name, i = m.group(1), m.end()
            continue
        lit = next((a for a in alts if buf.startswith(a, i)), None)
        if lit is None:
            return ("wait" if not final and any(a.startswith(buf[i:]) for a in alts) else "no"), "", 0
        i += len(lit)
    return "yes", name, i - 1


class _Scan:
    """Finds where a JSON value that starts with ``{`` or ``[`` ends, fed
    in pieces: brackets counted outside strings (escapes honoured). It does
    not validate the JSON."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_str, self.esc = depth, False, False

    def run(self, s: str, i: int = 0) -> int:
        """Scan ``s[i:]``: the index just past the value's end, or -1 (not ended)."""
        for j in range(i, len(s)):
            c = s[j]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
        return -1


class ToolCallStream:
    """Incremental tool-call parsing of generated text, in the format's
    markup (:class:`ToolFormat`): content is passed on as it comes, tool
    calls as OpenAI-style deltas as soon as they are known, their
    arguments in pieces as they are generated.

    ``feed(text)`` returns the events of a piece of text, in order:
    ``{"content": str}``, ``{"index", "id", "name"}`` when a call starts,
    ``{"index", "arguments": str}`` pieces that concatenate to its
    arguments; ``end()`` those of the end of the text. ``push(text)`` /
    ``finish()`` are the content-only view: ``push`` returns the content of
    ``feed``, ``finish`` ``(content tail, calls)``. :attr:`calls` holds the
    calls so far. Feeding a text in any pieces (down to single characters,
    cut inside escapes or multi-byte characters as an incremental decoder
    yields them) gives the same events joined, and :meth:`ToolFormat.parse`
    is this parser fed at once.

    :attr:`completed` counts the calls whose arguments are final: a call is
    complete as soon as its arguments' closing brace is read, before the
    rest of the output (the next calls included) is generated, so an agent
    can start each call while the model still writes the next ones::

        stream, started = ToolCallStream(fmt), 0
        async for step in ctx.generate(...):
            stream.feed(step.text)
            for call in stream.calls[started:stream.completed]:
                running.append(asyncio.ensure_future(run_tool(call)))
            started = stream.completed

    Rules:

    * A call is committed (reported) once its start is unambiguous: the
      opening markup (``<tool_call>``, ``[TOOL_CALLS]``; for
      ``llama3_json`` a ``{`` or ``<|python_tag|>`` at the start of the
      output, or after a call and ``;``), then ``{"name": "<name>",
      "arguments": {`` (or ``"parameters"``; any JSON whitespace), or for
      Mistral v11 ``name[ARGS]{``. Its arguments are then streamed as the
      model writes them: the raw JSON text of the object, byte for byte
      (no re-serialization), so a streamed call equals the parsed one.
    * A call object written in another order (arguments first, extra keys
      first, arguments as a JSON string) is held until it is complete, then
      reported whole if it parses (arguments re-serialized with
      ``json.dumps(..., ensure_ascii=False)``); otherwise its text is content.
    * Names are not checked against any tool list: a call to a tool the
      request did not offer is reported as written (callers decide), and
      never affects the calls around it.
    * Several calls are reported in order, ``index`` 0, 1, ... each with its
      own ``id``: Hermes blocks, ``;``-separated Llama 3 objects, the items of
      a Mistral array, repeated Mistral v11 calls.
    * Markup that does not continue as a call (``<tool_call>`` then prose)
      is content. The output ending inside a call's arguments
      (``max_tokens``) leaves the call with its arguments cut and
      :attr:`cut` set.
    * Content is stripped: whitespace at its start and end, and next to
      calls at the end, is dropped (whitespace is held until more content
      follows).
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        #: the text ended inside a call's arguments
        self.cut = False
        #: calls[:completed] have their final arguments (the rest of the output cannot change them)
        self.completed = 0
        self._buf = ""
        # content | open (after the marker: a call object?) | whole (a call object held to its end)
        # | args | rest (the call object after its arguments) | after (between calls) | text (content to the end)
        self._state = "start" if fmt.name == "llama3_json" else "content"
        self._scan = _Scan()
        self._pos = 0  # "whole": how far the scanner has read
        self._marker = ""  # the markup that opened the current call attempt (content if it is none)
        self._array = False  # mistral: inside [TOOL_CALLS][...]
        self._v11 = False  # mistral v11 form: the arguments are not inside a call object
        self._ws = ""  # content whitespace held back
        self._shown = False
        self._events: list[dict[str, Any]] = []

    # -- public
    def feed(self, text: str) -> list[dict[str, Any]]:
        """Events of ``text``, the next piece of the output."""
        self._buf += text
        self._run(False)
        out, self._events = self._events, []
        return out

    def end(self) -> list[dict[str, Any]]:
        """Events of the end of the output (what was held back)."""
        self._run(True)
        if self._state == "args":
            self.cut = True
        out, self._events = self._events, []
        return out

    def push(self, text: str) -> str:
        """The content of ``feed(text)`` (calls are kept in :attr:`calls`)."""
        return "".join(e["content"] for e in self.feed(text) if "content" in e)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content tail, calls)`` at the end of the output."""
        return "".join(e["content"] for e in self.end() if "content" in e), self.calls

    # -- output
    def _content(self, text: str) -> None:
        if not text:
            return
        s = self._ws + text
        body = s.rstrip(_WS)
        if not body:
            self._ws = s
            return
        self._ws = s[len(body):]
        if not self._shown:
            body = body.lstrip(_WS)
            self._shown = True
        self._events.append({"content": body})

    def _commit(self, name: str) -> ToolCall:
        call = ToolCall(name, "")
        self.calls.append(call)
        self._events.append({"index": len(self.calls) - 1, "id": call.id, "name": name})
        return call

    def _arguments(self, piece: str) -> None:
        if piece:
            self.calls[-1].arguments += piece
            self._events.append({"index": len(self.calls) - 1, "arguments": piece})

    def _fail(self, marker: str) -> None:
        """The markup ``marker`` did not start a call: it is content, and
        what follows it is read again as content."""
        self._content(marker)
        self._array = self._v11 = False
        self._state = "text" if self.fmt.name == "llama3_json" else "content"

    # -- the state machine
    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """Advance once; False when waiting for more text (or, when
        ``final``, when everything is read)."""
        buf, st, fmt = self._buf, self._state, self.fmt
        if st == "text":
            self._content(buf)
            self._buf = ""
            return False
        if st == "start":  # llama3_json: a call only at the start of the output
            i = _skip_ws(buf, 0)
            tag = "<|python_tag|>"
            if i == len(buf) or (not final and tag.startswith(buf[i:])):
                if final:
                    self._state = "text"
                    return True
                return False
            if buf.startswith(tag, i):
                self._buf, self._marker, self._state = buf[i + len(tag):], buf[: i + len(tag)], "open"
            elif buf[i] == "{":
                self._buf, self._marker, self._state = buf[i:], buf[:i], "open"
            else:
                self._state = "text"
            return True
        if st == "content":
            marker = fmt.marker
            at = buf.find(marker)
            if at >= 0:
                self._content(buf[:at])
                self._buf, self._marker, self._state = buf[at + len(marker):], marker, "open"
                self._array = self._v11 = False
                return True
            keep = 0 if final else _partial_suffix(buf, marker)
            self._content(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if st == "open":
            return self._open(final)
        if st == "whole":
            end = self._scan.run(buf, self._pos)
            if end < 0:
                self._pos = len(buf)
                if final:
                    self._fail(self._marker)
                    return True
                return False
            start = _skip_ws(buf, 0)
            try:
                call = _call_from(json.loads(buf[start:end]), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                self._fail(self._marker)
                return True
            self._commit(call.name)
            self._arguments(call.arguments)
            self.completed = len(self.calls)
            self._buf, self._state = buf[end:], "after"
            return True
        if st == "args":
            end = self._scan.run(buf)
            if end < 0:
                self._arguments(buf)
                self._buf = ""
                return False
            self._arguments(buf[:end])
            self.completed = len(self.calls)
            self._buf = buf[end:]
            if self._v11:
                self._state = "content"
            else:
                self._scan, self._state = _Scan(1), "rest"
            return True
        if st == "rest":
            end = self._scan.run(buf)
            if end < 0:
                self._buf = ""
                return False
            self._buf, self._state = buf[end:], "after"
            return True
        if st == "after":
            return self._after(final)
        raise AssertionError(st)

    def _open(self, final: bool) -> bool:
        """After the opening markup: a call (object or, Mistral v11, name[ARGS]) or not."""
        buf = self._buf
        i = _skip_ws(buf, 0)
        if i == len(buf):
            if final:
                self._fail(self._marker)
                return True
            return False
        if self.fmt.name == "mistral" and not self._array:
            if buf[i] == "[":
                self._buf, self._array = buf[i + 1:], True
                self._marker += buf[: i + 1]
                return True
            return self._open_v11(final)
        verdict, name, at = _header(buf, final)
        if verdict == "wait":
            return False
        if verdict == "yes":
            self._commit(name)
            self._buf, self._scan, self._state = buf[at:], _Scan(), "args"
            return True
        if buf[i] == "{":
            self._scan, self._pos, self._state = _Scan(), i, "whole"
            return True
        self._fail(self._marker)
        return True

    def _open_v11(self, final: bool) -> bool:
        """Mistral v11: ``name[ARGS]{...}`` (optionally ``[CALL_ID]id`` before ``[ARGS]``)."""
        buf = self._buf
        m = _V11_HEAD.match(buf)
        assert m is not None
        name, i = m.group(1), m.end()
        waiting = not final and i == len(buf) and len(name) <= 64
        if not waiting and (not name or len(name) > 64 or i == len(buf)):
            self._fail(self._marker)
            return True
        if waiting:
            return False
        if buf.startswith("[CALL_ID]", i):
            m = _V11_ID.match(buf, i)
            assert m is not None
            if m.end() == len(buf) and not final:
                return False
            i = m.end()
        elif not final and "[CALL_ID]".startswith(buf[i:]):
            return False
        if buf.startswith("[ARGS]", i):
            j = _skip_ws(buf, i + len("[ARGS]"))
            if j == len(buf) and not final:
                return False
            if j < len(buf) and buf[j] == "{":
                self._commit(name)
                self._buf, self._scan, self._state, self._v11 = buf[j:], _Scan(), "args", True
                return True
        elif not final and "[ARGS]".startswith(buf[i:]):
            return False
        self._fail(self._marker)
        return True

    def _after(self, final: bool) -> bool:
        """After a call object: the closing markup, the next call, or content."""
        buf, fmt = self._buf, self.fmt
        i = _skip_ws(buf, 0)
        if i == len(buf) and not final:
            return False
        rest = buf[i:]
        if fmt.name == "hermes":
            close = fmt.close.strip()
            if rest.startswith(close):
                self._buf, self._state = rest[len(close):], "content"
                return True
            if rest.startswith("{"):  # another call in the same block
                self._buf, self._marker, self._state = rest, "", "open"
                return True
            if not final and close.startswith(rest):
                return False
        elif fmt.name == "llama3_json":
            j = i
            while j < len(buf) and buf[j] in _WS + ";":
                j += 1
            if j < len(buf) and buf[j] == "{":
                self._buf, self._marker, self._state = buf[j:], "", "open"
                return True
            if j == len(buf) and not final:
                return False
            self._state = "text"
            return True
        elif self._array:
            if rest.startswith(","):
                self._buf, self._marker, self._state = rest[1:], "", "open"
                return True
            if rest.startswith("]"):
                self._buf, self._array, self._state = rest[1:], False, "content"
                return True
        self._state = "content"  # what follows the calls is content
        return True

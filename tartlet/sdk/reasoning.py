"""Reasoning of ``<think>`` models split from the answer
(:class:`ReasoningSplitter`), streamed or at once."""

from __future__ import annotations

from .tool_call_stream import _partial_suffix


# -- reasoning -------------------------------------------------------------------------
class ReasoningSplitter:
    """Splits generated text into reasoning and content for models that
    think in ``<think>...</think>`` (DeepSeek-R1, QwQ, Qwen3; the tags as
    their chat templates and model cards write them), streaming-safe: a tag
    split across pushes is held back until it is decided.

    Reasoning is recognised only at the start of the output (leading
    whitespace allowed), or from the first token when ``in_reasoning`` is
    set (templates whose generation prompt already opens ``<think>``, see
    :func:`prompt_opens_reasoning`). Whitespace around the reasoning is
    dropped. Output that ends before ``</think>`` is all reasoning.

    ``push(text)`` and ``finish()`` return ``(reasoning, content)`` deltas.
    """

    def __init__(self, in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._state = "reasoning_start" if in_reasoning else "start"
        self._buf = ""
        self.saw_reasoning = in_reasoning

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while True:
            buf = self._buf
            if self._state == "start":
                s = buf.lstrip()
                if s.startswith(self.open_tag):
                    self._buf, self._state, self.saw_reasoning = s[len(self.open_tag):], "reasoning_start", True
                    continue
                if self.open_tag.startswith(s):
                    return reasoning, content
                self._state = "content"
                continue
            if self._state == "reasoning_start":
                self._buf = buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "reasoning"
                continue
            if self._state == "reasoning":
                at = buf.find(self.close_tag)
                if at >= 0:
                    reasoning += buf[:at].rstrip()
                    self._buf, self._state = buf[at + len(self.close_tag):], "content_start"
                    continue
                keep = _partial_suffix(buf, self.close_tag)
                body = buf[: len(buf) - keep]
                ws = len(body) - len(body.rstrip())
                reasoning += body[: len(body) - ws]
                self._buf = buf[len(body) - ws:]
                return reasoning, content
            if self._state == "content_start":
                self._buf = buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "content"
                continue
            content += buf
            self._buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state in ("reasoning", "reasoning_start"):
            return buf.strip(), ""
        if self._state == "content_start":
            return "", buf.lstrip()
        return "", buf


def prompt_opens_reasoning(prompt: str, open_tag: str = "<think>") -> bool:
    """True when a rendered prompt ends inside an open ``<think>`` (the
    generation prompt of DeepSeek-R1 and QwQ templates), so the output
    starts as reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(open_tag)

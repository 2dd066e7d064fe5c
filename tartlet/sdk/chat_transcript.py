"""The chat template's text of a conversation as a context fills it, and
what to fill (or cut back) when the rendering changes.

A context fills a chat message by message: after each message the template
renders the whole conversation again, and only the new tail is tokenized
and appended. Templates sometimes rewrite text already filled (a tool call
rendered with other spacing than the model generated, consecutive tool
results merged into one turn); then the context is cut back to the last
fill before the first difference and the rendering filled from there.

:class:`ChatTranscript` is that bookkeeping, pure (no host calls, no
tokenizer): :class:`~tartlet.sdk.context.Context` drives it with its own
tokens, and the server's prompt-length check (``openai_protocol.prompt_length``,
the 400 ``context_length_exceeded``) drives the same object with a token
count, so the two cannot disagree on what a chat fills.
"""

from __future__ import annotations


class ChatTranscript:
    """The rendered chat so far and the token length after each fill.

    Attributes:
        rendered: the template's text of the conversation filled so far.
        marks: ``(len(rendered), token length)`` after each fill, oldest
            first; where to cut back to when the template rewrites an
            earlier part. Empty until the first fill.
    """

    def __init__(self) -> None:
        self.rendered = ""
        self.marks: list[tuple[int, int]] = []

    def copy(self) -> "ChatTranscript":
        out = ChatTranscript()
        out.rendered, out.marks = self.rendered, list(self.marks)
        return out

    def refill(self, rendered: str, length: int) -> tuple[int, str]:
        """What to do so a context of ``length`` tokens holding
        :attr:`rendered` holds ``rendered`` instead.

        Returns:
            ``(keep, text)``: cut the context back to ``keep`` tokens
            (``keep == length`` when ``rendered`` only extends what is
            filled), then fill ``text``; then call :meth:`filled`.
        """
        if not self.marks:
            self.marks = [(0, length)]  # the chat starts after whatever the context held
        if rendered.startswith(self.rendered):
            return length, rendered[len(self.rendered):]
        same = 0
        for a, b in zip(rendered, self.rendered):
            if a != b:
                break
            same += 1
        while len(self.marks) > 1 and self.marks[-1][0] > same:
            self.marks.pop()
        at, keep = self.marks[-1]
        return keep, rendered[at:]

    def filled(self, rendered: str, length: int) -> None:
        """Record that the context now holds ``rendered`` in ``length`` tokens."""
        self.rendered = rendered
        self.marks.append((len(rendered), length))

    def extend(self, text: str, length: int) -> None:
        """Record ``text`` appended outside the template (a generated reply)."""
        self.filled(self.rendered + text, length)

    def replace_from(self, start: int, text: str, length: int) -> None:
        """Record that everything from character ``start`` on is now ``text``
        (an assistant turn recorded as another message), ``length`` tokens."""
        self.rendered = self.rendered[:start] + text
        while self.marks and self.marks[-1][0] > start:
            self.marks.pop()
        self.marks.append((len(self.rendered), length))

    def adopt(self, rendered: str, length: int) -> None:
        """Start over from a context that already holds ``rendered``."""
        self.rendered, self.marks = rendered, [(len(rendered), length)]

    def reset(self) -> None:
        """Forget the chat (the context was truncated)."""
        self.rendered, self.marks = "", []

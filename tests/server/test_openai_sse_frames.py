"""The SSE frames of a streamed completion (``OpenAiRoutes._stream``): every
inferlet message waiting when the route wakes goes out in one write, and
each frame is the JSON body it always was."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tartlet.runtime.instance import Status
from tartlet.server.openai_api import OpenAiRoutes


class _Ended:
    """An instance that has finished (what ``_stream`` reads of one)."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.status = Status.FINISHED
        self.result = result
        self.done = asyncio.Event()
        self.done.set()

    async def wait(self) -> None:
        return None

    def abort(self, reason: str) -> None:  # pragma: no cover - never called for an ended instance
        raise AssertionError(reason)


def _body(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}  # fmt: skip


async def test_waiting_messages_share_one_write_and_keep_their_frames() -> None:
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
    inst = _Ended({"prompt_tokens": 3, "completion_tokens": 2})
    routes = OpenAiRoutes.__new__(OpenAiRoutes)  # _stream reads nothing of the service
    stream = routes._stream([inst], queue, "cmpl-x", 5, "m", False, True, 1)  # type: ignore[list-item]
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    queue.put_nowait((0, json.dumps({"i": 0, "text": "a"})))
    one = await first  # the route woke for one message: one frame
    for m in ({"i": 0, "text": "b\u00e9"}, {"i": 0, "finish_reason": "length", "completion_tokens": 2}):
        queue.put_nowait((0, json.dumps(m)))
    queue.put_nowait((0, None))
    two = await stream.__anext__()  # three messages waiting: one write
    rest = [x async for x in stream]
    assert one == f"data: {json.dumps(_body('a'))}\n\n"
    accented = "b\u00e9"
    assert two == f"data: {json.dumps(_body(accented))}\n\ndata: {json.dumps(_body('', 'length'))}\n\n"
    usage = {"id": "cmpl-x", "object": "text_completion", "created": 5, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}  # fmt: skip
    assert rest == [f"data: {json.dumps(usage)}\n\n", "data: [DONE]\n\n"]

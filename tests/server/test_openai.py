"""The OpenAI-compatible routes, checked with the official `openai` client
against the server over real HTTP (run in-process: conftest's noauth_server); greedy output must equal the
`text-completion` inferlet's for the same prompt."""

from __future__ import annotations

import httpx
import openai
import pytest

from tartlet.client import Client

MODEL = "smollm2-135m-instruct"
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()



async def inferlet_text(server, args: dict) -> str:
    async with await Client.connect(server.url) as c:
        ex = await (await c.launch("text-completion", args)).wait()
    assert ex.ok, ex.error
    return ex.result["text"]


async def test_models(oa):
    assert [m.id for m in oa.models.list().data] == [MODEL]


async def test_chat_completion_equals_text_completion(server, oa):
    expected = await inferlet_text(server, {"prompt": PROMPT, "max_tokens": 16})
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_completion_streaming(server, oa):
    expected = await inferlet_text(server, {"prompt": PROMPT, "system": "Answer in one word.", "max_tokens": 16})
    stream = oa.chat.completions.create(
        model=MODEL, stream=True, max_tokens=16, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}],
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 2 and "".join(deltas) == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals and finals[-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_completions_equal_raw_text_completion(server, oa):
    prompt = "The capital of France is"
    expected = await inferlet_text(server, {"prompt": prompt, "raw": True, "max_tokens": 12})
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in oa.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True))
    assert streamed == expected


async def test_ignore_eos_generates_exactly_max_tokens(server, oa):
    msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]
    short = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 48 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith(short.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body={"ignore_eos": "yes"})
    assert "ignore_eos" in str(e.value)


async def test_unsupported_parameters_are_400(oa):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        dict(functions=[{"name": "f", "parameters": {}}]),  # the deprecated form of tools (test_tool_calling has tools)
        dict(n=17),
        dict(logprobs=True, top_logprobs=21),
        dict(frequency_penalty=5),
        dict(extra_body={"frobnicate": 1}),
        dict(temperature=7),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert e.value.status_code == 400
        param = next(reversed(kw.get("extra_body", kw)))
        assert param in str(e.value), (kw, str(e.value))
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4", messages=msgs, max_tokens=4)
    r = httpx.post(str(oa.base_url) + "chat/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


async def test_streaming_client_disconnect_aborts_the_request(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # got the first token: hang up
    server.wait_pages_free()  # the request's instance was aborted and freed its pages
    assert server.get("/health").json()["running_instances"] == 0

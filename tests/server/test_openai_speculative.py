"""Speculative decoding in the served path (``[[models]] speculative``):
the OpenAI routes and ``text-completion`` of a server configured to
speculate give exactly the output of a server that does not, alone and
batched, streamed and not, with stop strings and ``max_tokens`` reached in
the middle of a draft; greedy and seeded requests speculate (the engine
verifies drafted positions: more tokens sampled than returned, fewer passes),
others do not; low acceptance hands the generation back to plain decoding.

Two in-process servers on the default model, identical but for
``speculative``: conftest's ``noauth_server`` (plain) and this module's."""

from __future__ import annotations

import threading

import pytest

from tartlet.client import Client

pytestmark = pytest.mark.slow  # a server of its own, every request run on two servers

MODEL = "smollm2-135m-instruct"
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the lens, "
    "and wrote the weather in a small leather book. Ships passed far out on the grey water, and none of them knew his name."
)
COPY = "Repeat this passage word for word:\n\n" + PASSAGE
EDIT = "Rewrite this passage, changing 'lighthouse keeper' to 'old sailor' and nothing else:\n\n" + PASSAGE
RAW = "Passage: " + PASSAGE + "\n\nThe same passage, copied exactly:\n\nPassage:"


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    """A no-auth server whose model speculates (n-gram drafts of up to 8
    tokens; ``max_batch`` 16 so that a handful of concurrent requests still
    speculate, batched together)."""
    from server_harness import InProcessServer

    d = tmp_path_factory.mktemp("spec-server")
    cfg = d / "config.toml"
    cfg.write_text(
        f'data_dir = "{d / "data"}"\n\n[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = 64\nthreads = 2\n'
        'speculative = { method = "ngram", max_draft = 8, max_ngram = 3, min_ngram = 1, max_batch = 16 }\n'
    )
    srv = InProcessServer(cfg, auth=False)
    yield srv
    srv.wait_pages_free()
    srv.stop()


@pytest.fixture(scope="module")
def plain_server(noauth_server):
    yield noauth_server
    noauth_server.wait_pages_free()


def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def counters(server) -> tuple[int, int]:
    """(model calls, tokens sampled) of the server's engine so far."""
    st = server.state.models[MODEL].engine.scheduler.stats
    return st.model_calls, st.tokens_generated


def chat(server, content: str, stream: bool, **kw):
    """``(text, finish_reason, completion_tokens)`` of one chat completion."""
    oa = client(server)
    msgs = [{"role": "user", "content": content}]
    if not stream:
        r = oa.chat.completions.create(model=MODEL, messages=msgs, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(oa.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                             stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish[-1], chunks[-1].usage.completion_tokens


async def text_completion(server, args: dict) -> dict:
    async with await Client.connect(server.url) as c:
        ex = await (await c.launch("text-completion", args)).wait()
    assert ex.ok, ex.error
    return ex.result


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_alone_equals_plain_decoding_in_fewer_passes(spec_server, plain_server, stream):
    want = chat(plain_server, COPY, stream, max_tokens=96, temperature=0)
    calls, sampled = counters(spec_server)
    got = chat(spec_server, COPY, stream, max_tokens=96, temperature=0)
    calls, sampled = counters(spec_server)[0] - calls, counters(spec_server)[1] - sampled
    assert got == want
    tokens = got[2]
    assert tokens >= 40 and PASSAGE[:60] in got[0]
    # the drafts were verified (every verified position is sampled) in far fewer passes than tokens
    assert sampled > tokens and calls < tokens // 2


def test_batched_requests_equal_plain_decoding(spec_server, plain_server):
    """Several requests at once (a completions prompt list: one instance
    each; and concurrent streamed chats): the engine batches their verify
    passes; every output is plain decoding's."""
    prompts = [RAW, "Passage: " + PASSAGE[:120] + "\n\nCopied:\n\nPassage:", "List three colours:", RAW + " The"]
    want = client(plain_server).completions.create(model=MODEL, prompt=prompts, max_tokens=64, temperature=0)
    calls, sampled = counters(spec_server)
    got = client(spec_server).completions.create(model=MODEL, prompt=prompts, max_tokens=64, temperature=0)
    sampled = counters(spec_server)[1] - sampled
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [(c.index, c.text, c.finish_reason) for c in want.choices]
    assert got.usage.completion_tokens == want.usage.completion_tokens and sampled > got.usage.completion_tokens

    contents = [COPY, EDIT, COPY, "Say hello."]
    results: dict[tuple[str, int], tuple] = {}

    def run(server, key, i):
        results[(key, i)] = chat(server, contents[i], True, max_tokens=80, temperature=0)

    for key, server in (("plain", plain_server), ("spec", spec_server)):
        threads = [threading.Thread(target=run, args=(server, key, i)) for i in range(len(contents))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for i in range(len(contents)):
        assert results[("spec", i)] == results[("plain", i)], contents[i]


def test_stop_strings_and_max_tokens_in_the_middle_of_a_draft(spec_server, plain_server):
    for kw in ({"stop": ["leather"]}, {"stop": ["lens,", "grey"]}, {"stop": ["\n\n"]}):
        for stream in (False, True):
            want = chat(plain_server, COPY, stream, max_tokens=96, temperature=0, **kw)
            assert chat(spec_server, COPY, stream, max_tokens=96, temperature=0, **kw) == want, kw
    oa_plain, oa_spec = client(plain_server), client(spec_server)
    for n in range(3, 15):
        want = oa_plain.completions.create(model=MODEL, prompt=RAW, max_tokens=n, temperature=0)
        got = oa_spec.completions.create(model=MODEL, prompt=RAW, max_tokens=n, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.choices[0].text, "length")
        streamed = "".join(c.choices[0].text for c in oa_spec.completions.create(
            model=MODEL, prompt=RAW, max_tokens=n, temperature=0, stream=True))
        assert streamed == want.choices[0].text


async def test_text_completion_cuts_a_draft_at_max_tokens(spec_server, plain_server):
    """``text-completion`` (its stats show a pass whose accepted draft went
    past ``max_tokens``): the tokens are plain decoding's, for every limit."""
    cut = 0
    for n in range(3, 15):
        args = {"prompt": RAW, "raw": True, "max_tokens": n}
        want = await text_completion(plain_server, args)
        got = await text_completion(spec_server, args)
        assert (got["tokens"], got["text"], got["finish_reason"]) == (want["tokens"], want["text"], want["finish_reason"])
        s = got["speculative"]
        cut += s["passes"] + s["accepted"] > len(got["tokens"])  # the last pass accepted more than max_tokens left
    assert cut > 0


def test_seeded_sampling_speculates_and_unseeded_does_not(spec_server, plain_server):
    kw = dict(max_tokens=80, temperature=0.8, top_p=0.95)
    for seed in (5, 11):
        want = chat(plain_server, COPY, False, seed=seed, **kw)
        calls, sampled = counters(spec_server)
        got = chat(spec_server, COPY, False, seed=seed, **kw)
        assert got == want
        assert counters(spec_server)[1] - sampled > got[2]  # drafts were verified
    _, sampled = counters(spec_server)
    got = chat(spec_server, COPY, False, **kw)  # unseeded: plain decoding, one sampled token per token
    assert counters(spec_server)[1] - sampled == got[2]


async def test_low_acceptance_stops_drafting_and_streams_on(spec_server, plain_server):
    """A prompt the output does not copy: the drafts are rejected, drafting
    stops after the acceptance window (16 passes) and the rest is the plain
    token stream; the tokens are plain decoding's."""
    args = {"prompt": "Write a short poem about the sea.", "max_tokens": 64}
    want = await text_completion(plain_server, args)
    got = await text_completion(spec_server, args)
    assert got["tokens"] == want["tokens"] and got["text"] == want["text"]
    s = got["speculative"]
    assert s["stopped"] == "acceptance" and s["passes"] == 16 and s["accepted"] < 8
    assert len(got["tokens"]) == 64
    copy = await text_completion(spec_server, {"prompt": COPY, "max_tokens": 64})
    assert copy["speculative"]["stopped"] is None and copy["speculative"]["passes"] < 16


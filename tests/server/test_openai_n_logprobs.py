"""``n`` > 1 and ``logprobs`` / ``top_logprobs`` on the OpenAI API (issue 13
item 5), with the official client against the server over HTTP (in-process):
n forks of one prefilled prompt, logprobs of the distribution sampled from."""

from __future__ import annotations

import math
import re
import uuid

import openai
import pytest

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()



def computed(server) -> float:
    m = re.search(r'^tartlet_tokens_computed_total\{model="[^"]*"\} (\S+)$', server.get("/metrics").text, re.M)
    assert m, "no tokens computed counter"
    return float(m.group(1))


def test_n_greedy_choices_equal_n1(oa):
    one = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
    three = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert all(c.finish_reason == one.choices[0].finish_reason for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    c1 = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    c3 = oa.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], max_tokens=8, n=3)
    assert [c.index for c in c3.choices] == list(range(6))
    assert [c.text for c in c3.choices[:3]] == [c1.choices[0].text] * 3
    assert len({c.text for c in c3.choices[3:]}) == 1


def test_n_seeded_reproducible_and_prompt_prefilled_once(server, oa):
    # a prompt no earlier request cached, long enough that n prefills would show
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(60))
    msgs = [{"role": "user", "content": f"Repeat after me: {words}. Now tell me a story."}]
    before = computed(server)
    a = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    spent = computed(server) - before
    prompt = a.usage.prompt_tokens
    assert prompt > 150 and a.usage.completion_tokens == 48
    # one prefill, then per fork its last prompt token re-run and 16 decode steps (the last token sampled is not run)
    assert spent <= prompt + 3 * 17, (spent, prompt)
    b = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # forks draw with different seeds
    # streamed: the same choices, each with its own finish_reason
    chunks = list(oa.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=1.0, seed=7, n=3, stream=True, extra_body={"ignore_eos": True},
    ))
    texts, finish = ["", "", ""], [None, None, None]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in a.choices] and finish == ["length"] * 3


def test_n_over_cap_is_400(oa):
    for n in (17, 0):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, n=n)
        assert e.value.body["param"] == "n"


def check_entry(e, top_n: int, greedy: bool) -> None:
    assert e.logprob <= 0 and len(e.top_logprobs) == top_n
    assert e.bytes == list(e.token.encode())
    tops = [t.logprob for t in e.top_logprobs]
    assert all(v <= 0 for v in tops) and tops == sorted(tops, reverse=True)
    assert sum(math.exp(v) for v in tops) <= 1 + 1e-6
    if greedy:
        assert math.isclose(e.logprob, tops[0], abs_tol=1e-6) and e.token == e.top_logprobs[0].token


def test_chat_logprobs(oa):
    plain = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10)
    r = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, logprobs=True, top_logprobs=5)
    c = r.choices[0]
    assert c.message.content == plain.choices[0].message.content  # asking for logprobs changes no greedy output
    assert plain.choices[0].logprobs is None
    assert "".join(e.token for e in c.logprobs.content) == c.message.content
    for e in c.logprobs.content:
        check_entry(e, 5, greedy=True)
    # streamed: the same entries
    entries, text = [], ""
    for ch in oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, logprobs=True, top_logprobs=5, stream=True):
        for d in ch.choices:
            text += d.delta.content or ""
            if d.logprobs and d.logprobs.content:
                entries += d.logprobs.content
    assert text == c.message.content
    assert [(e.token, round(e.logprob, 4)) for e in entries] == [(e.token, round(e.logprob, 4)) for e in c.logprobs.content]
    # without top_logprobs: the chosen tokens only; sampled at temperature 1 with n=2
    r = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, logprobs=True, temperature=1.0, seed=3, n=2)
    for c in r.choices:
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
        assert all(e.logprob <= 0 and e.top_logprobs == [] for e in c.logprobs.content)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=21)


def test_completions_logprobs(oa):
    prompt = "The capital of France is"
    plain = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=3)
    c = r.choices[0]
    assert c.text == plain.choices[0].text
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and v <= 0 and math.isclose(v, max(top.values()), abs_tol=1e-6)
        assert sum(math.exp(x) for x in top.values()) <= 1 + 1e-6
    streamed = list(oa.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=3, stream=True))
    toks = [t for ch in streamed for d in ch.choices if d.logprobs for t in d.logprobs.tokens]
    offs = [o for ch in streamed for d in ch.choices if d.logprobs for o in d.logprobs.text_offset]
    assert toks == lp.tokens and offs == lp.text_offset
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=6)


def test_n_with_response_format_and_logprobs(oa):
    import json

    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name."}], max_tokens=40, n=2,
        temperature=1.0, seed=11, logprobs=True, top_logprobs=2, response_format={"type": "json_object"},
    )
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
        assert all(len(e.top_logprobs) <= 2 for e in c.logprobs.content)

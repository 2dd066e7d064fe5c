"""llama.cpp's sampler fields on the OpenAI routes (``min_p``,
``typical_p``, ``mirostat``, ``dry_*``, ``xtc_*``), with the official
client's ``extra_body`` against the server over HTTP (in-process): accepted
and applied, llama.cpp's defaults change nothing, bad values are a 400
naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Repeat exactly: red blue red blue red blue red blue red blue"}]


@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()


def chat(oa, **kw) -> str:
    r = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, **kw)
    return r.choices[0].message.content


DEFAULTS = {"min_p": 0.0, "typical_p": 1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "dry_multiplier": 0.0,
            "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "dry_sequence_breakers": ["\n", ":", '"', "*"], "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1}


def test_llama_cpp_defaults_change_nothing(oa):
    greedy = chat(oa, temperature=0)
    assert chat(oa, temperature=0, extra_body=DEFAULTS) == greedy
    seeded = chat(oa, temperature=0.9, seed=3)
    assert chat(oa, temperature=0.9, seed=3, extra_body=DEFAULTS) == seeded
    # mirostat at temperature 0 is greedy, as in llama.cpp
    assert chat(oa, temperature=0, extra_body={"mirostat": 2}) == greedy


def test_sampler_fields_are_applied(oa):
    greedy = chat(oa, temperature=0)
    assert "red red red red red" in greedy  # greedy falls into a loop
    # DRY (greedy too): a strong penalty breaks exact repetitions of 3+ tokens
    dry = chat(oa, temperature=0, extra_body={"dry_multiplier": 3.0, "dry_allowed_length": 2})
    assert "red red red red" not in dry, dry
    # seeded draws with every engine-side field are reproducible; the completions route takes them too
    body = {"min_p": 0.05, "typical_p": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.1, "dry_multiplier": 0.8,
            "dry_sequence_breakers": ["\n", ","]}
    a = chat(oa, temperature=1.0, seed=11, extra_body=body)
    assert a == chat(oa, temperature=1.0, seed=11, extra_body=body)
    c = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=2, extra_body=body)
    c2 = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=2, extra_body=body)
    assert c.choices[0].text and c.choices[0].text == c2.choices[0].text
    # mirostat 2: a seeded run is reproducible, and streams
    m = chat(oa, temperature=1.0, seed=5, extra_body={"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2})
    assert m == chat(oa, temperature=1.0, seed=5, extra_body={"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2})
    stream = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=1.0, seed=5, stream=True,
                                        extra_body={"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == m


@pytest.mark.parametrize("field, value", [
    ("min_p", 1.5), ("typical_p", 0), ("typical_p", "0.5"), ("xtc_probability", -0.1), ("xtc_threshold", 2),
    ("dry_multiplier", -1), ("dry_base", 0.5), ("dry_allowed_length", -1), ("dry_allowed_length", 1.5),
    ("dry_penalty_last_n", -2), ("dry_sequence_breakers", "\n"), ("dry_sequence_breakers", [""]),
    ("mirostat", 3), ("mirostat", True), ("mirostat_tau", 0), ("mirostat_eta", -1),
])
def test_bad_sampler_fields_are_400_naming_them(oa, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        chat(oa, extra_body={field: value})
    assert e.value.status_code == 400
    assert e.value.body["param"] == field, e.value.body


def test_mirostat_1_and_raw_logit_samplers_are_refused(oa):
    with pytest.raises(openai.BadRequestError) as e:
        chat(oa, extra_body={"mirostat": 1})
    assert e.value.body["param"] == "mirostat" and "Mirostat v1" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(oa, logprobs=True, extra_body={"min_p": 0.1})
    assert e.value.body["param"] == "min_p" and "logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logit_bias={"42": 5}, extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat"
    # the fields are chat/completions extensions: the Responses route does not take them
    r = httpx.post(str(oa.base_url) + "responses", json={"model": MODEL, "input": "Hi", "min_p": 0.1}, timeout=60)
    assert r.status_code == 400 and "min_p" in r.text

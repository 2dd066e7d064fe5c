"""OpenAI ``response_format`` (``json_schema``, ``json_object``, ``text``) on
the server over real HTTP (run in-process), checked with the official ``openai`` client:
outputs must parse and validate against their schema (``jsonschema``),
streamed or not, greedy or sampled; bad formats are HTTP 400 naming the
problem before anything streams; no KV page leaks."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm2-135m-instruct"
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FRUITS = {
    "type": "object",
    "properties": {
        "fruits": {"type": "array", "items": {"enum": ["apple", "banana", "cherry", "mango"]}, "minItems": 1, "maxItems": 3},
        "ripe": {"type": "boolean"},
    },
    "required": ["fruits", "ripe"],
    "additionalProperties": False,
}
CASES = [("Describe a person as JSON.", "person", PERSON), ("Which fruits do you like? Answer in JSON.", "fruits", FRUITS)]


def rf_schema(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()



def aoa(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def chat(client: openai.AsyncOpenAI, question: str, rf: dict, stream: bool, max_tokens: int = 64, **kw) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    msgs = [{"role": "user", "content": question}]
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=max_tokens, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    async for c in await client.chat.completions.create(model=MODEL, messages=msgs, response_format=rf, max_tokens=max_tokens, stream=True, **kw):
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    return "".join(parts), finish


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_json_schema_output_validates(server, temperature):
    """Every (schema, streamed or not, seed) combination, run concurrently:
    the content parses, validates, and finished because the JSON was complete."""
    client = aoa(server)
    seeds = [1, 2] if temperature else [None]
    jobs, schemas = [], []
    for question, name, schema in CASES:
        for stream in (False, True):
            for seed in seeds:
                jobs.append(chat(client, question, rf_schema(name, schema), stream, temperature=temperature, seed=seed))
                schemas.append(schema)
    results = await asyncio.gather(*jobs)
    await client.close()
    for (text, finish), schema in zip(results, schemas):
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)
    if not temperature:  # greedy: streaming gives exactly the non-streamed content
        assert results[0][0] == results[1][0] and results[2][0] == results[3][0]


async def test_json_object_gives_a_json_object(server):
    """Greedy only: an unbounded object lets this 135M model nest until
    ``max_tokens`` when sampling (then the content is cut, as with OpenAI)."""
    client = aoa(server)
    rf = {"type": "json_object"}
    results = await asyncio.gather(
        chat(client, 'What is 2+2? Reply with a JSON object like {"answer": ...}.', rf, False, max_tokens=128),
        chat(client, 'What is the capital of France? Reply with a JSON object like {"city": ...}.', rf, True, 128),
    )
    await client.close()
    for text, finish in results:
        assert finish == "stop", (text, finish)
        assert isinstance(json.loads(text), dict)


async def test_text_format_and_completions_route(server, oa):
    """``{"type": "text"}`` changes nothing; ``/v1/completions`` honours a schema too."""
    msgs = [{"role": "user", "content": "Say hello."}]
    # the first request fills the prefix cache, so the two compared below start from the same cached pages
    # (a prefill from cached pages rounds differently from one over the whole prompt)
    oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    free = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)
    text = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content
    r = oa.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=48, extra_body={"response_format": rf_schema("person", PERSON)}
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),  # unknown type
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum"),  # contradiction
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),  # unsupported keyword
    (False, "false"),  # matches nothing
]


def test_invalid_schema_is_400_naming_the_problem(server, oa):
    msgs = [{"role": "user", "content": "hi"}]
    for schema, word in BAD_SCHEMAS:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=stream, response_format=rf_schema("bad", schema))
            assert e.value.status_code == 400
            err = e.value.body
            assert err["param"] == "response_format.json_schema.schema", err
            assert "invalid response_format" in err["message"] and word in err["message"], err["message"]
    assert server.get("/health").json()["running_instances"] == 0  # refused before any launch


def test_malformed_response_format_is_400(server):
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"type": "xml"}, "response_format.type", "'xml' is not supported"),
        ({"type": "json_schema"}, "response_format.json_schema", "needs a 'json_schema'"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name", "name"),
        (rf_schema("bad name!", {}), "response_format.json_schema.name", "bad name!"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema", "got list"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "response_format.json_schema.strict", "boolean"),
        ("json", "response_format", "must be an object"),
    ]
    for rf, param, words in cases:
        r = httpx.post(url, json={"model": MODEL, "messages": msgs, "max_tokens": 4, "response_format": rf}, timeout=30)
        assert r.status_code == 400, (rf, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (rf, err)


def test_no_pages_leak(server):
    server.wait_pages_free()
    assert server.get("/health").json()["running_instances"] == 0

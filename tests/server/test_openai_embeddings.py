"""``POST /v1/embeddings`` with the official `openai` client over real HTTP
(conftest's in-process noauth_server: the default model, quantized as users
get it): shapes, normalisation, batch equals singles, base64 equals float,
token ids equal text, errors naming the parameter, pages freed, and the
vectors against transformers' hidden states of the same weights."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import torch

from tartlet.client import Client

MODEL = "smollm2-135m-instruct"
TEXTS = ["The sun rises in the east.", "Tartlet serves programs next to the model.", "2 + 2 = 4"]


@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()


def norm(v: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in v))


def metric(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    return sum(s.value for s in fams[name].samples if s.name in (name, name + "_total"))


def test_one_input_shape_norm_usage(server, oa):
    launched = metric(server, "tartlet_instances_launched")
    r = oa.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert r.object == "list" and r.model == MODEL and len(r.data) == 1
    d = r.data[0]
    assert d.object == "embedding" and d.index == 0 and len(d.embedding) == 576
    assert abs(norm(d.embedding) - 1.0) < 1e-6
    n = len(server.state.model(None).engine.tokenizer.encode(TEXTS[0]))
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    assert metric(server, "tartlet_instances_launched") == launched + 1  # counted like the other /v1 routes
    server.wait_pages_free()


def test_batch_equals_singles(server, oa):
    batch = oa.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(oa.embeddings.create(model=MODEL, input=t).usage.prompt_tokens for t in TEXTS)
    for text, d in zip(TEXTS, batch.data):
        single = oa.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
        assert max(abs(a - b) for a, b in zip(d.embedding, single)) < 1e-6
        assert abs(norm(d.embedding) - 1.0) < 1e-6


def test_base64_decodes_to_the_float_result(server, oa):
    floats = oa.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    b64 = oa.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="base64")
    for f, b in zip(floats.data, b64.data):
        assert isinstance(b.embedding, str)
        raw = base64.b64decode(b.embedding)
        assert len(raw) == 4 * 576
        assert list(struct.unpack("<576f", raw)) == f.embedding  # the float values are float32 ones: exactly
    default = oa.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks for base64 and decodes it itself
    assert default.data[0].embedding == floats.data[0].embedding


def test_token_ids_equal_text(server, oa):
    ids = [server.state.model(None).engine.tokenizer.encode(t) for t in TEXTS[:2]]
    text = oa.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float").data
    by_ids = oa.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    one = oa.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data  # a flat list: one input
    assert len(one) == 1
    for a, b in zip(text, by_ids):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert max(abs(x - y) for x, y in zip(one[0].embedding, text[0].embedding)) < 1e-6


def test_dimensions_equal_to_the_size_only(server, oa):
    r = oa.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=576, encoding_format="float")
    assert len(r.data[0].embedding) == 576
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=256)
    assert e.value.body["param"] == "dimensions" and "576" in e.value.body["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [1.5, 2]}, "input", "list of token ids"),
    ({"input": {"text": "x"}}, "input", "must be a string"),
    ({"input": [[1, 2], "x", 3]}, "input", "must be a string"),
    ({"input": [10**9]}, "input", "outside the vocabulary"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "float, base64"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "x", "user": 7}, "user", "string"),
    ({"input": "x", "truncate": True}, "truncate", "unsupported parameter"),
    ({"input": "word " * 9000}, "input", "maximum context length"),
    ({"input": "x", "model": None}, "model", "required"),
])
def test_bad_requests_are_400_naming_the_parameter(server, body, param, words):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    if words == "maximum context length":
        assert err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(server, oa):
    with pytest.raises(openai.NotFoundError) as e:
        oa.embeddings.create(model="no-such-model", input="x")
    assert e.value.body["param"] == "model"


def test_pages_are_freed_after_each_request(server, oa):
    server.wait_pages_free()
    oa.embeddings.create(model=MODEL, input=[" ".join(TEXTS * 10)] * 3)  # several pages per input
    assert server.pages("used") == 0


async def test_configured_last_token_pooling(server, oa):
    """``[[models]] embedding_pooling = "last"``: the vector is the
    ``embedding`` inferlet's with last-token pooling, not mean pooling."""
    table = server.service.cfg.models[0]
    mean = oa.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    table.embedding_pooling = "last"
    try:
        last = oa.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    finally:
        table.embedding_pooling = "mean"
    async with await Client.connect(server.url) as c:
        ex = await (await c.launch("embedding", {"prompt": TEXTS[1], "pooling": "last"})).wait()
    assert ex.ok, ex.error
    assert max(abs(a - b) for a, b in zip(last, ex.result["embeddings"][0])) < 1e-6
    assert max(abs(a - b) for a, b in zip(last, mean)) > 1e-2


def test_vectors_match_transformers(server, oa, hf_model):
    """Mean pooling of transformers' final hidden states (float32 weights
    dequantized from the same GGUF), normalised: the server's vectors run
    the quantized kernels (16-bit activations, a float16 KV pool), so they
    agree to a cosine of 0.9999, not bit for bit."""
    tok = server.state.model(None).engine.tokenizer
    got = oa.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data
    for text, d in zip(TEXTS, got):
        with torch.no_grad():
            h = hf_model(torch.tensor([tok.encode(text)]), output_hidden_states=True).hidden_states[-1][0].double()
        ref = h.mean(0)
        ref = ref / ref.norm()
        cos = float(torch.tensor(d.embedding, dtype=torch.float64) @ ref)
        assert cos > 0.9999, (text, cos)

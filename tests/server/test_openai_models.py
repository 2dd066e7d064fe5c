"""The ``/v1`` request bodies as pydantic models (tartlet/server/openai_models.py,
openai_fields.py, openai_sampling.py, responses_protocol.py, embeddings_api.py):
the inferlet args a valid body gives, and each validation error mapped to
OpenAI's 400 (``param`` as OpenAI writes the path, ``code``, a message naming
the parameter) by ``openai_errors.validation_error``. No server, no model:
the routes' tests (test_openai*.py, test_tool_calling.py) check the same
bodies over HTTP."""

import pytest

from tartlet.server.embeddings_api import parse_embedding_request
from tartlet.server.openai_errors import ApiError
from tartlet.server.openai_models import parse_request
from tartlet.server.responses_protocol import parse_request as parse_responses

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def refused(body, chat=True):
    with pytest.raises(ApiError) as e:
        parse_request(body, chat, 8192, 49152)
    assert e.value.status == 400 and e.value.kind == "invalid_request_error"
    return e.value


def test_a_chat_body_gives_the_inferlet_args():
    body = {
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                                   *MSGS, {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                                   {"role": "tool", "content": "21", "tool_call_id": "c1"}],
        "tools": TOOLS, "max_completion_tokens": 12, "max_tokens": 3, "temperature": 1, "top_p": 0.5, "seed": 7, "stop": "\n",
        "n": 2, "logprobs": True, "top_logprobs": 3, "logit_bias": {"42": 5, "7": 0}, "frequency_penalty": 0.5, "presence_penalty": 0,
        "stream": True, "stream_options": {"include_usage": True}, "user": "u", "metadata": {"a": "b"}, "store": False,
    }
    req = parse_request(body, True, 8192, 49152)
    assert req["prompts"] is None and req["stream"] is True and req["include_usage"] is True
    assert req["args"] == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, MSGS[0],
                     {"role": "assistant", "content": None, "tool_calls": body["messages"][2]["tool_calls"]},
                     {"role": "tool", "content": "21", "tool_call_id": "c1"}],
        "tools": TOOLS, "tool_choice": "auto", "max_tokens": 12, "temperature": 1.0, "top_p": 0.5, "seed": 7, "stop": ["\n"],
        "ignore_eos": False, "frequency_penalty": 0.5, "logit_bias": {"42": 5.0}, "n": 2, "logprobs": 3,
    }
    assert isinstance(req["args"]["temperature"], float)


def test_a_completions_body_gives_one_args_dict_per_prompt_and_llama_cpp_samplers():
    req = parse_request({"model": "m", "prompt": [[1, 2], [3]], "min_p": 0.1, "dry_multiplier": 0.8, "dry_base": 1.75}, False, 8192, 49152)
    assert req["prompts"] == [{"prompt_tokens": [1, 2]}, {"prompt_tokens": [3]}] and req["stream"] is False
    assert req["args"] == {"model": "m", "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": None, "ignore_eos": False,
                           "sampler": {"min_p": 0.1, "dry_multiplier": 0.8}}
    req = parse_request({"model": "m", "prompt": "hi", "mirostat": 2, "mirostat_tau": 3}, False, 8192, None)
    assert req["prompts"] == [{"prompt": "hi"}] and req["args"]["mirostat"] == {"tau": 3.0, "eta": 0.1} and "sampler" not in req["args"]


@pytest.mark.parametrize(("body", "param", "code", "message"), [
    # an unknown or unserved parameter comes first, with why it is refused
    ({"model": "m", "messages": MSGS, "temperature": 7, "frobnicate": 1}, "frobnicate", "unsupported_parameter", "unsupported parameter 'frobnicate'"),
    ({"model": "m", "messages": MSGS, "functions": []}, "functions", "unsupported_parameter", "use 'tools'"),
    ({"model": "", "messages": MSGS}, "model", "missing_required_parameter", None),
    ({"messages": MSGS}, "model", "missing_required_parameter", "'model' is required (see GET /v1/models)"),
    ({"model": "m", "messages": []}, "messages", "invalid_value", "'messages' must be a non-empty list"),
    ({"model": "m", "messages": MSGS, "temperature": 7}, "temperature", "invalid_value", "'temperature' must be a number in [0, 2], got 7"),
    ({"model": "m", "messages": MSGS, "temperature": True}, "temperature", "invalid_value", "got True"),
    ({"model": "m", "messages": MSGS, "top_p": 0}, "top_p", "invalid_value", "'top_p' must be > 0"),
    ({"model": "m", "messages": MSGS, "n": 17}, "n", "invalid_value", "'n' must be an integer in [1, 16], got 17"),
    ({"model": "m", "messages": MSGS, "max_tokens": 9000}, "max_tokens", "invalid_value", "'max_tokens' must be an integer in [1, 8192], got 9000"),
    ({"model": "m", "messages": MSGS, "seed": 1.5}, "seed", "invalid_value", "'seed' must be an integer"),
    ({"model": "m", "messages": MSGS, "top_logprobs": 3}, "top_logprobs", "invalid_value", "needs 'logprobs'"),
    ({"model": "m", "messages": MSGS, "logit_bias": {"99999": 1}}, "logit_bias", "invalid_value", "not a token id in [0, 49152)"),
    ({"model": "m", "messages": MSGS + [{"role": "robot"}]}, "messages[1].role", "invalid_value",
     "messages[1].role must be system, developer, user, assistant or tool"),
    ({"model": "m", "messages": MSGS + [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[1].content", "invalid_value",
     "messages[1].content must be a string or a list of text parts"),
    ({"model": "m", "messages": MSGS + [{"role": "tool", "content": "21"}]}, "messages[1].tool_call_id", "invalid_value", "required for role 'tool'"),
    ({"model": "m", "messages": MSGS + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_value", "must be a JSON object as a string, got '{oops'"),
    ({"model": "m", "messages": MSGS + [{"role": "assistant", "tool_calls": ["x"]}]}, "messages[1].tool_calls[0]", "invalid_value", None),
    ({"model": "m", "messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "invalid_value", None),
    ({"model": "m", "messages": MSGS, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value", "'nope', which is not in 'tools'"),
    ({"model": "m", "messages": MSGS, "tool_choice": "required"}, "tool_choice", "invalid_value", "only allowed when 'tools'"),
    ({"model": "m", "messages": MSGS, "tools": TOOLS, "tool_choice": "required", "logprobs": True}, "logprobs", "unsupported_parameter", None),
    ({"model": "m", "messages": MSGS, "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter", None),
    ({"model": "m", "messages": MSGS, "response_format": {"type": "xml"}}, "response_format.type", "unsupported_parameter", "'xml' is not supported"),
    ({"model": "m", "messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "invalid_value", "got list"),
    ({"model": "m", "messages": MSGS, "typical_p": 0}, "typical_p", "invalid_value", "'typical_p' must be a number in (0, 1], got 0"),
    ({"model": "m", "messages": MSGS, "dry_allowed_length": 1.5}, "dry_allowed_length", "invalid_value", "must be an integer >= 0"),
    ({"model": "m", "messages": MSGS, "dry_sequence_breakers": [""]}, "dry_sequence_breakers", "invalid_value", None),
    ({"model": "m", "messages": MSGS, "mirostat": 1}, "mirostat", "unsupported_parameter", "Mirostat v1"),
    ({"model": "m", "messages": MSGS, "min_p": 0.1, "logprobs": True}, "min_p", "unsupported_parameter", "cannot be combined with 'logprobs'"),
    ({"model": "m", "messages": MSGS, "stream_options": {"x": 1}}, "stream_options", "invalid_value", "supports only include_usage"),
])
def test_chat_errors_name_the_param(body, param, code, message):
    e = refused(body)
    assert (e.param, e.code) == (param, code), e.body()
    if message is not None:
        assert message in e.body()["error"]["message"], e.body()


@pytest.mark.parametrize(("body", "param", "code", "message"), [
    ({"model": "m", "prompt": "hi", "tools": TOOLS}, "tools", "unsupported_parameter", "tool calling is available on /v1/chat/completions only"),
    ({"model": "m", "prompt": "hi", "top_logprobs": 2}, "top_logprobs", "unsupported_parameter", None),
    ({"model": "m", "prompt": [[]]}, "prompt", "invalid_value", "prompt[0] must not be empty"),
    ({"model": "m", "prompt": [10**9]}, "prompt", "invalid_value", "outside the vocabulary"),
    ({"model": "m"}, "prompt", "invalid_value", "'prompt' must be a string"),
    ({"model": "m", "prompt": "hi", "logprobs": 6}, "logprobs", "invalid_value", "'logprobs' must be an integer in [0, 5], got 6"),
    ({"model": "m", "prompt": "hi", "best_of": 2}, "best_of", "unsupported_parameter", None),
    ({"model": "m", "prompt": "hi", "suffix": "x"}, "suffix", "unsupported_parameter", None),
    ({"model": "m", "prompt": "hi", "logit_bias": {"42": 5}, "mirostat": 2}, "mirostat", "unsupported_parameter", None),
])
def test_completions_errors_name_the_param(body, param, code, message):
    e = refused(body, chat=False)
    assert (e.param, e.code) == (param, code), e.body()
    if message is not None:
        assert message in e.body()["error"]["message"], e.body()


def test_a_body_that_is_not_an_object_has_no_param():
    for chat in (True, False):
        e = refused([], chat)
        assert e.param is None and e.body()["error"]["message"] == "the request body must be a JSON object"


def test_responses_and_embeddings_bodies():
    req = parse_responses({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"},
                           "max_output_tokens": 16, "temperature": 0.5, "metadata": {"a": "b"}}, 8192)
    assert req["messages"] == [{"role": "user", "content": "x"}] and req["tool_choice"] == {"type": "function", "name": "f"}
    assert req["args"]["tool_choice"] == {"name": "f"} and req["args"]["max_tokens"] == 16 and req["store"] is True
    for body, param, code in [({"model": "m", "input": "x", "include": ["x"]}, "include", "unsupported_parameter"),
                              ({"model": "m", "input": "x", "min_p": 0.1}, "min_p", "unsupported_parameter"),
                              ({"model": "m", "input": [{"type": "image"}]}, "input[0].type", "unsupported_parameter"),
                              ({"model": "m", "input": "x", "top_p": 0}, "top_p", "invalid_value"),
                              ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
                               "text.format.name", "invalid_value")]:
        with pytest.raises(ApiError) as e:
            parse_responses(body, 8192)
        assert (e.value.param, e.value.code) == (param, code), e.value.body()
    assert parse_embedding_request({"model": "m", "input": ["a", [1, 2]]}, 49152) == {
        "model": "m", "inputs": ["a", [1, 2]], "encoding_format": "float", "dimensions": None}
    with pytest.raises(ApiError) as e:
        parse_embedding_request({"model": "m", "input": "x", "dimensions": 0}, 49152)
    assert e.value.param == "dimensions" and "positive integer" in str(e.value)

"""Model-native tool calling and reasoning (:mod:`tartlet.sdk.tools`).

Unit: the tool-call parsers read what real chat templates write for a tool
call (Qwen2.5 -> Hermes ``<tool_call>``, Llama 3.1 -> JSON with
``parameters``, Mistral Nemo -> ``[TOOL_CALLS]``; files in
``tests/sdk/chat_templates``), whole and streamed in pieces; the format is
detected from each template; rendering with tools through Qwen2.5's own
template and through SmolLM2's (which ignores tools: the Hermes fallback);
the ``<think>`` splitter on Qwen3's rendering, streamed character by
character.

On the real default model: a forced call from an inferlet, then a tool
result and a reply, with the context's tokens equal to the template's
rendering of the conversation; and the OpenAI API through the official
client: ``tool_choice`` required and named give calls whose arguments
validate against the schema (``jsonschema``), streams reassemble to the same
call, a tool-result round trip answers, ``none`` gives plain text, and bad
tools are 400 naming the ``param``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import jsonschema
import pytest

from harness import inline_program, run
from tartlet.engine.text.chat_template import render_chat_template
from tartlet.sdk import tools

TEMPLATES = Path(__file__).parent / "chat_templates"
MODEL = "smollm2-135m-instruct"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}, "hour24": {"type": "boolean"}},
    "required": ["timezone", "hour24"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET", "hour24": True})]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def template(name: str):
    src = (TEMPLATES / name).read_text()

    def render(messages, add_generation_prompt, tools_=None):
        return render_chat_template(src, messages, add_generation_prompt, special_tokens=SPECIAL, tools=tools_)

    return render


def assistant_reply(render, calls, end: str) -> str:
    """What ``render`` writes for an assistant turn holding ``calls`` (HF
    convention: arguments as objects), between the generation prompt and ``end``."""
    user = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    tc = [{"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    prompt = render(user, True, TOOLS)
    full = render(user + [{"role": "assistant", "content": "", "tool_calls": tc}], False, TOOLS)
    assert full.startswith(prompt), (prompt[-80:], full[-200:])
    reply = full[len(prompt):]
    return reply[: reply.index(end)] if end in reply else reply


# llama 3.1's template writes one call per turn ("This model only supports single tool-calls at once!")
FORMAT_CASES = [
    ("qwen2.5-7b-instruct.jinja", "hermes", CALLS, "<|im_end|>"),
    ("llama-3.1-8b-instruct.jinja", "llama3_json", CALLS[:1], "<|eot_id|>"),
    ("mistral-nemo-instruct-2407.jinja", "mistral", CALLS, "</s>"),
]


@pytest.mark.parametrize("name,fmt_name,calls,end", FORMAT_CASES)
def test_format_detected_from_the_template(name, fmt_name, calls, end):
    fmt = tools.detect_format(template(name))
    assert fmt.name == fmt_name and fmt.native


@pytest.mark.parametrize("name,fmt_name,calls,end", FORMAT_CASES)
def test_parser_reads_what_the_template_writes(name, fmt_name, calls, end):
    fmt = tools.FORMATS[fmt_name]
    reply = assistant_reply(template(name), calls, end)
    content, parsed = fmt.parse(reply)
    assert content == ""
    assert [(c.name, c.args()) for c in parsed] == calls, reply
    assert all(c.id.startswith("call_") for c in parsed)
    # with text before the calls (where the format allows it), streamed in random pieces
    text = reply if fmt_name == "llama3_json" else "Let me check.\n" + reply
    rng = random.Random(7)
    for _ in range(5):
        stream, shown, i = tools.ToolCallStream(fmt), [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            shown.append(stream.push(text[i:j]))
            i = j
        tail, streamed = stream.finish()
        shown.append(tail)
        assert "".join(shown).strip() == ("" if fmt_name == "llama3_json" else "Let me check.")
        assert [(c.name, c.args()) for c in streamed] == calls


def test_parsers_leave_plain_text_alone():
    for fmt in tools.FORMATS.values():
        for text in ("The weather is fine.", "<tool_call>\nnot json\n</tool_call>", '{"no": "name"}', "[TOOL_CALLS][oops"):
            content, calls = fmt.parse(text)
            assert calls == [] and content == text.strip()
            stream = tools.ToolCallStream(fmt)
            shown = stream.push(text)
            tail, calls = stream.finish()
            assert calls == [] and shown + tail == text


def test_other_spellings_of_the_formats():
    # Llama 3.x built-in-tool prefix and several calls separated by ';' (Llama 3.2 model card)
    _, calls = tools.LLAMA3_JSON.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [(c.name, c.args()) for c in calls] == [("a", {"x": 1}), ("b", {})]
    # Mistral v11 tokenizers: [TOOL_CALLS]name[ARGS]{...} (Mistral-Small-3.2)
    content, calls = tools.MISTRAL.parse('Sure. [TOOL_CALLS]get_time[ARGS]{"timezone": "UTC", "hour24": false}')
    assert content == "Sure." and [(c.name, c.args()) for c in calls] == [("get_time", {"timezone": "UTC", "hour24": False})]
    # Hermes call left open at end of sequence, arguments given as a JSON string
    _, calls = tools.HERMES.parse('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 2}"}')
    assert [(c.name, c.args()) for c in calls] == [("f", {"a": 2})]


def test_qwen25_template_renders_tools_and_tool_results():
    render = template("qwen2.5-7b-instruct.jinja")
    fmt = tools.detect_format(render)
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]  # fmt: skip
    text = tools.render_with(render, fmt, msgs, True, tools.normalize_tools(TOOLS))
    assert "<tools>\n" + json.dumps(tools.normalize_tools(TOOLS)[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n' in text


@pytest.fixture(scope="module")
def smol_tokenizer(tokenizer):
    return tokenizer  # conftest's, built once per session


@pytest.fixture(scope="module")
def smol_render(smol_tokenizer):
    return lambda m, agp, t=None: smol_tokenizer.apply_chat_template(m, add_generation_prompt=agp, tools=t)


def test_smollm2_template_gets_the_hermes_fallback(smol_render):
    fmt = tools.detect_format(smol_render)
    assert fmt.name == "hermes" and not fmt.native
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]  # fmt: skip
    text = tools.render_with(smol_render, fmt, msgs, True, tools.normalize_tools(TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_time"' in text and "<tool_call></tool_call> XML tags" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # no tools and no tool messages: the template's own rendering, untouched
    plain = [{"role": "user", "content": "hi"}]
    assert tools.render_with(smol_render, None, plain, True, None) == smol_render(plain, True)


def test_qwen3_reasoning_split_streaming():
    render = template("qwen3-0.6b.jinja")
    user = [{"role": "user", "content": "2+2?"}]
    prompt = render(user, True)
    full = render(user + [{"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two.\nThat is four."}], False)
    reply = full[len(prompt): full.rindex("<|im_end|>")]
    assert reply.startswith("<think>")
    for size in (1, 2, 3, 7, len(reply)):
        sp, r, c = tools.ReasoningSplitter(), [], []
        for i in range(0, len(reply), size):
            a, b = sp.push(reply[i: i + size])
            r.append(a)
            c.append(b)
        a, b = sp.finish()
        assert ("".join(r) + a, "".join(c) + b) == ("Two plus two.\nThat is four.", "It is 4.")
    # a prompt that opens <think> (DeepSeek-R1 style), an unclosed think, no think at all
    assert not tools.prompt_opens_reasoning(prompt) and tools.prompt_opens_reasoning("<|Assistant|><think>\n")
    sp = tools.ReasoningSplitter(in_reasoning=True)
    assert [sp.push("ab</thi"), sp.push("nk>\n\nok"), sp.finish()] == [("ab", ""), ("", "ok"), ("", "")]
    sp = tools.ReasoningSplitter()
    assert [sp.push("<think>cut"), sp.finish()] == [("cut", ""), ("", "")]
    sp = tools.ReasoningSplitter()
    assert [sp.push("<b>bold</b> <think>"), sp.finish()] == [("", "<b>bold</b> <think>"), ("", "")]


def test_bad_tools_name_the_param():
    cases = [
        ("nope", "tools"),
        ([], "tools"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "strict": 1}}], "tools[0].function.strict"),
    ]
    for value, param in cases:
        with pytest.raises(tools.ToolSpecError) as e:
            tools.normalize_tools(value)
        assert e.value.param == param, (value, e.value)
    assert tools.normalize_tools([{"name": "f"}]) == [{"type": "function", "function": {"name": "f", "parameters": tools.EMPTY_PARAMETERS}}]


# -- on the real model: an inferlet ---------------------------------------------------------------
AGENT = """
import json
from tartlet import Model
from tartlet.sdk.tools import ForcedToolCall, render_chat

TOOLS = json.loads(%r)

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.system("You are a weather assistant.", tools=TOOLS)
        ctx.user("What is the weather in Paris?")
        forced = ForcedToolCall(ctx, name=args.get("name"), max_tokens=64)
        deltas = [d async for d in forced]
        call = forced.call
        ctx.tool(json.dumps({"temperature": 21}), tool_call_id=call.id)
        reply = await ctx.generate(max_tokens=12).collect_text()
        ctx.user("Thanks")
        expected = render_chat(model, ctx._messages, False, ctx.tools)
        return {"name": call.name, "arguments": call.arguments, "finish": forced.finish_reason, "deltas": deltas,
                "reply": reply, "text": ctx.text, "expected": expected, "messages": ctx._messages}
"""


@pytest.mark.parametrize("name", ["get_weather", None])
async def test_forced_call_then_tool_result_in_an_inferlet(runtime, tmp_path, name):
    prog = inline_program(tmp_path, AGENT % json.dumps(TOOLS))
    inst = await run(runtime, prog, {"name": name})
    assert inst.error is None, inst.traceback
    r = inst.result
    assert r["finish"] == "tool_calls"
    if name:
        assert r["name"] == name
    jsonschema.validate(json.loads(r["arguments"]), SCHEMAS[r["name"]])
    assert r["deltas"][0] == {"index": 0, "id": r["messages"][2]["tool_calls"][0]["id"], "name": r["name"]}
    assert "".join(d.get("arguments", "") for d in r["deltas"]) == r["arguments"]
    assert r["messages"][2]["tool_calls"][0]["function"] == {"name": r["name"], "arguments": r["arguments"]}
    # the context holds exactly the template's rendering of the conversation (no duplicated turn)
    assert r["text"] == r["expected"]
    assert r["text"].count("<|im_start|>user\n<tool_response>") == 1 and r["text"].count("# Tools") == 1


@pytest.mark.slow
@pytest.mark.wasm  # a componentize-py build (cached) and a wasmtime compile
async def test_tool_calling_runs_the_same_in_a_wasm_component(runtime, host_state, tmp_path):
    """Tools and tool calls cross the WIT transport (chat-message records,
    the tools JSON) and give exactly the native run's call and reply."""
    from harness import assert_no_leaks
    from tartlet.runtime.builder import build
    from tartlet.runtime.wasm import WasmLimits, WasmRuntime

    d = tmp_path / "agent"
    d.mkdir()
    (d / "main.py").write_text(AGENT % json.dumps(TOOLS))
    (d / "inferlet.toml").write_text('name = "tool-agent"\nversion = "0.1.0"\nentry = "main.py"\n')
    native = await run(runtime, inline_program(tmp_path, AGENT % json.dumps(TOOLS)), {"name": None})
    wasm = WasmRuntime(host_state, limits=WasmLimits(memory_mb=256, cpu_time_s=60))
    sandboxed = await run(wasm, build(d), {"name": None})
    assert sandboxed.error is None, sandboxed.error
    a, b = native.result, sandboxed.result
    assert (b["name"], b["arguments"], b["reply"], b["expected"]) == (a["name"], a["arguments"], a["reply"], a["expected"])
    assert b["text"] == b["expected"]
    assert_no_leaks(host_state)


# -- on the real model: the OpenAI API ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(noauth_server):
    """The session's no-auth server (conftest), left with no page in use."""
    yield noauth_server
    noauth_server.wait_pages_free()


ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def stream_call(oa, **kw):
    """(content, tool_calls as [(id, name, arguments)], finish_reason) reassembled from a stream."""
    content, calls, finish = [], {}, None
    for chunk in oa.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                    assert tc.type == "function"
                if tc.function.name:
                    slot["name"] = tc.function.name
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return "".join(content), [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_returns_a_schema_valid_call(server, oa, choice):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # streamed: the same call (greedy), id and name first, then argument pieces
    content, calls, finish = stream_call(oa, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64)
    assert content == "" and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_n_forced_calls_are_each_valid(server, oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, n=2, temperature=1.0, seed=3)
    assert len(r.choices) == 2
    for c in r.choices:
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_result_round_trip(server, oa, smol_tokenizer):
    first = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    r = oa.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert c.message.content or c.message.tool_calls
    # the prompt grew by the call and the result, and the server's length check counts what the inferlet filled
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10
    from tartlet.server.openai_models import parse_request
    from tartlet.server.openai_protocol import prompt_length

    for body, usage in ((dict(messages=history, tools=TOOLS), r.usage), (dict(messages=ASK, tools=TOOLS, tool_choice="required"), first.usage)):
        job = parse_request(dict(body, model=MODEL), True, 8192)["args"]
        assert prompt_length(smol_tokenizer, job) == usage.prompt_tokens
    # auto, streamed, gives what the non-streamed request gave
    content, calls, finish = stream_call(oa, messages=history, tools=TOOLS, max_tokens=24)
    assert finish == c.finish_reason
    assert content == (c.message.content or "")
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]


def test_tool_choice_none_gives_plain_text(server, oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=16)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    assert isinstance(c.message.content, str) and c.message.content
    # without tools in the prompt it is the plain chat answer
    plain = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16)
    assert plain.choices[0].message.content == c.message.content
    assert getattr(c.message, "reasoning_content", None) is None


def test_bad_tool_requests_are_400_naming_the_param(server):
    url = server.url + "/v1/chat/completions"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": "required", "logprobs": True}, "logprobs"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": ASK + [{"role": "tool", "content": "21"}]}, "messages[1].tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": "{oops"})]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": ASK + [{"role": "robot", "content": "x"}]}, "messages[1].role"),
        ({"parallel_tool_calls": "yes", "tools": TOOLS}, "parallel_tool_calls"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert server.get("/health").json()["running_instances"] == 0

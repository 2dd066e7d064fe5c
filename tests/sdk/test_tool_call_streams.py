"""Streaming tool calls under stress (:class:`tartlet.sdk.tools.ToolCallStream`
and the OpenAI routes that use it).

Unit (pure Python): for each format (Hermes/Qwen ``<tool_call>``, Llama 3
JSON, Mistral ``[TOOL_CALLS]`` array and v11), model-like output holding
several calls, one to a tool nobody offered, with non-ASCII, emoji, escaped
quotes, ``\\u`` escapes (surrogate pairs included) in the arguments, fed cut
at every character boundary, one character at a time, one UTF-8 byte at a
time through an incremental decoder, and in random pieces: the events always
join to what :meth:`ToolFormat.parse` gives for the whole text, arguments
byte for byte as written; every prefix (an output cut by ``max_tokens``)
streams without retracting anything.

End to end (the in-process server, the default model, the official
``openai`` client): the model's output is scripted by a grammar (the SDK's
``Context.generate`` gets a constraint that admits exactly one text when the
conversation holds a marker), so the 135M model writes three parallel calls
with Unicode arguments and text before them; chat completions and the
Responses API, streamed and not, must give the same calls: distinct
``index``/``id`` per call, arguments streamed in several pieces that join to
the non-streamed arguments byte for byte.
"""

from __future__ import annotations

import codecs
import json
import random

import httpx
import openai
import pytest

from tartlet.sdk import tools

# -- unit: the parsers ---------------------------------------------------------------------
ARGS = [
    # raw JSON text of each call's arguments, as a model writes it
    '{"city": "S\\u00e3o Paulo \\"centro\\"", "unit": "celsius", "note": "☀️ 😀 naïve — 東京"}',
    '{"q": "\\ud83d\\ude00 \\\\ back\\\\slash {not} [a] \\"brace\\"", "n": [1, {"deep": null}], "ok": true}',
    '{}',
]
NAMES = ["get_weather", "unknown_tool", "get_time"]  # unknown_tool is offered by nobody: passed through as written


def hermes_text() -> str:
    blocks = "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in zip(NAMES, ARGS))
    return "Let me check   both.\n" + blocks + "\n"


def llama3_text() -> str:
    return "<|python_tag|>" + "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip(NAMES, ARGS))


def mistral_text() -> str:
    items = ", ".join(f'{{"name": "{n}", "arguments": {a}, "id": "abc{i}defgh"}}' for i, (n, a) in enumerate(zip(NAMES, ARGS)))
    return "Sure. [TOOL_CALLS][" + items + "]"


def mistral_v11_text() -> str:
    return "Sure. " + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in zip(NAMES, ARGS))


CASES = [
    ("hermes", tools.HERMES, hermes_text(), "Let me check   both."),
    ("llama3_json", tools.LLAMA3_JSON, llama3_text(), ""),
    ("mistral", tools.MISTRAL, mistral_text(), "Sure."),
    ("mistral_v11", tools.MISTRAL, mistral_v11_text(), "Sure."),
]
IDS = [c[0] for c in CASES]


def run_stream(fmt: tools.ToolFormat, pieces) -> tuple[str, list[dict], tools.ToolCallStream]:
    """Feed ``pieces``; (content, calls rebuilt from the deltas as
    [{"id", "name", "arguments", "pieces"}], the stream)."""
    s = tools.ToolCallStream(fmt)
    events = []
    for p in pieces:
        events += s.feed(p)
    events += s.end()
    return (*assemble(events), s)


def assemble(events: list[dict]) -> tuple[str, list[dict]]:
    content, calls = [], []
    for e in events:
        if "content" in e:
            content.append(e["content"])
            continue
        if "id" in e:
            assert e["index"] == len(calls), events  # a new call gets the next index
            assert set(e) == {"index", "id", "name"}
            calls.append({"id": e["id"], "name": e["name"], "arguments": "", "pieces": 0})
        else:
            assert set(e) == {"index", "arguments"} and e["arguments"] and e["index"] == len(calls) - 1
            calls[e["index"]]["arguments"] += e["arguments"]
            calls[e["index"]]["pieces"] += 1
    return "".join(content), calls


def utf8_pieces(text: str, cuts) -> list[str]:
    """``text`` as an incremental UTF-8 decoder yields it when the bytes are cut at ``cuts``."""
    data, dec, out, last = text.encode(), codecs.getincrementaldecoder("utf-8")(), [], 0
    for c in list(cuts) + [len(text.encode())]:
        out.append(dec.decode(data[last:c], final=c == len(data)))
        last = c
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_parse_reads_parallel_calls_with_unicode_arguments(case):
    _, fmt, text, content = case
    got_content, calls = fmt.parse(text)
    assert got_content == content
    assert [c.name for c in calls] == NAMES
    assert [c.arguments for c in calls] == ARGS  # the raw JSON text, byte for byte
    assert [c.args() for c in calls] == [json.loads(a) for a in ARGS]
    assert calls[0].args()["note"] == "☀️ 😀 naïve — 東京" and calls[1].args()["q"].startswith("😀 \\ back\\slash")
    assert len({c.id for c in calls}) == 3


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stream_equals_parse_at_every_boundary(case):
    _, fmt, text, content = case
    want = [(n, a) for n, a in zip(NAMES, ARGS)]

    def check(pieces, what):
        got, calls, s = run_stream(fmt, pieces)
        assert got == content, what
        assert [(c["name"], c["arguments"]) for c in calls] == want, what
        assert [(c.id, c.name, c.arguments) for c in s.calls] == [(c["id"], c["name"], c["arguments"]) for c in calls]
        assert len({c["id"] for c in calls}) == len(calls) and not s.cut
        return calls

    for k in range(len(text) + 1):  # one cut, at every character
        check([text[:k], text[k:]], k)
    calls = check(list(text), "char by char")
    assert all(c["pieces"] == len(c["arguments"]) for c in calls)  # arguments streamed as they come, not at the end
    data = text.encode()
    check(utf8_pieces(text, range(1, len(data))), "byte by byte")
    for k in range(len(data) + 1):  # one cut at every byte, inside multi-byte characters too
        check(utf8_pieces(text, [k]), k)
    rng = random.Random(35)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        check([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])], cuts)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_cut_output_never_retracts_what_was_streamed(case):
    """Every prefix (``max_tokens`` hit anywhere): streamed as a whole or
    char by char it gives the same result, and what ``feed`` sent is a
    prefix of what the whole text sends."""
    _, fmt, text, _ = case
    full_feed = tools.ToolCallStream(fmt)
    full_events = [e for ch in text for e in full_feed.feed(ch)]
    full_content, full_calls = assemble(full_events)
    for k in range(len(text) + 1):
        prefix = text[:k]
        whole_content, whole_calls = fmt.parse(prefix)
        content, calls, s = run_stream(fmt, list(prefix))
        assert content == whole_content and [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        st = tools.ToolCallStream(fmt)
        fed_content, fed_calls = assemble([e for ch in prefix for e in st.feed(ch)])
        assert full_content.startswith(fed_content), k
        for got, full in zip(fed_calls, full_calls):
            assert got["name"] == full["name"] and full["arguments"].startswith(got["arguments"]), k
        assert len(fed_calls) <= len(full_calls)
        # cut inside a call's arguments: the call is reported with what was written, and flagged
        if s.cut:
            assert calls and NAMES[len(calls) - 1] == calls[-1]["name"] and ARGS[len(calls) - 1].startswith(calls[-1]["arguments"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_call_is_complete_once_its_arguments_close(case):
    """``completed`` counts a call from the character that closes its
    arguments (the calls after it not written yet: an agent can start it
    then), never before; a cut inside the arguments leaves it incomplete."""
    _, fmt, text, _ = case
    ends, at = [], 0
    for a in ARGS:
        at = text.index(a, at) + len(a)
        ends.append(at)
    s = tools.ToolCallStream(fmt)
    for k, ch in enumerate(text, 1):
        s.feed(ch)
        assert s.completed == sum(e <= k for e in ends), k
        assert [c.arguments for c in s.calls[:s.completed]] == ARGS[:s.completed]
    s.end()
    assert s.completed == 3 and not s.cut
    cut = tools.ToolCallStream(fmt)
    cut.feed(text[: ends[1] - 1])
    cut.end()
    assert cut.cut and len(cut.calls) == 2 and cut.completed == 1


def test_a_broken_call_between_good_ones_is_content():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": "é"}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>\n'
            '<tool_call>\n{"name": "bad name!", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = tools.HERMES.parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": "é"}'), ("b", "{}")]
    assert content == '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "bad name!", "arguments": {}}\n</tool_call>'
    for k in range(len(text) + 1):
        got, streamed, _ = run_stream(tools.HERMES, [text[:k], text[k:]])
        assert got == content and [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_other_orders_are_held_and_reported_whole():
    # arguments before the name, arguments as a JSON string: reported when the object is complete
    text = ('<tool_call>{"arguments": {"city": "Zürich"}, "name": "get_weather"}</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"ü\\"}"}</tool_call>')
    content, calls = tools.HERMES.parse(text)
    assert content == "" and [(c.name, c.args()) for c in calls] == [("get_weather", {"city": "Zürich"}), ("f", {"a": "ü"})]
    for k in range(len(text) + 1):
        _, streamed, _ = run_stream(tools.HERMES, [text[:k], text[k:]])
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_plain_text_and_near_misses_stay_content():
    for fmt in tools.FORMATS.values():
        for text in ("Use <tool_ or [TOOL_ or {", "<tool_call> is a tag", "[TOOL_CALLS] none", '{"name": "x" but not json',
                     "{\"a\": 1}", "Answer: 42 😀"):
            content, calls = fmt.parse(text)
            assert calls == [] and content == text.strip(), (fmt.name, text)
            for k in range(len(text) + 1):
                got, streamed, _ = run_stream(fmt, [text[:k], text[k:]])
                assert got == content and streamed == [], (fmt.name, text, k)


# -- end to end: scripted model output through the OpenAI routes -------------------------------
MODEL = "smollm2-135m-instruct"
MARK = "[scripted reply 35]"
E2E_ARGS = [
    '{"city": "São Paulo \\"centro\\"", "unit": "celsius", "note": "☀️ 😀 東京"}',
    '{"symbol": "\\u00e9\\ud83d\\ude00", "path": "C:\\\\tmp"}',
    '{"timezone": "CET", "hour24": true}',
]
E2E_NAMES = ["get_weather", "lookup_stock", "get_time"]  # lookup_stock is not in TOOLS
SCRIPT = "Checking all three.\n" + "\n".join(
    f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in zip(E2E_NAMES, E2E_ARGS))
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": f"{MARK} Weather and time in São Paulo? 😀"}]


@pytest.fixture(scope="module")
def server(noauth_server):
    yield noauth_server
    noauth_server.wait_pages_free()


@pytest.fixture
def scripted(monkeypatch):
    """While the test runs, a generation whose conversation holds MARK and
    no constraint of its own writes SCRIPT (a grammar admitting only it)."""
    from tartlet.sdk.constraint import Grammar
    from tartlet.sdk.context import Context

    orig = Context.generate

    def generate(self, sampler=None, **kw):
        if kw.get("constraint") is None and MARK in self.chat_text:
            kw["constraint"] = Grammar("start: " + json.dumps(SCRIPT, ensure_ascii=False) + "\n", self.model.name)
        return orig(self, sampler, **kw)

    monkeypatch.setattr(Context, "generate", generate)


def chat_stream(oa, **kw):
    content, calls, finish = [], {}, None
    for chunk in oa.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
                if tc.id:
                    assert slot["id"] is None and tc.type == "function"  # id and name once, first
                    slot["id"], slot["name"] = tc.id, tc.function.name
                if tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
                    slot["pieces"] += 1
            finish = ch.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def test_chat_parallel_calls_streamed_equal_non_streamed(server, oa, scripted):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking all three."
    got = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert got == list(zip(E2E_NAMES, E2E_ARGS))  # byte for byte as written, the unknown tool passed through
    assert len({t.id for t in c.message.tool_calls}) == 3
    content, calls, finish = chat_stream(oa, messages=ASK, tools=TOOLS, max_tokens=400)
    assert (content, finish) == (c.message.content, c.finish_reason)
    assert [(s["name"], s["arguments"]) for s in calls] == got
    assert len({s["id"] for s in calls}) == 3 and all(s["id"].startswith("call_") for s in calls)
    assert all(s["pieces"] > 3 for s in calls[:2])  # arguments streamed as generated, not in one piece
    # the raw stream: indices 0, 1, 2, each call's first delta has id, type, name
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 400, "stream": True}) as resp:
        deltas = [tc for line in resp.iter_lines() if line.startswith("data: {")
                  for ch in json.loads(line[6:])["choices"] for tc in ch["delta"].get("tool_calls") or []]
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1, 2] and all(d["type"] == "function" and d["function"]["name"] for d in firsts)
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas if "id" not in d)


def test_chat_cut_inside_arguments_is_length(server, oa, scripted):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=30)
    c = r.choices[0]
    content, calls, finish = chat_stream(oa, messages=ASK, tools=TOOLS, max_tokens=30)
    assert finish == c.finish_reason and content == (c.message.content or "")
    assert [(s["name"], s["arguments"]) for s in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    if c.message.tool_calls:
        assert c.finish_reason == "length" and E2E_ARGS[0].startswith(c.message.tool_calls[-1].function.arguments)


def test_responses_parallel_calls_streamed_equal_non_streamed(server, oa, scripted):
    rtools = [dict(t["function"], type="function") for t in TOOLS]
    r = oa.responses.create(model=MODEL, input=ASK[0]["content"], tools=rtools, max_output_tokens=400, store=False)
    assert [o.type for o in r.output] == ["message", "function_call", "function_call", "function_call"]
    assert r.output_text == "Checking all three." and r.status == "completed"
    fcs = r.output[1:]
    assert [(o.name, o.arguments) for o in fcs] == list(zip(E2E_NAMES, E2E_ARGS))
    assert len({o.call_id for o in fcs}) == 3 and len({o.id for o in fcs}) == 3
    events = list(oa.responses.create(model=MODEL, input=ASK[0]["content"], tools=rtools, max_output_tokens=400, stream=True,
                                      store=False))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None), getattr(o, "call_id", None) is not None)
            for o in final.output] == [(o.type, getattr(o, "name", None), getattr(o, "arguments", None), getattr(o, "call_id", None) is not None)
                                       for o in r.output]
    assert final.output_text == r.output_text
    # per item: added, deltas, done, item done; then the next item
    by_item: dict[int, list[str]] = {}
    for e in events:
        if hasattr(e, "output_index"):
            by_item.setdefault(e.output_index, []).append(e.type)
    order = [e.output_index for e in events if hasattr(e, "output_index")]
    assert order == sorted(order)  # items do not interleave
    for idx in (1, 2, 3):
        kinds = by_item[idx]
        assert kinds[0] == "response.output_item.added" and kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
        assert kinds.count("response.function_call_arguments.delta") > (3 if idx < 3 else 0)
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == idx)
        assert args == E2E_ARGS[idx - 1]


def test_responses_input_items_list_in_order(server, oa):
    items = [{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "12:00"}, {"role": "user", "content": [{"type": "input_text", "text": "Ok?"}]}]
    rtools = [dict(t["function"], type="function") for t in TOOLS]
    r = oa.responses.create(model=MODEL, input=items, tools=rtools, max_output_tokens=4)
    try:
        data = httpx.get(server.url + f"/v1/responses/{r.id}/input_items", params={"order": "asc"}, timeout=30).json()["data"]
        assert [i["type"] for i in data] == ["message", "function_call", "function_call_output", "message"]
        assert data[0]["role"] == "user" and data[0]["content"] == [{"type": "input_text", "text": "Hi"}]
        assert data[1]["call_id"] == "c1" and data[2]["output"] == "12:00" and data[3]["content"][0]["text"] == "Ok?"
        assert len({i["id"] for i in data}) == 4
        desc = oa.responses.input_items.list(r.id)  # the client's default order: newest first
        assert [i.id for i in desc.data] == [i["id"] for i in reversed(data)]
        page = httpx.get(server.url + f"/v1/responses/{r.id}/input_items", params={"order": "asc", "limit": 2, "after": data[0]["id"]},
                         timeout=30).json()
        assert [i["id"] for i in page["data"]] == [data[1]["id"], data[2]["id"]] and page["has_more"] is True
        assert page["first_id"] == data[1]["id"] and page["last_id"] == data[2]["id"]
        bad = httpx.get(server.url + f"/v1/responses/{r.id}/input_items", params={"limit": 0}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    finally:
        oa.responses.delete(r.id)  # and its KV snapshot
    with pytest.raises(openai.NotFoundError):
        oa.responses.input_items.list(r.id)

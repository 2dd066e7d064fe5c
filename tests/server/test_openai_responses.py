"""The Responses API (``/v1/responses``) on a real ``tartlet serve`` with
auth, checked with the official ``openai`` client: text, typed stream
events, a function-tool round trip, ``previous_response_id`` prefilling only
the new items (usage and the engine's own token counter), a restart in
between, per-user isolation, and an ``openai-agents`` agent."""

from __future__ import annotations

import json

import openai
import pytest

from server_harness import ServerProcess, add_users, write_config

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("responses-server")
    cfg = write_config(d / "config.toml", d / "data")
    keys = add_users(cfg, "alice", "bob")
    server = ServerProcess(cfg)
    state = {"server": server, "cfg": cfg, "keys": keys}
    yield state
    state["server"].stop()


def client(setup, user: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=setup["server"].url + "/v1", api_key=setup["keys"][user], max_retries=0, timeout=120)


def tokens_computed(setup) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = setup["server"].get("/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "tartlet_tokens_computed"
               for s in fam.samples if s.name.endswith("_total"))


def test_text_response_equals_the_chat_route(setup):
    oa = client(setup)
    q = "What is the capital of France?"
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
                                      max_tokens=16)
    r = oa.responses.create(model=MODEL, instructions="Be brief.", input=q, max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert oa.responses.retrieve(r.id).output_text == r.output_text


def test_streamed_events_come_in_order_and_match(setup):
    oa = client(setup)
    plain = oa.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=24, store=False)
    events = list(oa.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=24, stream=True, store=False))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert len(deltas) >= 2 and set(kinds[4:4 + len(deltas)]) == {"response.output_text.delta"}
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                                       "response.completed" if plain.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens


def test_function_tool_round_trip_reuses_the_kv_of_the_previous_response(setup):
    oa = client(setup)
    r1 = oa.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                             max_output_tokens=48)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    streamed = [e for e in oa.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                               tool_choice="required", max_output_tokens=48, stream=True, store=False)]
    arg_deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arg_deltas == calls[0].arguments
    before = tokens_computed(setup)
    r2 = oa.responses.create(model=MODEL, previous_response_id=r1.id, tools=[WEATHER], max_output_tokens=24,
                             input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    computed = tokens_computed(setup) - before
    u = r2.usage
    held = r1.usage.input_tokens + r1.usage.output_tokens
    # the first turn: prompt, call, and the call's markup the grammar did not generate (<tool_call>), but the
    # tokens left pending when it was saved (without a pass): its last token and closing markup
    assert held - 1 <= u.input_tokens_details.cached_tokens <= held + 24
    new = u.input_tokens - u.input_tokens_details.cached_tokens
    assert 0 < new < 40
    # the engine ran only the new items (the first turn's pending tokens included) and the reply: saving this
    # response's own snapshot ran no pass
    assert computed <= new + u.output_tokens
    assert r2.output_text


def test_previous_response_survives_a_restart_and_is_per_user(setup):
    oa = client(setup)
    r1 = oa.responses.create(model=MODEL, input="My name is Ada. Say hello.", max_output_tokens=12)
    setup["server"].stop()
    setup["server"] = ServerProcess(setup["cfg"])
    oa = client(setup)
    assert oa.responses.retrieve(r1.id).output_text == r1.output_text
    r2 = oa.responses.create(model=MODEL, previous_response_id=r1.id, input="What is my name?", max_output_tokens=12)
    # all of r1 but its last token: a snapshot is saved without a pass, its pending tokens prefilled by the next turn
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 1
    bob = client(setup, "bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, previous_response_id=r1.id, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r1.id)
    oa.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r1.id)


def test_ignore_eos_generates_exactly_max_output_tokens_across_turns(setup):
    """The chat route's ``ignore_eos`` (vLLM's extension) on Responses:
    each turn is exactly ``max_output_tokens`` long, the next turn still
    continues from the stored snapshot (bench_agents' Responses client)."""
    oa = client(setup)
    short = oa.responses.create(model=MODEL, instructions="Answer in one word.", input="Capital of France?", max_output_tokens=40)
    assert short.status == "completed" and short.usage.output_tokens < 40
    r1 = oa.responses.create(model=MODEL, instructions="Answer in one word.", input="Capital of France?", max_output_tokens=40,
                             extra_body={"ignore_eos": True})
    assert r1.status == "incomplete" and r1.usage.output_tokens == 40
    assert r1.output_text.startswith(short.output_text)
    r2 = oa.responses.create(model=MODEL, previous_response_id=r1.id, input="And of Spain?", max_output_tokens=16,
                             extra_body={"ignore_eos": True})
    assert r2.usage.output_tokens == 16
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 1  # its last token is pending
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, input="x", max_output_tokens=4, extra_body={"ignore_eos": "yes"})
    assert e.value.body["param"] == "ignore_eos"


def snapshot_counters(setup) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = setup["server"].get("/metrics").text
    return {fam.name: sum(s.value for s in fam.samples if s.name.endswith("_total"))
            for fam in text_string_to_metric_families(text) if fam.name.startswith("tartlet_snapshot_")}


def test_each_turn_writes_only_its_new_pages_to_disk(setup):
    """A stored response's snapshot file names the page files of the turns
    before it (``tartlet-kv-snapshot/2``): a turn writes only the pages of its
    new tokens (and the previous turn's partly filled last page), so bytes
    written per turn stay flat while the conversation grows."""
    import time

    oa = client(setup)
    prev, pages, held = None, [], []
    for turn in range(8):
        before = snapshot_counters(setup)
        r = oa.responses.create(model=MODEL, input=f"Step {turn}: the tool said {turn * 7}. What next?", max_output_tokens=16,
                                extra_body={"ignore_eos": True}, **({"previous_response_id": prev} if prev else {}))
        prev = r.id
        for _ in range(600):  # the background writer: wait for this turn's snapshot
            after = snapshot_counters(setup)
            if after["tartlet_snapshot_write_seconds"] > before.get("tartlet_snapshot_write_seconds", 0):
                break
            time.sleep(0.05)
        pages.append(after["tartlet_snapshot_pages_written"] - before.get("tartlet_snapshot_pages_written", 0))
        held.append(r.usage.input_tokens + r.usage.output_tokens)
        if turn:
            new = held[-1] - held[-2]
            # the new tokens' pages, plus the previous last page (partly filled, now full) and one of slack for the boundary
            assert 0 < pages[-1] <= -(-new // 16) + 2, (turn, pages, held)
            assert after["tartlet_snapshot_pages_reused"] - before["tartlet_snapshot_pages_reused"] >= (held[-2] - 8) // 16 - 1
    assert held[-1] > 4 * held[0] and max(pages[1:]) <= min(pages[1:]) + 2  # flat, while the conversation grew 4x


def test_bad_requests_are_400_naming_the_parameter(setup):
    oa = client(setup)
    for kw, param in [({"input": []}, "input"), ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                      ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                      ({"input": [{"type": "image", "url": "x"}]}, "input[0].type")]:
        with pytest.raises(openai.BadRequestError) as e:
            oa.responses.create(model=MODEL, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)


def test_openai_agents_runs_a_function_tool_agent(setup):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        seen.append(city)
        return f"Sunny in {city}"

    oa = AsyncOpenAI(base_url=setup["server"].url + "/v1", api_key=setup["keys"]["alice"], max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=oa),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(seen) == 1 and result.final_output == f"Sunny in {seen[0]}"

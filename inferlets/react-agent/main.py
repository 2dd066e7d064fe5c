"""react-agent: multi-step Thought / Action / Observation over HTTP tools.

The whole trace is one assistant turn, written in the classic ReAct format::

    Thought: <free text, one line>
    Action: [{"name": "weather", "arguments": {"city": "Paris"}}, ...]
    Observation: <the tools' results>
    ... (repeated)
    Action: {"name": "finish"}
    Answer: <free text>

``Action`` is generated under a JSON Schema built from the tools: a list of
1 to ``max_parallel`` calls (each ``arguments`` constrained by the tool's
``parameters``, extra keys refused) or ``{"name": "finish"}`` (not offered
in the first step, and forced after ``max_steps``), so every action parses
and every call is schema-valid. What only an inferlet can do, used:

- the calls of one action run concurrently (asyncio), and each starts as
  soon as its JSON object is complete, while the model is still writing
  the next call: tool latency overlaps generation;
- an observation longer than ``long_output_tokens`` tokens is followed by
  ``Summary:`` and one non-empty line the model writes (regex-constrained,
  at most ``summary_tokens``); then the observation's
  tokens are masked from attention (``Context.mask_token_range``) and its
  fully hidden KV pages freed (``drop_masked_pages``): later steps read the
  summary, and the KV memory of long tool outputs is given back.

HTTP tools (the host's allowlist applies): ``{"name", "description",
"url", "method", "parameters"}``; ``method`` ``"POST"`` (default) sends the
arguments as a JSON body, ``"GET"`` as query parameters; the response body
(text) is the observation, an HTTP error status or a refused/failed fetch
becomes ``error: ...``.

Args:
    prompt (str, required): the question.
    tools (list, required): the HTTP tools, as above (``parameters``: JSON
        Schema of the arguments object, default any object).
    max_steps (int, default 4): most actions with tool calls.
    max_parallel (int, default 3): most calls in one action.
    min_parallel (int, default 1): fewest calls in an action with calls
        (e.g. 3 for a fan-out over independent sources).
    think_tokens (int, default 32), action_tokens (int, default 128),
    summary_tokens (int, default 32), max_tokens (int, default 96; the
        answer, which is never empty: its first token may not be EOS).
    long_output_tokens (int, default 64): observations longer than this
        are summarized, masked and dropped (0: never).
    max_observation_chars (int, default 4000): each tool result is cut to this.
    system (str): extra instructions before the tool list.
    temperature (float, default 0), seed (int), model (str).

Returns ``{"steps": [{"thought", "calls": [{"name", "arguments", "result",
"issued_at"}], "action_tokens", "summary"}], "answer", "finish_reason", "masked_tokens", "dropped_pages",
"live_pages", "pages", "transcript"}`` (``transcript``: the context's text,
masked tokens included; ``live_pages``/``pages``: KV pages at the end;
``issued_at``: how many action tokens had been generated when the call
was sent, of ``action_tokens``).
"""

import asyncio
import json
from urllib.parse import urlencode

from tartlet import HttpError, JsonSchema, Model, Regex, Sampler, brle, forward, http, session

EXAMPLE = """
Each Action is a JSON list of tool calls, run in parallel, or {"name": "finish"} when you can answer.
Example:
Question: Which is taller, tower A or tower B?
Thought: I need both heights, so I look them up at once.
Action: [{"name": "lookup", "arguments": {"q": "tower A"}}, {"name": "lookup", "arguments": {"q": "tower B"}}]
Observation: [lookup] Tower A, built in 1950, is 120 m tall and has 30 floors.
[lookup] Tower B, built in 1980, is 95 m tall and has 25 floors.
Summary: Tower A is 120 m tall; tower B is 95 m tall.
Thought: Tower A is taller.
Action: {"name": "finish"}
Answer: Tower A (120 m) is taller than tower B (95 m)."""
FINISH = {"type": "object", "properties": {"name": {"const": "finish"}}, "required": ["name"], "additionalProperties": False}


def _strict(schema):
    schema = dict(schema) if isinstance(schema, dict) else {"type": "object"}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def action_schema(tools, min_parallel, max_parallel, allow_finish):
    """JSON Schema of one Action: a list of min..max_parallel tool calls, or
    ``{"name": "finish"}`` when ``allow_finish``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "arguments": _strict(t.get("parameters"))},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": min_parallel, "maxItems": max_parallel}
    return {"anyOf": [array, FINISH]} if allow_finish else array


def _tools(arg):
    if not isinstance(arg, list) or not arg:
        raise ValueError("react-agent needs argument `tools`: a non-empty list of {name, description, url, method, parameters}")
    out, names = [], set()
    for t in arg:
        if not isinstance(t, dict):
            raise ValueError(f"a tool is a dict, got {t!r:.100}")
        name, url = t.get("name"), t.get("url")
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name) or name == "finish":
            raise ValueError(f"a tool needs a `name` of letters, digits, '_' or '-' (not 'finish'), got {name!r}")
        if name in names:
            raise ValueError(f"two tools are named {name!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"tool {name!r} needs an http(s) `url`, got {url!r}")
        method = str(t.get("method", "POST")).upper()
        if method not in ("GET", "POST"):
            raise ValueError(f"tool {name!r}: method must be GET or POST, got {t.get('method')!r}")
        params = t.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON Schema object")
        names.add(name)
        out.append({"name": name, "description": str(t.get("description", "")), "url": url, "method": method, "parameters": params})
    return out


def _int(args, key, default, lo):
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"argument `{key}` must be an int >= {lo}, got {v!r}")
    return v


async def run_tool(tool, arguments, max_chars):
    """The observation of one call: the response text, or ``error: ...``."""
    try:
        if tool["method"] == "GET":
            query = urlencode({k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()})
            r = await http.fetch(tool["url"] + ("&" if "?" in tool["url"] else "?") + query if query else tool["url"])
        else:
            r = await http.fetch(tool["url"], "POST", json=arguments)
    except (HttpError, ValueError) as e:  # the host refused or the fetch failed, or bad arguments: the model sees why
        return f"error: {e}"[:max_chars]
    text = r.text().strip()
    return (text if r.ok else f"error: HTTP {r.status}: {text}")[:max_chars]


def end_line(ctx, gen, start):
    """Leave the context ending with ``gen``'s text and one line break:
    keep the stop token when it is just line breaks, else cut the
    generation off (``truncate`` to ``start``) and fill the cleaned line."""
    if gen.finish_reason == "eos":
        ctx.truncate(ctx.seq_len - 1)
        ctx.fill("\n")
        return
    raw = ctx.model.detokenize(gen.tokens)
    extra = raw[len(gen.text):]
    if raw.endswith("\n") and not extra.strip():
        return  # the line break is already there
    if not extra:
        ctx.fill("\n")
    else:
        ctx.truncate(start)
        ctx.fill(gen.text.rstrip() + "\n")


async def first_token(ctx, sampler, banned):
    """Run the pending tokens and sample the next token with ``banned`` ids
    masked out of the logits; it is left pending. Returns it."""
    mask = brle.excluding(ctx.model.vocab_size, banned)
    [tok] = await ctx.forward(outputs=[forward.sample(len(ctx.pending) - 1, sampler, logit_mask=mask)])
    ctx.fill_tokens([tok])
    return tok


def complete_items(text):
    """``(start, end)`` of each complete object of a top-level JSON array
    in the (partial) ``text``, by bracket matching outside strings."""
    items, depth, start, in_str, esc = [], 0, None, False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth == 2 and c == "{":
                start = i
        elif c in "]}":
            if depth == 2 and c == "}" and start is not None:
                items.append((start, i + 1))
                start = None
            depth -= 1
    return items


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("react-agent needs a non-empty string argument `prompt`")
    tools = _tools(args.get("tools"))
    by_name = {t["name"]: t for t in tools}
    max_steps = _int(args, "max_steps", 4, 1)
    max_parallel = _int(args, "max_parallel", 3, 1)
    min_parallel = _int(args, "min_parallel", 1, 1)
    if min_parallel > max_parallel:
        raise ValueError(f"min_parallel ({min_parallel}) is larger than max_parallel ({max_parallel})")
    think_tokens = _int(args, "think_tokens", 32, 1)
    action_tokens = _int(args, "action_tokens", 128, 1)
    summary_tokens = _int(args, "summary_tokens", 32, 1)
    max_tokens = _int(args, "max_tokens", 96, 2)
    long_tokens = _int(args, "long_output_tokens", 64, 0)
    max_chars = _int(args, "max_observation_chars", 4000, 1)
    model = Model.load(args.get("model"))
    sampler = Sampler(temperature=float(args.get("temperature", 0.0)), seed=args.get("seed"))
    listing = "\n".join(json.dumps({"name": t["name"], "description": t["description"], "parameters": t["parameters"]}) for t in tools)
    system = (args.get("system", "") + "\n").lstrip() + "Answer the question using these tools:\n" + listing + EXAMPLE

    steps, masked, dropped = [], 0, 0
    with model.new_context() as ctx:
        ctx.system(system)
        ctx.user(prompt)
        ctx.begin_assistant()
        for n in range(max_steps + 1):
            ctx.fill("Thought:")
            start = ctx.seq_len
            think = ctx.generate(sampler, max_tokens=think_tokens, stop=["\n", "Action:"])
            thought = (await think.collect_text()).strip()
            end_line(ctx, think, start)
            session.send(f"Thought: {thought}\n")
            if n == max_steps:  # out of steps: answer with what we have
                ctx.fill('Action: {"name": "finish"}')
                break
            ctx.fill("Action: ")
            text, started, tasks = "", 0, []
            with JsonSchema(action_schema(tools, min_parallel, max_parallel, allow_finish=n > 0), model.name) as constraint:
                gen = ctx.generate(sampler, max_tokens=action_tokens, constraint=constraint)
                async for piece in gen:  # start each call as soon as its JSON object is complete
                    text += piece.text
                    for s, e in complete_items(text)[started:]:
                        call = json.loads(text[s:e])
                        call["issued_at"] = len(gen.tokens)
                        tasks.append((call, asyncio.ensure_future(run_tool(by_name[call["name"]], call["arguments"], max_chars))))
                        started += 1
            if gen.finish_reason != "constraint":
                for _, t in tasks:
                    t.cancel()
                raise ValueError(f"the action did not complete within action_tokens ({gen.finish_reason}): {gen.text!r}")
            action = json.loads(gen.text)
            session.send(f"Action: {gen.text}\n")
            if isinstance(action, dict):  # finish
                break
            results = await asyncio.gather(*(t for _, t in tasks))
            calls = [{"name": c["name"], "arguments": c["arguments"], "result": r, "issued_at": c["issued_at"]} for (c, _), r in zip(tasks, results)]
            if len(calls) == 1:
                obs = calls[0]["result"]
            else:
                obs = "\n".join(f"[{c['name']}] {c['result']}" for c in calls)
            ctx.fill("\nObservation: ")
            obs_start = ctx.seq_len
            ctx.fill(obs)
            obs_end = ctx.seq_len
            ctx.fill("\n")
            session.send(f"Observation: {obs}\n")
            step = {"thought": thought, "calls": calls, "action_tokens": len(gen.tokens), "summary": None}
            if long_tokens and obs_end - obs_start > long_tokens:
                ctx.fill("Summary:")
                start = ctx.seq_len
                with Regex(r" ?[^\s][^\n]*\n", model.name) as line:  # one line, not empty
                    summ = ctx.generate(sampler, max_tokens=summary_tokens, constraint=line)
                    step["summary"] = (await summ.collect_text()).strip()
                end_line(ctx, summ, start)
                # the summary is written (and in the KV cache, past the
                # observation): hide the raw output, free its pages
                ctx.mask_token_range(obs_start, obs_end)
                masked += obs_end - obs_start
                dropped += await ctx.drop_masked_pages()
                session.send(f"Summary: {step['summary']}\n")
            steps.append(step)
        ctx.fill("\nAnswer:")
        # the answer is not empty: its first token cannot end the turn
        head = model.detokenize([await first_token(ctx, sampler, model.eos_token_ids)])
        session.send(head)
        answer = ctx.generate(sampler, max_tokens=max_tokens - 1, stop=["\nQuestion:", "\nThought:", "\nAction:", "\nObservation:"])
        async for s in answer:
            if s.text:
                session.send(s.text)
        stats = await ctx.stats()
        transcript = ctx.text
    return {
        "steps": steps, "answer": (head + answer.text).strip(), "finish_reason": answer.finish_reason,
        "masked_tokens": masked, "dropped_pages": dropped, "live_pages": stats["live_pages"],
        "pages": stats["pages"], "transcript": transcript,
    }

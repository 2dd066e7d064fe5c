"""openai-completion: the inferlet behind ``/v1/chat/completions`` and
``/v1/completions``.

Args:
    messages (list of {role, content, tool_calls, tool_call_id}): chat mode,
        rendered with the model's chat template exactly as
        ``text-completion`` renders its ``system``/``prompt`` (one SDK call
        per message: ``ctx.add_message``); ``tool`` results and assistant
        ``tool_calls`` (OpenAI shapes) as :mod:`tartlet.tools` renders them.
    tools (list, optional): OpenAI tool list, rendered with the chat
        template (:meth:`Context.set_tools`) unless ``tool_choice`` is
        ``none``.
    tool_choice ("auto" | "none" | "required" | {"name": str}, default
        "auto" with tools): ``auto`` generates freely and parses tool calls
        out of the text (:class:`tartlet.tools.ToolCallStream`, the
        model's own format); ``required`` and a name force one call with
        constrained decoding (:class:`tartlet.tools.ForcedToolCall`), so
        the arguments are valid against the tool's schema.
    prompt (str): completion mode, filled as raw text (``text-completion
        --raw``).
    prompt_tokens (list of int): completion mode, token ids filled as they
        are (instead of ``prompt``).
    max_tokens (int), temperature (float, 0 = greedy), top_p (float),
    seed (int), stop (list of str), model (str).
    adapter (str, optional): the LoRA adapter of ``model`` every pass runs
        with (the server turns ``"model": "BASE:ADAPTER"`` into ``model``
        and ``adapter``).
    logit_bias (dict, optional): token id (int or its decimal string) ->
        bias added to that token's logit before sampling (OpenAI's
        ``logit_bias``; -100/100 in effect ban/force a token).
    sampler (dict, optional): more keyword arguments of ``Sampler`` (the
        server's llama.cpp fields: ``min_p``, ``typical_p``,
        ``xtc_probability``, ``xtc_threshold``, ``dry_multiplier``,
        ``dry_base``, ``dry_allowed_length``, ``dry_penalty_last_n``,
        ``dry_sequence_breakers``), applied by the engine.
    mirostat (dict, optional): ``{"tau", "eta"}``: sample with
        ``Sampler.mirostat_v2`` instead (llama.cpp's ``mirostat: 2``; the
        other truncation fields do not apply; greedy when ``temperature``
        is 0, as llama.cpp). Neither combines with ``logit_bias``,
        penalties or ``logprobs`` (the server refuses it).
    presence_penalty, frequency_penalty (float, optional): OpenAI's
        penalties over the generated tokens: ``logit[j] -= c[j] *
        frequency_penalty + (c[j] > 0) * presence_penalty`` where ``c[j]``
        counts token ``j`` in the output so far.
    response_format (dict, optional): OpenAI shape, as validated by the
        server: ``{"type": "json_object"}`` (output is a JSON object) or
        ``{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}`` (output is JSON valid against ``schema``; no schema:
        any JSON value); ``{"type": "text"}`` or absent: unconstrained.
        Applied with :mod:`tartlet.constraint` (``ctx.generate(...,
        constraint=...)``); compact JSON, generation ends when the value is
        complete (finish_reason ``"constraint"``).
    n (int, default 1): choices. With n > 1 the prompt is prefilled once
        (``flush``) and forked n times (KV pages shared); the forks generate
        concurrently, so the engine batches their steps. Fork ``k`` samples
        with seed ``seed + k`` (reproducible with a seed; with temperature 0
        all choices are equal).
    logprobs (int, optional): when present, each generated token's log
        probability and the ``logprobs`` most likely alternatives (0..20)
        are reported, under the distribution sampled from: the logits after
        ``logit_bias`` and penalties, divided by ``temperature`` (1 when
        greedy), before ``top_p``.

Without ``logit_bias`` and penalties the engine samples next to the logits
(greedy output is the ``text-completion`` inferlet's). With them each step
reads the raw logits (a ``logits`` output slot, the constraint's mask
applied by the host), adjusts them here and picks the token: argmax when
``temperature`` is 0, else a draw from ``softmax(logits / temperature)``
within ``top_p``. ``logprobs`` takes the same path (greedy output is then
still the argmax of the same logits; seeded draws use this module's RNG).

Speculative decoding: when the server configured it for the model
(``[[models]] speculative``, :attr:`Model.speculative`), a choice of ``n`` 1
sampled greedily or with a seed by the engine (no ``logprobs``,
``logit_bias``, penalties, Mirostat, ``response_format`` or forced tool
call) generates with :func:`tartlet.drafter.served_drafter`'s drafter: the
same tokens as without it, fewer passes when the output copies the prompt;
drafting stops for the rest of the choice when acceptance is low or the
engine is busy, and the choice then streams as any other (a host token
stream). A choice's ``speculative`` reports ``{"passes", "drafted",
"accepted", "stopped"}`` (None when not used).

Chat output is split into reasoning and content
(:class:`tartlet.tools.ReasoningSplitter`: ``<think>...</think>`` at the
start, or from the first token when the prompt opens ``<think>``).

Streams with ``session.send``, one JSON object per message: ``{"i": k,
"text": str, "logprobs": [entry]}`` as fork ``k`` produces text (``logprobs``
only when asked; an entry is ``{"token": str, "logprob": float, "top":
[[str, float], ...]}``, the tokens' strings concatenating to the text),
``{"i": k, "reasoning": str}`` for reasoning text, ``{"i": k, "tool_call":
{"index", "id", "name"} | {"index", "arguments"}}`` for tool calls (OpenAI
``delta.tool_calls`` items: id and name first, then argument pieces as they
are generated, also in ``auto`` mode; several calls get indices 0, 1, ...), and
``{"i": k, "finish_reason": str, "completion_tokens": int}`` when fork ``k``
ends (``tool_calls`` when it called tools). Returns ``{"choices": [{"text",
"reasoning", "tool_calls", "finish_reason", "completion_tokens",
"logprobs", "speculative"}], "prompt_tokens", "text", "finish_reason",
"completion_tokens"}`` (the last three: choice 0's text and finish reason,
the completion tokens of all choices; ``prompt_tokens``: every token the
model reads before the first generated one, the chat template's assistant
header included, counted once).

Raises:
    ValueError: an unknown response_format type, or an invalid schema (the
        grammar engine's message), before anything is generated.
"""

import asyncio
import heapq
import json
import math
import random

from tartlet import AnyJson, JsonSchema, Model, Sampler, forward, session
from tartlet.drafter import served_drafter
from tartlet.tools import ForcedToolCall, ReasoningSplitter, ToolCallStream, prompt_opens_reasoning, tool_format

_GOLDEN = 0x9E3779B97F4A7C15


class BiasedSampler(Sampler):
    """A sampler that reads the raw logits and applies ``logit_bias`` and
    the presence/frequency penalties before picking (see the module doc);
    with ``top_n`` (not None) it also records, per picked token, ``(logprob,
    [(id, logprob)] * top_n)`` in :attr:`record`."""

    def __init__(
        self, temperature: float, top_p: float, seed, bias: dict, presence: float, frequency: float, top_n: int | None = None,
    ) -> None:
        super().__init__(temperature=temperature, top_p=top_p, seed=seed)
        self.bias = bias
        self.presence = presence
        self.frequency = frequency
        self.top_n = top_n
        self.record: list[tuple[float, list[tuple[int, float]]]] = []
        self.counts: dict[int, int] = {}
        self.step = 0
        self._rng = random.Random(seed)

    @property
    def is_greedy(self) -> bool:
        return False

    def slot(self, index: int, step: int = 0) -> forward.OutputSlot:
        return forward.logits(index)

    def pick(self, result) -> int:
        logits = list(result)
        for t, b in self.bias.items():
            logits[t] += b
        for t, c in self.counts.items():
            logits[t] -= c * self.frequency + self.presence
        if self.temperature == 0:
            tok = max(range(len(logits)), key=logits.__getitem__)
        else:
            tok = self._draw(logits)
        if self.top_n is not None:
            self.record.append(self._logprobs(logits, tok))
        self.counts[tok] = self.counts.get(tok, 0) + 1
        self.step += 1
        return tok

    def _logprobs(self, logits: list, tok: int) -> tuple[float, list[tuple[int, float]]]:
        t = self.temperature or 1.0
        m = max(logits)
        lse = math.log(math.fsum(math.exp((x - m) / t) for x in logits if x != -math.inf))
        top = heapq.nlargest(self.top_n, range(len(logits)), key=logits.__getitem__) if self.top_n else []
        return (logits[tok] - m) / t - lse, [(i, (logits[i] - m) / t - lse) for i in top if logits[i] != -math.inf]

    def _draw(self, logits: list) -> int:
        t = self.temperature
        m = max(logits)
        cand = [(math.exp((x - m) / t), i) for i, x in enumerate(logits) if x != -math.inf]
        cand.sort(reverse=True)
        total = sum(p for p, _ in cand)
        kept, acc = [], 0.0
        for p, i in cand:
            if acc >= self.top_p * total:
                break
            kept.append((p, i))
            acc += p
        rng = random.Random((self.seed + self.step * _GOLDEN) % 2**63) if self.seed is not None else self._rng
        r = rng.random() * acc
        for p, i in kept:
            r -= p
            if r <= 0:
                return i
        return kept[-1][1]


def make_sampler(args: dict, seed=None) -> Sampler:
    temperature = float(args.get("temperature", 0.0))
    top_p = float(args.get("top_p", 1.0))
    bias = {int(k): float(v) for k, v in (args.get("logit_bias") or {}).items() if float(v) != 0}
    presence = float(args.get("presence_penalty") or 0.0)
    frequency = float(args.get("frequency_penalty") or 0.0)
    top_n = args.get("logprobs")
    if top_n is None and not bias and presence == 0 and frequency == 0:
        miro = args.get("mirostat")
        if miro is not None and temperature > 0:
            return Sampler.mirostat_v2(float(miro["tau"]), eta=float(miro["eta"]), temperature=temperature, seed=seed)
        extra = {} if miro is not None else dict(args.get("sampler") or {})
        return Sampler(temperature=temperature, top_p=top_p, seed=seed, **extra)
    return BiasedSampler(temperature, top_p, seed, bias, presence, frequency, None if top_n is None else int(top_n))


def make_constraint(rf, model: str):
    """The constraint for an OpenAI ``response_format`` (None: none)."""
    if not rf or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return JsonSchema({"type": "object"}, model)
    if rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        return AnyJson(model) if schema is None else JsonSchema(schema, model)
    raise ValueError(f"response_format type {rf.get('type')!r} is not supported (text, json_object, json_schema)")


def tool_mode(args: dict):
    """``(forced, name)``: whether a call is forced, and the forced tool's name."""
    choice = args.get("tool_choice", "auto") if args.get("tools") else "none"
    if isinstance(choice, dict):
        return True, choice["name"]
    return choice == "required", None


async def run_forced_call(k: int, ctx, args: dict, sampler, name) -> dict:
    """Choice ``k`` as one forced tool call, streaming its deltas."""
    forced = ForcedToolCall(ctx, args["tools"], name=name, sampler=sampler, max_tokens=int(args.get("max_tokens", 256)),
                            adapter=args.get("adapter"))
    async for delta in forced:
        session.send(json.dumps({"i": k, "tool_call": delta}))
    gen = forced.generator
    calls = [{"id": forced.call.id, "name": forced.call.name, "arguments": forced.call.arguments}] if forced.call else []
    session.send(json.dumps({"i": k, "finish_reason": forced.finish_reason, "completion_tokens": len(gen.tokens)}))
    return {"text": "", "reasoning": None, "tool_calls": calls, "finish_reason": forced.finish_reason,
            "completion_tokens": len(gen.tokens), "logprobs": None, "speculative": None}


def speculation(gen, drafter) -> dict | None:
    """What speculative decoding did for a choice (None: not used):
    ``passes`` (forward passes while drafting), ``drafted`` and ``accepted``
    draft tokens, ``stopped`` (None, ``"load"`` or ``"acceptance"``: see
    :class:`tartlet.drafter.AdaptiveDrafter`)."""
    if drafter is None:
        return None
    return {"passes": drafter.passes, "drafted": gen.stats.drafted, "accepted": gen.stats.accepted, "stopped": drafter.stopped}


async def run_choice(k: int, ctx, args: dict, model, constraint) -> dict:
    """Generate choice ``k`` on ``ctx``, streaming its messages."""
    seed = args.get("seed")
    sampler = make_sampler(args, None if seed is None else seed + k)
    forced, name = tool_mode(args)
    if forced:
        return await run_forced_call(k, ctx, args, sampler, name)
    chat = "messages" in args
    splitter = ReasoningSplitter(prompt_opens_reasoning(ctx.chat_text)) if chat else None
    calls_stream = ToolCallStream(tool_format(model)) if args.get("tools") and args.get("tool_choice", "auto") == "auto" else None
    reasoning_parts: list = []
    content_parts: list = []
    pending: list = []  # tool-call deltas found in the current step, sent after its text

    def route(reasoning: str, text: str) -> str:
        if reasoning:
            reasoning_parts.append(reasoning)
            session.send(json.dumps({"i": k, "reasoning": reasoning}))
        if calls_stream is not None:
            shown = []
            for e in calls_stream.feed(text):
                if "content" in e:
                    shown.append(e["content"])
                else:
                    pending.append(e)
            text = "".join(shown)
        content_parts.append(text)
        return text

    def send_calls() -> None:
        for d in pending:
            session.send(json.dumps({"i": k, "tool_call": d}))
        pending.clear()
    want_lp = args.get("logprobs") is not None
    # the server's speculative decoding ([[models]] speculative) for one choice the engine samples greedily or
    # seeded (None otherwise: logprobs, bias, penalties, Mirostat); off for good once it stops paying
    drafter = served_drafter(model, sampler) if int(args.get("n", 1)) == 1 and constraint is None else None
    gen = ctx.generate(
        sampler, max_tokens=int(args.get("max_tokens", 256)), stop=args.get("stop") or None, constraint=constraint,
        eos=not args.get("ignore_eos", False), overlap=True,  # the next pass runs while this step is sent
        adapter=args.get("adapter"), drafter=drafter,
    )
    names: dict[int, str] = {}

    def name(t: int) -> str:
        if t not in names:
            names[t] = model.detokenize([t])
        return names[t]

    entries: list[tuple[int, dict]] = []  # (start offset in the decoded text, entry)
    sent = emitted = raw_len = 0
    async for step in gen:
        if want_lp:  # one token per step (no drafter): its text is what it added to the decoded text
            raw = gen._raw
            for j, (lp, top) in enumerate(sampler.record[len(entries):]):
                text = raw[raw_len:] if j == 0 else ""
                entries.append((raw_len, {"token": text, "logprob": lp, "top": [[name(i), v] for i, v in top]}))
            raw_len = len(raw)
        emitted += len(step.text)
        shown = route(*splitter.push(step.text)) if splitter is not None else step.text
        ready = []
        while sent + len(ready) < len(entries) and entries[sent + len(ready)][0] < emitted:
            ready.append(entries[sent + len(ready)][1])
        if shown or ready:
            msg: dict = {"i": k, "text": shown}
            if want_lp:
                msg["logprobs"] = ready
                sent += len(ready)
            session.send(json.dumps(msg))
        send_calls()
    text, finish, calls = gen.text, gen.finish_reason, []
    if splitter is not None:
        tail = route(*splitter.finish())
        if calls_stream is not None:
            for e in calls_stream.end():
                if "content" in e:
                    content_parts.append(e["content"])
                    tail += e["content"]
                else:
                    pending.append(e)
            calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls_stream.calls]
            if calls:  # cut inside a call's arguments: length, as OpenAI
                finish = "length" if calls_stream.cut else "tool_calls"
        if tail:
            session.send(json.dumps({"i": k, "text": tail}))
        send_calls()
        text = "".join(content_parts)
    choice = {"text": text, "reasoning": "".join(reasoning_parts) if splitter is not None and splitter.saw_reasoning else None,
              "tool_calls": calls, "finish_reason": finish, "completion_tokens": len(gen.tokens), "logprobs": None,
              "speculative": speculation(gen, drafter)}
    if want_lp:
        choice["logprobs"] = [e for off, e in entries if off < len(gen.text)]
    session.send(json.dumps({"i": k, "finish_reason": finish, "completion_tokens": len(gen.tokens)}))
    return choice


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    n = int(args.get("n", 1))
    if not 1 <= n <= 64:
        raise ValueError(f"n must be in 1..64, got {n}")
    constraint = make_constraint(args.get("response_format"), model.name)
    forks: list = []
    try:
        with model.new_context() as ctx:
            if "messages" in args:
                if args.get("tools") and args.get("tool_choice", "auto") != "none":
                    ctx.set_tools(args["tools"])
                for m in args["messages"]:
                    ctx.add_message(m)
                ctx.begin_assistant()  # the header is part of what the model reads
            elif "prompt_tokens" in args:
                ctx.fill_tokens(args["prompt_tokens"])
            else:
                ctx.fill(args["prompt"])
            prompt_tokens = ctx.seq_len
            if n == 1:
                choices = [await run_choice(0, ctx, args, model, constraint)]
            else:
                await ctx.flush(adapter=args.get("adapter"))  # the prompt is computed once, then shared by the forks
                forks = [ctx.fork() for _ in range(n)]
                cons = [constraint] + [constraint.fork() for _ in range(n - 1)] if constraint is not None else [None] * n
                try:
                    choices = list(await asyncio.gather(*(run_choice(k, f, args, model, c) for k, (f, c) in enumerate(zip(forks, cons)))))
                finally:
                    for c in cons[1:]:
                        if c is not None:
                            c.close()
            return {
                "choices": choices,
                "text": choices[0]["text"],
                "finish_reason": choices[0]["finish_reason"],
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sum(c["completion_tokens"] for c in choices),
            }
    finally:
        for f in forks:
            f.close()
        if constraint is not None:
            constraint.close()

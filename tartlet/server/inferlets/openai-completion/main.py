"""openai-completion: the inferlet behind ``/v1/chat/completions`` and
``/v1/completions``.

Args:
    messages (list of {role, content}): chat mode, rendered with the model's
        chat template exactly as ``text-completion`` renders its
        ``system``/``prompt`` (one SDK call per message).
    prompt (str): completion mode, filled as raw text (``text-completion
        --raw``).
    prompt_tokens (list of int): completion mode, token ids filled as they
        are (instead of ``prompt``).
    max_tokens (int), temperature (float, 0 = greedy), top_p (float),
    seed (int), stop (list of str), model (str).
    logit_bias (dict, optional): token id (int or its decimal string) ->
        bias added to that token's logit before sampling (OpenAI's
        ``logit_bias``; -100/100 in effect ban/force a token).
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

Without ``logit_bias`` and penalties the engine samples next to the logits
(greedy output is the ``text-completion`` inferlet's). With them each step
reads the raw logits (a ``logits`` output slot, the constraint's mask
applied by the host), adjusts them here and picks the token: argmax when
``temperature`` is 0, else a draw from ``softmax(logits / temperature)``
within ``top_p``.

Streams the text with ``session.send``; returns ``{"text", "finish_reason",
"prompt_tokens", "completion_tokens"}`` (``prompt_tokens``: every token the
model reads before the first generated one, the chat template's assistant
header included).

Raises:
    ValueError: an unknown response_format type, or an invalid schema (the
        grammar engine's message), before anything is generated.
"""

import math
import random

from tartlet import AnyJson, JsonSchema, Model, Sampler, session

_GOLDEN = 0x9E3779B97F4A7C15


class BiasedSampler(Sampler):
    """A sampler that reads the raw logits and applies ``logit_bias`` and
    the presence/frequency penalties before picking (see the module doc)."""

    def __init__(self, temperature: float, top_p: float, seed, bias: dict, presence: float, frequency: float) -> None:
        super().__init__(temperature=temperature, top_p=top_p, seed=seed)
        self.bias = bias
        self.presence = presence
        self.frequency = frequency
        self.counts: dict[int, int] = {}
        self.step = 0
        self._rng = random.Random(seed)

    @property
    def is_greedy(self) -> bool:
        return False

    def slot(self, index: int, step: int = 0) -> dict:
        return {"index": index, "kind": "logits"}

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
        self.counts[tok] = self.counts.get(tok, 0) + 1
        self.step += 1
        return tok

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


def make_sampler(args: dict) -> Sampler:
    temperature = float(args.get("temperature", 0.0))
    top_p = float(args.get("top_p", 1.0))
    seed = args.get("seed")
    bias = {int(k): float(v) for k, v in (args.get("logit_bias") or {}).items() if float(v) != 0}
    presence = float(args.get("presence_penalty") or 0.0)
    frequency = float(args.get("frequency_penalty") or 0.0)
    if not bias and presence == 0 and frequency == 0:
        return Sampler(temperature=temperature, top_p=top_p, seed=seed)
    return BiasedSampler(temperature, top_p, seed, bias, presence, frequency)


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


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    sampler = make_sampler(args)
    constraint = make_constraint(args.get("response_format"), model.name)
    try:
        with model.new_context() as ctx:
            if "messages" in args:
                for m in args["messages"]:
                    getattr(ctx, m["role"])(m["content"])
                ctx.begin_assistant()  # the header is part of what the model reads
            elif "prompt_tokens" in args:
                ctx.fill_tokens(args["prompt_tokens"])
            else:
                ctx.fill(args["prompt"])
            prompt_tokens = ctx.seq_len
            gen = ctx.generate(
                sampler, max_tokens=int(args.get("max_tokens", 256)), stop=args.get("stop") or None, constraint=constraint,
                eos=not args.get("ignore_eos", False),
            )
            async for step in gen:
                if step.text:
                    session.send(step.text)
            return {
                "text": gen.text,
                "finish_reason": gen.finish_reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(gen.tokens),
            }
    finally:
        if constraint is not None:
            constraint.close()

"""prefix-cache: prefill a long system prompt once, answer many questions.

The first run prefills the system prompt and saves its KV cache as a named
snapshot (``ctx.save``). Every question is then answered from a fork of that
snapshot (``Context.open``), so only the question's own tokens are
prefilled. Snapshots outlive the inferlet: a later run with the same system
prompt (or the same ``snapshot`` name) finds the snapshot and skips the
system prefill entirely.

Args:
    system (str, required): the shared system prompt.
    questions (list[str] or str, required): user questions, answered
        concurrently (their decode steps share batches).
    snapshot (str): snapshot name (default: ``prefix-cache-`` + the first 16
        hex digits of the SHA-256 of ``system``).
    max_tokens (int, default 64): per answer.
    delete (bool, default false): delete the snapshot before returning.

Output: with one question the answer streams token by token; with several,
each answer is sent whole (``Q: ...`` / ``A: ...``) when it completes.

Returns ``{"answers": [str], "tokens": [[int]], "snapshot": str,
"created": bool, "system_tokens": int, "question_tokens": [int],
"prefill_tokens_computed": int, "prefill_tokens_saved": int}``;
``question_tokens[i]`` is what question ``i`` prefilled on top of the
snapshot; ``prefill_tokens_saved`` is what answering every question from
scratch would have prefilled in addition.
"""

import asyncio
import hashlib

from tartlet import Context, Model, SnapshotError, session


async def main(args: dict) -> dict:
    system = args.get("system")
    if not isinstance(system, str) or not system:
        raise ValueError("prefix-cache needs a non-empty string argument `system` (the shared system prompt)")
    questions = args.get("questions")
    if isinstance(questions, str):
        questions = [questions]
    if not isinstance(questions, list) or not questions or not all(isinstance(q, str) and q for q in questions):
        raise ValueError("prefix-cache needs `questions`: a non-empty list of non-empty strings")
    name = args.get("snapshot") or "prefix-cache-" + hashlib.sha256(system.encode()).hexdigest()[:16]
    max_tokens = int(args.get("max_tokens", 64))
    model = Model.load(args.get("model"))
    messages = [{"role": "system", "content": system}]

    created = False
    try:
        base = Context.open(model, name)
    except SnapshotError:  # no snapshot yet: prefill once and save it
        with model.new_context() as ctx:
            ctx.system(system)
            await ctx.flush()
            try:
                ctx.save(name)
                created = True
            except SnapshotError:
                pass  # another instance saved it first; use theirs
        base = Context.open(model, name)
    with base:
        base.adopt_chat(messages)
        system_tokens = base.seq_len
        stream = len(questions) == 1

        async def answer(q: str) -> tuple:
            with base.fork() as ctx:
                ctx.user(q)
                gen = ctx.generate(max_tokens=max_tokens)
                q_tokens = None
                async for step in gen:
                    if q_tokens is None:  # after the first pass: prompt in the KV cache
                        q_tokens = ctx.kv_len - system_tokens
                    if stream and step.text:
                        session.send(step.text)
                if not stream:
                    session.send(f"Q: {q}\nA: {gen.text}\n")
                return gen, q_tokens

        results = await asyncio.gather(*(answer(q) for q in questions))
    if args.get("delete"):
        Context.delete(model, name)
    q_tokens = [qt for _, qt in results]
    computed = sum(q_tokens) + (system_tokens if created else 0)
    return {
        "answers": [g.text for g, _ in results],
        "tokens": [g.tokens for g, _ in results],
        "snapshot": name,
        "created": created,
        "system_tokens": system_tokens,
        "question_tokens": q_tokens,
        "prefill_tokens_computed": computed,
        "prefill_tokens_saved": system_tokens * len(questions) + sum(q_tokens) - computed,
    }

"""parallel-generation: N continuations of one prompt, generated together.

The prompt is prefilled once (``flush``); ``fork()`` then makes N contexts
that share its full KV pages (only the partly filled last page is copied).
The N generators run concurrently with ``asyncio.gather``, so the engine
batches their decode steps into the same model calls.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    n (int, default 4): number of forks (1..64).
    max_tokens (int, default 64): per fork.
    temperature (float, default 0.8): 0 gives N identical greedy answers.
    top_p (float, default 0.95), seed (int, default 0): fork ``i`` samples
        with seed ``seed + i``.
    ignore_eos (bool, default false): always generate ``max_tokens``.

Returns ``{"texts": [str], "tokens": [[int]], "finish_reasons": [str],
"prompt_tokens": int, "fork_stats": [{"tokens", "pages", "live_pages",
"shared_pages"}]}``; ``fork_stats`` is each fork's KV right after the fork
(``shared_pages``: pages it shares with the prompt and its siblings).
"""

import asyncio

from tartlet import Model, Sampler, session


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("parallel-generation needs a non-empty string argument `prompt`")
    n = int(args.get("n", 4))
    if not 1 <= n <= 64:
        raise ValueError(f"parallel-generation: n must be in 1..64, got {n}")
    max_tokens = int(args.get("max_tokens", 64))
    temperature = float(args.get("temperature", 0.8))
    top_p = float(args.get("top_p", 0.95))
    seed = int(args.get("seed", 0))
    model = Model.load(args.get("model"))

    with model.new_context() as root:
        if args.get("system"):
            root.system(args["system"])
        root.user(prompt)
        root.begin_assistant()  # the assistant header is part of the shared prefix
        await root.flush()
        prompt_tokens = root.kv_len
        forks = [root.fork() for _ in range(n)]
        try:
            fork_stats = list(await asyncio.gather(*(f.stats() for f in forks)))

            async def one(i: int):
                sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed + i)
                gen = forks[i].generate(sampler, max_tokens=max_tokens, eos=not args.get("ignore_eos", False))
                await gen.collect_text()
                return gen

            gens = await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            for f in forks:
                f.close()
    for i, g in enumerate(gens):
        session.send(f"[{i}] {g.text}\n")
    return {
        "texts": [g.text for g in gens],
        "tokens": [g.tokens for g in gens],
        "finish_reasons": [g.finish_reason for g in gens],
        "prompt_tokens": prompt_tokens,
        "fork_stats": fork_stats,
    }

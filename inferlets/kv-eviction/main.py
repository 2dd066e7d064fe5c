"""kv-eviction: generate under a KV-cache budget with an eviction policy.

The prompt is prefilled and then decoded while a policy of
``tartlet.kv_eviction`` keeps at most ``budget`` tokens of the KV cache
visible: evicted tokens are hidden with ``ctx.mask_token_range`` and every
full page left without a kept token is freed with ``ctx.drop_masked_pages``.
Methods (see docs/sdk.md, "KV eviction"): ``window`` (StreamingLLM: the
first ``sink`` tokens and the latest ones), ``h2o`` (heavy hitters by
cumulative attention + ``recent`` latest tokens), ``snapkv`` (the prompt
compressed by the votes of its last ``window`` tokens, pooled with
``kernel_size``), ``tova`` (the token the current query attends to least
is evicted each step). Memory is held in pages: a page is freed only once
all its tokens are evicted, so ``peak_live_pages`` can exceed
``ceil(budget / page_size)``.

Args:
    prompt (str, required): the user message.
    method (str, default "h2o"): window, h2o, snapkv or tova.
    budget (int, default 128): KV tokens kept visible (>= 1).
    max_tokens (int, default 128).
    ignore_eos (bool, default false): keep generating past end-of-sequence.
    sink (int, default 4 for window, 0 for the others): leading tokens never evicted.
    recent (int, default budget // 2): h2o only: latest tokens kept.
    score (str, default "sum"): h2o only: rank by the cumulative attention
        ("sum", the paper) or by it over the queries that saw the token ("mean").
    heads (str, default "sum"): h2o, snapkv, tova: per-head scores summed
        or their max ("max").
    window (int, default min(32, budget)): snapkv only: observation window.
    kernel_size (int, default 7): snapkv only: pooling kernel (odd).
    pooling (str, default "max"): snapkv only: max or avg.
    layers (list of int, default all): h2o, snapkv, tova: layers whose scores count.
    chunk (int, default 1): h2o, snapkv, tova: evict whole chunks of this many
        positions (ChunkKV; the page size frees a page per chunk evicted).

Returns ``{"text", "tokens", "finish_reason", "method", "budget",
"kept_tokens", "evicted", "dropped_pages", "peak_live_pages", "page_size",
"final_stats": {"tokens", "pages", "live_pages", "shared_pages"}}``.
"""

from tartlet import Model, Sampler, kv_eviction, session

OPTIONS = ("sink", "recent", "score", "heads", "window", "kernel_size", "pooling", "layers", "chunk")


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("kv-eviction needs a non-empty string argument `prompt`")
    method = args.get("method", "h2o")
    options = {k: args[k] for k in OPTIONS if k in args}
    policy = kv_eviction.make_policy(method, args.get("budget", 128), **options)
    max_tokens = args.get("max_tokens", 128)
    model = Model.load(args.get("model"))
    tokens: list[int] = []
    sent = ""
    with model.new_context() as ctx:
        ctx.user(prompt)
        ctx.begin_assistant()
        eos = not args.get("ignore_eos", False)
        async for tok in policy.generate(ctx, Sampler.greedy(), max_tokens=max_tokens, eos=eos):
            tokens.append(tok)
            shown = model.detokenize(tokens)
            if shown.startswith(sent) and not shown.endswith("\ufffd"):  # whole characters only
                session.send(shown[len(sent):])
                sent = shown
        final = await ctx.stats()
    stopped = bool(tokens) and tokens[-1] in model.eos_token_ids and eos
    text = model.detokenize(tokens[:-1] if stopped else tokens)
    session.send(f"\n[{method}: {policy.kept_tokens} tokens kept of budget {policy.budget}; "
                 f"live KV pages peak {policy.peak_pages}; {policy.dropped_pages} pages dropped]\n")
    return {
        "text": text,
        "tokens": tokens,
        "finish_reason": "eos" if stopped else "length",
        "method": method,
        "budget": policy.budget,
        "kept_tokens": policy.kept_tokens,
        "evicted": policy.evicted,
        "dropped_pages": policy.dropped_pages,
        "peak_live_pages": policy.peak_pages,
        "page_size": model.page_size,
        "final_stats": final,
    }

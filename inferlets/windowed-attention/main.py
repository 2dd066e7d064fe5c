"""windowed-attention: sliding-window attention with attention sinks.

After every generation step the tokens between the first ``sink`` tokens
(the attention sinks of StreamingLLM, Xiao et al., ICLR 2024) and the last
``window`` tokens are hidden with ``ctx.mask_token_range``; pages whose
tokens are all hidden are freed with ``ctx.drop_masked_pages``. Attention
then spans at most ``sink + window`` tokens and the live KV pages stay under
``ceil(sink / page_size) + ceil(window / page_size) + 1`` however long the
generation runs. RoPE positions keep counting (they are not re-indexed).

Args:
    prompt (str, required): the user message.
    window (int, default 64): recent tokens kept visible (>= 1).
    sink (int, default 4): leading tokens kept visible (>= 0).
    max_tokens (int, default 256).
    ignore_eos (bool, default false): keep generating past end-of-sequence.

Returns ``{"text", "tokens", "finish_reason", "window", "sink",
"page_size", "page_bound", "peak_live_pages", "dropped_pages",
"final_stats": {"tokens", "pages", "live_pages", "shared_pages"}}``.
"""

from tartlet import Model, session


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("windowed-attention needs a non-empty string argument `prompt`")
    window = int(args.get("window", 64))
    sink = int(args.get("sink", 4))
    if window < 1 or sink < 0:
        raise ValueError(f"windowed-attention: need window >= 1 and sink >= 0, got window={window}, sink={sink}")
    max_tokens = int(args.get("max_tokens", 256))
    model = Model.load(args.get("model"))
    ps = model.page_size
    bound = -(-sink // ps) + -(-window // ps) + 1

    peak = 0
    dropped = 0
    with model.new_context() as ctx:
        ctx.user(prompt)
        gen = ctx.generate(max_tokens=max_tokens, eos=not args.get("ignore_eos", False))
        hidden_to = sink  # tokens [sink, hidden_to) are masked
        async for step in gen:
            if step.text:
                session.send(step.text)
            lo = ctx.kv_len - window
            if lo > hidden_to:
                ctx.mask_token_range(hidden_to, lo)
                hidden_to = lo
                dropped += await ctx.drop_masked_pages()
            stats = await ctx.stats()
            peak = max(peak, stats["live_pages"])
        final = await ctx.stats()
    session.send(f"\n[live KV pages: peak {peak}, bound {bound}; {dropped} pages dropped]\n")
    return {
        "text": gen.text,
        "tokens": gen.tokens,
        "finish_reason": gen.finish_reason,
        "window": window,
        "sink": sink,
        "page_size": ps,
        "page_bound": bound,
        "peak_live_pages": peak,
        "dropped_pages": dropped,
        "final_stats": final,
    }

"""cfg-guidance: classifier-free guidance (Sanchez et al. 2023, "Stay on
topic with Classifier-Free Guidance", arXiv:2306.17806).

Two contexts decode in lockstep: the conditional one holds the prompt, the
unconditional one a negative prompt (by default an empty user turn; with
``raw``, the prompt's last token, as Hugging Face's
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` does). Each step runs
both passes at once (:func:`tartlet.guidance.guided_logits`: the engine
batches them), combines the logits as ``u + w (c - u)``, picks a token from
the guided logits and appends it to both contexts. ``w = 1`` is plain
conditional decoding; ``w > 1`` strengthens what the prompt adds over the
negative prompt.

Args:
    prompt (str, required): the user message (or raw text with ``raw``).
    negative_prompt (str, default ""): the unconditional context's user
        message (or raw text); what the output should move away from.
    guidance_scale (float, default 1.5): ``w``.
    system (str): optional system message of the conditional context.
    raw (bool): fill the prompts as they are, without the chat template.
    max_tokens (int, default 64), temperature (float, default 0 = greedy),
    top_p (float, default 1), seed (int), model (str),
    ignore_eos (bool): keep going past end-of-sequence tokens.

Returns ``{"text", "tokens", "finish_reason", "guidance_scale"}``.
"""

import random

from tartlet import Model, session
from tartlet.guidance import guided_logits, pick
from tartlet.sampler import step_seed


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("cfg-guidance needs a non-empty string argument `prompt`")
    negative = args.get("negative_prompt", "")
    if not isinstance(negative, str):
        raise ValueError("cfg-guidance: `negative_prompt` must be a string")
    scale = float(args.get("guidance_scale", 1.5))
    max_tokens = int(args.get("max_tokens", 64))
    temperature = float(args.get("temperature", 0.0))
    top_p = float(args.get("top_p", 1.0))
    seed = args.get("seed")
    model = Model.load(args.get("model"))
    raw = bool(args.get("raw")) or not model.has_chat_template
    with model.new_context() as cond, model.new_context() as uncond:
        if raw:
            cond.fill(prompt)
            if negative:
                uncond.fill(negative)
            else:
                uncond.fill_tokens([cond.pending[-1]])
        else:
            if args.get("system"):
                cond.system(args["system"])
            cond.user(prompt)
            cond.begin_assistant()
            uncond.user(negative)
            uncond.begin_assistant()
        rng = random.Random(seed)
        eos = set(model.eos_token_ids)
        tokens: list[int] = []
        finish = "length"
        sent = ""
        for step in range(max_tokens):
            logits = await guided_logits(cond, uncond, scale)
            if seed is not None:
                rng = random.Random(step_seed(int(seed), step))
            tok = pick(logits, temperature, top_p, rng)
            tokens.append(tok)
            if tok in eos and not args.get("ignore_eos"):
                finish = "eos"
                break
            cond.fill_tokens([tok])
            uncond.fill_tokens([tok])
            text = model.detokenize([t for t in tokens if t not in eos])
            if not text.endswith("\ufffd") and text.startswith(sent) and len(text) > len(sent):
                session.send(text[len(sent):])
                sent = text
        text = model.detokenize([t for t in tokens if t not in eos])
        if len(text) > len(sent) and text.startswith(sent):
            session.send(text[len(sent):])
        return {"text": text, "tokens": tokens, "finish_reason": finish, "guidance_scale": scale}

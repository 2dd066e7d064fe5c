"""adapter-tune: improve a LoRA adapter on a few examples with forward passes only.

Zeroth-order tuning as MeZO does it (Malladi et al., 2023, "Fine-Tuning
Language Models with Just Forward Passes", Algorithm 1; SPSA, Spall 1992):
each step draws a direction ``z`` (standard normal over every ``A`` and
``B`` of the adapter) from a seed, evaluates the loss at ``theta + eps z`` and
``theta - eps z``, estimates the directional derivative ``g = (L+ - L-) / (2
eps)`` and moves ``theta <- theta - lr * g * z``. With ``directions`` > 1 the
step averages that many such estimates (each its own ``z``).

Here ``theta`` is a fork of the starting adapter (:meth:`tartlet.Adapter.fork`);
the two perturbed copies are forks of it moved by
:meth:`~tartlet.Adapter.perturb` (the host draws ``z`` from the seed, so no
weights cross between inferlet and host), evaluated concurrently: every
example under both copies lands in the same model calls. The loss is the
mean, over the examples, of the mean negative log-probability of the
answer's tokens (the assistant turn, end-of-turn markup included) given the
prompt, read teacher-forced from ``logprobs`` output slots of one forward
pass per example (:func:`tartlet.forward.logprobs`).

Cost per step: ``2 * directions * len(examples)`` forward passes (each a
prefill of one example's whole chat text: the prompt cannot be cached
across copies, since every layer's KV depends on the adapter), ``2 *
directions`` forks and ``3 * directions`` perturbations (one normal
draw per adapter weight each); plus ``len(examples)`` passes for each exact
loss reported (``initial_loss``, ``final_loss``).

Args:
    adapter (str, required): the adapter to start from (served, or saved by
        this user).
    examples (list, required): ``{"prompt": str, "answer": str}`` objects
        (a user message and the assistant reply it should get), 1 to 64.
    system (str): a system message before each prompt.
    steps (int, default 20): MeZO steps.
    lr (float, default 5e-4): learning rate.
    eps (float, default 1e-2): perturbation scale.
    directions (int, default 1): directions averaged per step.
    seed (int, default 0): the seeds of the directions derive from it.
    reset (bool, default false): start from the adapter with every ``B``
        set to zero (the base model, as PEFT initialises a new LoRA: ``A``
        kept, ``B = 0``).
    save (str): save the tuned adapter under this name (the user's
        namespace; usable as ``BASE:NAME`` over the OpenAI routes).

Returns ``{"losses": [per-step estimate (L+ + L-) / 2], "initial_loss",
"final_loss", "saved": name or None, "forward_passes": int, "steps",
"parameters": int}``; each step's loss is also sent to the session as a
line ``step N loss X``.
"""

import asyncio
import random

from tartlet import Model, forward, session

MAX_EXAMPLES = 64


def _examples(model, args: dict) -> list[tuple[list[int], list[int]]]:
    """``(prompt tokens, answer tokens)`` per example: the chat template's
    rendering of the prompt with the generation prompt, and what the whole
    exchange adds after it."""
    examples = args.get("examples")
    if not isinstance(examples, list) or not 1 <= len(examples) <= MAX_EXAMPLES:
        raise ValueError(f"adapter-tune needs `examples`: a list of 1 to {MAX_EXAMPLES} {{prompt, answer}} objects")
    system = args.get("system")
    out = []
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict) or not isinstance(ex.get("prompt"), str) or not isinstance(ex.get("answer"), str) \
                or not ex["answer"]:
            raise ValueError(f"examples[{i}] must be an object with string `prompt` and non-empty `answer`")
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": ex["prompt"]}]
        prompt = model.tokenize(model.apply_chat_template(msgs))
        whole = model.tokenize(model.apply_chat_template(msgs + [{"role": "assistant", "content": ex["answer"]}],
                                                         add_generation_prompt=False))
        if whole[: len(prompt)] != prompt or len(whole) <= len(prompt):
            raise ValueError(f"examples[{i}]: the chat template does not render the answer after the prompt")
        out.append((prompt, whole[len(prompt):]))
    return out


def _number(args: dict, key: str, default: float, kind=float, low: float = 0.0) -> float:
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) or not v > low:
        raise ValueError(f"adapter-tune: `{key}` must be a {'whole ' if kind is int else ''}number > {low}, got {v!r}")
    return kind(v)


async def main(args: dict) -> dict:
    name = args.get("adapter")
    if not isinstance(name, str) or not name:
        raise ValueError("adapter-tune needs `adapter`: the name of the adapter to start from")
    model = Model.load(args.get("model"))
    examples = _examples(model, args)
    steps = _number(args, "steps", 20, int, -1)
    lr = _number(args, "lr", 5e-4)
    eps = _number(args, "eps", 1e-2)
    directions = _number(args, "directions", 1, int)
    seeds = random.Random(_number(args, "seed", 0, int, -1))
    passes = 0

    async def loss(adapter) -> float:
        """Mean over the examples of the mean -log P(answer token | before it)."""
        nonlocal passes

        async def one(prompt: list[int], answer: list[int]) -> float:
            ids = prompt + answer
            slots = [forward.logprobs(j, [ids[j + 1]]) for j in range(len(prompt) - 1, len(ids) - 1)]
            with model.new_context() as ctx:
                lps = await ctx.forward(ids[:-1], outputs=slots, adapter=adapter)
            return -sum(lp[0] for lp in lps) / len(answer)

        passes += len(examples)
        per = await asyncio.gather(*(one(p, a) for p, a in examples))
        return sum(per) / len(per)

    theta = model.adapter(name).fork()
    try:
        if args.get("reset"):
            for m in theta.modules():
                theta.set(m.name, B=bytes(4 * m.out_features * m.rank))
        initial = await loss(theta)
        losses = []
        for step in range(steps):
            dirs = [seeds.getrandbits(63) for _ in range(directions)]

            async def estimate(seed: int) -> tuple[float, float]:
                with theta.fork() as plus, theta.fork() as minus:
                    plus.perturb(seed, eps)
                    minus.perturb(seed, -eps)
                    return tuple(await asyncio.gather(loss(plus), loss(minus)))

            pairs = await asyncio.gather(*(estimate(s) for s in dirs))
            for seed, (lp, lm) in zip(dirs, pairs):
                g = (lp - lm) / (2 * eps)  # the projected gradient along z
                theta.perturb(seed, -lr * g / directions)
            losses.append(sum(lp + lm for lp, lm in pairs) / (2 * len(pairs)))
            session.send(f"step {step + 1} loss {losses[-1]:.4f}\n")
        final = await loss(theta)
        saved = None
        if args.get("save"):
            saved = theta.save(args["save"]).name
        n_params = sum(m.rank * (m.in_features + m.out_features) for m in theta.modules())
    finally:
        theta.drop()
    session.send(f"loss {initial:.4f} -> {final:.4f} in {steps} steps ({passes} forward passes)\n")
    return {"losses": losses, "initial_loss": initial, "final_loss": final, "saved": saved, "forward_passes": passes,
            "steps": steps, "parameters": n_params}

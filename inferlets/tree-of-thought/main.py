"""tree-of-thought: explore reasoning steps as a tree of forked contexts.

Breadth-first Tree of Thoughts (Yao et al., NeurIPS 2023). The problem is
prefilled once. At each level every kept node is forked ``breadth`` times;
each child samples one reasoning step (one line). A judge then scores each
child in a further fork: the judge question is appended after the child's
steps and one forward pass reads the log-probabilities of "yes" and "no"
(:func:`tartlet.forward.logprobs`); the score is ``log P(yes) - log P(no)``.
The ``keep`` best children become the next level. Forks share the KV pages
of their common prefix, so a node's steps are prefilled once for all its
descendants and judges.

Args:
    prompt (str, required): the question to reason about (alias: ``problem``).
    depth (int, default 2): reasoning steps per path (1..6).
    breadth (int, default 2): children per node (1..8).
    keep (int, default 2): nodes kept per level (1..8).
    step_tokens (int, default 32): longest step, in tokens.
    temperature (float, default 0.8), seed (int, default 0).

Returns ``{"answer": str (the best path's steps, one per line), "score",
"path": [node id], "nodes": [{"id", "parent", "depth", "text", "score"}]}``;
node 0 is the root (the problem).
"""

import asyncio
import math

from tartlet import Model, Sampler, forward, session

JUDGE = "Are the reasoning steps above correct and useful so far? Answer yes or no."
_MARK = "\x00THOUGHTS\x00"


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


async def main(args: dict) -> dict:
    problem = args.get("prompt", args.get("problem"))
    if not isinstance(problem, str) or not problem:
        raise ValueError("tree-of-thought needs a non-empty string argument `prompt` (or its alias `problem`)")
    depth = int(args.get("depth", 2))
    breadth = int(args.get("breadth", 2))
    keep = int(args.get("keep", 2))
    for name, v, hi in (("depth", depth, 6), ("breadth", breadth, 8), ("keep", keep, 8)):
        if not 1 <= v <= hi:
            raise ValueError(f"tree-of-thought: {name} must be in 1..{hi}, got {v}")
    step_tokens = int(args.get("step_tokens", 32))
    temperature = float(args.get("temperature", 0.8))
    seed = int(args.get("seed", 0))
    model = Model.load(args.get("model"))

    # The chat template around the assistant's steps: the prompt before them
    # and, after them, the judge's question up to the judge's answer.
    msgs = [{"role": "user", "content": f"{problem}\nThink step by step, one short step per line."}]
    full = model.apply_chat_template(msgs + [{"role": "assistant", "content": _MARK}, {"role": "user", "content": JUDGE}])
    before, after = full.split(_MARK)
    if before != model.apply_chat_template(msgs, add_generation_prompt=True):
        raise ValueError("tree-of-thought: this model's chat template does not render an assistant turn as a suffix")
    judge_suffix = model.tokenize(after)
    yes_ids = sorted({model.tokenize(w)[0] for w in ("yes", "Yes", " yes", " Yes")})
    no_ids = sorted({model.tokenize(w)[0] for w in ("no", "No", " no", " No")})

    nodes = [{"id": 0, "parent": None, "depth": 0, "text": problem, "score": 0.0}]
    root = model.new_context()
    root.fill(before)
    await root.flush()
    frontier = [(0, root)]
    live = [root]
    try:
        for d in range(1, depth + 1):

            async def expand(parent_id: int, parent_ctx, j: int):
                ctx = parent_ctx.fork()
                live.append(ctx)
                sampler = Sampler(temperature=temperature, top_p=0.95, seed=seed + 1000 * d + 10 * parent_id + j)
                gen = ctx.generate(sampler, max_tokens=step_tokens, stop="\n")
                await gen.collect_text()
                if gen.finish_reason == "eos":  # drop the end of turn: deeper steps continue
                    ctx.truncate(ctx.seq_len - 1)
                if gen.finish_reason != "stop":  # end the step's line
                    ctx.fill("\n")
                with ctx.fork() as judge:
                    judge.fill_tokens(judge_suffix)
                    (lp,) = await judge.forward(outputs=[forward.logprobs(len(judge.pending) - 1, yes_ids + no_ids)])
                score = _logsumexp(lp[: len(yes_ids)]) - _logsumexp(lp[len(yes_ids) :])
                return parent_id, ctx, gen.text.strip(), score

            children = await asyncio.gather(*(expand(pid, pctx, j) for pid, pctx in frontier for j in range(breadth)))
            scored = []
            for parent_id, ctx, text, score in children:
                node = {"id": len(nodes), "parent": parent_id, "depth": d, "text": text, "score": score}
                nodes.append(node)
                scored.append((score, node["id"], ctx))
            scored.sort(key=lambda s: -s[0])
            for _, _, ctx in scored[keep:]:
                ctx.close()
            frontier = [(nid, ctx) for _, nid, ctx in scored[:keep]]
    finally:
        for ctx in live:
            ctx.close()
    best_id = frontier[0][0]
    path = []
    nid = best_id
    while nid is not None:
        path.append(nid)
        nid = nodes[nid]["parent"]
    path.reverse()
    steps = [nodes[i]["text"] for i in path[1:]]
    for n in nodes[1:]:
        session.send(f"{'  ' * n['depth']}[{n['id']}<-{n['parent']}] {n['score']:+.2f} {n['text']}\n")
    session.send("best path:\n" + "\n".join(steps) + "\n")
    return {"answer": "\n".join(steps), "score": nodes[best_id]["score"], "path": path, "nodes": nodes}

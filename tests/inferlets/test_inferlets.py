"""The standard inferlets on the real model.

(``windowed-attention`` is tested in test_masking.py, ``speculative-decoding``
and ``jacobi-decoding`` in test_speculative.py, ``text-completion`` in
test_text_completion.py.)
"""

from __future__ import annotations

import math

from harness import drain, inline_program, run, run_ok
from tartlet.host.session import Session
from tartlet.runtime.instance import Status
from tartlet.runtime.program import find_program

HISTORY = """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.user(args["turns"][0])
    ctx.assistant(args["reply"])
    ctx.user(args["turns"][1])
    return await ctx.generate(max_tokens=args["max_tokens"]).collect_tokens()
"""


async def test_chat_turns_reuse_the_context(runtime, engine, tmp_path):
    turns = ["What is the capital of France?", "And what is the capital of Italy?"]
    st = engine.scheduler.stats
    k0 = st.tokens_computed
    res = await run_ok(runtime, "chat", {"turns": turns, "max_tokens": 24})
    computed = st.tokens_computed - k0
    assert len(res["replies"]) == 2 and res["finish_reasons"] == ["eos", "eos"]
    first = await run_ok(runtime, "text-completion", {"prompt": turns[0], "max_tokens": 24})
    assert res["replies"][0] == first["text"] and res["tokens"][0] == first["tokens"]
    # turn 2 equals a fresh context holding the whole history
    ref = await run_ok(runtime, inline_program(tmp_path, HISTORY, "history"), {"turns": turns, "reply": res["replies"][0], "max_tokens": 24})
    assert res["tokens"][1] == ref
    assert "Rome" in res["replies"][1]
    # the first turn was not prefilled again: the engine computed each token once
    # (the prefix cache could hide a re-prefill of full pages, but not of the tail)
    assert computed <= res["context_tokens"]


async def test_chat_interactive_reads_the_session(runtime):
    session = Session()
    out: list = []
    session.listen(out.append)
    session.push("What is the capital of France?")
    session.push("/exit")
    inst = runtime.launch(find_program("chat"), {"interactive": True, "max_tokens": 16}, session)
    await inst.wait()
    assert inst.status is Status.FINISHED, inst.error
    assert inst.result["replies"] == ["The capital of France is Paris."]
    assert "".join(out).strip() == "The capital of France is Paris."


async def test_parallel_generation_batches_forks_over_shared_pages(runtime, engine):
    n, max_tokens = 4, 16
    st = engine.scheduler.stats
    calls0 = st.model_calls
    res = await run_ok(runtime, "parallel-generation", {"prompt": "Name a fruit and describe it.", "n": n, "max_tokens": max_tokens, "seed": 5})
    calls = st.model_calls - calls0
    total = sum(len(t) for t in res["tokens"])
    assert total >= n * 4
    assert calls < total, f"{calls} model calls for {total} tokens: forks were not batched"
    p = res["prompt_tokens"]
    for fs in res["fork_stats"]:
        assert fs["tokens"] == p
        assert fs["shared_pages"] == p // 16 and fs["pages"] == -(-p // 16)
    assert len(set(map(tuple, res["tokens"]))) > 1, "seeded forks should differ"
    # each fork's sampling depends only on its own seed: a solo run with the same seed agrees
    solo = await run_ok(runtime, "parallel-generation", {"prompt": "Name a fruit and describe it.", "n": 1, "max_tokens": max_tokens, "seed": 7})
    assert solo["tokens"][0] == res["tokens"][2]


async def test_best_of_n_scores_by_mean_logprob(runtime, tmp_path):
    res = await run_ok(runtime, "best-of-n", {"prompt": "Name a fruit.", "n": 3, "max_tokens": 12, "seed": 1})
    cands = res["candidates"]
    assert len(cands) == 3
    for c in cands:
        assert len(c["logprobs"]) == len(c["tokens"]) and all(lp <= 0 for lp in c["logprobs"])
        assert math.isclose(c["score"], sum(c["logprobs"]) / len(c["logprobs"]))
    assert res["score"] == max(c["score"] for c in cands) == cands[res["best"]]["score"]
    assert res["tokens"] == cands[res["best"]]["tokens"]
    # the recorded log-probabilities are the model's: recompute one candidate in one pass
    c = cands[res["best"]]
    code = """
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.user("Name a fruit.")
        ctx.begin_assistant()
        toks = args["tokens"]
        base = len(ctx.pending)
        ctx.fill_tokens(toks)
        outs = [forward.logprobs(base - 1 + i, [t]) for i, t in enumerate(toks)]
        return [lp[0] for lp in await ctx.forward(outputs=outs)]
    """
    lps = await run_ok(runtime, inline_program(tmp_path, code, "rescore"), {"tokens": c["tokens"]})
    assert all(abs(a - b) < 2e-3 for a, b in zip(lps, c["logprobs"])), (lps, c["logprobs"])


async def test_prefix_cache_snapshot_is_reused_by_a_later_run(runtime, engine):
    system = "You are the help desk of the Tartlet bakery. " + " ".join(
        f"Rule {i}: answer politely, mention the bakery's opening hours (7 to 19) when relevant." for i in range(12)
    )
    name = "test-prefix-cache"
    st = engine.scheduler.stats
    args = {"system": system, "questions": ["When do you open?", "Do you sell bread?"], "max_tokens": 12, "snapshot": name}
    first = await run_ok(runtime, "prefix-cache", args)
    assert first["created"] is True and first["snapshot"] == name
    s = first["system_tokens"]
    assert s > 200
    assert first["prefill_tokens_saved"] == s  # the second question did not prefill the system prompt
    drain(runtime.state)
    assert name in runtime.state.model(None).snapshots.names()

    k0 = st.tokens_computed
    second = await run_ok(runtime, "prefix-cache", dict(args, questions=["Do you sell cakes?"], delete=True))
    computed = st.tokens_computed - k0
    assert second["created"] is False and second["system_tokens"] == s
    assert second["prefill_tokens_computed"] == second["question_tokens"][0] < 30
    assert second["prefill_tokens_saved"] == s
    # the engine agrees: this run computed its question and answer only
    assert computed <= second["question_tokens"][0] + len(second["tokens"][0])
    drain(runtime.state)
    assert name not in runtime.state.model(None).snapshots.names()
    # the same answer as a plain run with the whole prompt
    ref = await run_ok(runtime, "text-completion", {"system": system, "prompt": "Do you sell cakes?", "max_tokens": 12})
    assert second["tokens"][0] == ref["tokens"]


async def test_beam_search(runtime, tmp_path):
    prompt = "What is the capital of France?"
    one = await run_ok(runtime, "beam-search", {"prompt": prompt, "k": 1, "max_tokens": 16})
    greedy = await run_ok(runtime, "text-completion", {"prompt": prompt, "max_tokens": 16})
    assert one["tokens"] == greedy["tokens"]  # width 1 is greedy decoding
    res = await run_ok(runtime, "beam-search", {"prompt": prompt, "k": 3, "max_tokens": 12})
    beams = res["beams"]
    assert len(beams) >= 3
    assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    assert res["tokens"] == beams[0]["tokens"] and res["score"] == beams[0]["score"]
    assert len({tuple(b["tokens"]) for b in beams}) == len(beams)
    # a beam's log-probability is the model's: recompute it in one pass
    code = """
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.user(args["prompt"])
        ctx.begin_assistant()
        base = len(ctx.pending)
        ctx.fill_tokens(args["tokens"])
        outs = [forward.logprobs(base - 1 + i, [t]) for i, t in enumerate(args["tokens"])]
        return sum(lp[0] for lp in await ctx.forward(outputs=outs))
    """
    for b in beams[:2]:
        lp = await run_ok(runtime, inline_program(tmp_path, code, "beamlp"), {"prompt": prompt, "tokens": b["tokens"]})
        assert abs(lp - b["logprob"]) < 5e-3, (lp, b)


async def test_tree_of_thought_explores_and_prunes(runtime):
    res = await run_ok(
        runtime,
        "tree-of-thought",
        {"problem": "Tom has 3 apples and eats one. How many apples are left?", "depth": 2, "breadth": 2, "keep": 1, "step_tokens": 12},
    )
    nodes = res["nodes"]
    # root + 2 children + 2 grandchildren of the one kept child
    assert len(nodes) == 5
    assert [n["depth"] for n in nodes] == [0, 1, 1, 2, 2]
    level1 = nodes[1:3]
    kept = max(level1, key=lambda n: n["score"])
    assert all(n["parent"] == kept["id"] for n in nodes[3:])
    best = max(nodes[3:], key=lambda n: n["score"])
    assert res["path"] == [0, kept["id"], best["id"]] and res["score"] == best["score"]
    assert res["answer"] == "\n".join(nodes[i]["text"] for i in res["path"][1:])
    assert all(math.isfinite(n["score"]) for n in nodes)


async def test_logit_probe_classifies(runtime):
    """The probe's numbers agree with each other; the label is the most
    likely choice. (SmolLM2-135M is a weak zero-shot classifier: it says "No"
    to almost every yes/no question, so only relative scores are checked.)"""
    pos_neg = []
    for review in ("I loved this movie, it was wonderful and moving.", "A boring, terrible film. I hated every minute."):
        q = f'Review: "{review}"\nIs the sentiment of this review positive or negative?'
        res = await run_ok(runtime, "logit-probe", {"prompt": q, "k": 5, "choices": ["Positive", "Negative"]})
        pos_neg.append(res["probs"]["Positive"])
        assert res["label"] == max(res["choices"], key=res["choices"].get)
    assert pos_neg[0] > pos_neg[1], "the positive review should score more 'Positive' than the negative one"

    res = await run_ok(runtime, "logit-probe", {"prompt": "Is water wet? Answer yes or no.", "k": 5})
    assert set(res["choices"]) == {"Yes", "No"} and res["label"] in ("Yes", "No")
    assert len(res["top"]) == 5 and res["entropy"] > 0
    probs = [t["prob"] for t in res["top"]]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
    found = 0
    for t in res["top"]:  # the choices' log-probabilities agree with the distribution probe
        if t["text"] in res["choices"]:
            found += 1
            assert abs(math.log(t["prob"]) - res["choices"][t["text"]]) < 1e-4
    assert found == 2
    assert abs(sum(res["probs"].values()) - 1) < 1e-9
    # multi-token choices are scored by teacher forcing
    res = await run_ok(
        runtime,
        "logit-probe",
        {"prompt": "What is the capital of France?", "choices": ["The capital of France is Paris.", "The capital of France is Rome."]},
    )
    assert res["label"] == "The capital of France is Paris."
    assert res["choices"]["The capital of France is Rome."] < res["choices"]["The capital of France is Paris."] < 0


async def test_inferlet_argument_errors(runtime):
    for name, args, msg in (
        ("chat", {}, "needs `turns`"),
        ("parallel-generation", {"prompt": "x", "n": 0}, "n must be in"),
        ("best-of-n", {}, "non-empty string argument `prompt`"),
        ("prefix-cache", {"system": "s"}, "needs `questions`"),
        ("windowed-attention", {"prompt": "x", "window": 0}, "window >= 1"),
        ("beam-search", {"prompt": "x", "k": 0}, "k must be in"),
        ("tree-of-thought", {"problem": "x", "depth": 9}, "depth must be in"),
        ("speculative-decoding", {"prompt": "x", "max_draft": 0}, "max_draft"),
        ("jacobi-decoding", {"prompt": "x", "window": 0}, "window must be in"),
        ("logit-probe", {"prompt": "x", "choices": []}, "choices"),
    ):
        inst = await run(runtime, name, args)
        assert inst.status is Status.FAILED, name
        assert msg in inst.error, (name, inst.error)

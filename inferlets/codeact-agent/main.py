"""codeact-agent: the model acts by writing Python; the host runs it in a sandbox.

The whole trace is one assistant turn::

    Thought: <one line>
    Code:
    ```python
    <the snippet>
    ```
    Output:
    <what it printed, or its error>
    Thought: ...
    Answer: <free text>

Each snippet runs with ``tartlet.sandbox.run_python``: a fresh WebAssembly
instance of CPython on the host (no files, no sockets, no processes), with
a wall-time limit and a memory cap per run. Whatever happens there (an
exception, an infinite loop stopped at ``time_limit_s``, a ``MemoryError`` at
``memory_mb``, a refused ``open``) comes back as text under ``Output:`` for
the model's next step; the agent and the server go on. The code of earlier
steps that ran cleanly is run again (output discarded) before each new
snippet, so variables carry over between steps (``keep_state``).

After each output the model writes a thought and picks ``Code:`` or
``Answer:`` (a choice under a regex constraint; the first step always
writes code, and after ``max_steps`` runs it must answer). ``code`` gives
the snippets of the first steps instead of generating them (a client's
plan, or tests: a 135M model writes poor code); their thoughts are still
the model's.

Args:
    prompt (str, required): the task.
    code (str or list of str): snippets for the first steps, run as given.
    max_steps (int, default 3): most snippets run.
    time_limit_s (float, default 5): wall-time limit of one run, seconds
        (at most the host's, 10 s unless configured otherwise).
    memory_mb (int, default 64): memory cap of one run, MiB (24 to the
        host's maximum, 256 unless configured otherwise).
    keep_state (bool, default true): rerun earlier clean steps first.
    think_tokens (int, default 32), code_tokens (int, default 160),
    max_tokens (int, default 96; the answer, never empty).
    max_output_chars (int, default 1000): each output is cut to this.
    system (str): extra instructions before the format description.
    temperature (float, default 0), seed (int), model (str).

Returns ``{"steps": [{"thought", "code", "given", "status", "stdout",
"error", "elapsed_ms", "output"}], "answer", "finish_reason",
"transcript"}`` (``status``: ok / error / timeout / memory / crashed;
``output``: the text fed back; ``transcript``: the context's text).
"""

from tartlet import Model, Regex, Sampler, brle, forward, sandbox, session

FORMAT = """Solve the task by writing Python code. Each step is one Thought line, then either a Python code block that prints what you need (you will see its Output) or the final Answer.
Example:
Task: What is 17 * 23 + 4?
Thought: I compute it with Python.
Code:
```python
print(17 * 23 + 4)
```
Output:
395
Thought: The output is the result.
Answer: 17 * 23 + 4 = 395."""
FENCE = "```"


def _int(args, key, default, lo, hi=None):
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"argument `{key}` must be an int >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v!r}")
    return v


def _given(arg):
    if arg is None:
        return []
    if isinstance(arg, str):
        arg = [arg]
    if not isinstance(arg, list) or not all(isinstance(c, str) and c.strip() for c in arg):
        raise ValueError("argument `code` must be a non-empty string or a list of them")
    if any(FENCE in c for c in arg):
        raise ValueError(f"argument `code` may not contain {FENCE!r} (it ends a code block)")
    return [c.strip("\n") for c in arg]


async def first_token(ctx, sampler, banned):
    """Sample the next token with ``banned`` ids masked out; it is left pending."""
    mask = brle.excluding(ctx.model.vocab_size, banned)
    [tok] = await ctx.forward(outputs=[forward.sample(len(ctx.pending) - 1, sampler, logit_mask=mask)])
    ctx.fill_tokens([tok])
    return tok


async def write_line(ctx, sampler, max_tokens):
    """Generate one line and leave the context ending with it and ``\\n``
    (whatever stop token or cut the generation ended with)."""
    start = ctx.seq_len
    gen = ctx.generate(sampler, max_tokens=max_tokens, stop=["\n"])
    text = (await gen.collect_text()).strip()
    ctx.truncate(start)
    ctx.fill(" " + text + "\n" if text else "\n")
    return text


async def main(args: dict) -> dict:
    prompt = args.get("prompt", args.get("task"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("codeact-agent needs a non-empty string argument `prompt`")
    given = _given(args.get("code"))
    max_steps = _int(args, "max_steps", max(3, len(given)), 1, 32)
    if len(given) > max_steps:
        raise ValueError(f"{len(given)} snippets given in `code` but max_steps is {max_steps}")
    think_tokens = _int(args, "think_tokens", 32, 1)
    code_tokens = _int(args, "code_tokens", 160, 1)
    max_tokens = _int(args, "max_tokens", 96, 2)
    max_chars = _int(args, "max_output_chars", 1000, 16)
    time_limit = args.get("time_limit_s", 5.0)
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or time_limit <= 0:
        raise ValueError(f"argument `time_limit_s` must be a positive number of seconds, got {time_limit!r}")
    memory_mb = _int(args, "memory_mb", 64, 1)
    keep_state = args.get("keep_state", True)
    if not isinstance(keep_state, bool):
        raise ValueError(f"argument `keep_state` must be true or false, got {keep_state!r}")
    model = Model.load(args.get("model"))
    sampler = Sampler(temperature=float(args.get("temperature", 0.0)), seed=args.get("seed"))
    system = (args.get("system", "") + "\n").lstrip() + FORMAT

    steps, setup = [], ""
    with model.new_context() as ctx:
        ctx.system(system)
        ctx.user("Task: " + prompt)
        ctx.begin_assistant()
        for n in range(max_steps + 1):
            ctx.fill("Thought:")
            thought = await write_line(ctx, sampler, think_tokens)
            session.send(f"Thought: {thought}\n")
            if n == max_steps:
                break  # out of steps: answer
            if n >= len(given) and n > 0:  # the model picks: more code, or the answer
                start = ctx.seq_len
                with Regex("(Code|Answer):", model.name) as choice:
                    pick = await ctx.generate(sampler, max_tokens=8, constraint=choice).collect_text()
                ctx.truncate(start)
                if pick.startswith("Answer"):
                    break
            ctx.fill(f"Code:\n{FENCE}python\n")
            if n < len(given):
                code = given[n]
            else:
                start = ctx.seq_len
                gen = ctx.generate(sampler, max_tokens=code_tokens, stop=[FENCE])
                code = (await gen.collect_text()).strip("\n")
                ctx.truncate(start)
            ctx.fill((code + "\n" if code else "") + FENCE + "\n")
            session.send(f"Code:\n{FENCE}python\n{code}\n{FENCE}\n")
            if code.strip():
                r = await sandbox.run_python(code, setup=setup, time_limit_s=time_limit, memory_mb=memory_mb)
                output = r.feedback(max_chars)
                if r.ok and keep_state:
                    setup += code + "\n"
                step = {"status": r.status, "stdout": r.stdout, "error": r.error, "elapsed_ms": r.elapsed_ms}
            else:
                output = "error: the code block is empty"
                step = {"status": "error", "stdout": "", "error": output, "elapsed_ms": 0}
            ctx.fill(f"Output:\n{output}\n")
            session.send(f"Output:\n{output}\n")
            steps.append({"thought": thought, "code": code, "given": n < len(given), **step, "output": output})
        ctx.fill("Answer:")
        head = model.detokenize([await first_token(ctx, sampler, model.eos_token_ids)])
        session.send(head)
        answer = ctx.generate(sampler, max_tokens=max_tokens - 1, stop=["\nThought:", "\nCode:", "\nOutput:", "\nTask:"])
        async for s in answer:
            if s.text:
                session.send(s.text)
        transcript = ctx.text
    return {"steps": steps, "answer": (head + answer.text).strip(), "finish_reason": answer.finish_reason, "transcript": transcript}

"""agent-swarm: a coordinator and worker agents that talk over messaging topics.

The coordinator (this inferlet, launched by the client) writes the shared
preamble once (system message + task), prefills it and saves it as a
snapshot; then it launches one child inferlet per worker (this same
program, ``role: "worker"``). Every worker opens the snapshot, so the
preamble's KV pages are computed once and shared by all agents, and adds
its own instruction in its own context. Messages, all through
``tartlet.messaging`` (topics scoped to the user, under
``swarm/<swarm_id>/``):

- ``to/<worker>`` (queue): the coordinator's instruction for each round, and
  ``stop`` at the end;
- ``replies`` (queue): each worker's reply, ``{"from", "round", "text"}``;
- ``board`` (broadcast): after every round but the last, all replies of the
  round; each worker reads the others' replies before it revises its own.

Finally the coordinator reads the last round's replies into its own fork of
the preamble and writes the combined answer. The workers of one round
generate concurrently (in shared batches).

Args:
    prompt (str, required): the task.
    workers (list): the worker agents, each a name (letters, digits, ``-``,
        ``_``) or ``{"name", "instruction"}``; default a ``solver`` and a
        ``checker``.
    rounds (int, default 2): rounds of replies (round 2 on: each worker
        revises after reading the board).
    worker_tokens (int, default 48): each reply; max_tokens (int, default
        96): the final answer.
    swarm_id (str): the topics' namespace (default: a random id).
    timeout_s (float, default 120): longest wait for a reply.
    temperature (float, default 0), seed (int), model (str).
    role (str): ``coordinator`` (default) or ``worker`` (set by the
        coordinator for its children, with ``name``, ``instruction``,
        ``snapshot``).

Returns (coordinator) ``{"swarm_id", "workers": [{"name", "id", "status",
"replies", "boards_read"}], "messages": [{"topic", "from", "to", "round", "text"}],
"answer", "finish_reason", "transcript"}``: ``messages`` lists every message
the coordinator sent or received, in order; ``transcript`` is the
coordinator's context. A worker returns ``{"name", "replies", "boards"}``.
"""

import asyncio
import json
import os

from tartlet import Context, Model, Sampler, children, messaging, session

DEFAULT_WORKERS = [
    {"name": "solver", "instruction": "Give a short, direct answer to the task."},
    {"name": "checker", "instruction": "List the key facts the answer needs, briefly."},
]
SYSTEM = "You are one agent of a small team working on the same task. Be brief and factual."


def _int(args, key, default, lo, hi=None):
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"argument `{key}` must be an int >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v!r}")
    return v


def _name(v, what):
    if not isinstance(v, str) or not v or len(v) > 40 or not all(c.isalnum() or c in "-_" for c in v):
        raise ValueError(f"{what} must be 1-40 letters, digits, '-' or '_', got {v!r:.60}")
    return v


def _workers(arg):
    if arg is None:
        return [dict(w) for w in DEFAULT_WORKERS]
    if not isinstance(arg, list) or not 1 <= len(arg) <= 16:
        raise ValueError("argument `workers` must be a list of 1 to 16 names or {name, instruction} objects")
    out, seen = [], set()
    for w in arg:
        if isinstance(w, str):
            w = {"name": w}
        if not isinstance(w, dict):
            raise ValueError(f"a worker is a name or {{name, instruction}}, got {w!r:.60}")
        name = _name(w.get("name"), "a worker's name")
        if name in seen:
            raise ValueError(f"two workers are named {name!r}")
        seen.add(name)
        instr = w.get("instruction", f"Give your contribution to the task as the team's {name}.")
        if not isinstance(instr, str) or not instr.strip():
            raise ValueError(f"worker {name!r}: instruction must be a non-empty string")
        out.append({"name": name, "instruction": instr})
    return out


def _timeout(args):
    t = args.get("timeout_s", 120)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
        raise ValueError(f"argument `timeout_s` must be a positive number of seconds, got {t!r}")
    return float(t)


async def _wait(aw, timeout, what):
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no {what} within timeout_s={timeout:g}") from None


def _board(replies):
    return "\n".join(f"[{r['from']}] {r['text']}" for r in replies)


async def worker(args, model, sampler):
    """A worker: pull instructions from ``to/<name>``, reply on ``replies``,
    read the board (broadcast) between rounds."""
    name, base, snap = _name(args.get("name"), "`name`"), args.get("topics"), args.get("snapshot")
    if not isinstance(base, str) or not isinstance(snap, str):
        raise ValueError("a worker needs `topics` and `snapshot` (it is launched by an agent-swarm coordinator)")
    tokens, timeout = _int(args, "worker_tokens", 48, 1), _timeout(args)
    replies, boards = [], []
    with messaging.subscribe(base + "/board") as board, Context.open(model, snap) as ctx:
        ctx.adopt_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": args["task_message"]}])
        while True:
            msg = json.loads(await _wait(messaging.pull(f"{base}/to/{name}"), timeout, "instruction"))
            if msg["type"] == "stop":
                break
            rnd = msg["round"]
            text = f"You are the team's {name}. {msg['instruction']}"
            if rnd > 0:  # first read what the others said last round
                seen = json.loads(await _wait(board.next(), timeout, "board message"))
                boards.append(seen)
                others = [r for r in seen["replies"] if r["from"] != name]
                text = "The team's replies so far:\n" + _board(others) + f"\nRevise your reply. {msg['instruction']}"
            ctx.user(text)
            reply = (await ctx.generate(sampler, max_tokens=tokens).collect_text()).strip() or "(no reply)"
            replies.append(reply)
            messaging.push(base + "/replies", json.dumps({"from": name, "round": rnd, "text": reply}))
            session.send(f"[{name} r{rnd}] {reply}\n")
    return {"name": name, "replies": replies, "boards": boards}


async def coordinator(args, model, sampler):
    prompt = args.get("prompt", args.get("task"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("agent-swarm needs a non-empty string argument `prompt`")
    workers = _workers(args.get("workers"))
    rounds = _int(args, "rounds", 2, 1, 8)
    worker_tokens = _int(args, "worker_tokens", 48, 1)
    max_tokens = _int(args, "max_tokens", 96, 1)
    timeout = _timeout(args)
    swarm_id = args.get("swarm_id") or os.urandom(6).hex()
    _name(swarm_id, "`swarm_id`")
    base = f"swarm/{swarm_id}"
    task_message = "Task: " + prompt
    log = []

    with model.new_context() as pre:
        pre.system(SYSTEM)
        pre.user(task_message)
        await pre.flush()
        snap = pre.snapshot()  # the shared preamble: prefilled once, opened by every worker
        kids = []
        try:
            common = {"role": "worker", "topics": base, "snapshot": snap, "task_message": task_message,
                      "worker_tokens": worker_tokens, "timeout_s": timeout, "model": args.get("model"),
                      "temperature": args.get("temperature", 0.0), "seed": args.get("seed")}  # fmt: skip
            for w in workers:
                kids.append(children.launch("agent-swarm", {**common, "name": w["name"]}))
            last = []
            for rnd in range(rounds):
                for w in workers:
                    msg = {"type": "instruction", "round": rnd, "instruction": w["instruction"]}
                    messaging.push(f"{base}/to/{w['name']}", json.dumps(msg))
                    log.append({"topic": f"{base}/to/{w['name']}", "from": "coordinator", "to": w["name"], "round": rnd, "text": w["instruction"]})
                got = []
                for _ in workers:
                    r = json.loads(await _wait(messaging.pull(base + "/replies"), timeout, "worker reply"))
                    got.append(r)
                    log.append({"topic": base + "/replies", "from": r["from"], "to": "coordinator", "round": r["round"], "text": r["text"]})
                got.sort(key=lambda r: [w["name"] for w in workers].index(r["from"]))
                if rnd < rounds - 1:
                    messaging.broadcast(base + "/board", json.dumps({"round": rnd, "replies": got}))
                    log.append({"topic": base + "/board", "from": "coordinator", "to": "*", "round": rnd, "text": _board(got)})
                last = got
            for w in workers:
                messaging.push(f"{base}/to/{w['name']}", json.dumps({"type": "stop"}))
            ended = [await _wait(k.join(), timeout, "worker end") for k in kids]
        except BaseException:
            for k in kids:
                k.cancel()
            raise
        finally:
            Context.delete(model, snap)
        for k, e in zip(kids, ended):
            if e.status != "finished":
                raise RuntimeError(f"worker {k.id} {e.status}: {e.error}")
        with pre.fork() as ctx:
            ctx.user("Replies of your team:\n" + _board(last) + "\nCombine them into one final answer to the task.")
            answer = ctx.generate(sampler, max_tokens=max_tokens)
            async for s in answer:
                if s.text:
                    session.send(s.text)
            transcript = ctx.text
    return {
        "swarm_id": swarm_id,
        "workers": [
            {"name": e.result["name"], "id": k.id, "status": e.status, "replies": e.result["replies"], "boards_read": len(e.result["boards"])}
            for k, e in zip(kids, ended)
        ],
        "messages": log, "answer": answer.text.strip(), "finish_reason": answer.finish_reason, "transcript": transcript,
    }


async def main(args: dict) -> dict:
    role = args.get("role", "coordinator")
    if role not in ("coordinator", "worker"):
        raise ValueError(f"argument `role` must be 'coordinator' or 'worker', got {role!r}")
    model = Model.load(args.get("model"))
    sampler = Sampler(temperature=float(args.get("temperature") or 0.0), seed=args.get("seed"))
    return await (worker(args, model, sampler) if role == "worker" else coordinator(args, model, sampler))

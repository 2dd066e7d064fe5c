"""A test inferlet for tests/server/test_cluster.py: one operation per launch
(``args["op"]``), so each test can act on one replica and check on another.

- ``save``: fill ``prompt``, save snapshot ``name``, then generate
  ``n`` greedy tokens; returns ``{"tokens": [...]}``.
- ``open``: open snapshot ``name``, generate ``n`` greedy tokens; returns
  ``{"tokens": [...]}``.
- ``set`` / ``get``: the key-value store (``key``, ``value``).
- ``push`` / ``pull``: messaging queue topic ``topic`` (``msg``).
- ``long``: generate ``n`` tokens, sending each as it comes.
"""

from tartlet import Context, Model, Sampler
from tartlet.sdk import messaging, session, store


async def main(args: dict) -> dict:
    op = args["op"]
    model = Model.load()
    if op == "save":
        ctx = model.new_context()
        ctx.fill(args["prompt"])
        await ctx.flush()
        ctx.save(args["name"])
        out = await ctx.generate(Sampler.greedy(), max_tokens=args.get("n", 8)).collect_tokens()
        return {"tokens": out}
    if op == "open":
        ctx = Context.open(model, args["name"])
        out = await ctx.generate(Sampler.greedy(), max_tokens=args.get("n", 8)).collect_tokens()
        return {"tokens": out}
    if op == "set":
        store.set(args["key"], args["value"])
        return {}
    if op == "get":
        return {"value": store.get(args["key"])}
    if op == "push":
        messaging.push(args["topic"], args["msg"])
        return {}
    if op == "pull":
        return {"msg": await messaging.pull(args["topic"])}
    if op == "long":
        ctx = model.new_context()
        ctx.fill(args.get("prompt", "Once upon a time"))
        n = 0
        async for step in ctx.generate(Sampler.greedy(), max_tokens=args.get("n", 200)):
            session.send(step.text or ".")
            n += len(step.tokens)
        return {"n": n}
    raise ValueError(f"unknown op {op!r}")

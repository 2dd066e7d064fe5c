"""Fuzz a real ``tartlet serve`` over both transports (issue 40's target:
>= 100,000 WebSocket frames and 10,000 HTTP bodies with 0 ``internal``
errors, 0 5xx, 0 server paths or Python class names in an error, and every
over-size frame closed with 1009).

The server runs as users run it (auth on, users ``good`` and ``evil``,
uploads sandboxed; :class:`bench_soak.Server`). Every input comes from one
seeded :class:`random.Random`, so a finding replays with ``--seed``:

* **WebSocket** (``/ws``, as ``evil``, ``--connections`` at once): frames of
  every request type of :mod:`tartlet.protocol`, each a plausible request
  with 0-3 mutations (a field dropped, set to a hostile value: huge or
  negative numbers, ``NaN``, 300-character and path-like strings, control
  characters, deep nesting, wrong types; unknown fields; the whole frame
  replaced by a scalar, an array or broken JSON), binary frames, and every
  ``--oversize-every``-th frame one over ``[limits] max_message_bytes``
  (the connection must close with 1009, then a new one opens). Launches
  that succeed are aborted at once. Frames go in batches ending with a
  ``ping``; the server answers a connection's requests in order, so the
  ``pong`` closes each batch.
* **HTTP** (``/v1`` routes, ``--http-workers`` at once): request bodies of
  the OpenAI routes (chat, completions, responses, embeddings) mutated the
  same way, broken JSON, wrong content types, over-size bodies (413), and
  ``GET``/``DELETE`` of random response ids. Bodies that happen to be
  valid generate at most 4 tokens.

Checked on every reply: no ``internal`` error code, no HTTP status >= 500,
no server folder (the data and work folders, the temp folder, the
repository, ``sys.prefix``, the home folder) in any text, and no Python
exception class name (``KeyError``, ``Traceback``, ...) in a protocol or
HTTP error. A launched inferlet's own ``exit`` error may name its
exception class (it is the user's program's error), but no server path.
Ends with the server's RSS before and after, the tracebacks in its log, a
table and one ``JSON:`` line; exits 1 on any finding.

    .venv/bin/python benchmarks/fuzz_server.py                       # 100,000 frames, 10,000 bodies
    .venv/bin/python benchmarks/fuzz_server.py --frames 2000 --bodies 300 --seed 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import websockets

from bench_soak import Server
from common import ROOT, report

#: Error codes the WebSocket protocol documents (tartlet/protocol.py).
WS_CODES = {"bad_request", "unauthorized", "not_found", "unknown_program", "limit", "too_large", "forbidden"}
#: A Python exception class or a traceback named in an error text.
CLASS_NAME = re.compile(r"\bTraceback\b|\b(?:Key|Type|Value|Attribute|Index|Name|OS|Runtime|Assertion|Recursion|Overflow|"
                        r"ZeroDivision|JSONDecode|Validation|Unicode\w*|Lookup|Import|NotImplemented)Error\b|\bException\b")
WS_TYPES = ["launch", "upload", "adapter_add", "adapter_chunk", "adapter_list", "adapter_remove", "send", "close_input",
            "attach", "detach", "abort", "list", "ping"]
INFERLETS = ["text-completion", "echo", "best-of-n", "parallel-forks", "no-such-inferlet"]


class Mutator:
    """Hostile JSON values and mutations of a request, from one seeded RNG."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def hostile(self, depth: int = 0) -> Any:
        r = self.r
        pick = r.randrange(18)
        if pick == 0:
            return None
        if pick == 1:
            return r.choice([True, False])
        if pick == 2:
            return r.choice([-1, 0, 1, 2**31, 2**63, -(2**63), 10**40])
        if pick == 3:
            return r.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 1e-320])
        if pick == 4:
            return "a" * r.choice([0, 1, 255, 256, 300, 5000])
        if pick == 5:
            return r.choice(["../../etc/passwd", "/etc/shadow", "..", ".", "~/x", "C:\\x", "a/../../b", "sha256:" + "0" * 64,
                             "sha256:zz", "x.py", "\\\\server\\share"])
        if pick == 6:
            return "".join(chr(r.randrange(0, 0x110000)) for _ in range(r.randrange(1, 40))
                           ).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        if pick == 7:
            return "\x00\x01\x1b[31m\u202e\ufeff"
        if pick == 8:
            return "😀" * r.randrange(1, 100)
        if pick == 9:
            nest: Any = 1
            for _ in range(r.choice([10, 100, 600])):
                nest = [nest] if r.random() < 0.5 else {"a": nest}
            return nest
        if pick == 10 and depth < 3:
            return [self.hostile(depth + 1) for _ in range(r.randrange(0, 5))]
        if pick == 11 and depth < 3:
            return {self.key(): self.hostile(depth + 1) for _ in range(r.randrange(0, 5))}
        if pick == 12:
            return r.choice(INFERLETS)
        if pick == 13:
            return r.randrange(-5, 5)
        if pick == 14:
            return r.random() * r.choice([1, 100, 1e6])
        if pick == 15:
            return "%s%n%x{0}{__class__}${jndi:ldap://x}"
        if pick == 16:
            return [None] * r.choice([0, 1000, 100_000])
        return ""

    def key(self) -> str:
        return self.r.choice(["", "id", "type", "__proto__", "a" * 300, "model", "x", "\x00", "files", "args"])

    def mutate(self, msg: dict[str, Any]) -> Any:
        """``msg`` with 0-3 mutations, or (rarely) replaced whole."""
        r = self.r
        if r.random() < 0.04:
            return self.hostile()
        for _ in range(r.choice([0, 1, 1, 2, 3])):
            how = r.randrange(4)
            keys = list(msg)
            if how == 0 and keys:
                msg.pop(r.choice(keys))
            elif how == 1 and keys:
                msg[r.choice(keys)] = self.hostile()
            elif how == 2:
                msg[self.key()] = self.hostile()
            elif keys:  # a nested field
                k = r.choice(keys)
                if isinstance(msg[k], dict):
                    msg[k][self.key()] = self.hostile()
        return msg


def ws_request(m: Mutator, n: int) -> Any:
    """A plausible request of a random type, mutated."""
    r = m.r
    t = r.choice(WS_TYPES) if r.random() < 0.97 else m.hostile()
    base: dict[str, Any] = {"type": t, "id": n}
    if t == "launch":
        base.update(inferlet=r.choice(INFERLETS), args={"prompt": "Hi", "max_tokens": r.randrange(1, 4)},
                    attach=r.random() < 0.5, time_limit_s=r.choice([1, 5]))
        if r.random() < 0.2:
            base.pop("inferlet")
            base["program"] = "sha256:" + "%064x" % r.getrandbits(256)
    elif t == "upload":
        base["files"] = {r.choice(["main.py", "../main.py", "a/b.py", "/abs.py", "x" * 300]): "async def main(args):\n    return 1\n"}
    elif t in ("adapter_add", "adapter_chunk", "adapter_list", "adapter_remove"):
        base.update(name=r.choice(["a", "../a", "x" * 300, ""]), model=r.choice(["smollm2-135m-instruct", "nope"]),
                    files={"adapter_config.json": "e30="}, file="adapter_model.safetensors", data_b64="AAAA")
    elif t in ("send", "close_input", "attach", "detach", "abort"):
        base.update(instance=r.choice(["i-1", "0", "x" * 300, "../x"]), data="hello")
    return m.mutate(base)


def http_request(m: Mutator, n: int) -> tuple[str, str, Any, dict[str, str]]:
    """(method, path, body (object, text or None), extra headers)."""
    r = m.r
    route = r.choice(["chat", "completions", "responses", "embeddings", "models", "get", "delete"])
    if route == "models":
        return "GET", "/v1/models", None, {}
    if route in ("get", "delete"):
        rid = r.choice(["resp_" + "%032x" % r.getrandbits(128), "..", "x" * 300, "%2e%2e%2fetc"])
        return ("GET" if route == "get" else "DELETE"), f"/v1/responses/{rid}", None, {}
    model = r.choice(["smollm2-135m-instruct", "smollm2-135m-instruct:nope", "nope", ""])
    if route == "chat":
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": r.randrange(1, 5),
                                "stream": r.random() < 0.3}
        if r.random() < 0.3:
            body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        if r.random() < 0.2:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        path = "/v1/chat/completions"
    elif route == "completions":
        body = {"model": model, "prompt": "Hi", "max_tokens": r.randrange(1, 5), "stream": r.random() < 0.3,
                "logprobs": r.choice([None, 1, 5])}
        path = "/v1/completions"
    elif route == "responses":
        body = {"model": model, "input": "Hi", "max_output_tokens": r.randrange(1, 5), "stream": r.random() < 0.3}
        path = "/v1/responses"
    else:
        body = {"model": model, "input": ["Hi", "there"]}
        path = "/v1/embeddings"
    mutated = m.mutate(body)
    if isinstance(mutated, dict):  # keep generations short whatever the mutations did
        for k in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
            v = mutated.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 4:
                mutated[k] = 4
        if isinstance(mutated.get("n"), int) and mutated["n"] > 2:
            mutated["n"] = 2
    headers = {}
    if r.random() < 0.05:
        headers["Content-Type"] = r.choice(["text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"])
    if r.random() < 0.05:
        return "POST", path, r.choice(["{", "[1,", "\x00", "", "{\"model\": }", "null", '"x"', "1e999999"]), headers
    return "POST", path, mutated, headers


class Findings:
    """What the run saw: counts, and each violation with its input."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = [p for p in paths if p and p != "/"]
        self.counts: Counter[str] = Counter()
        self.violations: list[dict[str, Any]] = []

    def check_text(self, where: str, text: str, sent: Any, errors_only: bool) -> None:
        for p in self.paths:
            if p in text:
                self.flag(where, f"server path {p!r}", text, sent)
                return
        if errors_only and CLASS_NAME.search(text):
            self.flag(where, "exception class name", text, sent)

    def flag(self, where: str, what: str, text: str, sent: Any) -> None:
        self.counts[f"{where} violations"] += 1
        if len(self.violations) < 50:
            self.violations.append({"where": where, "what": what, "reply": text[:400], "sent": repr(sent)[:400]})


def dumps(msg: Any) -> str:
    """JSON text; non-finite floats as Python writes them (NaN, Infinity: not
    JSON, which the server must refuse cleanly); past Python's recursion
    limit, a hand-built deep array."""
    try:
        return json.dumps(msg)
    except (RecursionError, ValueError):
        return "[" * 100_000 + "]" * 100_000


async def ws_worker(k: int, srv: Server, a: argparse.Namespace, rng: random.Random, quota: list[int], f: Findings) -> None:
    url = srv.url.replace("http", "ws") + "/ws"
    headers = {"Authorization": f"Bearer {srv.keys['evil']}"}
    m = Mutator(rng)
    big = "x" * (a.max_message_bytes + 1024)
    n = 0
    while quota[0] > 0:
        async with websockets.connect(url, additional_headers=headers, max_size=None, open_timeout=60) as ws:
            while quota[0] > 0:
                batch = min(a.batch, quota[0])
                quota[0] -= batch
                sent: dict[int, Any] = {}
                over = False
                for _ in range(batch):
                    n += 1
                    f.counts["ws frames"] += 1
                    if a.oversize_every and f.counts["ws frames"] % a.oversize_every == 0:
                        over = True
                        f.counts["ws over-size frames"] += 1
                        try:
                            await ws.send(big)
                            while True:  # the replies to this batch's frames, then the close
                                text = await asyncio.wait_for(ws.recv(), 60)
                                await ws_reply(ws, json.loads(text), text, sent, f)
                        except websockets.ConnectionClosed:
                            pass
                        except TimeoutError:
                            f.flag("ws", "no close after an over-size frame", "", "over-size")
                        code = ws.close_code
                        f.counts[f"ws over-size closed {code}"] += 1
                        if code != 1009:
                            f.flag("ws", f"over-size frame closed with {code}", str(ws.close_reason), "over-size")
                        break
                    if rng.random() < 0.01:
                        await ws.send(rng.randbytes(rng.randrange(1, 64)))  # binary frame
                        continue
                    msg = ws_request(m, k * 10**9 + n)
                    sent[k * 10**9 + n] = msg
                    await ws.send(dumps(msg) if rng.random() > 0.02 else dumps(msg)[:-1])
                if over:
                    break  # closed by the server: a new connection
                ping = f"batch-{k}-{n}"
                await ws.send(json.dumps({"type": "ping", "id": ping}))
                while True:
                    try:
                        text = await asyncio.wait_for(ws.recv(), 120)
                    except TimeoutError:
                        f.flag("ws", "no pong within 120 s", "", ping)
                        return
                    msg = json.loads(text)
                    if msg.get("id") == ping:
                        break
                    await ws_reply(ws, msg, text, sent, f)


async def ws_reply(ws: Any, msg: dict[str, Any], text: str, sent: dict[int, Any], f: Findings) -> None:
    t = msg.get("type")
    f.counts[f"ws reply {t}"] += 1
    rid = msg.get("id")
    src = sent.get(rid) if isinstance(rid, int) else None  # a mutated id may be any JSON value
    if t == "error":
        code = msg.get("code")
        f.counts[f"ws error {code}"] += 1
        if code not in WS_CODES:
            f.flag("ws", f"error code {code!r}", text, src)
        f.check_text("ws", text, src, errors_only=True)
    else:
        f.check_text("ws", text, src, errors_only=False)
    if t == "launched":  # do not let fuzzed launches pile up
        await ws.send(json.dumps({"type": "abort", "instance": msg.get("instance"), "id": "abort"}))


async def http_worker(srv: Server, a: argparse.Namespace, rng: random.Random, quota: list[int], f: Findings) -> None:
    m = Mutator(rng)
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {srv.keys['evil']}"}) as http:
        while quota[0] > 0:
            quota[0] -= 1
            f.counts["http bodies"] += 1
            if a.oversize_every and f.counts["http bodies"] % max(1, a.oversize_every // 10) == 0:
                method, path, body, headers = "POST", "/v1/chat/completions", "x" * (a.max_message_bytes + 1024), {}
            else:
                method, path, body, headers = http_request(m, f.counts["http bodies"])
            content = body if isinstance(body, str) else None if body is None else dumps(body)
            try:
                async with http.stream(method, path, content=content, headers=headers) as resp:
                    text = (await resp.aread()).decode("utf-8", "replace")
            except httpx.HTTPError as e:
                f.flag("http", f"transport error {type(e).__name__}", str(e), (method, path, body))
                continue
            f.counts[f"http {resp.status_code}"] += 1
            if resp.status_code >= 500:
                f.flag("http", f"status {resp.status_code}", text, (method, path, body))
            if '"internal' in text or "server_error" in text:
                f.flag("http", "internal error", text, (method, path, body))
            f.check_text("http", text, (method, path, body), errors_only=resp.status_code >= 400 or '"error"' in text)


async def fuzz(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tartlet-fuzz-"))
    srv = Server(work, a.kv_cache_mb)
    try:
        f = Findings([str(work), str(srv.data), tempfile.gettempdir(), str(ROOT), sys.prefix, os.path.expanduser("~")])
        rss0 = srv.rss_mb()
        t0 = time.perf_counter()
        ws_quota, http_quota = [a.frames], [a.bodies]
        jobs = [ws_worker(k, srv, a, random.Random(a.seed * 1000 + k), ws_quota, f) for k in range(a.connections)]
        jobs += [http_worker(srv, a, random.Random(a.seed * 1000 + 500 + k), http_quota, f) for k in range(a.http_workers)]
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
        alive = srv.proc.poll() is None and httpx.get(srv.url + "/health", timeout=30).status_code == 200
        return {"counts": dict(f.counts), "violations": f.violations, "wall_s": wall, "rss_before_mb": rss0,
                "rss_after_mb": srv.rss_mb(), "tracebacks_in_log": srv.tracebacks(), "server_alive": alive}
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=100_000, help="WebSocket frames in all (default 100,000)")
    p.add_argument("--bodies", type=int, default=10_000, help="HTTP requests in all (default 10,000)")
    p.add_argument("--connections", type=int, default=4, help="WebSocket connections at once")
    p.add_argument("--http-workers", type=int, default=4, help="HTTP requests at once")
    p.add_argument("--batch", type=int, default=50, help="frames per batch before the closing ping")
    p.add_argument("--oversize-every", type=int, default=1000, help="every Nth frame over the size limit (0: none; HTTP: every N/10th body)")
    p.add_argument("--max-message-bytes", type=int, default=8 * 2**20, help="the server's [limits] max_message_bytes (its default)")
    p.add_argument("--kv-cache-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    res = asyncio.run(fuzz(a))
    c = res["counts"]
    rows = [["WebSocket", c.get("ws frames", 0), c.get("ws error internal", 0), "-",
             c.get("ws over-size frames", 0), c.get("ws over-size closed 1009", 0), c.get("ws violations", 0)],
            ["HTTP", c.get("http bodies", 0), "-", sum(v for k, v in c.items() if re.fullmatch(r"http 5\d\d", k)),
             "-", "-", c.get("http violations", 0)]]
    report(f"Fuzz of tartlet serve (seed {a.seed}): {res['wall_s']:.0f} s, server RSS {res['rss_before_mb']:.0f} -> "
           f"{res['rss_after_mb']:.0f} MiB, {res['tracebacks_in_log']} tracebacks in its log, alive: {res['server_alive']}",
           ["transport", "inputs", "internal", "5xx", "over-size", "closed 1009", "violations"], rows, {"args": vars(a), **res})
    for v in res["violations"][:20]:
        print("FINDING:", json.dumps(v))
    if res["violations"] or not res["server_alive"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

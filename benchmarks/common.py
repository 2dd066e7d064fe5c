"""Shared helpers of the benchmarks: engine and reference loading, timing,
a served ``tartlet serve`` process and a local HTTP tool server, and
printing a table plus one JSON line."""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_engine(**cfg: Any):
    """A started :class:`Engine` on the default model with ``EngineConfig``'s
    defaults (its GGUF weights kept quantized, float32 compute) unless ``cfg``
    says otherwise (``dtype="float32"``: the dequantized reference path)."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(**cfg))


def load_hf_reference(dtype: str = "float32"):
    """transformers' model and tokenizer dequantized from the same GGUF."""
    import torch
    import transformers

    from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve

    path = resolve(DEFAULT_MODEL)
    kw = dict(gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=getattr(torch, dtype), **kw).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    return model, tok


def run_inferlets(engine: Any, program: str, args_list: list[dict[str, Any]]) -> tuple[list[Any], float]:
    """Run one instance per args dict concurrently on ``engine``; returns the
    results and the wall time in seconds."""
    from tartlet.host.state import HostState
    from tartlet.runtime.instance import Status
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import find_program

    state = HostState()
    state.add_engine(engine)
    prog = find_program(program)

    async def go() -> list[Any]:
        rt = NativeRuntime(state)
        insts = [rt.launch(prog, a) for a in args_list]
        for i in insts:
            await i.wait()
            if i.status is not Status.FINISHED:
                raise RuntimeError(f"{program} {i.status.value}: {i.error}")
        return [i.result for i in insts]

    t0 = time.perf_counter()
    res = asyncio.run(go())
    return res, time.perf_counter() - t0


MODEL = "smollm2-135m-instruct"

#: The grounded workload (bench_speculative_served, bench_vs_llamacpp ``--workload grounded``): each prompt
#: gives a passage and asks to repeat or lightly edit it, so the output copies the prompt (high n-gram overlap,
#: where prompt-lookup speculative decoding pays). 16 prompts: every instruction with every passage.
GROUNDED_PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the lens, "
    "and wrote the weather in a small leather book. Ships passed far out on the grey water, and none of them knew his name.",
    "Our quarterly meeting will take place on Thursday at ten in the main conference room. Please bring your project "
    "updates, the revised budget sheet, and any questions about the new travel policy. Coffee will be served at half past nine.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the green light "
    "stops blinking. Then open the settings page in your browser and sign in with the password printed on the label.",
    "Maria planted tomatoes, basil and peppers in the small garden behind her house. Every morning she watered them before "
    "work, and every evening she pulled the weeds. By August the kitchen smelled of fresh sauce and the neighbours asked for seeds.",
]
GROUNDED_INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word.",
    "Copy the following passage in full. Do not add anything before or after it.",
    "Rewrite the following passage, keeping every sentence but making the first word of each sentence uppercase.",
    "Return the following passage unchanged, then stop.",
]
GROUNDED_PROMPTS = [f"{ins}\n\n{p}" for p in GROUNDED_PASSAGES for ins in GROUNDED_INSTRUCTIONS]


def tool_text(path: str, chars: int) -> str:
    """The text of the tool server's answer to ``path`` (``/tool?...``):
    ``tool output for PATH`` padded with filler words to at least ``chars``
    characters. Pure Python with no imports, so an inferlet can inline its
    source (``inspect.getsource``) and compute the same text without the
    call (bench_agents' ideal run)."""
    text = f"tool output for {path}"
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    i = 0
    while len(text) < chars:
        text += f" {words[i % len(words)]} {i}"
        i += 1
    return text


def start_tools(latency_s: float) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A local HTTP tool server on loopback (a thread per request): ``GET
    /tool?step=S&call=C&chars=N`` sleeps ``latency_s`` seconds, then answers
    ``{"result": ...}`` whose text depends only on the query (``chars``:
    at least that many characters of filler, default none). Returns the
    server and the tool's URL."""

    class Tools(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            time.sleep(latency_s)
            q = parse_qs(urlsplit(self.path).query)
            body = json.dumps({"result": tool_text(self.path, int(q.get("chars", ["0"])[0]))}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tools)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/tool"


def start_server(kv_cache_mb: int, programs: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, model_options: dict[str, Any] | None = None,
                 ) -> tuple[subprocess.Popen, str]:
    """A ``tartlet serve --no-auth`` process on loopback (the default model,
    a ``kv_cache_mb`` MiB page pool, HTTP allowed to ``127.0.0.1:*``) with
    ``programs`` (name -> Python source) installed as native inferlets;
    ``model_options``: more keys of the model's ``[[models]]`` table
    (e.g. ``{"batch_wait_ms": 5}``).
    Returns the process and its base URL; stop it with ``terminate()``."""
    d = Path(tempfile.mkdtemp(prefix="tartlet-bench-"))
    (d / "programs").mkdir()
    for name, source in (programs or {}).items():
        (d / "programs" / f"{name}.py").write_text(source)
    cfg = d / "config.toml"
    cfg.write_text(
        f'data_dir = "{d}"\nprogram_dir = "{d / "programs"}"\n[limits]\nmax_instances_per_user = 1000\n'
        f'[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = {kv_cache_mb}\n'
        + "".join(f"{k} = {_toml_value(v)}\n" for k, v in (model_options or {}).items())
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tartlet.cli.main", "serve", "--config", str(cfg), "--port", "0", "--no-auth",
         "--allow-host", "127.0.0.1:*", *(extra_args or [])],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://[\d.]+:\d+)", line)
        if m:
            # keep reading its output, so that a full pipe never blocks it
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def _toml_value(v: Any) -> str:
    """``v`` as a TOML value: JSON for strings, numbers and booleans, an
    inline table for a dict (``speculative = { method = "ngram", ... }``)."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def paired(ours: Callable[[], float], theirs: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    """Run the two systems alternately ``repeats`` times (ours, theirs, ours,
    ...), so that a drift in machine speed hits both; returns the median
    seconds of each and the median of the per-pair ratios theirs/ours."""
    pairs = [(ours(), theirs()) for _ in range(repeats)]
    a, b = zip(*pairs)
    return statistics.median(a), statistics.median(b), statistics.median(y / x for x, y in pairs)


def model_file(name_or_path: str | None) -> Path:
    """The GGUF file of ``--model``: a path as given, or the default model
    (fetched by the model store) when None."""
    if name_or_path is None:
        from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve

        return Path(resolve(DEFAULT_MODEL)).resolve()
    return Path(name_or_path).resolve()


def exit_on_signals() -> None:
    """Exit cleanly on SIGTERM / SIGHUP too, not only on Ctrl-C, so a
    benchmark's ``finally`` stops the servers it started."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: sys.exit(128 + signum))


def report(title: str, columns: list[str], rows: list[list[Any]], payload: dict[str, Any] | None) -> None:
    """Print a fixed-width table, then ``JSON: {...}`` on one line (none
    when ``payload`` is None: a later table carries it)."""
    widths = [max(len(str(c)), *(len(_fmt(r[i])) for r in rows)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))
    if payload is not None:
        print("JSON: " + json.dumps(payload))


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)

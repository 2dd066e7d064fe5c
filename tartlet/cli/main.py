"""The ``tartlet`` command line."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

import typer
from rich.console import Console

from .args import ArgsError, parse_inferlet_args

if TYPE_CHECKING:  # imported where used: the engine imports torch, slow for the other commands
    from ..engine.core.engine import Engine
    from ..runtime.program import Program

app = typer.Typer(help="Tartlet: a programmable LLM serving system.", no_args_is_help=True, add_completion=False)
model_app = typer.Typer(help="Manage models (download, list, remove).", no_args_is_help=True)
app.add_typer(model_app, name="model")
err = Console(stderr=True)


def _fail(msg: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    inferlet: str = typer.Argument(..., help="Bundled inferlet name, inferlet folder or .py file."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m", help="Model name, .gguf file or HF folder."),
    dtype: str = typer.Option("auto", help="auto (quantized GGUF weights stay quantized, float32 compute), or float32/bfloat16: every weight dequantized (reference path)."),
    quantize: Optional[str] = typer.Option(None, help="Quantize float weights at load: q8_0, q4_0, q4_1, q5_0, q5_1 (CPU)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    kv_cache_mb: int = typer.Option(1024, help="KV page pool budget in MiB."),
    kv_dtype: str = typer.Option("auto", help="KV page element type: auto (float16 for quantized weights, else the compute dtype), float32, bfloat16, float16, or int8 (8-bit rows with a float32 scale each: 3.8x the tokens of float32 per MiB)."),
    matmul_dtype: str = typer.Option("float32", help="With quantized weights: precision of the float GEMM that calls of 8+ rows (prompts, decode batches) take: float32, or bfloat16 (AVX512_BF16 CPUs: ~1.8x faster products, but batching may change greedy outputs at near-ties)."),
    page_size: int = typer.Option(16, help="Tokens per KV page."),
    max_batch_tokens: int = typer.Option(512, help="Token budget of one model call."),
    threads: Optional[int] = typer.Option(None, help="Torch CPU threads."),
    time_limit: Optional[float] = typer.Option(None, help="Wall-time limit of the inferlet, seconds."),
    json_out: bool = typer.Option(False, "--json", help="Print the inferlet's return value as JSON."),
    stats: bool = typer.Option(False, "--stats", help="Print engine statistics to stderr at the end."),
    sandbox: bool = typer.Option(False, "--sandbox", help="Build the inferlet and run it as a WASM component (.wasm files always are)."),
) -> None:
    """Run an inferlet once on a local engine and stream its output.

    Inferlet arguments follow `--`: `tartlet run text-completion -- --prompt "Hi" --max-tokens 32`.
    """
    from ..engine.loading.loader import ModelLoadError
    from ..runtime.program import find_program
    from ..sdk.errors import ProgramError

    words = list(ctx.args)
    if words and words[0] == "--":
        words = words[1:]
    if words in (["--help"], ["-h"]):  # the inferlet's own arguments, not tartlet run's
        try:
            print(find_program(inferlet).usage())
        except ProgramError as e:
            _fail(str(e))
        return
    try:
        args = parse_inferlet_args(words)
        wasm = None
        if sandbox or inferlet.endswith(".wasm"):
            from .build_commands import sandboxed_component

            program, wasm = sandboxed_component(inferlet)
        else:
            program = find_program(inferlet)
            program.load_main()  # fail fast on a broken inferlet, before loading the model
    except (ArgsError, ProgramError) as e:
        _fail(str(e))
    from ..engine.core.engine import Engine, EngineConfig  # imports torch: only once the arguments are good

    cfg = EngineConfig(
        model=model, dtype=dtype, quantize=quantize, device=device, kv_cache_mb=kv_cache_mb, kv_dtype=kv_dtype, page_size=page_size,
        max_batch_tokens=max_batch_tokens, threads=threads, matmul_dtype=matmul_dtype,
    )
    try:
        with err.status(f"loading {model}") as status:
            engine = Engine.load(cfg, progress=lambda m: status.update(m))
    except (ModelLoadError, ValueError) as e:
        _fail(str(e))
    try:
        code = asyncio.run(_run_instance(engine, program, args, time_limit, json_out, wasm))
    finally:
        if stats:
            _print_stats(engine)
        engine.close()
    raise typer.Exit(code)


async def _run_instance(
    engine: Engine, program: Program, args: dict[str, Any], time_limit: float | None, json_out: bool, wasm: Path | None = None,
) -> int:
    from ..host.session import Session
    from ..host.state import HostState, gc_for_serving
    from ..runtime.instance import Instance, Status
    from ..runtime.native import NativeRuntime

    state = HostState()
    state.add_engine(engine)
    gc_for_serving()  # the model lives as long as the run: collections skip it
    # the program on the native runtime, or its component on the WASM one
    launch: Callable[[Session], Instance] = functools.partial(NativeRuntime(state, time_limit_s=time_limit).launch, program, args)
    if wasm is not None:
        from ..runtime.wasm import WasmRuntime

        launch = functools.partial(WasmRuntime(state, time_limit_s=time_limit).launch, wasm, args)
    session = Session()
    streamed = False

    def show(msg: str | bytes) -> None:
        nonlocal streamed
        streamed = True
        if isinstance(msg, bytes):
            sys.stdout.buffer.write(msg)
        else:
            sys.stdout.write(msg)
        sys.stdout.flush()

    session.listen(show)
    inst = launch(session)
    try:
        await inst.wait()
    except asyncio.CancelledError:
        inst.abort("interrupted")
        await inst.wait()
    if streamed:
        sys.stdout.write("\n")
    if inst.status is Status.FINISHED:
        if json_out:
            print(json.dumps(inst.result))
        elif not streamed and inst.result is not None:
            print(inst.result if isinstance(inst.result, str) else json.dumps(inst.result, indent=2))
        return 0
    err.print(f"[bold red]inferlet {program.name} {inst.status.value}:[/] {inst.error}", highlight=False)
    return 1


def _print_stats(engine: Engine) -> None:
    import resource

    st = engine.scheduler.stats
    kv = engine.pool.stats()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    err.print(
        f"model calls {st.model_calls}, tokens computed {st.tokens_computed}, prefix tokens reused "
        f"{st.prefix_tokens_reused}, forward time {st.forward_seconds:.2f} s, "
        f"pages used {kv.used} cached {kv.cached} free {kv.free} of {kv.total}\n"
        f"weights {engine.model.weight_bytes() / 2**20:.1f} MiB ({engine.model.weight_summary()}"
        f"{'; ' + products if (products := engine.model.products_summary()) else ''}), "
        f"{engine.kv_summary()}\n"
        f"peak RSS {peak_mib:.0f} MiB"
        f"{'' if engine.load_seconds is None else f', model loaded in {engine.load_seconds:.1f} s'}",
        highlight=False,
    )


@model_app.command("download")
def model_download(name: str = typer.Argument("smollm2-135m-instruct")) -> None:
    """Fetch a known model into the model cache (verifying its hash)."""
    from ..engine.loading.loader import ModelLoadError
    from ..engine.loading.model_store import download

    try:
        with err.status(f"downloading {name}") as status:
            path = download(name, progress=lambda m: status.update(m))
    except ModelLoadError as e:
        _fail(str(e))
    print(path)


@model_app.command("list")
def model_list() -> None:
    """Known models and whether they are downloaded."""
    from rich.table import Table

    from ..engine.loading.model_store import list_models
    from ..paths import models_dir

    table = Table(title=f"models in {models_dir()}")
    for col in ("name", "downloaded", "size", "path"):
        table.add_column(col)
    for m in list_models():
        size = f"{m.size / 2**20:.1f} MiB" if m.size else "-"
        table.add_row(m.name, "yes" if m.downloaded else "no", size, str(m.path))
    Console().print(table)


@model_app.command("remove")
def model_remove(name: str) -> None:
    """Delete a downloaded model from the cache."""
    from ..engine.loading.loader import ModelLoadError
    from ..engine.loading.model_store import remove

    try:
        removed = remove(name)
    except ModelLoadError as e:
        _fail(str(e))
    print(f"removed {name}" if removed else f"{name} was not downloaded")


@app.command("inferlets")
def inferlets(name: Optional[str] = typer.Argument(None, help="Show this inferlet's arguments.")) -> None:
    """List the bundled inferlets, or document one (its arguments and result)."""
    from ..runtime.program import find_program, list_programs
    from ..sdk.errors import ProgramError

    if name is not None:
        try:
            print(find_program(name).usage())
        except ProgramError as e:
            _fail(str(e))
        return
    for n, prog in sorted(list_programs().items()):
        print(f"{n:24s} {prog.description}")


@app.command()
def version() -> None:
    """Print the Tartlet version."""
    from .. import __version__

    print(__version__)


from .server_commands import register as _register_server_commands  # noqa: E402

_register_server_commands(app)  # serve, install, config, auth
from .client_commands import register as _register_client_commands  # noqa: E402

_register_client_commands(app)  # submit, list, attach, abort, ping
from .adapter_commands import register as _register_adapter_commands  # noqa: E402

_register_adapter_commands(app)  # adapter add, list, remove
from .build_commands import register as _register_build_commands  # noqa: E402

_register_build_commands(app)  # build, new


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

"""Server and client commands: ``serve``, ``submit``, ``list``, ``attach``,
``abort``, ``ping``, ``config init|show``, ``auth add|list|remove``,
``install``. Registered on the main app by :func:`register`.

Client commands find the server with ``--server`` (env ``TARTLET_SERVER``,
default ``http://127.0.0.1:8080``) and the key with ``--key`` (env
``TARTLET_API_KEY``).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from .args import ArgsError, parse_inferlet_args

err = Console(stderr=True)
config_app = typer.Typer(help="Server configuration (TOML).", no_args_is_help=True)
auth_app = typer.Typer(help="API keys of the server.", no_args_is_help=True)

SERVER = typer.Option("http://127.0.0.1:8080", "--server", "-s", envvar="TARTLET_SERVER", help="Server URL.")
KEY = typer.Option(None, "--key", "-k", envvar="TARTLET_API_KEY", help="API key.")
CONFIG = typer.Option(None, "--config", "-c", envvar="TARTLET_CONFIG", help="Config file (default: user config dir).")


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


def _load(config: Optional[Path]) -> Any:
    from ..runtime.config import ConfigError, load_config

    try:
        return load_config(config)
    except ConfigError as e:
        _fail(str(e))


def serve(
    config: Optional[Path] = CONFIG,
    host: Optional[str] = typer.Option(None, help="Bind address (overrides the config)."),
    port: Optional[int] = typer.Option(None, help="Port; 0 picks a free one (printed)."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Accept every client as user 'local' (local development)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Serve only this model (overrides [[models]])."),
    kv_cache_mb: Optional[int] = typer.Option(None, help="KV page budget of each model, MiB."),
    data_dir: Optional[str] = typer.Option(None, help="Folder of keys, store and programs (overrides the config)."),
    allow_host: list[str] = typer.Option([], "--allow-host", help="Add a host to the HTTP allowlist (repeatable)."),
    max_pages: Optional[int] = typer.Option(None, help="KV pages per instance."),
    max_wall_time: Optional[float] = typer.Option(None, help="Wall time per instance, seconds."),
    max_instances: Optional[int] = typer.Option(None, help="Running instances per user."),
) -> None:
    """Serve inferlets over WebSocket (/ws) and HTTP (/v1 OpenAI-compatible, /health, /metrics)."""
    from pydantic import ValidationError

    from ..engine.loader import ModelLoadError
    from ..runtime.config import format_errors
    from ..server.app import serve as run_server

    cfg = _load(config)
    try:  # each assignment is validated like the file's keys
        if host is not None:
            cfg.host = host
        if port is not None:
            cfg.port = port
        if data_dir is not None:
            cfg.data_dir, cfg.program_dir, cfg.store_path, cfg.auth.keys_file = data_dir, "", "", ""
            cfg.resolve_paths()
        if model is not None:
            cfg.models = [type(cfg.models[0])(model=model)]
        if kv_cache_mb is not None:
            for m in cfg.models:
                m.kv_cache_mb = kv_cache_mb
        cfg.http.allow_hosts = cfg.http.allow_hosts + allow_host
        if max_pages is not None:
            cfg.limits.max_pages_per_instance = max_pages
        if max_wall_time is not None:
            cfg.limits.max_wall_time_s = max_wall_time
        if max_instances is not None:
            cfg.limits.max_instances_per_user = max_instances
    except ValidationError as e:
        _fail(format_errors(e, "command line"))
    try:
        run_server(cfg, auth=not no_auth)
    except (ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))


async def _client(server: str, key: Optional[str]) -> Any:
    from ..client import Client, TartletError

    try:
        return await Client.connect(server, key)
    except TartletError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot reach {server}: {e}")


def _print_output(msg: str | bytes) -> None:
    if isinstance(msg, bytes):
        sys.stdout.buffer.write(msg)
    else:
        sys.stdout.write(msg)
    sys.stdout.flush()


async def _stream(inst: Any, json_out: bool) -> int:
    streamed = False
    async for msg in inst.output():
        streamed = True
        _print_output(msg)
    if streamed:
        sys.stdout.write("\n")
    ex = inst.exit
    if ex.ok:
        if json_out:
            print(json.dumps(ex.result))
        elif not streamed and ex.result is not None:
            print(ex.result if isinstance(ex.result, str) else json.dumps(ex.result, indent=2))
        return 0
    err.print(f"[bold red]instance {inst.id} {ex.status}:[/] {ex.error}", highlight=False)
    return 1


def submit(
    ctx: typer.Context,
    inferlet: str = typer.Argument(..., help="Inferlet name on the server, or a local .py file / folder (uploaded)."),
    server: str = SERVER,
    key: Optional[str] = KEY,
    send: list[str] = typer.Option([], "--send", help="Message to send to the inferlet after launch (repeatable)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Print the instance id and exit; it keeps running."),
    json_out: bool = typer.Option(False, "--json", help="Print the return value as JSON."),
) -> None:
    """Launch an inferlet on a server, stream its output, exit with its status (0 finished, 1 otherwise)."""
    words = list(ctx.args)
    if words and words[0] == "--":
        words = words[1:]
    try:
        args = parse_inferlet_args(words)
    except ArgsError as e:
        _fail(str(e))

    async def go() -> int:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            local = Path(inferlet)
            target: Any = local if (local.suffix == ".py" or local.is_dir()) and local.exists() else inferlet
            try:
                inst = await c.launch(target, args, attach=not detach)
            except TartletError as e:
                _fail(str(e))
            if detach:
                print(inst.id)
                return 0
            for m in send:
                await inst.send(m)
            if send:
                await inst.close_input()
            try:
                return await _stream(inst, json_out)
            except asyncio.CancelledError:
                await c.abort(inst.id)
                raise
        finally:
            await c.close()

    raise typer.Exit(asyncio.run(go()))


def list_cmd(server: str = SERVER, key: Optional[str] = KEY, as_json: bool = typer.Option(False, "--json")) -> None:
    """Your instances on the server (running and recently ended)."""

    async def go() -> list[dict[str, Any]]:
        c = await _client(server, key)
        try:
            return await c.list()
        finally:
            await c.close()

    rows = asyncio.run(go())
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['id']}  {r['status']:9s} {r['program']:24s} {r.get('error') or ''}")


def attach(iid: str, server: str = SERVER, key: Optional[str] = KEY, json_out: bool = typer.Option(False, "--json")) -> None:
    """Stream a running instance's output until it ends."""

    async def go() -> int:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            try:
                inst = await c.attach(iid)
            except TartletError as e:
                _fail(str(e))
            return await _stream(inst, json_out)
        finally:
            await c.close()

    raise typer.Exit(asyncio.run(go()))


def abort(iid: str, server: str = SERVER, key: Optional[str] = KEY) -> None:
    """Abort one of your instances."""

    async def go() -> None:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            await c.abort(iid)
        except TartletError as e:
            _fail(str(e))
        finally:
            await c.close()

    asyncio.run(go())
    print(f"aborted {iid}")


def ping(server: str = SERVER, key: Optional[str] = KEY) -> None:
    """Check that the server answers and the key is valid."""
    import time

    async def go() -> tuple[dict, float]:
        c = await _client(server, key)
        try:
            t0 = time.perf_counter()
            r = await c.ping()
            return r, time.perf_counter() - t0
        finally:
            await c.close()

    r, dt = asyncio.run(go())
    print(f"pong from {server} as user {r.get('user')!r} in {dt * 1000:.1f} ms")


@config_app.command("init")
def config_init(
    path: Optional[Path] = typer.Argument(None, help="Where to write (default: the user config file)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a default config file."""
    from ..runtime.config import ServerConfig, default_config_path, render_config

    p = path or default_config_path()
    if p.exists() and not force:
        _fail(f"{p} exists (use --force to overwrite)")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_config(ServerConfig()))
    print(p)


@config_app.command("show")
def config_show(config: Optional[Path] = CONFIG) -> None:
    """Print the effective config (defaults filled in)."""
    from ..runtime.config import render_config

    print(render_config(_load(config)), end="")


@auth_app.command("add")
def auth_add(user: str, config: Optional[Path] = CONFIG) -> None:
    """Create an API key for USER and print it (it is stored hashed; shown only now)."""
    from ..server.auth import KeyStore

    try:
        print(KeyStore(_load(config).auth.keys_file).add(user))
    except ValueError as e:
        _fail(str(e))


@auth_app.command("list")
def auth_list(config: Optional[Path] = CONFIG) -> None:
    """Users and key prefixes."""
    from ..server.auth import KeyStore

    for e in KeyStore(_load(config).auth.keys_file).list():
        print(f"{e['user']:24s} {e['prefix']}…")


@auth_app.command("remove")
def auth_remove(who: str = typer.Argument(..., help="A user (all its keys) or a key prefix."), config: Optional[Path] = CONFIG) -> None:
    """Revoke keys."""
    from ..server.auth import KeyStore

    n = KeyStore(_load(config).auth.keys_file).remove(who)
    if not n:
        _fail(f"no key for {who!r}", 1)
    print(f"removed {n} key(s)")


def install(
    path: Path = typer.Argument(..., help="An inferlet folder, .py file or .wasm component."),
    config: Optional[Path] = CONFIG,
    force: bool = typer.Option(False, "--force", help="Replace an installed inferlet of the same name."),
) -> None:
    """Install an inferlet into the server's program directory (launchable by name).

    Folders and .py files run as `[programs] installed_runtime` says; a .wasm
    component (from `tartlet build`) always runs sandboxed, named by its file stem.
    """
    from ..runtime.program import ProgramError, load_program

    cfg = _load(config)
    dest_dir = Path(cfg.program_dir)
    try:
        if path.suffix == ".wasm":
            from ..runtime.wasm_engine import shared_engine

            if not path.is_file():
                raise ProgramError(f"no component at {path}")
            with err.status(f"checking {path.name}"):
                shared_engine().load(path)  # refuses what is not a component (and caches its compile)
            name = path.stem
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):
                raise ProgramError(f"a component's file stem is its name: use letters, digits, - and _, got {name!r}")
            dest = dest_dir / f"{name}.wasm"
        else:
            prog = load_program(path)
            prog.load_main()
            name = prog.name
            dest = dest_dir / (prog.name if path.is_dir() else f"{prog.name}.py")
    except ProgramError as e:
        _fail(str(e))
    dest_dir.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        if not force:
            _fail(f"{dest} exists (use --force to replace)")
        shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
    if path.is_dir():
        shutil.copytree(path, dest, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    else:
        shutil.copy2(path, dest)
    print(f"installed {name} -> {dest}")


def register(app: typer.Typer) -> None:
    """Add these commands to the ``tartlet`` app."""
    app.command()(serve)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(submit)
    app.command("list")(list_cmd)
    app.command()(attach)
    app.command()(abort)
    app.command()(ping)
    app.command()(install)
    app.add_typer(config_app, name="config")
    app.add_typer(auth_app, name="auth")

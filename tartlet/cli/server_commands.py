"""Commands that act on this machine's server: ``serve``, ``install``,
``config init|show``, ``auth add|list|remove``. Registered on the main app by
:func:`register`.

Each reads the server config (``--config``, env ``TARTLET_CONFIG``, default
the user config file; :mod:`tartlet.server.config`); none talks to a running
server (that is :mod:`.client_commands`).
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer
from rich.console import Console

from ..sdk.errors import StoreError

if TYPE_CHECKING:
    from ..server.auth import ApiKeyStore

err = Console(stderr=True)
config_app = typer.Typer(help="Server configuration (TOML).", no_args_is_help=True)
auth_app = typer.Typer(help="API keys of the server.", no_args_is_help=True)

CONFIG = typer.Option(None, "--config", "-c", envvar="TARTLET_CONFIG", help="Config file (default: user config dir).")


def _fail(msg: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


def _load(config: Optional[Path]) -> Any:
    from ..server.config import ConfigError, load_config

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
    replicas: Optional[int] = typer.Option(
        None, "--replicas", help="Run N server replicas on Ray Serve behind one gateway (the \\[cluster] table; docs/server.md 'Scaling out')."
    ),
) -> None:
    """Serve inferlets over WebSocket (/ws) and HTTP (/v1 OpenAI-compatible, /health, /metrics)."""
    from pydantic import ValidationError

    from ..engine.loading.loader import ModelLoadError
    from ..server.app import serve as run_server
    from ..server.config import format_errors

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
        if replicas is not None:
            cfg.cluster.replicas = replicas
    except ValidationError as e:
        _fail(format_errors(e, "command line"))
    c = cfg.cluster
    if c.replicas >= 1 or c.min_replicas is not None or c.max_replicas is not None:
        from ..cluster.launcher import serve_cluster

        try:
            serve_cluster(cfg, auth=not no_auth)
        except (ValueError, OSError, RuntimeError) as e:
            _fail(str(e))
        return
    try:
        run_server(cfg, auth=not no_auth)
    except (ModelLoadError, ValueError, OSError) as e:
        _fail(str(e))


def install(
    path: Path = typer.Argument(..., help="An inferlet folder, .py file or .wasm component."),
    config: Optional[Path] = CONFIG,
    force: bool = typer.Option(False, "--force", help="Replace an installed inferlet of the same name."),
) -> None:
    """Install an inferlet into the server's program directory (launchable by name).

    Folders and .py files run as `[programs] installed_runtime` says; a .wasm
    component (from `tartlet build`) always runs sandboxed, named by its file stem.
    """
    from ..runtime.program import load_program
    from ..sdk.errors import ProgramError

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


@config_app.command("init")
def config_init(
    path: Optional[Path] = typer.Argument(None, help="Where to write (default: the user config file)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a default config file."""
    from ..server.config import ServerConfig, default_config_path, render_config

    p = path or default_config_path()
    if p.exists() and not force:
        _fail(f"{p} exists (use --force to overwrite)")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_config(ServerConfig()))
    print(p)


@config_app.command("show")
def config_show(config: Optional[Path] = CONFIG) -> None:
    """Print the effective config (defaults filled in)."""
    from ..server.config import render_config

    print(render_config(_load(config)), end="")


@contextlib.contextmanager
def _keys(config: Optional[Path]) -> Iterator[ApiKeyStore]:
    """The API keys of the config (``[store] url``: PostgreSQL; else the keys
    file), closed after use. Raises StoreError: PostgreSQL unreachable."""
    from ..server.auth import key_store

    keys = key_store(_load(config))
    try:
        yield keys
    finally:
        keys.close()


@auth_app.command("add")
def auth_add(user: str, config: Optional[Path] = CONFIG) -> None:
    """Create an API key for USER and print it (it is stored hashed; shown only now)."""
    try:
        with _keys(config) as keys:
            print(keys.add(user))
    except ValueError as e:  # a bad user name; StoreError (a ValueError): PostgreSQL unreachable
        _fail(str(e))


@auth_app.command("list")
def auth_list(config: Optional[Path] = CONFIG) -> None:
    """Users and key prefixes."""
    try:
        with _keys(config) as keys:
            entries = keys.list()
    except StoreError as e:
        _fail(str(e))
    for k in entries:
        print(f"{k['user']:24s} {k['prefix']}…")


@auth_app.command("remove")
def auth_remove(who: str = typer.Argument(..., help="A user (all its keys) or a key prefix."), config: Optional[Path] = CONFIG) -> None:
    """Revoke keys."""
    try:
        with _keys(config) as keys:
            n = keys.remove(who)
    except StoreError as e:
        _fail(str(e))
    if not n:
        _fail(f"no key for {who!r}", 1)
    print(f"removed {n} key(s)")


def register(app: typer.Typer) -> None:
    """Add these commands to the ``tartlet`` app."""
    app.command()(serve)
    app.command()(install)
    app.add_typer(config_app, name="config")
    app.add_typer(auth_app, name="auth")

"""Commands that talk to a running server: ``submit``, ``list``,
``attach``, ``abort``, ``ping``. Registered on the main app by
:func:`register` (``serve`` and the server's own files: :mod:`.server_commands`).

They find the server with ``--server`` (env ``TARTLET_SERVER``, default
``http://127.0.0.1:8080``) and the key with ``--key`` (env
``TARTLET_API_KEY``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer
from rich.console import Console

from .args import ArgsError, parse_inferlet_args

if TYPE_CHECKING:
    from ..client import Client, RemoteInstance

err = Console(stderr=True)

SERVER = typer.Option("http://127.0.0.1:8080", "--server", "-s", envvar="TARTLET_SERVER", help="Server URL.")
KEY = typer.Option(None, "--key", "-k", envvar="TARTLET_API_KEY", help="API key.")


def _fail(msg: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(code)


async def _client(server: str, key: Optional[str]) -> Client:
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


def _print_log(stream: str, line: str) -> None:
    print(f"[{stream}] {line}", file=sys.stderr, flush=True)


async def _stream(inst: RemoteInstance, json_out: bool) -> int:
    streamed = False
    async for msg in inst.output():
        streamed = True
        _print_output(msg)
    if streamed:
        sys.stdout.write("\n")
    ex = inst.exit
    assert ex is not None  # output() ends once the exit is known
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
    logs: bool = typer.Option(False, "--logs", help="Also print what the inferlet prints (stdout/stderr), to stderr."),
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
            target: str | Path = local if (local.suffix == ".py" or local.is_dir()) and local.exists() else inferlet
            try:
                inst = await c.launch(target, args, attach=not detach, logs=logs)
            except TartletError as e:
                _fail(str(e))
            if detach:
                print(inst.id)
                return 0
            if logs:
                inst.on_log = _print_log
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

    async def go() -> tuple[dict[str, Any], float]:
        c = await _client(server, key)
        try:
            t0 = time.perf_counter()
            r = await c.ping()
            return r, time.perf_counter() - t0
        finally:
            await c.close()

    r, dt = asyncio.run(go())
    print(f"pong from {server} as user {r.get('user')!r} in {dt * 1000:.1f} ms")


def register(app: typer.Typer) -> None:
    """Add these commands to the ``tartlet`` app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(submit)
    app.command("list")(list_cmd)
    app.command()(attach)
    app.command()(abort)
    app.command()(ping)

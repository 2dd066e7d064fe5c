"""``tartlet adapter add|list|remove``: a user's LoRA adapters on a running
server (uploaded into the user's namespace, usable by its inferlets and as
``"model": "BASE:NAME"`` over the OpenAI routes; docs/adapters.md).
Registered on the main app by :func:`register`; they find the server as the
other client commands do (``--server``/``TARTLET_SERVER``, ``--key``/``TARTLET_API_KEY``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Optional

import typer

from .client_commands import KEY, SERVER, _client, _fail

adapter_app = typer.Typer(help="Your LoRA adapters on a server (upload, list, remove).", no_args_is_help=True)
MODEL = typer.Option(None, "--model", "-m", help="Served model (default: the server's default model).")


@adapter_app.command("add")
def add(
    name: str = typer.Argument(..., help="Name to serve it under (letters, digits, . _ -)."),
    path: Path = typer.Argument(..., help="A PEFT folder (adapter_config.json + adapter_model.safetensors) or a .gguf LoRA file."),
    model: Optional[str] = MODEL, server: str = SERVER, key: Optional[str] = KEY,
) -> None:
    """Upload a LoRA adapter into your namespace (checked against the model first)."""

    async def go() -> dict[str, Any]:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            return await c.add_adapter(name, path, model)
        except (TartletError, ValueError, OSError) as e:
            _fail(str(e))
        finally:
            await c.close()

    info = asyncio.run(go())
    print(f"added adapter {info['name']!r}: {info['modules']} modules, rank {info['rank']}, "
          f"{info['weight_bytes'] / 2**20:.1f} MiB")


@adapter_app.command("list")
def list_cmd(model: Optional[str] = MODEL, server: str = SERVER, key: Optional[str] = KEY,
             as_json: bool = typer.Option(False, "--json")) -> None:
    """The adapters you may use: the server's and yours."""

    async def go() -> list[dict[str, Any]]:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            return await c.list_adapters(model)
        except TartletError as e:
            _fail(str(e))
        finally:
            await c.close()

    rows = asyncio.run(go())
    if as_json:
        print(json.dumps(rows))
        return
    for r in rows:
        size = "" if r["weight_bytes"] is None else f"{r['weight_bytes'] / 2**20:.1f} MiB"
        print(f"{r['name']:32s} {r['owner']:6s} {size}")


@adapter_app.command("remove")
def remove(name: str, model: Optional[str] = MODEL, server: str = SERVER, key: Optional[str] = KEY) -> None:
    """Delete one of your adapters."""

    async def go() -> None:
        from ..client import TartletError

        c = await _client(server, key)
        try:
            await c.remove_adapter(name, model)
        except TartletError as e:
            _fail(str(e))
        finally:
            await c.close()

    asyncio.run(go())
    print(f"removed adapter {name!r}")


def register(app: typer.Typer) -> None:
    """Add ``tartlet adapter ...`` to the ``tartlet`` app."""
    app.add_typer(adapter_app, name="adapter")
